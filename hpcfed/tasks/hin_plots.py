"""Figures for FedAHE runs: t-SNE of the exported embeddings, and convergence of several runs.

    python -m hpcfed.tasks.hin_plots tsne RUN_DIR --out tsne.png
    python -m hpcfed.tasks.hin_plots convergence feddwa=RUN_A fedavg=RUN_B afed=RUN_C --out conv.png

The t-SNE reads every ``RUN_DIR/embeddings/site*.h5`` (`hpcfed.store.embeddings`) and colours
points by label. The convergence figure reads each run's ``metrics.jsonl`` and draws the mean over
clients of each client's latest ``train_loss`` and ``val_micro_f1`` against wall time and against
the number of uploads the server has accepted, one line per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    return {"time": np.array(times), "updates": np.array(updates), "value": np.array(values),
            "reporting": np.array(reporting, dtype=np.int64), "num_clients": num_clients}


def time_to_reach(curve: dict[str, np.ndarray], target: float) -> float | None:
    """First wall time at which the curve reaches `target` with every client heard from, or None.

    An async run whose straggler has not reported yet averages only the fast sites; counting that
    would credit a federation for leaving a site out.
    """
    complete = curve["reporting"] >= curve.get("num_clients", 0) if "reporting" in curve else True
    hit = np.flatnonzero((curve["value"] >= target) & complete)
    return float(curve["time"][hit[0]]) if hit.size else None


def plot_convergence(runs: dict[str, str | Path], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for row, (metric, label) in enumerate((("train_loss", "train loss"), ("val_micro_f1", "val Micro-F1"))):
        for col, xkey in enumerate(("time", "updates")):
            ax = axes[row, col]
            for name, run in runs.items():
                c = convergence_curves(Path(run) / "metrics.jsonl", metric)
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
    xy = TSNE(n_components=2, random_state=seed, init="pca", perplexity=min(30.0, max(5.0, len(x) / 4 - 1))).fit_transform(x)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcfed.tasks.hin_plots")
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tsne")
    t.add_argument("run_dir")
    t.add_argument("--out", required=True)
    c = sub.add_parser("convergence")
    c.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    c.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.what == "tsne":
        print(plot_tsne(args.run_dir, args.out))
    else:
        runs = {}
        for item in args.runs:
            if "=" not in item:
                raise SystemExit(f"{item!r}: write NAME=RUN_DIR")
            name, path = item.split("=", 1)
            runs[name] = path
        print(plot_convergence(runs, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
