"""How often one site may knock from one address (`hpcfed.comm.rendezvous.Listener`): at most
`per_window` knocks in `window_s`, counted before any proof is checked, so a flood costs no
cryptography. Keyed by (address, claimed site), so a flood that claims a site from one host does
not lock out that site's own job on another; the table is bounded (cleared once it is full)."""

from __future__ import annotations

import time


class KnockLimit:
    """The recent knocks of each (address, site) pair."""

    def __init__(self, per_window: int, window_s: float, table: int) -> None:
        self.per_window, self.window_s, self.table = per_window, window_s, table
        self._recent: dict[tuple[str, int], list[float]] = {}

    def over(self, host: str, site: int) -> int:
        """Count this knock: 0 when it is within the limit, else how many came in the window."""
        now = time.monotonic()
        if len(self._recent) >= self.table:
            self._recent.clear()
        times = [t for t in self._recent.get((host, site), []) if now - t < self.window_s]
        if len(times) >= self.per_window:
            self._recent[(host, site)] = times
            return len(times)
        self._recent[(host, site)] = [*times, now]
        return 0
