"""Pictures of a run's metrics: one PNG per metric (per round and per wall time, one line per site),
and TensorBoard event files of the same series."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

from hpcfed.report.metrics_file import SERVER, Metrics, single_valued, site_label

X_LABELS = {"sync": "round (from 0)", "async": "accepted updates",
            None: "round (sync, from 0) / accepted updates (async)"}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "metric"


def plot_metrics(metrics: Metrics, out_dir: str | Path, mode: str | None = None,
                 names: dict[int, str] | None = None) -> list[Path]:
    """One PNG per numeric metric with more than one value at some site (panels: per round, per wall
    time; one line per site). The x axis is the round in sync runs, accepted updates in async runs."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    skip = set(single_valued(metrics))
    for name in sorted(metrics.series):
        per_site = metrics.series[name]
        if name in skip:
            continue
        fig = Figure(figsize=(10, 3.6), dpi=100)
        FigureCanvasAgg(fig)
        ax_round, ax_time = fig.subplots(1, 2)
        for client in sorted(per_site):
            s = per_site[client]
            style = {"linestyle": "--", "color": "black"} if client == SERVER else {}
            marker = "o" if len(s.values) < 30 else None
            ax_round.plot(s.rounds, s.values, marker=marker, markersize=3, label=site_label(client, names), **style)
            ax_time.plot(s.times, s.values, marker=marker, markersize=3, label=site_label(client, names), **style)
        ax_round.set_xlabel(X_LABELS[mode])
        ax_time.set_xlabel("wall time since start (s)")
        for ax in (ax_round, ax_time):
            ax.set_ylabel(name)
            ax.grid(True, alpha=0.3)
        ax_round.legend(fontsize="small", loc="best")
        fig.suptitle(f"{name}  ({metrics.path.parent.name})")
        fig.tight_layout()
        path = out_dir / f"{_slug(name)}.png"
        fig.savefig(path, metadata={"Description": f"{name} per {X_LABELS[mode]} and per wall time"})
        written.append(path)
    return written


def write_tensorboard(metrics: Metrics, log_dir: str | Path) -> Path:
    """Scalars ``<metric>/<site>`` with step = round and wall time = start + time; needs `tensorboard`."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ValueError(f"--tensorboard needs the tensorboard package ({exc}); `pip install tensorboard`, "
                         f"or leave out --tensorboard") from None
    log_dir = Path(log_dir)
    start = time.time()  # metrics hold relative times; anchor them so TensorBoard's wall-time axis is ordered
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        for name in sorted(metrics.series):
            for client, s in sorted(metrics.series[name].items()):
                tag = f"{name}/{'server' if client == SERVER else f'site{client}'}"
                for r, t, v in zip(s.rounds, s.times, s.values):
                    if math.isfinite(v) and math.isfinite(r):
                        writer.add_scalar(tag, v, global_step=int(r),
                                          walltime=start + (t if math.isfinite(t) else 0.0))
    finally:
        writer.close()
    return log_dir
