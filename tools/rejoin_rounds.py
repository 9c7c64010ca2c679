"""How soon a rejoining site takes part again (issue 38): `hpcfed serve` and K `hpcfed join` jobs;
one site job at a time is SIGKILLed, started again `--away` seconds later with the same command,
and waited for until its first upload after its knock is folded; `--rejoins` times.

    python tools/rejoin_rounds.py [--mode sync|async] [--sites 4] [--rejoins 10] [--away 2-5]
                                  [--secure] [--seed 0] [--out DIR] [--json]

It reads the server's metrics.jsonl (`tools/chaos_checks.rejoin_rounds`: each ``rejoined`` event
carries the time its knock came):

- sync: the rounds from the round in progress at its knock to the round that first folded its
  upload (1: the next round, the goal "within one round of its knock");
- async: the uploads folded between its knock and the step that let it in (0: at once), and the
  other sites' uploads folded before its own first one (K - 1 is one round of the others).

The load average is printed with the figures (the machine may be shared); the counts are not
timings, but a loaded node makes a site slower to start and so later to knock, never later to be
let in once it has knocked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools.chaos_checks import events, rejoin_rounds  # noqa: E402  (the repository's root is on the path above)
from tools.chaos_soak import MARKER, Soak, _finish, _overrides  # noqa: E402

ASYNC_NAME = "quickstart_async.yaml"


def _async_config(folder: Path) -> str:
    """The quickstart as an asynchronous federation (FedAsync takes no `weighting`)."""
    path = folder / ASYNC_NAME
    path.write_text((REPO / "configs/quickstart.yaml").read_text().replace("  weighting: num_examples\n", "")
                    .replace("name: fedavg ", "name: fedasync "))
    return str(path)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the federation, kill and restart sites until `args.rejoins` rejoins were folded; the figures."""
    out = Path(args.out)
    if out.exists() and not (out / MARKER).exists():
        raise SystemExit(f"rejoin rounds: {out} exists and is not this tool's folder: pick another --out")
    soak = Soak(argparse.Namespace(out=str(out), sites=args.sites, plain=not args.secure))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("made by tools/rejoin_rounds.py\n")
    if args.mode == "async":
        soak.config = _async_config(out)
        soak.overrides = [o for o in _overrides(args.sites, False) if not o.startswith("federation.slowdown")]
    load_before = _load()
    rng = random.Random(args.seed)
    lo, hi = (float(x) for x in args.away.split("-"))
    try:
        soak.start_server()
        for cid in range(args.sites):
            soak.start_site(cid)
        _wait(lambda: any(e["name"] in ("round_time_s", "broadcast") for e in events(soak.srv)), 900, soak,
              "the first round")
        done, cid = 0, -1
        while done < args.rejoins:
            # another site than the last: a site is let back in at most every REJOIN_INTERVAL_S (10 s)
            cid = rng.choice([c for c in range(args.sites) if c != cid])
            soak.kill_site(cid)
            time.sleep(rng.uniform(lo, hi))
            soak.start_site(cid)
            _wait(lambda n=done: _folded(soak.srv) > n, 600, soak, f"rejoin {done + 1} folded")
            done += 1
            print(f"rejoin {done}: site {cid} (load {_load()})", flush=True)
        (soak.srv / "HALT").touch()
        assert soak.server is not None
        code = _finish(soak.server, 300)
        for proc in soak.sites.values():
            _finish(proc, 120)
    finally:
        for proc in [*soak.sites.values(), *([soak.server] if soak.server is not None else [])]:
            if proc.poll() is None:
                _finish(proc, 0.1)
    rows = rejoin_rounds(soak.srv)
    return {"mode": args.mode, "sites": args.sites, "secure_aggregation": args.secure, "server_exit": code,
            "load_before": load_before, "load_after": _load(), "rejoins": rows}


def _folded(srv: Path) -> int:
    """Rejoins whose first upload after the knock is folded."""
    rows = rejoin_rounds(srv)
    return sum(1 for r in rows if r.get("rounds", r.get("others_before_first")) is not None)


def _wait(ready: Any, timeout: float, soak: Soak, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if soak.server is None or soak.server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"rejoin rounds: never {what}; see {soak.out}/server.out")
        time.sleep(0.5)


def _print(result: dict[str, Any]) -> None:
    rows = result["rejoins"]
    print(f"rejoins: {result['mode']}, K = {result['sites']}, secure aggregation "
          f"{'on' if result['secure_aggregation'] else 'off'}; load average {result['load_before']} before, "
          f"{result['load_after']} after; server exit {result['server_exit']}")
    print(f"seconds from the knock to its setup done: {[r['let_in_s'] for r in rows]}")
    if result["mode"] == "sync":
        delays = [r["rounds"] for r in rows]
        print(f"rounds from the knock to the first folded upload (1: the next round): {delays}; within one round: "
              f"{sum(1 for d in delays if d is not None and d <= 1)} of {len(delays)}")
    else:
        admit = [r["before_admit"] for r in rows]
        others = [r["others_before_first"] for r in rows]
        print(f"uploads folded between the knock and the let-in (0: at once): {admit}; at once: "
              f"{sum(1 for a in admit if a == 0)} of {len(admit)}")
        print(f"other sites' uploads folded before its first (K - 1 = {result['sites'] - 1} is one round): {others}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--rejoins", type=int, default=10)
    p.add_argument("--away", default="2-5", metavar="LO-HI", help="seconds a killed site stays away (uniform)")
    p.add_argument("--secure", action="store_true", help="secure aggregation on (sync only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/hpcfed-rejoin-rounds")
    p.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = p.parse_args(argv)
    if args.secure and args.mode == "async":
        p.error("--secure is for sync rounds here")
    result = measure(args)
    _print(result)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
