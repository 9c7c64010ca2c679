"""A test-side spy for the secure aggregation run (tests/runtime/test_secagg_mpi.py), started under
mpiexec in place of ``python -m hpcfed``: ``secagg_spy.py SPY_DIR SILENT_CLIENT hpcfed-args...``.

- rank 0: every message the channel decrypts and decodes on rank 0 (each `Message` built) is
  written to SPY_DIR/rank0/ (its tensors as .npz, its kind, source and header as .json);
- ranks 1..K: what each site fed secure aggregation, per round (the model it was sent, its update
  delta, its weight, its fixed-point codes), to SPY_DIR/site<id>-r<round>.npz: the plaintext the
  test checks rank 0's view against;
- site SILENT_CLIENT (-1: none) goes silent in round 0 after it shared its keys, past the stage
  deadline (SPY_SILENT_S seconds): a dropout after share submission.
- SPY_KILL="CID:STAGE,..." with SPY_KILL_ROUND=R: in round R site CID SIGKILLs itself, STAGE
  "before" when it is about to mask (it shared its keys, sent no masked input) or "after" just
  after it sent SA_MASKED, or "reveal" when asked for the unmasking, instead of answering; the other
  sites then hold their masked input for SPY_HOLD_S seconds, so that rank 0 learns of the deaths
  (`hpcfed.server.departures`) before it asks for the unmasking.
  Needs `hpcfed run` (`hpcfed.launch.rank_guard`): the test passes a wrapper as --mpiexec that starts
  this file in place of ``-m hpcfed`` (``secagg_spy.py SPY_DIR -1 run ...``).

Only the test uses this file; nothing in hpcfed imports it.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's hpcfed, not an installed one


def _spy_rank0(out: Path) -> None:
    from hpcfed.comm import api

    out.mkdir(parents=True, exist_ok=True)
    counter = itertools.count()
    original = api.Message.__init__

    def recording_init(self: api.Message, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]  # the dataclass's own signature
        i = next(counter)
        np.savez(out / f"msg-{i:05d}.npz", **{k.replace("/", "|"): np.asarray(v) for k, v in self.tensors.items()})
        (out / f"msg-{i:05d}.json").write_text(json.dumps({"kind": self.kind, "source": self.source,
                                                           "header": self.header}, default=str))

    api.Message.__init__ = recording_init  # type: ignore[method-assign]  # the spy's whole point


def _kills() -> tuple[dict[int, str], int, float]:
    spec = os.environ.get("SPY_KILL", "")
    kills = {int(c): stage for c, stage in (item.split(":") for item in spec.split(",") if item)}
    return kills, int(os.environ.get("SPY_KILL_ROUND", "0")), float(os.environ.get("SPY_HOLD_S", "0"))


def _spy_site(out: Path, client: int, silent: int, silent_s: float) -> None:
    from hpcfed import protocol as P
    from hpcfed.client import privacy_stages, secagg
    from hpcfed.client.upload import RoundStart, Upload, Upstream

    encode, send = privacy_stages.Encode.__call__, secagg.SecAggSite._send
    kills, kill_round, hold_s = _kills()

    def send_(self: secagg.SecAggSite, kind: int, header: dict, tensors: dict | None = None) -> None:
        if kind == P.SA_REVEAL and kills.get(client) == "reveal" and header.get("round") == kill_round:
            os.kill(os.getpid(), signal.SIGKILL)  # asked for its shares, it dies instead of answering
        send(self, kind, header, tensors)
        if kind == P.SA_MASKED and kills.get(client) == "after" and header.get("round") == kill_round:
            os.kill(os.getpid(), signal.SIGKILL)  # its masked input is on its way; the unmasking is not

    def encode_(self: privacy_stages.Encode, start: RoundStart, upstream: Upstream) -> Upload:
        upload = encode(self, start, upstream)
        rnd = start.round
        np.savez(out / f"site{client}-r{rnd}.npz", sent=upload.sent, delta=upload.delta, weight=self.weight(upload),
                 codes=upload.codes)
        if client == silent and rnd == 0:
            time.sleep(silent_s)  # keys shared, masked input late: the server must go on without it
        if rnd == kill_round and kills.get(client) == "before":
            os.kill(os.getpid(), signal.SIGKILL)  # keys shared, no masked input
        if rnd == kill_round and kills and client not in kills:
            time.sleep(hold_s)  # the survivors mask once rank 0 has seen both sites die
        return upload

    privacy_stages.Encode.__call__ = encode_  # type: ignore[method-assign]  # the spy's whole point
    secagg.SecAggSite._send = send_  # type: ignore[method-assign]


def main() -> None:
    spy_dir, silent, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if rank == 0:
        _spy_rank0(spy_dir / "rank0")
    else:
        spy_dir.mkdir(parents=True, exist_ok=True)
        _spy_site(spy_dir, rank - 1, silent, float(os.environ.get("SPY_SILENT_S", "0")))
    from hpcfed.cli.commands import main as cli_main

    sys.exit(cli_main(args))


if __name__ == "__main__":
    main()
