"""``hpcfed report DIR``: plots and a Markdown summary from a run's ``metrics.jsonl``.

    hpcfed report runs/quickstart                 # -> runs/quickstart/report.md + report/*.png
    hpcfed report runs/quickstart --tensorboard   # + TensorBoard event files in runs/quickstart/tensorboard

Input, one JSON object per line (written by rank 0, see `hpcfed.server.metrics`)::

    {"round": 3, "client": 1, "name": "loss", "value": 0.41, "time": 12.3}

`client` is the site's client id, or -1/null for server events (aggregation statistics, round times);
`time` is seconds since the federation started; `value` may be null (a non-finite number) or a string
(e.g. the name of a checkpoint). Numeric series are plotted: one PNG per metric with two panels,
the metric per round and per wall time, one line per site (and one for the server). ``report.md``
lists the run (from ``summary.json`` when present), the final metrics per site, the last and best
value of every metric per site, and the run's events (checkpoints, stragglers, failed clients).

A line cut short by kill -9 (the usual last line of a killed run) is skipped with a note; a file
with no valid line is an error that names it.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVER = -1  # plot key of server events (client -1 or null)
EVENT_NAMES = ("checkpoint", "straggler", "client_failed")  # shown as events, not only as plots


@dataclass
class Series:
    """One metric of one site: parallel lists of rounds, times and values."""

    rounds: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class Metrics:
    """What metrics.jsonl holds: numeric series by name and client, events, and the lines skipped."""

    path: Path
    series: dict[str, dict[int, Series]]  # name -> client (-1 = server) -> series
    events: list[dict[str, Any]]  # non-numeric records and EVENT_NAMES, in file order
    num_records: int
    skipped: list[tuple[int, str]]  # (line number, why)


def read_metrics(path: str | Path) -> Metrics:
    """Parse ``metrics.jsonl``; malformed lines are skipped and listed, an empty result is an error."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist; `hpcfed report` needs a run directory that holds metrics.jsonl "
                         f"(the --out folder of `hpcfed run`)")
    series: dict[str, dict[int, Series]] = defaultdict(lambda: defaultdict(Series))
    events: list[dict[str, Any]] = []
    skipped: list[tuple[int, str]] = []
    count = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                skipped.append((lineno, f"not JSON ({exc.msg})"))
                continue
            why = _check_record(rec)
            if why:
                skipped.append((lineno, why))
                continue
            count += 1
            client = rec.get("client")
            client = SERVER if client is None or client < 0 else int(client)
            value = rec["value"]
            name = rec["name"]
            if name in EVENT_NAMES or isinstance(value, str):
                events.append({"round": rec.get("round"), "client": client, "name": name, "value": value,
                               "time": rec.get("time")})
            if _is_number(value) or value is None:
                s = series[name][client]
                s.rounds.append(float(rec["round"]) if _is_number(rec.get("round")) else math.nan)
                s.times.append(float(rec["time"]) if _is_number(rec.get("time")) else math.nan)
                s.values.append(float(value) if value is not None else math.nan)
    if count == 0:
        detail = f"; first problem: line {skipped[0][0]}: {skipped[0][1]}" if skipped else " (the file is empty)"
        raise ValueError(f"{path} holds no metric records{detail}; is it the metrics.jsonl of an hpcfed run?")
    return Metrics(path, {k: dict(v) for k, v in series.items()}, events, count, skipped)


def _check_record(rec: Any) -> str:
    if not isinstance(rec, dict):
        return "not a JSON object"
    if not isinstance(rec.get("name"), str) or not rec["name"]:
        return "no metric name (key 'name')"
    if "value" not in rec:
        return "no key 'value'"
    client = rec.get("client")
    if client is not None and (not isinstance(client, int) or isinstance(client, bool)):
        return f"key 'client' must be an integer or null, got {client!r}"
    for key in ("round", "time"):
        if rec.get(key) is not None and not _is_number(rec[key]):
            return f"key {key!r} must be a number or null, got {rec[key]!r}"
    v = rec["value"]
    if not (v is None or isinstance(v, str) or _is_number(v)):
        return f"key 'value' must be a number, string or null, got {type(v).__name__}"
    return ""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _site_label(client: int, names: dict[int, str] | None = None) -> str:
    if client == SERVER:
        return "server"
    name = (names or {}).get(client)
    return f"site {client} ({name})" if name else f"site {client}"


def site_names(summary: dict[str, Any] | None) -> dict[int, str]:
    """Each site's name from the run's config: ``task.site_names`` when set, else the datasets of
    ``task.sites`` (the events task: client k reads sites[k]); {} when the config names none."""
    cfg = (summary or {}).get("config")
    task = cfg.get("task") if isinstance(cfg, dict) else None
    options = task.get("options") if isinstance(task, dict) else None
    if not isinstance(options, dict):
        return {}
    for key in ("site_names", "sites"):
        names = options.get(key)
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return {k: (n if key == "site_names" else short_site(n))[:80] for k, n in enumerate(names)}
    return {}


_FILE_SITE = re.compile(r"^(.*?\.(?:parquet|jsonl|ndjson|json|csv|tsv|npz|txt))(.*)$", re.IGNORECASE)


def short_site(name: str) -> str:
    """A site's dataset as a legend shows it: a file's name without its folders, its selector kept
    (``/data/runs/c6.parquet:1/3`` -> ``c6.parquet:1/3``); a built-in name as it is."""
    m = _FILE_SITE.match(name)
    if m:
        return Path(m.group(1)).name + m.group(2)
    return Path(name).name if name.startswith(("/", "~", ".")) else name


# Metric names that are scores: higher is better, or lower for the LOWER ones. Anything else
# (a weight such as bola_lambda, a learning rate, a count) has no "best" and is not ranked.
HIGHER = ("acc", "nmi", "ami", "ari", "f1", "precision", "recall", "auc", "sim_", "score", "mrr", "hits")
LOWER = ("loss", "error", "perplexity", "rmse", "mae")


def best_of(name: str) -> str | None:
    """"max" or "min" for a score of that name, None for a metric that is not a score."""
    low = name.lower()
    if any(k in low for k in LOWER):
        return "min"
    if any(k in low for k in HIGHER) and not low.startswith("num_"):
        return "max"
    return None


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "metric"


# ----------------------------------------------------------------------------------------------
# plots


def run_mode(metrics: Metrics, summary: dict[str, Any] | None) -> str | None:
    """"sync" or "async" from summary.json's config, else from what the server logs in each mode
    (sync: ``round_time_s`` per round; async: ``broadcast`` per accepted update); None if unknown."""
    cfg = (summary or {}).get("config")
    fed = cfg.get("federation") if isinstance(cfg, dict) else None
    if isinstance(fed, dict) and fed.get("mode") in ("sync", "async"):
        return str(fed["mode"])
    if "round_time_s" in metrics.series:
        return "sync"
    if "broadcast" in metrics.series:
        return "async"
    return None


X_LABELS = {"sync": "round (from 0)", "async": "accepted updates",
            None: "round (sync, from 0) / accepted updates (async)"}


def single_valued(metrics: Metrics) -> list[str]:
    """Metrics with at most one finite value per site (final results, setup figures): a line plot of
    them is empty or meaningless, so they are listed in the report instead of plotted."""
    return sorted(name for name, per_site in metrics.series.items()
                  if all(sum(math.isfinite(v) for v in s.values) <= 1 for s in per_site.values()))


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
            ax_round.plot(s.rounds, s.values, marker=marker, markersize=3, label=_site_label(client, names), **style)
            ax_time.plot(s.times, s.values, marker=marker, markersize=3, label=_site_label(client, names), **style)
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


# ----------------------------------------------------------------------------------------------
# Markdown


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


def _round(r: float) -> str:
    return str(int(r)) if math.isfinite(r) else "–"


def render_markdown(metrics: Metrics, plots: list[Path], run_dir: Path, summary: dict[str, Any] | None) -> str:
    """The text of report.md: run settings, final metrics per site, plots and events."""
    lines = [f"# hpcfed run report: `{run_dir.name}`", ""]
    lines.append(f"Generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} from `{metrics.path.name}` "
                 f"({metrics.num_records} records).")
    lines.append("")
    if summary:
        cfg = summary.get("config", {}) if isinstance(summary.get("config"), dict) else {}
        fed = cfg.get("federation", {}) if isinstance(cfg.get("federation"), dict) else {}
        rows = [
            ("config", cfg.get("source") or cfg.get("name")),
            ("mode", fed.get("mode")),
            ("strategy", (cfg.get("strategy") or {}).get("name") if isinstance(cfg.get("strategy"), dict) else None),
            ("task", (cfg.get("task") or {}).get("name") if isinstance(cfg.get("task"), dict) else None),
            ("rounds", summary.get("rounds")),
            ("updates accepted", summary.get("updates_accepted")),
            ("server version", summary.get("server_version")),
            ("wall time (s)", summary.get("wall_time_s")),
            ("server CPU (s)", summary.get("server_cpu_s")),
            ("last checkpoint", summary.get("last_checkpoint")),
            ("config hash", summary.get("config_hash")),
        ]
        rejected = summary.get("rejected")
        if isinstance(rejected, dict):
            total = sum(v for part in rejected.values() if isinstance(part, dict) for v in part.values()
                        if _is_number(v))
            rows.append(("rejected messages", total))
        lines += ["## Run", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in rows if v is not None]
        lines.append("")
        clients = summary.get("clients")
        if isinstance(clients, dict) and clients:
            names = sorted({k for r in clients.values() if isinstance(r, dict) for k in r})
            lines += ["## Final metrics (summary.json)", ""]
            lines.append("| site | " + " | ".join(names) + " |")
            lines.append("|---|" + "---|" * len(names))
            for cid in sorted(clients, key=lambda c: int(c) if str(c).lstrip("-").isdigit() else 0):
                r = clients[cid]
                who = _site_label(int(cid), site_names(summary)) if str(cid).isdigit() else str(cid)
                lines.append(f"| {who} | " + " | ".join(_fmt(r.get(n)) for n in names) + " |")
            mean = summary.get("mean")
            if isinstance(mean, dict):
                lines.append("| **mean** | " + " | ".join(_fmt(mean.get(n)) for n in names) + " |")
            lines.append("")
    else:
        lines += ["No `summary.json` in the run directory: the run has not finished (killed, halted, or still "
                  "running); the tables below cover what `metrics.jsonl` holds so far.", ""]

    who_is = site_names(summary)
    lines += ["## Metrics", "", "Last value (at its round) and best value per site; best = lowest for losses and "
              "errors, highest for accuracies, NMI/AMI/ARI, F1, precision and similarity; other metrics "
              "(weights such as bola_lambda, learning rates, counts, times) are not scores and are not ranked (–).",
              ""]
    lines += ["| metric | site | points | last | last round | best | best round |", "|---|---|---|---|---|---|---|"]
    for name in sorted(metrics.series):
        for client in sorted(metrics.series[name]):
            s = metrics.series[name][client]
            finite = [(v, r) for v, r in zip(s.values, s.rounds) if math.isfinite(v)]
            if not finite:
                lines.append(f"| {name} | {_site_label(client, who_is)} | {len(s.values)} | nan | | | |")
                continue
            last_v, last_r = finite[-1]
            best = best_of(name)
            shown = "– | –"
            if best is not None:
                best_v, best_r = (min if best == "min" else max)(finite, key=lambda vr: vr[0])
                shown = f"{_fmt(best_v)} | {_round(best_r)}"
            lines.append(f"| {name} | {_site_label(client, who_is)} | {len(s.values)} | {_fmt(last_v)} | "
                         f"{_round(last_r)} | {shown} |")
    lines.append("")

    if metrics.events:
        lines += ["## Events", "", "| time (s) | round | who | event | value |", "|---|---|---|---|---|"]
        for e in metrics.events[:200]:
            who = _site_label(e["client"], who_is)
            lines.append(f"| {_fmt(e['time'])} | {_fmt(e['round'])} | {who} | {e['name']} | {_fmt(e['value'])} |")
        if len(metrics.events) > 200:
            lines.append(f"| | | | … {len(metrics.events) - 200} more | |")
        lines.append("")

    single = single_valued(metrics)
    if plots or single:
        lines += ["## Plots", ""]
    if single:
        lines += [f"Not plotted (one value per site, see the tables above): {', '.join(f'`{n}`' for n in single)}.", ""]
    if plots:
        for p in plots:
            rel = p.relative_to(run_dir) if p.is_relative_to(run_dir) else p
            lines += [f"### {p.stem}", "", f"![{p.stem}]({rel.as_posix()})", ""]

    if metrics.skipped:
        lines += ["## Skipped lines", ""]
        for lineno, why in metrics.skipped[:20]:
            lines.append(f"- `{metrics.path.name}` line {lineno}: {why}")
        if len(metrics.skipped) > 20:
            lines.append(f"- … and {len(metrics.skipped) - 20} more")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# TensorBoard


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


# ----------------------------------------------------------------------------------------------


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
