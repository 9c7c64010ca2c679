"""Server checkpoint size vs. number of sites K (issue 13): rank 0's file must hold the global model and
the strategy state only, so its size must not grow with K; each site's shard holds its own state.

    python tools/ckpt_size.py [--hidden 1024] [--ks 2 4 8]

Runs quickstart (2 rounds, FedAvg, Adam at the sites) with a bigger hidden layer for each K, side by
side, and prints for each: the server checkpoint's bytes, (global + strategy state) bytes, their ratio,
and the mean site shard bytes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    """Run quickstart for each K and print the checkpoint and shard sizes; exit status."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    env = {**os.environ, "HPCFED_PSK": os.environ.get("HPCFED_PSK") or "11" * 32}
    print(f"{'K':>3} {'server ckpt B':>14} {'global+strategy B':>18} {'ratio':>6} {'site shard B (mean)':>20}")
    for k in args.ks:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            cmd = [sys.executable, "-m", "hpcfed", "run", "configs/quickstart.yaml", "--np", str(k + 1), "--out",
                   str(out), "rounds=2", "checkpoint_every=1", "eval_every=0", f"task.hidden={args.hidden}",
                   "task.samples_per_site=64"]
            subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=1800)
            ckpt = sorted((out / "checkpoints").glob("ckpt-*.h5"))[-1]
            with h5py.File(ckpt, "r") as f:
                state = sum(f["strategy"][n].nbytes for n in f["strategy"])
            shards = [sorted(d.glob("shard-*.h5"))[-1].stat().st_size for d in (out / "sites").iterdir()]
            size = ckpt.stat().st_size
            print(f"{k:>3} {size:>14} {state:>18} {size / state:>6.3f} {sum(shards) / len(shards):>20.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
