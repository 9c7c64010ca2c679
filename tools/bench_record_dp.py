"""What record-level DP costs in time: a site's local training and a federation's round, plain against
DP-SGD, side by side in one run.

    python tools/bench_record_dp.py [--batch-sizes 32 128 512] [--fits 8] [--k 4] [--rounds 6]
                                    [--repeats 2] [--set key=value ...] [--skip-rounds] [--json]
    python tools/bench_record_dp.py --rounds 8 --accuracy 4:8:0.05:128:2:0.1 4:0:0.05:128:2:0.1 ...

Local training: one quickstart site (in this process, one torch thread) fits `--fits` rounds plain, with
`privacy.record_dp` (ε 8) as sites run it (the linear layers' clipped sums, `hpcfed.privacy.linear_clip`),
with the same DP-SGD on Opacus's per-example gradient hooks (the path of models with other layers) and on
`torch.func` vmap (the path of a model the hooks miss), interleaved round by round; the median CPU time of
a round's fit (the first left out) and the ratios to plain, per batch size. CPU time, not wall time: on a
loaded machine it moves far less.

Rounds: `--repeats` pairs of real federations (`mpiexec -n K+1 python -m hpcfed run`, the quickstart,
`--rounds` rounds, no checkpoints), plain then record DP (ε 8), one after the other; the median round
time (metrics.jsonl `round_time_s`, first round left out) of each and the ratio DP / plain per pair.
That ratio is the issue's goal (≤ 2); the fits above say where the time goes.

Accuracy (`--accuracy K:EPS:LR:BATCH:EPOCHS:CLIP[:SEED] ...`, EPS 0 = plain): the quickstart's FedAvg
run in this process (the sites' tasks, fit and evaluated as the federation does, parameters averaged by
examples; no MPI, so a sweep takes seconds per setting instead of minutes): final mean test accuracy
after `--rounds` rounds and the largest site ε. Its plain figures equal the mpiexec runs' (K = 4:
0.895, K = 8: 0.956); under DP its noise differs from a federation's (another secret seed), not its law.

A benchmark, not a test: the round times move with the machine's load (printed with them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.bench_privacy import finish, record_run  # noqa: E402  (the repo root is put on sys.path first)

DP_KEYS = ["privacy.record_dp.epsilon=8", "privacy.record_dp.delta=1e-5"]


def _site(batch_size: int, method: str | None, rounds: int) -> object:
    """A quickstart site (client 0 of 4); `method` None: plain, else record DP with that gradient path."""
    from hpcfed.config import RecordDPConfig
    from hpcfed.privacy.record_dp import SiteSettings
    from hpcfed.tasks.base import Site
    from hpcfed.tasks.synthetic import SyntheticTask

    spec = SiteSettings(RecordDPConfig(epsilon=8.0, delta=1e-5), rounds, secret_seed=1) if method else None
    task = SyntheticTask(SyntheticTask.Config(batch_size=batch_size),
                         Site(client_id=0, num_clients=4, seed=0, out_dir=Path(tempfile.mkdtemp()), record_dp=spec))
    if method:
        task.private.sgd.method = method  # type: ignore[union-attr]  # set just above: record_dp is given
    return task


def fit_table(batch_sizes: list[int], fits: int) -> list[dict]:
    """Median CPU seconds of one site's round of local training: plain, DP-SGD by the linear layers' clipped
    sums, by Opacus's hooks and by vmap."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for bs in batch_sizes:
        sites = {name: _site(bs, method, fits) for name, method in
                 (("plain", None), ("linear", "linear"), ("hooks", "hooks"), ("vmap", "vmap"))}
        times: dict[str, list[float]] = {name: [] for name in sites}
        for rnd in range(fits):
            for name, task in sites.items():
                start = time.process_time()
                task.fit(rnd)  # type: ignore[attr-defined]  # a SyntheticTask
                times[name].append(time.process_time() - start)
        med = {name: statistics.median(t[1:] if len(t) > 1 else t) for name, t in times.items()}
        rows.append({"batch_size": bs, **{f"{n}_s": v for n, v in med.items()},
                     **{f"{n}_ratio": med[n] / med["plain"] for n in ("linear", "hooks", "vmap")}})
        print(f"  fit, batch {bs:4d}: plain {med['plain'] * 1e3:7.1f} ms; record DP "
              + ", ".join(f"{n} {med[n] * 1e3:7.1f} ms (x{rows[-1][n + '_ratio']:.2f})"
                          for n in ("linear", "hooks", "vmap")) + " CPU per round", flush=True)
    return rows


def fedavg_in_process(k: int, rounds: int, eps: float, lr: float, batch: int, epochs: int, clip: float,
                      seed: int = 0) -> dict:
    """The quickstart's FedAvg in this process: final mean test accuracy and max site ε (eps 0: plain)."""
    from hpcfed.config import RecordDPConfig
    from hpcfed.privacy.record_dp import SiteSettings
    from hpcfed.tasks.base import Site
    from hpcfed.tasks.synthetic import SyntheticTask

    out = Path(tempfile.mkdtemp())
    settings = RecordDPConfig(epsilon=eps, delta=1e-5, clip_norm=clip) if eps else None
    spec = SiteSettings(settings, rounds, secret_seed=1234 + seed) if settings else None
    sites = [SyntheticTask(SyntheticTask.Config(lr=lr, batch_size=batch, local_epochs=epochs),
                           Site(client_id=i, num_clients=k, seed=seed, out_dir=out, record_dp=spec))
             for i in range(k)]
    model: dict = dict(sites[0].get_parameters())
    for rnd in range(rounds):
        updates = []
        for task in sites:
            task.set_parameters(model)
            updates.append((task.fit(rnd).num_examples, task.get_parameters()))
        total = sum(n for n, _ in updates)
        if total:
            model = {name: sum(n * p[name] for n, p in updates) / total for name in model}
    accuracy = []
    for task in sites:
        task.set_parameters(model)
        accuracy.append(task.evaluate(rounds, final=True)["accuracy"])
    epsilon = max(t.private.accountant.epsilon for t in sites if t.private) if settings else None
    return {"accuracy": statistics.fmean(accuracy), "epsilon": epsilon}


def accuracy_table(settings: list[str], rounds: int) -> list[dict]:
    """`fedavg_in_process` for each K:EPS:LR:BATCH:EPOCHS:CLIP[:SEED]."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for text in settings:
        k, eps, lr, batch, epochs, clip, *seed = text.split(":")
        row: dict = {"k": int(k), "epsilon_target": float(eps), "lr": float(lr), "batch_size": int(batch),
                     "local_epochs": int(epochs), "clip_norm": float(clip), "seed": int(seed[0]) if seed else 0}
        row.update(fedavg_in_process(int(k), rounds, float(eps), float(lr), int(batch), int(epochs), float(clip),
                                     row["seed"]))
        rows.append(row)
        eps_text = f"ε {row['epsilon']:.2f}" if row["epsilon"] is not None else "plain"
        print(f"  accuracy, {text}: {row['accuracy']:.3f} ({eps_text})", flush=True)
    return rows


def round_table(k: int, rounds: int, repeats: int, extra: list[str], timeout: float) -> list[dict]:
    """Median round time of plain and record-DP federations, run in pairs one after the other."""
    rows = []
    for rep in range(repeats):
        plain = record_run(k, rounds, extra, timeout)
        dp = record_run(k, rounds, [*extra, *DP_KEYS], timeout)
        rows.append({"k": k, "rounds": rounds, "plain_s": plain["round_time_s"], "record_dp_s": dp["round_time_s"],
                     "ratio": dp["round_time_s"] / plain["round_time_s"], "plain_accuracy": plain["accuracy"],
                     "record_dp_accuracy": dp["accuracy"], "epsilon": dp["epsilon"]})
        print(f"  round, K={k} pair {rep + 1}: plain {plain['round_time_s']:.3f} s, record DP "
              f"{dp['round_time_s']:.3f} s (x{rows[-1]['ratio']:.2f}); load {os.getloadavg()[0]:.1f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--fits", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for the federations")
    ap.add_argument("--skip-rounds", action="store_true", help="only the local-training table")
    ap.add_argument("--accuracy", nargs="*", default=[], metavar="K:EPS:LR:BATCH:EPOCHS:CLIP[:SEED]",
                    help="in-process FedAvg settings to score (only these when given)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    print(f"bench_record_dp: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    result: dict = {"load_average": os.getloadavg()[0]}
    if args.accuracy:
        result["accuracy"] = accuracy_table(args.accuracy, args.rounds)
    else:
        result["fit"] = fit_table(args.batch_sizes, args.fits)
    if not args.skip_rounds and not args.accuracy:
        result["rounds"] = round_table(args.k, args.rounds, args.repeats, args.set, args.timeout)
        ratio = statistics.median(r["ratio"] for r in result["rounds"])
        print(f"  median round-time ratio record DP / plain: x{ratio:.2f}", flush=True)
    return finish(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
