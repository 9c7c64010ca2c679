"""Lifelines over real sockets: a peer whose process ends, or that falls silent, is lost once."""

from __future__ import annotations

import socket
import time

import pytest

from hpcfed.comm.lifeline import Lifelines


def _wait_for(cond, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_closed_lifeline_is_lost_at_once_and_reported_once():
    lost: list[tuple[int, str]] = []
    lines = Lifelines(lambda r, why: lost.append((r, why)), interval=0.05, timeout=30)
    ours, theirs = socket.socketpair()
    lines.add(3, ours)
    theirs.sendall(b"hostile junk " * 1000)  # whatever comes is read and thrown away
    time.sleep(0.2)
    assert lost == [] and lines.watched() == [3]
    theirs.close()  # what the kernel does when the peer's process dies
    _wait_for(lambda: lost)
    time.sleep(0.2)
    lines.close()
    assert lost == [(3, "its job ended (its lifeline closed)")] and lines.watched() == []


def test_a_silent_peer_is_lost_after_the_timeout_and_a_beating_one_is_not():
    lost: list[int] = []
    lines = Lifelines(lambda r, why: lost.append(r), interval=0.05, timeout=0.5)
    mute, mute_peer = socket.socketpair()
    talk, talk_peer = socket.socketpair()
    peer = Lifelines(lambda r, why: None, interval=0.05, timeout=30)  # the other side beats back
    peer.add(0, talk_peer)
    lines.add(1, mute)
    lines.add(2, talk)
    _wait_for(lambda: lost, 5)
    time.sleep(0.3)
    assert lost == [1] and lines.watched() == [2]
    assert mute_peer.recv(100)  # our beats reached the silent one too
    lines.close()
    peer.close()
    mute_peer.close()


def test_the_interval_must_be_below_the_timeout():
    with pytest.raises(ValueError, match="below the timeout"):
        Lifelines(lambda r, why: None, interval=5, timeout=5)
