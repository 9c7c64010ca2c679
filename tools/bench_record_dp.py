"""What record-level DP costs in time: a site's local training and a federation's round, plain against
DP-SGD, side by side in one run.

    python tools/bench_record_dp.py [--batch-sizes 32 128 512] [--fits 8] [--k 4] [--rounds 6]
                                    [--repeats 2] [--round-batch-sizes 32 128 500] [--skip-fits]
                                    [--set key=value ...] [--skip-rounds] [--json]
    python tools/bench_record_dp.py --rounds 8 --accuracy 4:8:0.05:128:2:0.1 4:0:0.05:128:2:0.1 ...
                                    [--hidden 64] [--records 500] [--momentum 0] [--server-lr 1] [--freeze-first]
                                    [--optimizer adam|sgd] [--sgd-momentum 0] [--noise-multiplier Z]

Local training: one quickstart site (in this process, one torch thread) fits `--fits` rounds plain, with
`privacy.record_dp` (ε 8) as sites run it (the linear layers' clipped sums, `hpcfed.privacy.linear_clip`),
with the same DP-SGD on Opacus's per-example gradient hooks (the path of models with other layers) and on
`torch.func` vmap (the path of a model the hooks miss), interleaved round by round; the median CPU time of
a round's fit (the first left out) and the ratios to plain, per batch size. CPU time, not wall time: on a
loaded machine it moves far less.

Rounds: `--repeats` pairs of real federations (`mpiexec -n K+1 python -m hpcfed run`, the quickstart,
`--rounds` rounds, no checkpoints) per batch size of `--round-batch-sizes`, plain and record DP (ε 8) one
after the other, the order swapped every repeat; the median round time (metrics.jsonl `round_time_s`,
first round left out) of each and the ratio DP / plain per pair.
That ratio is the issue's goal (≤ 2); the fits above say where the time goes.

Accuracy (`--accuracy K:EPS:LR:BATCH:EPOCHS:CLIP[:SEED] ...`, EPS 0 = plain): the quickstart's FedAvg
run in this process (the sites' tasks, fit and evaluated as the federation does, parameters averaged by
examples; no MPI, so a sweep takes seconds per setting instead of minutes): final mean test accuracy
after `--rounds` rounds and the largest site ε. Its plain figures equal the mpiexec runs' (K = 4:
0.895, K = 8: 0.956); under DP its noise differs from a federation's (another secret seed), not its law.
`--momentum`/`--server-lr` put FedAvgM's server step on the mean, `--hidden` narrows the MLP and
`--freeze-first` keeps its first layer at the shared initial weights (fewer trained parameters, so less
noise in norm): the ideas tried in docs/benchmarks.md, "Record-level DP: whole rounds per batch size".
`--optimizer sgd --sgd-momentum 0.9` trains the sites by SGD with momentum (`task.optimizer`,
`task.momentum`; the recipe of configs/quickstart_record_dp.yaml is `--accuracy K:8:0.3:500:16:1`), and
`--noise-multiplier` gives z instead of a target ε, to part the noise's cost from the clipping's
(docs/benchmarks.md, "Record DP at 500 records a site").

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
from typing import Any

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
                      seed: int = 0, *, hidden: int = 64, records: int = 500, momentum: float = 0.0,
                      server_lr: float = 1.0, freeze_first: bool = False, optimizer: str = "adam",
                      site_momentum: float = 0.0, noise_multiplier: float | None = None) -> dict:
    """The quickstart's FedAvg in this process: final mean test accuracy and max site ε (eps 0: plain).
    `momentum` > 0 or `server_lr` != 1: FedAvgM's server step (`hpcfed.strategies.fedavgm`) on the mean;
    `hidden`: the MLP's hidden width (the quickstart's `task.hidden`); `records`: each site's training
    records (`task.samples_per_site`: DP-SGD's noise against the signal falls with them); `freeze_first`:
    the first layer stays at its initial weights, the same on every site (random ReLU features), so
    DP-SGD's noise falls on the other layers' parameters only; `optimizer`/`site_momentum`: the sites'
    `task.optimizer` and `task.momentum`; `noise_multiplier`: z given (the budget then set far above
    what the run spends), to see what the noise costs apart from the clipping."""
    from hpcfed.config import RecordDPConfig
    from hpcfed.privacy.record_dp import SiteSettings
    from hpcfed.tasks.base import Site
    from hpcfed.tasks.synthetic import SyntheticTask

    out = Path(tempfile.mkdtemp())
    settings = RecordDPConfig(epsilon=eps if noise_multiplier is None else 1e12, delta=1e-5, clip_norm=clip,
                              noise_multiplier=noise_multiplier) if eps or noise_multiplier else None
    spec = SiteSettings(settings, rounds, secret_seed=1234 + seed) if settings else None
    sites = [SyntheticTask(SyntheticTask.Config(lr=lr, batch_size=batch, local_epochs=epochs, hidden=hidden,
                                                samples_per_site=records, optimizer=optimizer,  # type: ignore[arg-type]
                                                momentum=site_momentum),
                           Site(client_id=i, num_clients=k, seed=seed, out_dir=out, record_dp=spec))
             for i in range(k)]
    if freeze_first:
        from hpcfed.tasks.private_training import RecordDPTraining, steps_per_round

        def loss_of(task: SyntheticTask) -> Any:
            return lambda x, y: task.loss_fn(task.model(x), y)

        for task in sites:
            task.encoder[0].requires_grad_(False)
            if spec is not None:  # DP-SGD over the trainable parameters left
                records = len(task.data["x_train"])
                task.private = RecordDPTraining(spec, task.site.client_id, model=task.model, loss=loss_of(task),
                                                records=records, batch_size=batch,
                                                steps_per_round=steps_per_round(records, batch, epochs))
    model: dict = dict(sites[0].get_parameters())
    velocity: dict = {name: 0.0 for name in model}
    for rnd in range(rounds):
        updates = []
        for task in sites:
            task.set_parameters(model)
            updates.append((task.fit(rnd).num_examples, task.get_parameters()))
        total = sum(n for n, _ in updates)
        if total:
            mean = {name: sum(n * p[name] for n, p in updates) / total for name in model}
            # FedAvgM: v = β·v + (θ̄ - θ), θ += η·v (β 0, η 1: FedAvg's mean itself)
            velocity = {name: momentum * velocity[name] + (mean[name] - model[name]) for name in model}
            model = {name: model[name] + server_lr * velocity[name] for name in model}
    accuracy = []
    for task in sites:
        task.set_parameters(model)
        accuracy.append(task.evaluate(rounds, final=True)["accuracy"])
    epsilon = max(t.private.accountant.epsilon for t in sites if t.private) if settings else None
    z = sites[0].private.plan.noise_multiplier if sites[0].private is not None else None
    return {"accuracy": statistics.fmean(accuracy), "epsilon": epsilon, "z": z}


def accuracy_table(settings: list[str], rounds: int, **server: Any) -> list[dict]:
    """`fedavg_in_process` for each K:EPS:LR:BATCH:EPOCHS:CLIP[:SEED] (`server`: its hidden, momentum,
    server_lr and freeze_first, the same for every setting)."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for text in settings:
        k, eps, lr, batch, epochs, clip, *seed = text.split(":")
        row: dict = {"k": int(k), "epsilon_target": float(eps), "lr": float(lr), "batch_size": int(batch),
                     "local_epochs": int(epochs), "clip_norm": float(clip), "seed": int(seed[0]) if seed else 0}
        row.update(fedavg_in_process(int(k), rounds, float(eps), float(lr), int(batch), int(epochs), float(clip),
                                     row["seed"], **server))
        row.update(server)
        rows.append(row)
        eps_text = f"ε {row['epsilon']:.2f}, z {row['z']:.2f}" if row["epsilon"] is not None else "plain"
        print(f"  accuracy, {text}: {row['accuracy']:.3f} ({eps_text})", flush=True)
    return rows


def round_table(k: int, rounds: int, repeats: int, extra: list[str], timeout: float,
                batch_sizes: list[int] | None = None) -> list[dict]:
    """Median round time of plain and record-DP federations, run in interleaved pairs: each repeat runs one
    pair per batch size (none given: the config's), plain first on even repeats and DP first on odd ones, so a
    drift of the machine's load falls on both sides."""
    rows = []
    for rep in range(repeats):
        for bs in batch_sizes or [0]:
            keys = [*extra, f"task.batch_size={bs}"] if bs else list(extra)
            order = ("plain", "dp") if rep % 2 == 0 else ("dp", "plain")
            runs = {side: record_run(k, rounds, keys if side == "plain" else [*keys, *DP_KEYS], timeout)
                    for side in order}
            plain, dp = runs["plain"], runs["dp"]
            rows.append({"k": k, "rounds": rounds, "batch_size": bs, "repeat": rep, "plain_s": plain["round_time_s"],
                         "record_dp_s": dp["round_time_s"], "ratio": dp["round_time_s"] / plain["round_time_s"],
                         "plain_accuracy": plain["accuracy"], "record_dp_accuracy": dp["accuracy"],
                         "epsilon": dp["epsilon"], "load": os.getloadavg()[0]})
            print(f"  round, K={k} batch {bs or 'config'} pair {rep + 1}: plain {plain['round_time_s']:.3f} s, "
                  f"record DP {dp['round_time_s']:.3f} s (x{rows[-1]['ratio']:.2f}); "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--fits", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--round-batch-sizes", type=int, nargs="*", default=[],
                    help="the federation pairs at these batch sizes (default: the config's)")
    ap.add_argument("--skip-fits", action="store_true", help="only the federations' table")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for the federations")
    ap.add_argument("--skip-rounds", action="store_true", help="only the local-training table")
    ap.add_argument("--accuracy", nargs="*", default=[], metavar="K:EPS:LR:BATCH:EPOCHS:CLIP[:SEED]",
                    help="in-process FedAvg settings to score (only these when given)")
    ap.add_argument("--hidden", type=int, default=64, help="--accuracy: the MLP's hidden width (task.hidden)")
    ap.add_argument("--records", type=int, default=500,
                    help="--accuracy: training records per site (task.samples_per_site; the quickstart's 500)")
    ap.add_argument("--momentum", type=float, default=0.0, help="--accuracy: FedAvgM's server momentum β")
    ap.add_argument("--server-lr", type=float, default=1.0, help="--accuracy: FedAvgM's server learning rate η")
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                    help="--accuracy: the sites' task.optimizer")
    ap.add_argument("--sgd-momentum", type=float, default=0.0, help="--accuracy: the sites' task.momentum (sgd)")
    ap.add_argument("--noise-multiplier", type=float, default=None,
                    help="--accuracy: z given instead of computed from EPS (what the noise alone costs)")
    ap.add_argument("--freeze-first", action="store_true",
                    help="--accuracy: the first layer stays at its (shared) initial weights")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    print(f"bench_record_dp: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    result: dict = {"load_average": os.getloadavg()[0]}
    if args.accuracy:
        result["accuracy"] = accuracy_table(args.accuracy, args.rounds, hidden=args.hidden, records=args.records,
                                            momentum=args.momentum, server_lr=args.server_lr,
                                            freeze_first=args.freeze_first, optimizer=args.optimizer,
                                            site_momentum=args.sgd_momentum,
                                            noise_multiplier=args.noise_multiplier)
    elif not args.skip_fits:
        result["fit"] = fit_table(args.batch_sizes, args.fits)
    if not args.skip_rounds and not args.accuracy:
        result["rounds"] = round_table(args.k, args.rounds, args.repeats, args.set, args.timeout,
                                       args.round_batch_sizes)
        for bs in args.round_batch_sizes or [0]:
            rows = [r for r in result["rounds"] if r["batch_size"] == bs]
            print(f"  median ratio record DP / plain, batch {bs or 'config'}: round time "
                  f"x{statistics.median(r['ratio'] for r in rows):.2f}", flush=True)
    return finish(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
