"""Waiting without blocking inside MPI: poll, spin a little, then sleep with a doubling back-off.

An idle rank sleeps up to `backoff_max_s` between polls, so it uses well under 20% of a core. Work
under way paces itself faster: a transfer in progress (`active`) spins longer and sleeps little,
and a rank in conversation (a frame arrived less than `CONVERSATION_S` ago) sleeps at most
`CONVERSATION_SLEEP_S`. `Pacer` picks among those for a receive.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from hpcfed.comm.stats import ChannelStats

ACTIVE_SPIN_S = 2e-3  # spin while a transfer is under way (a 4 MiB chunk takes ~1 ms) ...
ACTIVE_SLEEP_S = 2e-4  # ... and then sleep at most this long between polls
# A rank that received a frame less than CONVERSATION_S ago is in a conversation: its peer's next
# message is likely within a millisecond, so it sleeps at most CONVERSATION_SLEEP_S between polls.
# Without this, one late reply (a preempted peer) could tip a ping-pong into a stable slow state
# where each side is deep in its back-off sleep whenever the other's message lands (~200 round
# trips/s instead of thousands).
CONVERSATION_S = 0.05
CONVERSATION_SLEEP_S = 5e-5
FIRST_SLEEP_S = 1e-5

_yield_cpu: Callable[[], object] = getattr(os, "sched_yield", lambda: time.sleep(0))


class Backoff:
    """Spin for `spin_s` (yielding the core each time), then sleep 10 us, 20 us, ... up to `max_s` between polls."""

    __slots__ = ("max_s", "sleep", "spin_s", "stats", "t0")

    def __init__(self, spin_s: float, max_s: float, stats: ChannelStats | None = None) -> None:
        self.spin_s, self.max_s, self.stats = spin_s, max_s, stats
        self.reset()

    def reset(self) -> None:
        """Something happened: start over with spinning."""
        self.t0 = time.perf_counter()
        self.sleep = FIRST_SLEEP_S

    def pause(self, deadline: float | None = None) -> None:
        """Wait once before the next poll (never past `deadline`, a `time.monotonic()` value)."""
        now = time.perf_counter()
        if now - self.t0 < self.spin_s:
            # Give the core away while spinning: when the peer rank shares this core (more ranks
            # than cores, or no core binding) a pure spin keeps it from running until the spin
            # ends, which costs every message the whole spin plus a sleep.
            _yield_cpu()
            return
        s = self.sleep
        if deadline is not None:
            s = min(s, max(0.0, deadline - time.monotonic()))
        if s > 0:
            time.sleep(s)
            if self.stats is not None:
                self.stats.idle_sleeps += 1
        self.sleep = min(self.sleep * 2, self.max_s)


def active(spin_s: float, backoff_max_s: float) -> Backoff:
    """The pace of a wait on a transfer under way: active work, not idling, so a sleeping sender
    does not stall the chunk pipeline."""
    return Backoff(max(spin_s, ACTIVE_SPIN_S), min(backoff_max_s, ACTIVE_SLEEP_S))


class Pacer:
    """The three paces of a receive: busy (a multi-chunk message is arriving: its next chunk is
    imminent), talking (a frame came moments ago) and idle."""

    __slots__ = ("busy", "idle", "talking")

    def __init__(self, spin_s: float, backoff_max_s: float, stats: ChannelStats) -> None:
        self.idle = Backoff(spin_s, backoff_max_s, stats)
        self.talking = Backoff(spin_s, min(backoff_max_s, CONVERSATION_SLEEP_S), stats)
        self.busy = Backoff(ACTIVE_SPIN_S, min(backoff_max_s, ACTIVE_SLEEP_S), stats)

    def pick(self, assembling: bool, last_frame_at: float) -> Backoff:
        """The pace for now, given whether a message is part-received and when the last frame came
        (a `time.perf_counter()` value)."""
        if assembling:
            return self.busy
        return self.talking if time.perf_counter() - last_frame_at < CONVERSATION_S else self.idle

    def settle(self, backoff: Backoff, last_frame_at: float) -> Backoff:
        """After a poll that found nothing: a conversation that is over backs off to the idle pace."""
        if backoff is self.talking and time.perf_counter() - last_frame_at >= CONVERSATION_S:
            return self.idle
        return backoff
