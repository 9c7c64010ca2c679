"""A test-side spy for the secure buffered async run (tests/runtime/test_secagg_buffer_mpi.py), started
under mpiexec in place of ``python -m hpcfed``: ``buffer_spy.py SPY_DIR hpcfed-args...``.

- rank 0: every message it decrypts, as tests/privacy/secagg_spy.py records them (SPY_DIR/rank0/);
- ranks 1..K: what each site fed each buffer it joined (the model it trained from, its clipped delta,
  the model it trained as a plain site would upload it, the staleness and version it was told) to
  SPY_DIR/site<id>-b<buffer>.npz;
- SPY_KILL="CID:STAGE,..." with SPY_KILL_BUFFER=B: in the first buffer numbered >= B that site CID
  joins, it SIGKILLs itself once invited, its epoch keys advertised and relayed to the others
  ("before": no masked input), or just after it sent its masked input ("after"); SPY_HOLD_S: the
  other members of that buffer wait that long before masking, so that rank 0 learns of the deaths
  first;
- SPY_READY_DELAY="CID:SECONDS,...": that site waits so long before each SA_READY (a schedule: who is
  ready first), and rank 0 writes, in its loop's order, each site it took as ready, each buffer it
  ran (with its members) and each site it answered, to SPY_DIR/order.jsonl.

Only the test uses this file; nothing in hpcfed imports it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's hpcfed, not an installed one
from secagg_spy import _kills, _spy_rank0


def _spy_site(out: Path, client: int) -> None:
    from hpcfed import protocol as P
    from hpcfed.client import secagg_buffer

    site_cls = secagg_buffer.BufferedSecAggSite
    buffer, send = site_cls._buffer, site_cls._send
    kills, kill_from, hold_s = _kills()
    kill_from = int(os.environ.get("SPY_KILL_BUFFER", "0"))
    current = {"buffer": -1}

    def buffer_(self, invite, upload, adverts) -> None:  # type: ignore[no-untyped-def]  # the patched method's own
        current["buffer"] = invite.buffer
        np.savez(out / f"site{client}-b{invite.buffer}.npz", sent=upload.sent, delta=upload.delta * upload.scale,
                 trained=(upload.sent + upload.delta).astype(np.float32),  # the model a plain site would upload
                 staleness=invite.staleness, version=invite.version, members=sorted(invite.members))
        if kills and client not in kills and invite.buffer >= kill_from and set(kills) <= invite.members:
            time.sleep(hold_s)  # the survivors mask once rank 0 has seen the others die
        if invite.buffer >= kill_from and kills.get(client) == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        buffer(self, invite, upload, adverts)

    delay = _ready_delays().get(client, 0.0)

    def send_(self, kind: int, header: dict, tensors: dict | None = None) -> None:  # type: ignore[no-untyped-def]
        if kind == P.SA_READY and delay:
            time.sleep(delay)
        send(self, kind, header, tensors)
        stage = kills.get(client)
        if current["buffer"] >= kill_from and kind == P.SA_MASKED and stage == "after":
            os.kill(os.getpid(), signal.SIGKILL)

    site_cls._buffer = buffer_  # type: ignore[method-assign]  # the spy's whole point
    site_cls._send = send_  # type: ignore[method-assign]


def _ready_delays() -> dict[int, float]:
    spec = os.environ.get("SPY_READY_DELAY", "")
    return {int(c): float(s) for c, s in (item.split(":") for item in spec.split(",") if item)}


def _spy_order(out: Path) -> None:
    """Rank 0's loop, in its order: a site taken as ready, a buffer run (its members), a site answered."""
    import json

    from hpcfed.server.buffered import SecureBufferedLoop

    take_ready, run_buffer, answer = SecureBufferedLoop.take_ready, SecureBufferedLoop.run_buffer, \
        SecureBufferedLoop.answer
    log = out / "order.jsonl"

    def write(event: dict) -> None:
        with log.open("a") as f:
            f.write(json.dumps(event) + "\n")

    def take_ready_(self, msg) -> None:  # type: ignore[no-untyped-def]  # the patched method's own
        before = set(self.ready)
        take_ready(self, msg)
        if msg.source - 1 in set(self.ready) - before:
            write({"ready": msg.source - 1})

    def run_buffer_(self, members: set[int]) -> int:  # type: ignore[no-untyped-def]
        write({"buffer": self.next_buffer, "members": sorted(members)})
        return run_buffer(self, members)

    def answer_(self, cid: int) -> None:  # type: ignore[no-untyped-def]
        answer(self, cid)
        write({"answered": cid})

    SecureBufferedLoop.take_ready = take_ready_  # type: ignore[method-assign]
    SecureBufferedLoop.run_buffer = run_buffer_  # type: ignore[method-assign]
    SecureBufferedLoop.answer = answer_  # type: ignore[method-assign]


def main() -> None:
    spy_dir, args = Path(sys.argv[1]), sys.argv[2:]
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if rank == 0:
        _spy_rank0(spy_dir / "rank0")
        _spy_order(spy_dir)
    else:
        spy_dir.mkdir(parents=True, exist_ok=True)
        _spy_site(spy_dir, rank - 1)
    from hpcfed.cli.commands import main as cli_main

    sys.exit(cli_main(args))


if __name__ == "__main__":
    main()
