"""How far a federation is and when it should end: the server's console progress and status line.

The server's output is piped through mpiexec (never a terminal), so progress is a plain part of its
log lines -- ``4/8 rounds, ETA 12 s`` -- rather than a redrawn bar. The rate is measured over the
work done by this process, so a resumed run's estimate is not skewed by the rounds it skipped.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hpcfed.cost import brief as cost_brief
from hpcfed.cost import rank_cost

log = logging.getLogger("hpcfed.server")


class Progress:
    """Work done out of the total (rounds, or accepted async updates), and when it should end."""

    def __init__(self, total: int, done: int = 0, unit: str = "rounds") -> None:
        self.total, self.unit = max(0, total), unit
        self._start_done, self._t0 = done, time.monotonic()
        self.done = done

    def advance_to(self, done: int) -> None:
        """`done` units of the total are done."""
        self.done = done

    def eta_s(self) -> float | None:
        """Seconds left at this process's rate so far (None before the first step or after the last)."""
        worked = self.done - self._start_done
        if worked <= 0 or self.done >= self.total:
            return None
        return (time.monotonic() - self._t0) / worked * (self.total - self.done)

    def describe(self) -> str:
        """``4/8 rounds, ETA 12 s`` (no ETA before the first step or after the last)."""
        eta = self.eta_s()
        return f"{self.done}/{self.total} {self.unit}" + (f", ETA {format_duration(eta)}" if eta is not None else "")


class StatusLine:
    """The server's ``status:`` log line, at most every `every_s` seconds: where it is, the
    message and byte rates since the last line, what it rejected, and what it costs."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last = time.monotonic()
        self._last_msgs = 0
        self._last_bytes = 0

    def maybe_log(self, progress: Progress | None, version: int, rejected: int, stats: Any) -> None:
        """Log the line when it is due; `rejected` counts the runtime's refusals, `stats` is the
        channel's (`ChannelStats`), whose own refusals are added."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        dt = now - self._last
        self._last = now
        rejected += sum(stats.rejected.values())
        where = progress.describe() if progress else "setting up"
        log.info("status: %s, version %d, %.1f msg/s, %.2f MB/s in, rejected %d; %s", where, version,
                 (stats.messages_received - self._last_msgs) / dt,
                 (stats.bytes_received - self._last_bytes) / dt / 1e6, rejected, cost_brief(rank_cost(stats)))
        self._last_msgs, self._last_bytes = stats.messages_received, stats.bytes_received


def format_duration(seconds: float) -> str:
    """``45 s``, ``3 min 07 s``, ``2 h 05 min``."""
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 120:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
