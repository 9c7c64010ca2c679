"""The text of ``report.md``: the run's settings, final metrics per site, last and best value of every
metric, events, plots and the lines skipped."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from hpcfed.report.metrics_file import Metrics, best_of, is_number, single_valued, site_label, site_names


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
                        if is_number(v))
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
                who = site_label(int(cid), site_names(summary)) if str(cid).isdigit() else str(cid)
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
                lines.append(f"| {name} | {site_label(client, who_is)} | {len(s.values)} | nan | | | |")
                continue
            last_v, last_r = finite[-1]
            best = best_of(name)
            shown = "– | –"
            if best is not None:
                best_v, best_r = (min if best == "min" else max)(finite, key=lambda vr: vr[0])
                shown = f"{_fmt(best_v)} | {_round(best_r)}"
            lines.append(f"| {name} | {site_label(client, who_is)} | {len(s.values)} | {_fmt(last_v)} | "
                         f"{_round(last_r)} | {shown} |")
    lines.append("")

    if metrics.events:
        lines += ["## Events", "", "| time (s) | round | who | event | value |", "|---|---|---|---|---|"]
        for e in metrics.events[:200]:
            who = site_label(e["client"], who_is)
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
