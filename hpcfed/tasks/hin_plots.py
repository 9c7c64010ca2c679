"""Figures for FedAHE runs: t-SNE of the exported embeddings, and convergence of several runs.

    python -m hpcfed.tasks.hin_plots tsne RUN_DIR --out tsne.png
    python -m hpcfed.tasks.hin_plots convergence feddwa=RUN_A fedavg=RUN_B afed=RUN_C --out conv.png
    python -m hpcfed.tasks.hin_plots table RUN_DIR ...       # Markdown: mean ± sd over seeds

The table reads each run's ``summary.json`` and groups runs that differ only in ``seed``.

The t-SNE reads every ``RUN_DIR/embeddings/site*.h5`` (`hpcfed.store.embeddings`) and colours
points by label. The convergence figure reads each run's ``metrics.jsonl`` and draws the mean over
clients of each client's latest ``train_loss`` and ``val_micro_f1`` against wall time and against
the number of uploads the server has accepted, one line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def convergence_curves(metrics_path: str | Path, metric: str) -> dict[str, np.ndarray]:
    """time, updates (uploads accepted so far) and the mean over clients of their latest `metric`.

    ``reporting`` is how many clients have reported `metric` so far and ``num_clients`` the
    federation's size (from the run's ``num_clients`` event; 0 if absent): a mean over only the
    sites heard from is not the federation's F1 (see `time_to_reach`).
    """
    events = []
    with open(metrics_path) as fh:
        for line in fh:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    events.sort(key=lambda e: e.get("time", 0.0))
    latest: dict[int, float] = {}
    uploads = num_clients = 0
    times, updates, values, reporting = [], [], [], []
    for e in events:
        if e.get("name") == "num_clients" and e.get("client") is None:
            num_clients = int(e["value"])
        if e.get("client") is None or e.get("name", "").startswith("final_"):
            continue
        if e["name"] == "train_loss":
            uploads += 1
        if e["name"] == metric and e.get("value") is not None:
            latest[e["client"]] = float(e["value"])
            times.append(float(e["time"]))
            updates.append(uploads)
            values.append(float(np.mean(list(latest.values()))))
            reporting.append(len(latest))
    curve: dict[str, Any] = {"time": np.array(times), "updates": np.array(updates), "value": np.array(values),
                             "reporting": np.array(reporting, dtype=np.int64), "num_clients": num_clients}
    return curve


def time_to_reach(curve: dict[str, np.ndarray], target: float) -> float | None:
    """First wall time at which the curve reaches `target` with every client heard from, or None.

    An async run whose straggler has not reported yet averages only the fast sites; counting that
    would credit a federation for leaving a site out.
    """
    complete = curve["reporting"] >= curve.get("num_clients", 0) if "reporting" in curve else True
    hit = np.flatnonzero((curve["value"] >= target) & complete)
    return float(curve["time"][hit[0]]) if hit.size else None


def plot_convergence(runs: dict[str, str | Path], out: str | Path, metric: str = "val_micro_f1") -> Path:
    """Loss (top) and `metric` (bottom), mean over sites, against wall time (left) and uploads (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    f1_label = "val Micro-F1" + (" of the received model" if metric.startswith("received") else "")
    for row, (curve_name, label) in enumerate((("train_loss", "train loss"), (metric, f1_label))):
        for col, xkey in enumerate(("time", "updates")):
            ax = axes[row, col]
            for name, run in runs.items():
                c = convergence_curves(Path(run) / "metrics.jsonl", curve_name)
                if c["value"].size:
                    ax.plot(c[xkey], c["value"], label=name, drawstyle="steps-post")
            ax.set_xlabel("wall time (s)" if xkey == "time" else "uploads accepted")
            ax.set_ylabel(label + " (mean over sites)")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_tsne(run_dir: str | Path, out: str | Path, max_points: int = 4000, seed: int = 0) -> Path:
    """A t-SNE picture of a FedAHE run's exported node embeddings, coloured by label; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.manifold import TSNE

    from hpcfed.store.embeddings import read_export

    files = sorted((Path(run_dir) / "embeddings").glob("site*.h5"))
    if not files:
        raise ValueError(f"{run_dir}/embeddings has no site*.h5 exports; run a federation with --out {run_dir} first")
    vectors, labels, sites = [], [], []
    for k, path in enumerate(files):
        e = read_export(path)
        vectors.append(e.vectors)
        labels.append(e.labels if e.labels is not None else np.full(len(e.vectors), -1))
        sites.append(np.full(len(e.vectors), k))
    x, y = np.concatenate(vectors), np.concatenate(labels)
    keep = y >= 0
    x, y = x[keep], y[keep]
    rng = np.random.default_rng(seed)
    if len(x) > max_points:
        pick = rng.choice(len(x), max_points, replace=False)
        x, y = x[pick], y[pick]
    perplexity = min(30.0, max(5.0, len(x) / 4 - 1))
    xy = TSNE(n_components=2, random_state=seed, init="pca", perplexity=perplexity).fit_transform(x)
    fig, ax = plt.subplots(figsize=(7, 6))
    for c in np.unique(y):
        ax.scatter(xy[y == c, 0], xy[y == c, 1], s=4, label=f"class {c}")
    ax.set_title(f"t-SNE of FedAHE embeddings ({len(files)} sites, {len(x)} nodes)")
    ax.legend(markerscale=3)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


TABLE_METRICS = (("micro_f1", "Micro-F1"), ("macro_f1", "Macro-F1"), ("home_micro_f1", "Micro-F1, each test node once"),
                 ("lr_micro_f1", "LogReg Micro-F1"), ("lr_macro_f1", "LogReg Macro-F1"))


STRATEGY_METHODS = {"fedasync": "afed"}  # HINTask.METHODS: the method whose strategy has another name


def run_group(summary: dict) -> tuple[str, str, str, str]:
    """(dataset, split, partition, method) of a run, read from the config in its summary.json."""
    cfg = summary.get("config", {})
    task = cfg.get("task", {}).get("options", {})
    part = task.get("partition", "random")
    if part == "by_type":
        part = f"by_type {task.get('partition_type')}"
    # a run started without method= is named by its strategy, as the method of that strategy is
    strategy = cfg.get("strategy", {}).get("name") if isinstance(cfg.get("strategy"), dict) else None
    method = cfg.get("method") or STRATEGY_METHODS.get(str(strategy), strategy) or "?"
    return (str(task.get("dataset", "?")), str(task.get("split", "20")), part, str(method))


def results_table(run_dirs: list[str | Path]) -> str:
    """Markdown rows, one per (dataset, split, partition, method): mean ± sd (ddof 1) over the runs' seeds."""
    groups: dict[tuple, list[dict]] = {}
    for d in run_dirs:
        path = Path(d) / "summary.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist; pass run folders written by `hpcfed run --out`")
        summary = json.loads(path.read_text())
        groups.setdefault(run_group(summary), []).append(summary)
    head = "| dataset | split | partition | method | seeds | " + " | ".join(n for _, n in TABLE_METRICS) + " |"
    lines = [head, "|" + "---|" * (5 + len(TABLE_METRICS))]
    for key, runs in groups.items():
        seeds = ",".join(str(r.get("config", {}).get("seed", "?")) for r in runs)
        cells = []
        for metric, _ in TABLE_METRICS:
            vals = np.array([r[metric] for r in runs if r.get(metric) is not None], dtype=float)
            cells.append("" if not vals.size else f"{vals.mean():.3f}" if vals.size == 1
                         else f"{vals.mean():.3f} ± {vals.std(ddof=1):.3f}")
        lines.append(f"| {' | '.join(key)} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcfed.tasks.hin_plots tsne|convergence``: the FedAHE paper's figures from runs; exit status."""
    p = argparse.ArgumentParser(prog="python -m hpcfed.tasks.hin_plots")
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tsne")
    t.add_argument("run_dir")
    t.add_argument("--out", required=True)
    c = sub.add_parser("convergence")
    c.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    c.add_argument("--out", required=True)
    c.add_argument("--metric", default="val_micro_f1", help="F1 curve: val_micro_f1 or received_val_micro_f1")
    tb = sub.add_parser("table")
    tb.add_argument("run_dirs", nargs="+")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError) as exc:  # a bad path or file: one line, no traceback
        print(f"hin_plots {args.what}: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.what == "tsne":
        print(plot_tsne(args.run_dir, args.out))
    elif args.what == "table":
        print(results_table(args.run_dirs))
    else:
        runs = {}
        for item in args.runs:
            if "=" not in item:
                raise SystemExit(f"{item!r}: write NAME=RUN_DIR")
            name, path = item.split("=", 1)
            runs[name] = path
        print(plot_convergence(runs, args.out, metric=args.metric))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
