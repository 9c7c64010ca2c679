#!/usr/bin/env python3
"""Hostile-input campaign against a LIVE hpcfed server.

    python tools/hostile_campaign.py [--json] [--messages 1200] [--config configs/quickstart.yaml]
                                     [--out DIR] [key=value ...]

Runs the real runtime twice under ``mpiexec`` on the same config, with the same world size:

1. **baseline**: ``mpiexec -n K+2 python -m hpcfed run CONFIG`` — server + K+1 honest clients;
2. **attacked**: ``mpiexec -n K+1 python -m hpcfed run CONFIG : -n 1 python tools/hostile_campaign.py
   --worker ...`` — the last rank is hostile. It is an *authenticated* client (it holds the job's key
   and completes the secure handshake) that trains honestly, so the federation has the same members
   as the baseline, and before each of its honest uploads it sends a batch of crafted messages to the
   server (rank 0):

   - frames (`FRAME_ATTACKS`): tampered ciphertext / tag / header, replayed frames, reordered
     sequence numbers and chunks, truncated frames, a wrong key (random, or the other direction's),
     wrong source / destination rank (in the frame header or only in the authenticated data),
     oversize frames, lying headers (length, total, chunk index/count/offset), bad protocol version /
     frame type / flags, handshake frames after the handshake, random garbage;
   - bundles (`BUNDLE_ATTACKS`): correctly encrypted and authenticated frames whose plaintext is a
     malformed bundle (bad magic, lying header/tensor lengths and offsets, unknown dtype code, huge
     ndim, header that is not UTF-8 / not JSON / not an object / too deep / NaN / duplicate keys,
     a 401-digit integer in num_examples / version / round / a metric, a zero-size tensor whose
     other dimension is 2**64-1);
   - runtime messages (`RUNTIME_ATTACKS`), sent through the real `SecureChannel.send` so that they
     are VALID encrypted messages and test the server's own validation: NaN/Inf parameters, wrong
     dtypes, wrong shapes, missing or unknown tensor names, lying update headers, stale rounds.

   - memory floods (`--flood-mib N`, `FLOOD_ATTACKS`), sent before the first upload: N MiB of
     valid sealed messages of a kind the server never reads (kind 99, 64 MiB each), UPDATEs larger
     than their kind's bound (4 x model + 64 MiB, see `hpcfed.protocol.server_bounds`), and forged
     first chunks declaring an 8 GiB message. The server must drop each on arrival without buffering
     it: ``server_peak_rss_growth_mib`` (attacked minus baseline) is the figure (goal: <= 64).

The JSON result: ``sent`` (crafted messages), ``accepted`` (sent minus the rejections the server
counted in ``summary.json``: must be 0), ``server_alive`` (the attacked run finished normally and
the hostile rank still got its final model), ``honest_result_equal`` (final per-site metrics and the
final global model are identical to the baseline's), plus per-attack counts and the server's
rejection reasons. Exit status 0 only when all four hold.

The frame forger (`tools/hostile_forger.py`) uses the channel's internals (its session keys and
sequence counters) on purpose: it is the adversary holding a compromised client's keys.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from tools.hostile_forger import ALL_ATTACKS, Forger, RecordingTransport  # noqa: E402 (after the path is set)


def _plan(total: int, rounds: int) -> list[int]:
    """How many crafted messages to send before each round's honest upload."""
    base, extra = divmod(total, max(1, rounds))
    return [base + (1 if r < extra else 0) for r in range(rounds)]


def worker_main(args: argparse.Namespace) -> int:
    """Body of the hostile rank: the real client loop, with attacks before each honest upload."""
    from hpcfed.client import client as client_mod
    from hpcfed.launch import rank as launcher
    from hpcfed.launch.parent import prepare_config

    cfg = prepare_config(args.config, args.overrides)
    out_dir = Path(args.out)
    if cfg.mode != "sync":
        raise SystemExit("the campaign compares against a baseline bit for bit: use a sync config")
    plan = _plan(args.messages, cfg.rounds)
    report: dict[str, Any] = {"rank": None, "sent": 0, "by_attack": {}, "rounds_attacked": 0,
                              "final_model_received": False, "stopped_by_server": False}
    attacks: Iterator[str] = _cycle(ALL_ATTACKS)

    class HostileClient(client_mod.Client):
        def __init__(self, config: Any, channel: Any, out_dir: Path, device: str = "cpu", resume: bool = False,
                     keys: Any = None, ranks: Any = None) -> None:
            channel.transport = RecordingTransport(channel.transport)
            super().__init__(config, channel, out_dir, device=device, resume=resume, keys=keys, ranks=ranks)
            self.forger: Forger | None = None
            report["rank"] = channel.rank

        def _train_and_upload(self, msg: Any) -> None:
            rnd = int(msg.header["round"])
            if self.forger is None:
                self.forger = Forger(self.channel, self.layout.size, seed=cfg.seed + 7)
            quota = plan[rnd] if 0 <= rnd < len(plan) else 0
            if args.flood_mib and report["rounds_attacked"] == 0:
                self.forger.flood(args.flood_mib << 20)
            done = 0
            while done < quota:
                if self.forger.attack(next(attacks), rnd, int(msg.header.get("version", 0))):
                    done += 1
            report["rounds_attacked"] += 1
            super()._train_and_upload(msg)  # then behave exactly like the honest site

        def _final(self, msg: Any) -> None:
            report["final_model_received"] = True
            super()._final(msg)

        def run(self) -> None:
            try:
                super().run()
                report["stopped_by_server"] = True
            finally:
                if self.forger is not None:
                    report["by_attack"] = dict(sorted(self.forger.sent.items()))
                    report["sent"] = sum(self.forger.sent.values())
                (out_dir / "hostile.json").write_text(json.dumps(report, indent=2))

    client_mod.Client = HostileClient  # run_rank imports Client from this module when it starts
    return launcher.run_rank(cfg, out_dir, resume=False)


def _cycle(names: tuple[str, ...]) -> Iterator[str]:
    while True:
        yield from names


# =================================================================================================
# the driver


def _mpiexec() -> str:
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise SystemExit("hostile_campaign: no mpiexec on PATH (pip install mpich)")
    return exe


def _run(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> int:
    with open(log, "w") as fh:
        try:
            return subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            fh.write(f"\nhostile_campaign: killed after {timeout:g} s\n")
            return 124


def _final_model(out: Path) -> dict[str, bytes]:
    from hpcfed.store import checkpoint as ck

    newest = ck.latest_valid(out / "checkpoints", warn=lambda _: None)
    if newest is None:
        return {}
    return {k: np.ascontiguousarray(v).tobytes() for k, v in sorted(newest.strategy[1].items())}


def _num_clients(config: str, overrides: list[str]) -> int:
    from hpcfed.config import load

    n = load(config, overrides).federation.num_clients
    return n if n is not None else 2


def campaign(config: str, overrides: list[str], *, messages: int, out: Path, timeout: float = 300,
             log: Callable[[str], None] = lambda s: None, flood_mib: int = 0) -> dict[str, Any]:
    """A clean run and the same run with a hostile client; what was sent, refused, and whether results match."""
    from hpcfed.launch.parent import prepare_config

    cfg = prepare_config(config, overrides)
    if cfg.mode != "sync":
        raise ValueError(f"{config}: the campaign needs a synchronous strategy (its result is compared bit for bit)")
    honest = _num_clients(config, overrides)
    world = honest + 2  # server + honest clients + the hostile client
    overrides = [o for o in overrides if not o.startswith("federation.num_clients=")]
    # The campaign measures the channel's and runtime's refusal of every crafted message, one after
    # another from one rank: the first malformed one would evict the site (security.on_misbehaviour)
    # and the rest would be dropped unread. Eviction has tests of its own (tests/server/test_eviction*).
    if not any(o.startswith("security.on_misbehaviour=") for o in overrides):
        overrides = [*overrides, "security.on_misbehaviour=ignore"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.setdefault("HPCFED_PSK", os.urandom(32).hex())
    mpi = _mpiexec()
    py = sys.executable
    base_out, atk_out = out / "baseline", out / "attacked"
    for d in (base_out, atk_out):
        shutil.rmtree(d, ignore_errors=True)
    log(f"baseline: {world} ranks, no attack -> {base_out}")
    t0 = time.monotonic()
    rc_base = _run([mpi, "-n", str(world), py, "-m", "hpcfed", "run", config, *overrides, "--out", str(base_out)],
                   env, timeout, out / "baseline.log")
    t_base = time.monotonic() - t0
    log(f"attacked: {world - 1} ranks + 1 hostile rank sending {messages} crafted messages -> {atk_out}")
    t0 = time.monotonic()
    rc_atk = _run([mpi, "-n", str(world - 1), py, "-m", "hpcfed", "run", config, *overrides, "--out", str(atk_out),
                   ":", "-n", "1", py, str(Path(__file__).resolve()), "--worker", "--config", config,
                   "--out", str(atk_out), "--messages", str(messages), "--flood-mib", str(flood_mib), *overrides],
                  env, timeout, out / "attacked.log")
    t_atk = time.monotonic() - t0

    def read(path: Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    s_base, s_atk = read(base_out / "summary.json"), read(atk_out / "summary.json")
    hostile = read(atk_out / "hostile.json")
    rejected = s_atk.get("rejected", {"runtime": {}, "channel": {}})
    n_rejected = sum(rejected.get("runtime", {}).values()) + sum(rejected.get("channel", {}).values())
    base_rejected = s_base.get("rejected", {"runtime": {}, "channel": {}})
    sent = int(hostile.get("sent", 0))
    hostile_cid = str(world - 2)
    equal = (rc_base == 0 and rc_atk == 0 and bool(s_base) and bool(s_atk)
             and s_base.get("clients") == s_atk.get("clients")
             and _final_model(base_out) == _final_model(atk_out) != {})
    result = {
        "sent": sent,
        "accepted": sent - n_rejected if s_atk else sent,
        "server_alive": rc_atk == 0 and bool(s_atk) and bool(hostile.get("final_model_received"))
        and bool(hostile.get("stopped_by_server")),
        "honest_result_equal": equal,
        "world_size": world,
        "hostile_rank": hostile.get("rank"),
        "rounds_attacked": hostile.get("rounds_attacked", 0),
        "by_attack": hostile.get("by_attack", {}),
        "rejected_by_server": {"channel": rejected.get("channel", {}), "runtime": rejected.get("runtime", {})},
        "baseline_rejected": (sum(base_rejected.get("runtime", {}).values())
                              + sum(base_rejected.get("channel", {}).values())),
        "final_metrics": {"baseline": s_base.get("clients"), "attacked": s_atk.get("clients")},
        "hostile_site_final_metrics_equal": (s_base.get("clients") or {}).get(hostile_cid)
        == (s_atk.get("clients") or {}).get(hostile_cid),
        "exit_codes": {"baseline": rc_base, "attacked": rc_atk},
        "flood_mib": flood_mib,
        "server_peak_rss_mib": {"baseline": _server_rss_mib(s_base), "attacked": _server_rss_mib(s_atk)},
        "server_peak_rss_growth_mib": (round(_server_rss_mib(s_atk) - _server_rss_mib(s_base), 1)
                                       if s_base and s_atk else None),
        "wall_s": {"baseline": round(t_base, 2), "attacked": round(t_atk, 2)},
        "out": str(out),
    }
    return result


def _server_rss_mib(summary: dict[str, Any]) -> float:
    cost = (summary.get("cost") or {}).get("0") or {}
    return round(cost.get("peak_rss_bytes", 0) / 2**20, 1)


def main(argv: list[str] | None = None) -> int:
    """Run the campaign (or, with --worker, be the hostile rank) and print the result; exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both runs (e.g. rounds=4)")
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--messages", type=int, default=1200, help="crafted messages to send (spread over the rounds)")
    p.add_argument("--out", default=None, help="keep both runs here (default: a temporary folder, removed)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before it is killed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--flood-mib", type=int, default=0,
                   help="also flood the server with this many MiB of unsolicited / oversize messages (e.g. 2048)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the hostile rank itself
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.messages < 0 or (args.messages == 0 and not args.flood_mib):
        p.error("--messages must be at least 1 (or 0 with --flood-mib)")
    tmp = None
    if args.out:
        out = Path(args.out).resolve()
        out.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="hpcfed-hostile-")
        out = Path(tmp)
    say = (lambda s: print(f"[hostile] {s}", file=sys.stderr)) if args.json else (lambda s: print(f"[hostile] {s}"))
    try:
        result = campaign(args.config, args.overrides, messages=args.messages, out=out, timeout=args.timeout, log=say,
                          flood_mib=args.flood_mib)
    finally:
        if tmp is not None and not os.environ.get("HPCFED_KEEP_CAMPAIGN"):
            shutil.rmtree(tmp, ignore_errors=True)
    ok = (result["sent"] >= args.messages and result["accepted"] == 0 and result["server_alive"]
          and result["honest_result_equal"])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key in ("sent", "accepted", "server_alive", "honest_result_equal"):
            print(f"{key}: {result[key]}")
        print("server rejections:", json.dumps(result["rejected_by_server"]))
        if not ok:
            print(f"FAILED; logs in {out} (set --out to keep them)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
