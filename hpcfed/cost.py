"""What a rank's part of a federation cost: peak memory, bytes moved, time in AES-GCM.

Every rank measures its own (`rank_cost`); clients send theirs to the server with RESULT, and the
server checks them like any header value from a peer (`parse_cost`: known keys only, bounded
non-negative ints, finite non-negative floats) before they go into ``summary.json``.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Mapping

_INTS = ("peak_rss_bytes", "bytes_sent", "bytes_received", "messages_sent", "messages_received",
         "polls", "idle_sleeps")  # polls: Iprobe calls; idle_sleeps: back-off sleeps (a waiting rank sleeps)
_FLOATS = ("seal_s", "open_s")
_SITE_FLOATS = ("examples_per_s",)  # a site's, with its RESULT: its training throughput (all its ranks)
# optional on any rank: CPU seconds of its federation loop (from its first model or round to its last
# upload: neither the imports, the set-up nor the final evaluation), to read CPU per round or buffer
_LOOP_FLOATS = ("loop_cpu_s",)
_MAX_INT = 1 << 62  # far above any real figure; a larger one is a lie
_MAX_SECONDS = 1e9


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def rank_cost(stats: object, loop_cpu_s: float | None = None) -> dict[str, float]:
    """This rank's cost so far, from its channel's `ChannelStats`, and the CPU seconds of its loop if known."""
    return {"peak_rss_bytes": peak_rss_bytes(),
            **{k: int(getattr(stats, k, 0)) for k in _INTS if k != "peak_rss_bytes"},
            **{k: float(getattr(stats, k, 0.0)) for k in _FLOATS},
            **({"loop_cpu_s": max(0.0, float(loop_cpu_s))} if loop_cpu_s is not None else {})}


def parse_cost(value: object) -> dict[str, float] | None:
    """A peer's reported cost if it is well formed, else None (the caller rejects the message)."""
    required, optional = set(_INTS) | set(_FLOATS), set(_SITE_FLOATS) | set(_LOOP_FLOATS)
    if not isinstance(value, dict) or not required <= set(value) <= required | optional:
        return None
    out: dict[str, float] = {}
    for k in _INTS:
        v = value[k]
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _MAX_INT:
            return None
        out[k] = v
    for k in (*_FLOATS, *(f for f in (*_SITE_FLOATS, *_LOOP_FLOATS) if f in value)):
        v = value[k]
        if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                or not 0 <= v <= _MAX_SECONDS):
            return None
        out[k] = float(v)
    return out


def brief(cost: Mapping[str, float]) -> str:
    """One line for logs: peak RSS, bytes out/in, AES-GCM seconds."""
    return (f"peak RSS {cost['peak_rss_bytes'] / 2**20:.0f} MiB, sent {cost['bytes_sent'] / 1e6:.1f} MB, "
            f"received {cost['bytes_received'] / 1e6:.1f} MB, seal {cost['seal_s']:.2f} s, open {cost['open_s']:.2f} s")
