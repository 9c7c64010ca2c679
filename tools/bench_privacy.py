"""What privacy costs: secure aggregation against plain FedAvg rounds, and DP's utility, side by side.

    python tools/bench_privacy.py [--json] [--k 4 8 16] [--p 1M] [--rounds 3]
                                  [--utility-k 8] [--utility-rounds 8] [--z 2.0] [--clip 0.3]
                                  [--skip-cost] [--skip-utility]

Cost: for each K, two real federations (`mpiexec -n K+1 python -m hpcfed run`) of the synthetic task
carrying P float32 parameters (`task.ballast`, no local training), one plain, one with
`privacy.secure_aggregation=true`, run one after the other; from what each wrote it reports the
median round time (metrics.jsonl `round_time_s`, first round left out) and rank 0's bytes per round
(summary.json `cost`), and their ratios secagg / plain.

Utility: the quickstart (8 rounds, K sites) plain, with secure aggregation, with central DP-FedAvg and
with distributed DP (secure aggregation, each site adding its share of the noise) at noise
multiplier z and clip C; the final mean test accuracy and ε at δ = 1e-5.

A benchmark, not a test: on a shared machine the times move with the load (printed with them).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.bench_scale import parse_count  # noqa: E402  (the repo root is put on sys.path first)

SECAGG = ["privacy.secure_aggregation=true"]
QUIET = ["federation.round_deadline_s=3000", "federation.client_timeout_s=3000", "federation.setup_timeout_s=3000",
         "federation.status_every_s=3600", "influence.enabled=false"]


def run(k: int, overrides: list[str], timeout: float) -> dict:
    """One quickstart federation of K sites with `overrides`; its metrics and summary."""
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        raise SystemExit("no mpiexec on PATH; install an MPI (`pip install mpich`)")
    with tempfile.TemporaryDirectory(prefix="bench_privacy_") as tmp:
        out = Path(tmp) / "run"
        cmd = [mpiexec, "-n", str(k + 1), sys.executable, "-m", "hpcfed", "run", str(REPO / "configs/quickstart.yaml"),
               "--out", str(out), *QUIET, *overrides]
        env = {**os.environ, "HPCFED_PSK": secrets.token_hex(32), "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"K={k} {overrides}: the federation failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {"events": events, "summary": json.loads((out / "summary.json").read_text())}


def cost(k: int, p: int, rounds: int, secure: bool, timeout: float) -> dict:
    """Round time and rank 0's traffic per round, plain or with secure aggregation."""
    res = run(k, [f"rounds={rounds}", "checkpoint_every=0", "eval_every=0", f"task.ballast={p}",
                  "task.local_epochs=0", "task.samples_per_site=100", "task.hidden=16",
                  *(SECAGG if secure else [])], timeout)
    times = [e["value"] for e in res["events"] if e["name"] == "round_time_s"]
    server = res["summary"]["cost"]["0"]
    return {"round_time_s": statistics.median(times[1:] if len(times) > 1 else times), "round_times_s": times,
            "rank0_bytes_in_per_round": server["bytes_received"] / rounds,
            "rank0_bytes_out_per_round": server["bytes_sent"] / rounds}


def cost_table(ks: list[int], p: int, rounds: int, timeout: float) -> list[dict]:
    rows = []
    for k in ks:
        plain, secure = cost(k, p, rounds, False, timeout), cost(k, p, rounds, True, timeout)
        rows.append({"k": k, "p": p, "plain": plain, "secagg": secure,
                     "time_ratio": secure["round_time_s"] / plain["round_time_s"],
                     "bytes_in_ratio": secure["rank0_bytes_in_per_round"] / plain["rank0_bytes_in_per_round"]})
        print(f"  K={k:3d} P={p:,}: round {plain['round_time_s']:.3f} s plain, {secure['round_time_s']:.3f} s secagg "
              f"(x{rows[-1]['time_ratio']:.2f}); rank 0 in {plain['rank0_bytes_in_per_round'] / 1e6:.1f} MB / "
              f"{secure['rank0_bytes_in_per_round'] / 1e6:.1f} MB per round (x{rows[-1]['bytes_in_ratio']:.2f})",
              flush=True)
    return rows


def utility_table(k: int, rounds: int, z: float, clip: float, timeout: float) -> list[dict]:
    dp = [f"privacy.dp.clip_norm={clip}", f"privacy.dp.noise_multiplier={z}"]
    setups = {"plain FedAvg": [], "secure aggregation": SECAGG, f"central DP (z={z:g}, C={clip:g})": dp,
              f"distributed DP + secagg (z={z:g}, C={clip:g})": [*dp, *SECAGG]}
    rows = []
    for name, overrides in setups.items():
        summary = run(k, [f"rounds={rounds}", "checkpoint_every=0", *overrides], timeout)["summary"]
        privacy = summary.get("privacy") or {}
        rows.append({"setup": name, "k": k, "rounds": rounds, "accuracy": summary["mean"]["accuracy"],
                     "epsilon": privacy.get("epsilon")})
        eps = f", ε = {rows[-1]['epsilon']:.2f} (δ = 1e-5)" if rows[-1]["epsilon"] else ""
        print(f"  {name:45s} K={k} {rounds} rounds: test accuracy {rows[-1]['accuracy']:.3f}{eps}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--p", default="1M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--utility-k", type=int, default=8)
    ap.add_argument("--utility-rounds", type=int, default=8)
    ap.add_argument("--z", type=float, default=2.0)
    ap.add_argument("--clip", type=float, default=0.3)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--skip-utility", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"bench_privacy: {os.cpu_count()} cores, load average {load:.1f} at the start", flush=True)
    result: dict = {"load_average": load}
    if not args.skip_cost:
        result["cost"] = cost_table(args.k, parse_count(args.p), args.rounds, args.timeout)
    if not args.skip_utility:
        result["utility"] = utility_table(args.utility_k, args.utility_rounds, args.z, args.clip, args.timeout)
    result["load_average_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
