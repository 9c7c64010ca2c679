"""Back-off polling: spin (yielding the core), then sleeps that double up to the cap, never past a
deadline; the receive pace follows the conversation."""

from __future__ import annotations

import time

from hpcfed.comm import polling
from hpcfed.comm.stats import ChannelStats


def test_after_the_spin_the_sleeps_double_up_to_the_cap(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(polling.time, "sleep", sleeps.append)
    stats = ChannelStats()
    b = polling.Backoff(spin_s=0.0, max_s=1e-4, stats=stats)
    for _ in range(6):
        b.pause()
    assert sleeps == [1e-5, 2e-5, 4e-5, 8e-5, 1e-4, 1e-4]
    assert stats.idle_sleeps == 6
    b.reset()
    b.pause()
    assert sleeps[-1] == polling.FIRST_SLEEP_S


def test_while_spinning_it_yields_and_never_sleeps(monkeypatch):
    sleeps: list[float] = []
    yields: list[int] = []
    monkeypatch.setattr(polling.time, "sleep", sleeps.append)
    monkeypatch.setattr(polling, "_yield_cpu", lambda: yields.append(1))
    b = polling.Backoff(spin_s=60.0, max_s=0.005)
    for _ in range(5):
        b.pause()
    assert sleeps == [] and len(yields) == 5


def test_a_sleep_never_runs_past_the_deadline(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(polling.time, "sleep", sleeps.append)
    b = polling.Backoff(spin_s=0.0, max_s=1.0)
    b.sleep = 0.5
    b.pause(deadline=time.monotonic() + 0.01)
    assert len(sleeps) == 1 and 0 < sleeps[0] <= 0.01
    b.pause(deadline=time.monotonic() - 1)  # already past: no sleep at all
    assert len(sleeps) == 1


def test_an_active_wait_spins_longer_and_sleeps_little():
    b = polling.active(spin_s=1e-4, backoff_max_s=0.005)
    assert b.spin_s == polling.ACTIVE_SPIN_S and b.max_s == polling.ACTIVE_SLEEP_S
    b = polling.active(spin_s=0.01, backoff_max_s=1e-4)
    assert b.spin_s == 0.01 and b.max_s == 1e-4


def test_the_receive_pace_follows_the_conversation():
    pacer = polling.Pacer(5e-4, 0.005, ChannelStats())
    assert pacer.talking.max_s == polling.CONVERSATION_SLEEP_S and pacer.idle.max_s == 0.005
    now = time.perf_counter()
    assert pacer.pick(True, -float("inf")) is pacer.busy  # a message part-received: its next chunk is near
    assert pacer.pick(False, now) is pacer.talking
    assert pacer.pick(False, now - 2 * polling.CONVERSATION_S) is pacer.idle
    assert pacer.settle(pacer.talking, now) is pacer.talking
    assert pacer.settle(pacer.talking, now - 2 * polling.CONVERSATION_S) is pacer.idle
    assert pacer.settle(pacer.busy, now - 2 * polling.CONVERSATION_S) is pacer.busy
