"""How a round's cost grows with the number of sites K and the model size P.

    python tools/bench_scale.py [--json] [--k 2 4 8 16 32] [--p 1M 16M 64M] [--rounds 3]

For each (K, P) it runs a real federation (`mpiexec -n K+1 python -m hpcfed run`) of the synthetic
task carrying P float32 parameters (`task.ballast`, no local training: `task.local_epochs=0`), and
reads what the run wrote: the median synchronous round time (metrics.jsonl `round_time_s`, the
first round left out when there are more) and rank 0's peak RSS (summary.json `cost`). In the same
run it measures the secure channel's one-way throughput between two ranks (`hpcfed bench comm
--quick`, 64 MB messages) and reports the ideal round time: the bytes rank 0 must move in a round
(K models out, K updates in: 2 K x 4 P) divided by that throughput. `overhead` = round time / ideal.

Prints a table (or JSON) and writes docs/img/bench_scale.png. A (K, P) whose clients would need more
memory than `--mem-gib` allows is skipped and reported as such. This is a benchmark, not a test: on a
shared machine the figures move with the load, which is reported with them.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9}
CLIENT_OVERHEAD_BYTES = 350 << 20  # a client rank's Python + torch + MPI before any model
CLIENT_MODEL_COPIES = 4  # the task's model, its get_parameters copy, the received and the sent message


def parse_count(text: str) -> int:
    """A count written as 1000, 16M or 1.5G, as an int."""
    text = text.strip().upper()
    if text and text[-1] in _SUFFIX:
        return int(float(text[:-1]) * _SUFFIX[text[-1]])
    return int(text)


def client_memory_bytes(k: int, p: int) -> int:
    """Estimated memory of K client ranks holding models of P float32 parameters."""
    return k * (CLIENT_MODEL_COPIES * 4 * p + CLIENT_OVERHEAD_BYTES)


def run_one(k: int, p: int, rounds: int, timeout: float) -> dict:
    """One federation of K clients and P float32 parameters; what its outputs say it cost."""
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        raise SystemExit("no mpiexec on PATH; install an MPI (`pip install mpich`)")
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        out = Path(tmp) / "run"
        cmd = [mpiexec, "-n", str(k + 1), sys.executable, "-m", "hpcfed", "run", str(REPO / "configs/quickstart.yaml"),
               "--out", str(out), f"rounds={rounds}", "checkpoint_every=0", "eval_every=0",
               f"task.ballast={p}", "task.local_epochs=0", "task.samples_per_site=100", "task.hidden=16",
               "federation.round_deadline_s=3000", "federation.client_timeout_s=3000",
               "federation.setup_timeout_s=3000", "federation.status_every_s=3600"]
        env = {**os.environ, "HPCFED_PSK": secrets.token_hex(32), "PYTHONPATH": str(REPO)}
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"K={k} P={p}: the federation failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        times = [e["value"] for e in events if e["name"] == "round_time_s"]  # in round order
        summary = json.loads((out / "summary.json").read_text())
    steady = times[1:] if len(times) > 1 else times
    server = summary["cost"]["0"]
    return {"k": k, "p": p, "model_bytes": 4 * p, "round_times_s": times, "round_time_s": statistics.median(steady),
            "rank0_peak_rss_bytes": server["peak_rss_bytes"], "rank0_seal_s": server["seal_s"],
            "rank0_open_s": server["open_s"], "rank0_bytes_sent": server["bytes_sent"],
            "rank0_bytes_received": server["bytes_received"], "wall_s": wall}


def channel_throughput() -> dict:
    """The secure channel's, AES-GCM's and raw MPI's throughput in GB/s (quick bench)."""
    import contextlib
    import io

    from hpcfed.comm.bench import run_bench

    with contextlib.redirect_stdout(io.StringIO()):
        r = run_bench(quick=True)
    return {"secure_gbps": r["secure_gbps"], "aes_gcm_gbps": r["aes_gcm_gbps"], "raw_mpi_gbps": r["raw_mpi_gbps"]}


def plot(rows: list[dict], path: Path) -> None:
    """Save round time and rank 0 peak RSS against K, one line per P, to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for p in sorted({r["p"] for r in rows if "round_time_s" in r}):
        pts = [r for r in rows if r["p"] == p and "round_time_s" in r]
        ks = [r["k"] for r in pts]
        a.plot(ks, [r["round_time_s"] for r in pts], "o-", label=f"P={_fmt(p)} measured")
        a.plot(ks, [r["ideal_s"] for r in pts], "--", color=a.lines[-1].get_color(), label=f"P={_fmt(p)} ideal")
        b.plot(ks, [r["rank0_peak_rss_bytes"] / 2**20 for r in pts], "o-", label=f"P={_fmt(p)}")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients K")
        ax.legend(fontsize=7)
    a.set_yscale("log")
    a.set_ylabel("round time (s)")
    a.set_title("round time vs ideal (bytes / channel throughput)")
    b.set_ylabel("rank 0 peak RSS (MiB)")
    b.set_title("server memory")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(p: int) -> str:
    return f"{p / 1e6:g}M" if p >= 10**6 else f"{p / 1e3:g}K"


def table(result: dict) -> str:
    """The results as text: the channel line, then one Markdown row per (K, P)."""
    tp = result["throughput"]
    lines = [f"channel: secure {tp['secure_gbps']:.2f} GB/s one way (one-core AES-GCM {tp['aes_gcm_gbps']:.2f}, "
             f"raw MPI {tp['raw_mpi_gbps']:.2f}); load average {result['load_average_before']} before, "
             f"{result['load_average_after']} after, {result['cpu_count']} cores",
             "| K | P | model | round time | ideal | overhead | rank 0 peak RSS | RSS / model |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['k']} | {_fmt(r['p'])} | {4 * r['p'] / 1e6:.0f} MB | skipped: {r['skipped']} | | | | |")
            continue
        lines.append(f"| {r['k']} | {_fmt(r['p'])} | {r['model_bytes'] / 1e6:.0f} MB | {r['round_time_s']:.2f} s | "
                     f"{r['ideal_s']:.2f} s | {r['overhead']:.2f}x | {r['rank0_peak_rss_bytes'] / 2**20:.0f} MiB | "
                     f"{r['rank0_peak_rss_bytes'] / r['model_bytes']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the (K, P) grid, print the table or JSON and save the plot; exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="numbers of clients")
    ap.add_argument("--p", nargs="+", default=["1M", "16M", "64M"], help="float32 parameters (1M, 16M, ...)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mem-gib", type=float, default=12.0, help="skip (K, P) whose clients need more memory")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per federation")
    ap.add_argument("--png", default=str(REPO / "docs/img/bench_scale.png"))
    args = ap.parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]
    tp = channel_throughput()
    rows = []
    for p in [parse_count(x) for x in args.p]:
        for k in args.k:
            if client_memory_bytes(k, p) > args.mem_gib * 2**30:
                rows.append({"k": k, "p": p, "skipped": f"clients need ~{client_memory_bytes(k, p) / 2**30:.0f} GiB "
                                                        f"(> --mem-gib {args.mem_gib:g})"})
                continue
            row = run_one(k, p, args.rounds, args.timeout)
            row["ideal_s"] = 2 * k * row["model_bytes"] / (tp["secure_gbps"] * 1e9)
            row["overhead"] = row["round_time_s"] / row["ideal_s"]
            row["load_average"] = [round(x, 2) for x in os.getloadavg()]
            rows.append(row)
            if not args.json:
                print(f"K={k} P={_fmt(p)}: round {row['round_time_s']:.2f} s, ideal {row['ideal_s']:.2f} s, "
                      f"rank 0 peak RSS {row['rank0_peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    result = {"throughput": tp, "rows": rows, "cpu_count": os.cpu_count(), "load_average_before": load_before,
              "load_average_after": [round(x, 2) for x in os.getloadavg()],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if any("round_time_s" in r for r in rows):
        plot(rows, Path(args.png))
        result["png"] = args.png
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
