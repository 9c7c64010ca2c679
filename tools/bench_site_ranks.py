"""Scaling inside a site: time per round with R = 1 and R = 2 ranks per site, side by side.

    python tools/bench_site_ranks.py [--json] [--ranks 1 2] [--rounds 4] [--hidden 2048] [--samples 4000]

Runs a real federation of one site (`hpcfed run configs/quickstart.yaml --np 1+R`, so the site's R
ranks and rank 0) for each R, on the synthetic task made compute-bound: a wide MLP
(`task.hidden`), many examples (`task.samples_per_site`) and a batch of 256 shared by the site's
ranks (the global batch is the same for every R). It reads what each run wrote: the median round
time (metrics.jsonl `round_time_s`, the first round left out), the site's throughput (summary.json
`throughput`, examples per second of training) and rank 0's bytes sent and peak RSS, which must not
grow with R. Prints the ratio of each R's round time to R = 1's, and the cores the machine has: a
site's R ranks need R free cores (each rank trains on `threads_per_rank` = 1 thread), so on a
loaded 2-core host the figure is core-bound. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(ranks: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One federation of one site of `ranks` ranks; its round time, throughput and rank 0's cost."""
    overrides = [f"rounds={args.rounds}", f"federation.ranks_per_site={ranks}", "checkpoint_every=1000",
                 f"task.hidden={args.hidden}", f"task.samples_per_site={args.samples}", "task.batch_size=256",
                 "task.dim=64", "eval_every=0"]
    cmd = [sys.executable, "-m", "hpcfed", "run", "configs/quickstart.yaml", *overrides,
           "--np", str(1 + ranks), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"R={ranks}: hpcfed run failed:\n{proc.stderr[-3000:]}")
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["value"] for r in rounds if r.get("name") == "round_time_s"]
    summary = json.loads((out / "summary.json").read_text())
    cost = summary["cost"]["0"]
    return {"ranks": ranks, "round_s": statistics.median(times[1:] or times), "wall_s": time.monotonic() - t0,
            "examples_per_s": summary["throughput"]["0"], "rank0_bytes_sent": cost["bytes_sent"],
            "rank0_peak_rss_mib": cost["peak_rss_bytes"] / 2**20}


def main(argv: list[str] | None = None) -> int:
    """Run each R side by side and print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-site-ranks-") as tmp:
        for ranks in args.ranks:
            rows.append(run_once(ranks, args, Path(tmp) / f"r{ranks}"))
    base = rows[0]["round_s"]
    for row in rows:
        row["ratio_to_first"] = row["round_s"] / base
    load = os.getloadavg()[0]
    info = {"cores": os.cpu_count(), "load_1min": round(load, 2), "hidden": args.hidden, "samples": args.samples,
            "rounds": args.rounds, "rows": rows}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"one site, synthetic MLP hidden={args.hidden}, {args.samples} examples, batch 256; "
          f"{info['cores']} cores, load {load:.1f}")
    print(f"{'R':>3} {'round s':>9} {'x R=' + str(rows[0]['ranks']):>8} {'examples/s':>11} "
          f"{'rank0 MB sent':>14} {'rank0 RSS MiB':>14}")
    for r in rows:
        print(f"{r['ranks']:>3} {r['round_s']:>9.3f} {r['ratio_to_first']:>8.2f} {r['examples_per_s']:>11.0f} "
              f"{r['rank0_bytes_sent'] / 1e6:>14.1f} {r['rank0_peak_rss_mib']:>14.0f}")
    if (info["cores"] or 1) < 1 + max(args.ranks):
        print(f"core-bound: {info['cores']} cores for 1 + {max(args.ranks)} ranks; "
              f"R ranks scale only with R free cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
