"""What privacy costs: secure aggregation against plain FedAvg rounds, and DP's utility, side by side.

    python tools/bench_privacy.py [--json] [--k 4 8 16] [--p 1M] [--rounds 3] [--baseline DIR]
                                  [--utility-k 8] [--utility-rounds 8] [--z 2.0] [--clip 0.3]
                                  [--skip-cost] [--skip-utility]
    python tools/bench_privacy.py --async [--k 4 8 16] [--p 1M] [--rounds 3] [--buffer 4] [--repeat 1] [--utility-k 3]

Cost: for each K, two real federations (`mpiexec -n K+1 python -m hpcfed run`) of the synthetic task
carrying P float32 parameters (`task.ballast`, no local training), one plain, one with
`privacy.secure_aggregation=true`, run one after the other; from what each wrote it reports the
median round time (metrics.jsonl `round_time_s`, first round left out) and rank 0's bytes per round
(summary.json `cost`), and their ratios secagg / plain. `--baseline DIR` (a checkout of an earlier
hpcfed, e.g. `git archive main | tar -x -C /tmp/base`) adds that tree's secure aggregation rounds
beside this one's, run in the same loop (plain, baseline, this tree, for each K): before and after.

Utility: the quickstart (8 rounds, K sites) plain, with secure aggregation, with central DP-FedAvg and
with distributed DP (secure aggregation, each site adding its share of the noise: discrete Skellam
noise, the default, and continuous Gaussian noise) at noise multiplier z and clip C; the final mean
test accuracy and ε at δ = 1e-5.

Record DP (`--record-dp`): the quickstart for each K in `--record-k`, `--record-rounds` rounds, plain
(ε = ∞) and with `privacy.record_dp` at each target ε in `--epsilons` (δ = 1e-5, clip `--record-clip`),
run one after the other; the final mean test accuracy, the largest site ε the run reports (summary.json
privacy.record_dp), and the median round time against plain's; then plain and ε = 8 at each batch
size in `--batch-sizes` (K = the first of `--record-k`): how the cost of per-example gradients grows.

Asynchronous (`--async`): FedBuff (configs/quickstart_fedbuff.yaml, buffers of `--buffer`, at most K),
plain async against secure buffered async (each buffer summed securely among its members on the sites'
epoch keys: `hpcfed.privacy.secagg_epoch`), `--repeat` pairs per K, plain and secure alternating: the
median time between two server versions (one buffer applied; metrics.jsonl `fedbuff_version`) with P
float32 parameters and no local training, and the CPU per buffer of rank 0, of a member (per upload)
and of all ranks (summary.json cost's `loop_cpu_s`), each pair's ratios and their medians; then (unless `--utility-k
1`) the quickstart FedBuff's final mean test accuracy plain and secure (`--utility-k` sites,
`--utility-rounds` x K uploads).

A benchmark, not a test: on a shared machine the times move with the load (printed with them).
"""

from __future__ import annotations

import argparse
import itertools
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


def run(k: int, overrides: list[str], timeout: float, repo: Path = REPO,
        config: str = "configs/quickstart.yaml") -> dict:
    """One federation of K sites (`config`, the quickstart by default) with `overrides`, of the hpcfed in
    `repo`; its metrics and summary."""
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        raise SystemExit("no mpiexec on PATH; install an MPI (`pip install mpich`)")
    with tempfile.TemporaryDirectory(prefix="bench_privacy_") as tmp:
        out = Path(tmp) / "run"
        cmd = [mpiexec, "-n", str(k + 1), sys.executable, "-m", "hpcfed", "run", str(repo / config),
               "--out", str(out), *QUIET, *overrides]
        env = {**os.environ, "HPCFED_PSK": secrets.token_hex(32), "PYTHONPATH": str(repo)}
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"K={k} {overrides}: the federation failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {"events": events, "summary": json.loads((out / "summary.json").read_text())}


def cost(k: int, p: int, rounds: int, secure: bool, timeout: float, repo: Path = REPO) -> dict:
    """Round time and rank 0's traffic per round, plain or with secure aggregation."""
    res = run(k, [f"rounds={rounds}", "checkpoint_every=0", "eval_every=0", f"task.ballast={p}",
                  "task.local_epochs=0", "task.samples_per_site=100", "task.hidden=16",
                  *(SECAGG if secure else [])], timeout, repo)
    times = [e["value"] for e in res["events"] if e["name"] == "round_time_s"]
    server = res["summary"]["cost"]["0"]
    return {"round_time_s": statistics.median(times[1:] if len(times) > 1 else times), "round_times_s": times,
            "rank0_bytes_in_per_round": server["bytes_received"] / rounds,
            "rank0_bytes_out_per_round": server["bytes_sent"] / rounds}


def cost_table(ks: list[int], p: int, rounds: int, timeout: float, baseline: Path | None = None) -> list[dict]:
    rows = []
    for k in ks:
        plain = cost(k, p, rounds, False, timeout)
        before = cost(k, p, rounds, True, timeout, baseline) if baseline else None
        secure = cost(k, p, rounds, True, timeout)
        row = {"k": k, "p": p, "plain": plain, "secagg": secure,
               "time_ratio": secure["round_time_s"] / plain["round_time_s"],
               "bytes_in_ratio": secure["rank0_bytes_in_per_round"] / plain["rank0_bytes_in_per_round"]}
        was = ""
        if before is not None:
            row.update(secagg_baseline=before, time_ratio_baseline=before["round_time_s"] / plain["round_time_s"])
            was = f", baseline secagg {before['round_time_s']:.3f} s (x{row['time_ratio_baseline']:.2f})"
        rows.append(row)
        print(f"  K={k:3d} P={p:,}: round {plain['round_time_s']:.3f} s plain, {secure['round_time_s']:.3f} s secagg "
              f"(x{row['time_ratio']:.2f}){was}; rank 0 in {plain['rank0_bytes_in_per_round'] / 1e6:.1f} MB / "
              f"{secure['rank0_bytes_in_per_round'] / 1e6:.1f} MB per round (x{row['bytes_in_ratio']:.2f}); "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    return rows


def utility_table(k: int, rounds: int, z: float, clip: float, timeout: float) -> list[dict]:
    dp = [f"privacy.dp.clip_norm={clip}", f"privacy.dp.noise_multiplier={z}"]
    # Distributed DP twice: the sites' discrete Skellam noise (the default) and continuous Gaussian
    # noise rounded afterwards, at the same z: accuracy and ε of the exact mechanism against the old one.
    setups = {"plain FedAvg": [], "secure aggregation": SECAGG, f"central DP (z={z:g}, C={clip:g})": dp,
              f"distributed DP + secagg, skellam (z={z:g})": [*dp, *SECAGG],
              f"distributed DP + secagg, gaussian (z={z:g})": [*dp, *SECAGG, "privacy.dp.noise=gaussian"]}
    rows = []
    for name, overrides in setups.items():
        summary = run(k, [f"rounds={rounds}", "checkpoint_every=0", *overrides], timeout)["summary"]
        privacy = summary.get("privacy") or {}
        rows.append({"setup": name, "k": k, "rounds": rounds, "accuracy": summary["mean"]["accuracy"],
                     "epsilon": privacy.get("epsilon")})
        eps = f", ε = {rows[-1]['epsilon']:.2f} (δ = 1e-5)" if rows[-1]["epsilon"] else ""
        print(f"  {name:45s} K={k} {rounds} rounds: test accuracy {rows[-1]['accuracy']:.3f}{eps}", flush=True)
    return rows


def record_run(k: int, rounds: int, overrides: list[str], timeout: float) -> dict:
    """One quickstart federation (no checkpoints): accuracy, max site ε, median round time (first left out)."""
    res = run(k, [f"rounds={rounds}", "checkpoint_every=0", *overrides], timeout)
    times = [e["value"] for e in res["events"] if e["name"] == "round_time_s"]
    record = (res["summary"].get("privacy") or {}).get("record_dp") or {}
    return {"accuracy": res["summary"]["mean"]["accuracy"], "epsilon": record.get("epsilon"),
            "sites": record.get("sites"), "round_time_s": statistics.median(times[1:] if len(times) > 1 else times)}


def record_dp_table(ks: list[int], rounds: int, epsilons: list[float], clip: float, batch_sizes: list[int],
                    extra: list[str], timeout: float) -> dict:
    """Accuracy against ε and round time against plain, per K; then the cost against the batch size."""
    rows: list[dict] = []
    for k in ks:
        plain = record_run(k, rounds, extra, timeout)
        rows.append({"k": k, "target": None, **plain, "time_ratio": 1.0})
        print(f"  K={k} {rounds} rounds, ε = ∞ (plain): accuracy {plain['accuracy']:.3f}, round "
              f"{plain['round_time_s']:.2f} s; load {os.getloadavg()[0]:.1f}", flush=True)
        for eps in epsilons:
            dp = record_run(k, rounds, [*extra, f"privacy.record_dp.epsilon={eps}", "privacy.record_dp.delta=1e-5",
                                        f"privacy.record_dp.clip_norm={clip}"], timeout)
            rows.append({"k": k, "target": eps, **dp, "time_ratio": dp["round_time_s"] / plain["round_time_s"]})
            gap = dp["accuracy"] - plain["accuracy"]
            print(f"  K={k} {rounds} rounds, ε = {eps:g}: accuracy {dp['accuracy']:.3f} ({gap:+.3f}), "
                  f"max site ε {dp['epsilon']:.3f}, round {dp['round_time_s']:.2f} s (x{rows[-1]['time_ratio']:.2f}); "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    growth = []
    for bs in batch_sizes:
        plain = record_run(ks[0], rounds, [*extra, f"task.batch_size={bs}"], timeout)
        dp = record_run(ks[0], rounds, [*extra, f"task.batch_size={bs}", "privacy.record_dp.epsilon=8",
                                        "privacy.record_dp.delta=1e-5", f"privacy.record_dp.clip_norm={clip}"], timeout)
        growth.append({"batch_size": bs, "plain_s": plain["round_time_s"], "record_dp_s": dp["round_time_s"],
                       "time_ratio": dp["round_time_s"] / plain["round_time_s"]})
        print(f"  K={ks[0]} batch {bs}: round {plain['round_time_s']:.2f} s plain, "
              f"{dp['round_time_s']:.2f} s record DP (x{growth[-1]['time_ratio']:.2f}); "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    return {"rows": rows, "batch_growth": growth}


FEDBUFF = "configs/quickstart_fedbuff.yaml"
# `loop_cpu`'s figures, as printed (plain / secure, in ms)
CPU_KEYS = {"rank0_cpu_per_buffer_s": "rank 0 per buffer", "member_cpu_per_upload_s": "a member per upload",
            "all_cpu_per_buffer_s": "all ranks per buffer"}


def buffer_time(k: int, p: int, rounds: int, buffer: int, secure: bool, timeout: float) -> dict:
    """FedBuff with P parameters and no local training: the median time between two server versions."""
    res = run(k, [f"rounds={rounds}", "checkpoint_every=0", "eval_every=0", f"task.ballast={p}", "task.local_epochs=0",
                  "task.samples_per_site=100", "task.hidden=16", f"federation.buffer_size={min(buffer, k)}",
                  *(SECAGG if secure else [])], timeout, config=FEDBUFF)
    bumps, last = [], None
    for e in res["events"]:
        if e["name"] == "fedbuff_version" and e["value"] != last:
            bumps.append(e["time"])
            last = e["value"]
    gaps = [b - a for a, b in itertools.pairwise(bumps)]
    return {"buffer_time_s": statistics.median(gaps) if gaps else float("nan"), "buffers": len(bumps),
            **loop_cpu(res["summary"])}


def loop_cpu(summary: dict) -> dict:
    """CPU per buffer from each rank's loop CPU (summary.json cost's `loop_cpu_s`: set-up and final
    evaluation left out): rank 0's per buffer applied, a member's per upload it made (all sites' CPU
    over the uploads folded), and all ranks' together per buffer (what bounds the wall time when
    the ranks outnumber the cores)."""
    buffers = max(1, int(summary["server_version"]) - 1)
    uploads = max(1, int(summary["updates_accepted"]))
    cost = summary["cost"]
    server = float(cost["0"].get("loop_cpu_s", float("nan")))
    sites = sum(float((c or {}).get("loop_cpu_s", float("nan"))) for r, c in cost.items() if r != "0")
    return {"buffers_applied": buffers, "uploads": uploads, "rank0_cpu_per_buffer_s": server / buffers,
            "member_cpu_per_upload_s": sites / uploads, "all_cpu_per_buffer_s": (server + sites) / buffers}


def async_table(ks: list[int], p: int, rounds: int, buffer: int, utility_k: int, utility_rounds: int,
                timeout: float, repeat: int = 1) -> dict:
    """Plain against secure buffered async, side by side: buffer time per K (`repeat` pairs, plain and
    secure alternating; the median of the pairs' ratios), then the quickstart's accuracy."""
    rows = []
    for k in ks:
        pairs = []
        for _ in range(repeat):
            plain, secure = (buffer_time(k, p, rounds, buffer, s, timeout) for s in (False, True))
            pairs.append({"plain": plain, "secure": secure, "load": os.getloadavg()[0],
                          "time_ratio": secure["buffer_time_s"] / plain["buffer_time_s"],
                          **{f"{key}_ratio": secure[key] / plain[key] for key in CPU_KEYS}})
        row = {"k": k, "p": p, "buffer": min(buffer, k), "pairs": pairs,
               "time_ratio": statistics.median(pair["time_ratio"] for pair in pairs),
               **{f"{key}_ratio": statistics.median(pair[f"{key}_ratio"] for pair in pairs) for key in CPU_KEYS}}
        rows.append(row)
        for pair in pairs:
            cpu = "; CPU " + ", ".join(f"{what} {pair['plain'][key] * 1e3:.0f} / {pair['secure'][key] * 1e3:.0f} ms "
                                       f"(x{pair[f'{key}_ratio']:.2f})" for key, what in CPU_KEYS.items())
            print(f"  K={k:3d} P={p:,} buffer {row['buffer']}: {pair['plain']['buffer_time_s']:.3f} s plain, "
                  f"{pair['secure']['buffer_time_s']:.3f} s secure per buffer (x{pair['time_ratio']:.2f}){cpu}; "
                  f"load {pair['load']:.1f}", flush=True)
        print(f"  K={k:3d}: median ratio x{row['time_ratio']:.2f} wall, " + ", ".join(
            f"x{row[f'{key}_ratio']:.2f} {what}" for key, what in CPU_KEYS.items()) + f" over {repeat} pair(s)",
            flush=True)
    if utility_k < 2:
        return {"buffers": rows}
    utility = {}
    for secure in (False, True):
        res = run(utility_k, [f"rounds={utility_rounds}", "checkpoint_every=0", *(SECAGG if secure else [])],
                  timeout, config=FEDBUFF)
        utility["secure" if secure else "plain"] = res["summary"]["mean"]["accuracy"]
    print(f"  quickstart FedBuff, K={utility_k}: accuracy {utility['plain']:.4f} plain, {utility['secure']:.4f} "
          f"secure ({utility['secure'] - utility['plain']:+.4f}); load {os.getloadavg()[0]:.1f}", flush=True)
    return {"buffers": rows, "utility": utility}


def finish(result: dict, as_json: bool) -> int:
    """A benchmark's end: the load average now beside the figures, and the figures as JSON if asked."""
    result["load_average_end"] = os.getloadavg()[0]
    if as_json:
        print(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--p", default="1M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--utility-k", type=int, default=8)
    ap.add_argument("--utility-rounds", type=int, default=8)
    ap.add_argument("--z", type=float, default=2.0)
    ap.add_argument("--clip", type=float, default=0.3)
    ap.add_argument("--baseline", type=Path, default=None,
                    help="an earlier hpcfed checkout whose secure aggregation rounds run beside this tree's")
    ap.add_argument("--record-dp", action="store_true", help="only the record-level DP table (see the docstring)")
    ap.add_argument("--record-k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--record-rounds", type=int, default=8)
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--record-clip", type=float, default=1.0)
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[32, 128])
    ap.add_argument("--record-set", nargs="*", default=[], help="extra key=value overrides for the record-DP runs")
    ap.add_argument("--async", dest="asynchronous", action="store_true",
                    help="only plain against secure buffered async, FedBuff (see the docstring)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="--async: plain/secure pairs per K, alternating (the median ratio is reported)")
    ap.add_argument("--buffer", type=int, default=4, help="--async: federation.buffer_size (at most K)")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--skip-utility", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"bench_privacy: {os.cpu_count()} cores, load average {load:.1f} at the start", flush=True)
    result: dict = {"load_average": load}
    if args.asynchronous:
        result["async"] = async_table(args.k, parse_count(args.p), args.rounds, args.buffer, args.utility_k,
                                      args.utility_rounds, args.timeout, args.repeat)
        args.skip_cost = args.skip_utility = True
    if args.record_dp:
        result["record_dp"] = record_dp_table(args.record_k, args.record_rounds, args.epsilons, args.record_clip,
                                              args.batch_sizes, args.record_set, args.timeout)
    if not args.skip_cost and not args.record_dp:
        result["cost"] = cost_table(args.k, parse_count(args.p), args.rounds, args.timeout, args.baseline)
    if not args.skip_utility and not args.record_dp:
        result["utility"] = utility_table(args.utility_k, args.utility_rounds, args.z, args.clip, args.timeout)
    return finish(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
