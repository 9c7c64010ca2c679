"""How far a federation is and when it should end: the server's console progress.

The server's output is piped through mpiexec (never a terminal), so progress is a plain part of its
log lines -- ``4/8 rounds, ETA 12 s`` -- rather than a redrawn bar. The rate is measured over the
work done by this process, so a resumed run's estimate is not skewed by the rounds it skipped.
"""

from __future__ import annotations

import time


class Progress:
    def __init__(self, total: int, done: int = 0, unit: str = "rounds") -> None:
        self.total, self.unit = max(0, total), unit
        self._start_done, self._t0 = done, time.monotonic()
        self.done = done

    def advance_to(self, done: int) -> None:
        self.done = done

    def eta_s(self) -> float | None:
        worked = self.done - self._start_done
        if worked <= 0 or self.done >= self.total:
            return None
        return (time.monotonic() - self._t0) / worked * (self.total - self.done)

    def describe(self) -> str:
        """``4/8 rounds, ETA 12 s`` (no ETA before the first step or after the last)."""
        eta = self.eta_s()
        return f"{self.done}/{self.total} {self.unit}" + (f", ETA {format_duration(eta)}" if eta is not None else "")


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 120:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 120:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
