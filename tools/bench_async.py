"""Straggler benchmark: asynchronous FedDWA vs synchronous FedAvg with one site made 4x slower.

    python tools/bench_async.py [--config configs/fedahe_synthetic.yaml] [--np 4] [--slow 2] [--factor 4]
                                [--json] [--plot conv.png] [--afed] [--repeats 1] [--metric val_micro_f1]
                                [--secure] [key=value ...]

Both runs use the same config and seed; sync FedAvg runs ``rounds`` rounds, the async runs may accept
up to ``--async-updates`` (default 2) x rounds x clients uploads; all use
``federation.slowdown={SLOW: FACTOR}`` (the slow site sleeps (factor - 1) x its real work after
each fit). The target is the F1 that sync FedAvg **ends** with (mean over sites of each site's
latest ``val_micro_f1``); the speedup is FedAvg's wall time to first reach it divided by
FedDWA's, where a run's curve counts only once every site has reported (an async run whose
straggler has not uploaded yet is not credited with the fast sites' mean). ``--json`` prints
``{"speedup": ..., "target_f1": ..., "runs": {...}}``.

``--repeats N`` runs the pair N times, alternating FedAvg and FedDWA so that a change in the
machine's background load hits both, and reports the median of the N speedups (each against its
own FedAvg run) with every pair listed. ``--metric`` picks the curve: ``val_micro_f1`` (each site's
model after its local step) or ``received_val_micro_f1`` (the model the server sent, logged with
``task.model_selection=best_val``).

``--secure`` runs every federation of the comparison with ``privacy.secure_aggregation=true``: sync
FedAvg's rounds summed securely against FedDWA's buffers summed securely among their members
(`hpcfed.strategies.feddwa_buffers`), so the speedup is secure async against secure sync.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcfed.tasks.hin_plots import convergence_curves, plot_convergence, time_to_reach  # noqa: E402


def run(config: str, method: str, out: Path, np_: int, overrides: list[str], metric: str) -> dict:
    """Run one federation with `method`; its wall time, accepted updates, F1 scores and `metric` curve."""
    cmd = [sys.executable, "-m", "hpcfed", "run", config, "--np", str(np_), "--out", str(out), "--force",
           f"method={method}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    curve = convergence_curves(out / "metrics.jsonl", metric)
    if not curve["value"].size:
        raise SystemExit(f"{out}/metrics.jsonl has no {metric!r}; received_val_micro_f1 needs "
                         f"task.model_selection=best_val")
    return {"method": method, "out": str(out), "wall_time_s": summary["wall_time_s"],
            "updates_accepted": summary["updates_accepted"], "final_val_micro_f1": float(curve["value"][-1]),
            "test_micro_f1": summary.get("micro_f1"), "test_macro_f1": summary.get("macro_f1"), "curve": curve}


def compare(runs: dict[str, dict]) -> dict:
    """Speedup of FedDWA over FedAvg for one set of runs: time to FedAvg's final F1, and to 95-99 % of it."""
    target = runs["fedavg"]["final_val_micro_f1"]
    t_avg = time_to_reach(runs["fedavg"]["curve"], target)
    t_dwa = time_to_reach(runs["feddwa"]["curve"], target)
    speedup = (t_avg / t_dwa) if (t_avg is not None and t_dwa) else 0.0
    # context for a missed target: how soon each run gets within 1-5 % of it
    near = {f"{frac:.2f}": {m: time_to_reach(r["curve"], frac * target) for m, r in runs.items()}
            for frac in (0.99, 0.98, 0.95)}
    return {"speedup": speedup, "target_f1": target, "time_to_target_s": {"fedavg": t_avg, "feddwa": t_dwa},
            "time_to_fraction_of_target_s": near,
            "runs": {m: {k: v for k, v in r.items() if k != "curve"} for m, r in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    """Run the FedAvg / FedDWA pair (`--repeats` times) and print the speedup; exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/fedahe_synthetic.yaml")
    p.add_argument("--np", type=int, default=4, help="MPI ranks (server + clients)")
    p.add_argument("--slow", type=int, default=2, help="client id of the straggler")
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--async-updates", type=float, default=2.0,
                   help="async runs may accept this many times rounds x clients uploads (the time to the "
                        "target is what is compared; a longer budget only lets a slow start still arrive)")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    p.add_argument("--afed", action="store_true", help="also run AFed/FedAsync for the figure")
    p.add_argument("--plot", default=None, help="write the convergence PNG here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--repeats", type=int, default=1, help="run the FedAvg/FedDWA pair this many times")
    p.add_argument("--metric", default="val_micro_f1", help="per-site F1 curve to compare")
    p.add_argument("--secure", action="store_true",
                   help="every run with privacy.secure_aggregation=true (secure async against secure sync)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_async_"))
    overrides = [f"federation.slowdown={{{args.slow}: {args.factor}}}",
                 *(["privacy.secure_aggregation=true"] if args.secure else []), *args.overrides]
    from hpcfed.config import load

    rounds = load(REPO / args.config if not Path(args.config).is_absolute() else args.config,
                  [o for o in args.overrides if o.startswith("rounds=")]).rounds
    budget = [f"federation.max_updates={int(args.async_updates * rounds * (args.np - 1))}"]
    pairs = []
    for rep in range(args.repeats):
        suffix = f"_{rep}" if args.repeats > 1 else ""
        methods = ("fedavg", "feddwa", *(("afed",) if args.afed and rep == 0 else ()))
        runs = {m: run(args.config, m, root / f"{m}{suffix}", args.np, overrides + (budget if m != "fedavg" else []),
                       args.metric) for m in methods}
        pairs.append(compare(runs))
    report = dict(sorted(pairs, key=lambda r: r["speedup"])[len(pairs) // 2])  # the median pair
    if args.repeats > 1:
        report["speedups"] = [r["speedup"] for r in pairs]
        report["pairs"] = pairs
    report.update({"metric": args.metric, "slowdown": {str(args.slow): args.factor}, "secure": args.secure})
    if args.plot:
        plot_convergence({m: r["out"] for m, r in pairs[0]["runs"].items()}, args.plot, metric=args.metric)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        t = report["time_to_target_s"]
        print(f"target {args.metric} {report['target_f1']:.4f} (sync FedAvg's final); FedAvg reaches it at "
              f"{t['fedavg']} s, FedDWA at {t['feddwa']} s: speedup {report['speedup']:.2f}x")
        for m, r in report["runs"].items():
            print(f"  {m}: wall {r['wall_time_s']:.1f} s, {r['updates_accepted']} uploads, "
                  f"test Micro/Macro-F1 {r['test_micro_f1']:.4f}/{r['test_macro_f1']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
