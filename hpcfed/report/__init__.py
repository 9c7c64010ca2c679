"""``hpcfed report DIR``: plots and a Markdown summary from a run's ``metrics.jsonl``.

    hpcfed report runs/quickstart                 # -> runs/quickstart/report.md + report/*.png
    hpcfed report runs/quickstart --tensorboard   # + TensorBoard event files in runs/quickstart/tensorboard

Input: the run's ``metrics.jsonl`` (read by `hpcfed.report.metrics_file`) and ``summary.json`` when
present. Numeric series are plotted: one PNG per metric with two panels,
the metric per round and per wall time, one line per site (and one for the server). ``report.md``
lists the run (from ``summary.json`` when present), the final metrics per site, the last and best
value of every metric per site, and the run's events (checkpoints, stragglers, failed clients).

Parts: `metrics_file` (reading), `plots` (PNG and TensorBoard), `markdown` (report.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcfed.report.markdown import render_markdown
from hpcfed.report.metrics_file import Metrics, read_metrics, run_mode, site_names
from hpcfed.report.plots import plot_metrics, write_tensorboard

__all__ = ["Metrics", "make_report", "read_metrics", "site_names"]


def make_report(run_dir: str | Path, *, out: str | Path | None = None, tensorboard: bool = False) -> dict[str, Any]:
    """Write ``report.md`` and PNG plots for the run in `run_dir`; return what was written."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist (pass the --out folder of `hpcfed run`)")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    summary = None
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{summary_path}: not valid JSON (line {exc.lineno}: {exc.msg}); "
                             f"delete it to report from metrics.jsonl alone") from None
        if not isinstance(summary, dict):
            raise ValueError(f"{summary_path}: expected a JSON object, got {type(summary).__name__}")
    out_dir = Path(out) if out else run_dir
    plots = plot_metrics(metrics, out_dir / "report", run_mode(metrics, summary), site_names(summary))
    md_path = out_dir / "report.md"
    md_path.write_text(render_markdown(metrics, plots, out_dir, summary))
    result: dict[str, Any] = {"report": str(md_path), "plots": [str(p) for p in plots],
                              "records": metrics.num_records, "skipped_lines": len(metrics.skipped)}
    if tensorboard:
        result["tensorboard"] = str(write_tensorboard(metrics, out_dir / "tensorboard"))
    return result
