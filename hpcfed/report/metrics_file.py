"""Reading a run's ``metrics.jsonl`` for a report: numeric series per metric and site, events, the
lines skipped; and what a report says about them (site names, which metrics are scores, the run's
mode). Input, one JSON object per line (written by rank 0, see `hpcfed.server.metrics`)::

    {"round": 3, "client": 1, "name": "loss", "value": 0.41, "time": 12.3}

`client` is the site's client id, or -1/null for server events (aggregation statistics, round times);
`time` is seconds since the federation started; `value` may be null (a non-finite number) or a string
(e.g. the name of a checkpoint). A line cut short by kill -9 (the usual last line of a killed run) is
skipped with a note; a file with no valid line is an error that names it.
"""

from __future__ import annotations

import json
import math
import re
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
            if is_number(value) or value is None:
                s = series[name][client]
                s.rounds.append(float(rec["round"]) if is_number(rec.get("round")) else math.nan)
                s.times.append(float(rec["time"]) if is_number(rec.get("time")) else math.nan)
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
        if rec.get(key) is not None and not is_number(rec[key]):
            return f"key {key!r} must be a number or null, got {rec[key]!r}"
    v = rec["value"]
    if not (v is None or isinstance(v, str) or is_number(v)):
        return f"key 'value' must be a number, string or null, got {type(v).__name__}"
    return ""


def is_number(v: Any) -> bool:
    """Whether a JSON value is a number (a bool is not, though Python counts it as an int)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def site_label(client: int, names: dict[int, str] | None = None) -> str:
    """How tables and legends name a series: "server", or "site K" with the site's dataset when known."""
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


def single_valued(metrics: Metrics) -> list[str]:
    """Metrics with at most one finite value per site (final results, setup figures): a line plot of
    them is empty or meaningless, so they are listed in the report instead of plotted."""
    return sorted(name for name, per_site in metrics.series.items()
                  if all(sum(math.isfinite(v) for v in s.values) <= 1 for s in per_site.values()))
