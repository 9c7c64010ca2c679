"""`hpcfed status OUT`: a running federation's sites, rounds, traffic and privacy spend, live.

It reads OUT/live.json (rank 0 rewrites it at most once a second, `hpcfed.server.live`) and the tail
of OUT/metrics.jsonl (each site's ε, where record-level DP reports one), draws them with rich and
redraws every `--interval` seconds, like ``top``; `--once` prints one table and exits (for scripts
and logs). With `--metrics-port` it also serves the same figures as a Prometheus text endpoint
(`hpcfed.ops.prometheus`). It only reads files, so it runs anywhere the run directory is visible: a
login node, a laptop with the file system mounted.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from hpcfed.server.live import FORMAT, LIVE_FILE


class LiveStatusError(ValueError):
    """No live status to show: the folder holds none, or not one of hpcfed's (the message says which)."""


MAX_LIVE_BYTES = 4 << 20  # a live file is a few hundred bytes per site: anything bigger is not ours
METRICS_TAIL_BYTES = 1 << 20  # how much of metrics.jsonl's end is read for the sites' ε
STATE_STYLES = {"present": "green", "rejoining": "cyan", "late": "dim", "dropped": "yellow", "evicted": "red",
                "excluded": "red"}


def read_live(out_dir: Path) -> dict[str, Any]:
    """The newest snapshot of the run in `out_dir`; a clear error when there is none or it is not one."""
    path = Path(out_dir) / LIVE_FILE
    try:
        size = path.stat().st_size
        if size > MAX_LIVE_BYTES:
            raise LiveStatusError(f"{path}: {size} bytes, more than a live status file can be ({MAX_LIVE_BYTES}); "
                            f"is this an hpcfed run directory?")
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise LiveStatusError(f"{path} does not exist: no federation has written its live status there yet "
                        f"(rank 0 writes it once its sites are set up; is {out_dir} the run's --out?)") from None
    except (OSError, ValueError) as exc:
        raise LiveStatusError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("sites"), list):
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise LiveStatusError(f"{path}: not an hpcfed live status file (format {found!r})")
    return data


def site_epsilons(out_dir: Path) -> dict[int, float]:
    """Each site's newest reported ε (any metric whose name contains ``epsilon``), from the end of
    metrics.jsonl; empty when the run reports none."""
    path = Path(out_dir) / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - METRICS_TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return {}
    found: dict[int, float] = {}
    for line in tail:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the first line of the tail may be cut
        if not isinstance(event, dict) or "epsilon" not in str(event.get("name", "")):
            continue
        client, value = event.get("client"), event.get("value")
        if isinstance(client, int) and isinstance(value, (int, float)) and math.isfinite(value):
            found[client] = float(value)
    return found


def _size(n: object) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


SHOWN_GAPS = 3  # the newest gaps drawn per site (the count says how many more)


def gaps_text(gaps: object) -> str:
    """A site's gaps as `12→15, 30→` (away since round 30), the newest `SHOWN_GAPS`; the file is
    read as untrusted: anything but [int, int or null] pairs is skipped."""
    if not isinstance(gaps, list):
        return "-"
    pairs = [g for g in gaps[-1000:] if isinstance(g, list) and len(g) == 2 and _round(g[0]) and
             (g[1] is None or _round(g[1]))]
    if not pairs:
        return "-"
    text = ", ".join(f"{left}→{'' if back is None else back}" for left, back in pairs[-SHOWN_GAPS:])
    return text if len(pairs) <= SHOWN_GAPS else f"{len(pairs) - SHOWN_GAPS} more, {text}"


def _round(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -1 <= value < 1 << 62


def _headline(snap: dict[str, Any], now: float) -> str:
    progress = snap.get("progress") or {}
    where = (f"{progress.get('done', '?')}/{progress.get('total', '?')} {progress.get('unit', 'rounds')}"
             if progress else "setting up")
    eta = progress.get("eta_s") if progress else None
    age = now - float(snap.get("time", now))
    parts = [f"{snap.get('run')}: {snap.get('status')}", f"{snap.get('mode')} {snap.get('strategy')}", where]
    if isinstance(eta, (int, float)):
        parts.append(f"ETA {eta:.0f} s")
    parts.append(f"model version {snap.get('version')}")
    nxt = snap.get("next_checkpoint")
    parts.append("next checkpoint " + (f"after {nxt}" if nxt is not None else "none due"))
    parts.append(f"updated {age:.0f} s ago")
    return " | ".join(parts)


def render(snap: dict[str, Any], epsilons: dict[int, float], now: float | None = None) -> Any:
    """The live view as a rich renderable: a headline, one row per site, the server's totals."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = time.time() if now is None else now
    table = Table(expand=False)
    for column in ("site", "rank", "state", "last round", "heard", "in", "out", "ε", "away (left→back)", "reason"):
        # a site's state is never cut short (a narrow or piped console squeezes the other columns instead)
        is_state = column == "state"
        table.add_column(column, justify="left" if column in ("state", "reason") else "right",
                         no_wrap=is_state, min_width=max(map(len, STATE_STYLES)) if is_state else None)
    for site in snap["sites"]:
        if not isinstance(site, dict):
            continue
        state = str(site.get("state", "?"))
        heard = site.get("last_heard_s")
        eps = epsilons.get(site.get("client"))  # type: ignore[arg-type]  # a non-int id simply finds none
        table.add_row(str(site.get("client")), str(site.get("rank")), Text(state, style=STATE_STYLES.get(state, "")),
                      "-" if site.get("last_round") is None else str(site.get("last_round")),
                      "-" if heard is None else f"{heard:.0f} s ago", _size(site.get("bytes_in")),
                      _size(site.get("bytes_out")), "-" if eps is None else f"{eps:.2f}", gaps_text(site.get("gaps")),
                      str(site.get("reason") or ""))
    server = snap.get("server") or {}
    footer = (f"server: in {_size(server.get('bytes_in'))}, out {_size(server.get('bytes_out'))}, "
              f"{server.get('updates_accepted', 0)} updates accepted, {server.get('rejected', 0)} messages refused, "
              f"peak RSS {_size(server.get('peak_rss_bytes'))}")
    return Group(Text(_headline(snap, now), style="bold"), table, Text(footer))


def watch(out_dir: Path, interval: float, once: bool) -> int:
    """Draw the live view until the run ends (or once); returns the exit status."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    snap = read_live(out_dir)
    if once:
        console.print(render(snap, site_epsilons(out_dir)))
        return 0
    with Live(render(snap, site_epsilons(out_dir)), console=console, refresh_per_second=4) as live:
        while snap.get("status") in ("running", "setting up"):
            time.sleep(interval)
            try:
                snap = read_live(out_dir)
            except LiveStatusError:
                continue  # replaced between stat and read, or briefly unreadable: try again
            live.update(render(snap, site_epsilons(out_dir)))
    return 0
