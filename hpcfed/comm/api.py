"""The seam between the secure channel and the code that uses it (server, client, live search).

`Channel` is what a server or client may call; `SecureChannel` (`hpcfed.comm.channel`) is the
implementation, and tests may stand in an in-process one. `Message` is one decrypted, decoded
message as it leaves the channel. Nothing here knows of learning.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class ChannelError(RuntimeError):
    """The channel cannot go on with a peer (handshake failed, timeout, cut off); names the rank."""


@dataclass
class Message:
    """One authenticated, decrypted message: who sent it, its kind, JSON header and tensors."""

    source: int
    kind: int
    header: dict[str, Any]
    tensors: dict[str, np.ndarray]
    nbytes: int  # bundle bytes (before encryption)


class Outgoing(Protocol):
    """A message posted without waiting: `done()` once the peer has taken all of it."""

    dest: int

    def done(self) -> bool:
        """Whether the peer has taken the whole message (its buffers may be reused)."""


class Channel(Protocol):
    """Encrypted, authenticated point-to-point messages between this rank and its peers."""

    rank: int
    size: int
    peers: list[int]
    shared_memory: bool
    on_message: Callable[[Message], bool] | None
    on_reject: Callable[[int, str, str], None] | None

    @property
    def stats(self) -> Any:
        """This rank's counters (messages, bytes, refusals by reason and rank, crypto time)."""

    def connect(self, peers: Collection[int], timeout: float, *, require_all: bool = True) -> None:
        """Authenticate with each peer; ChannelError naming the ranks that did not answer within `timeout` s
        (with `require_all` false, the run goes on with those that did)."""

    def expect(self, kinds: Collection[int] | Mapping[int, Collection[int]] | None,
               max_bytes: Mapping[int, int] | None = None, *, inbox_max_messages: int | None = None,
               inbox_max_bytes: int | None = None) -> None:
        """Declare what this rank accepts (kinds, per-kind byte bounds, the inbox's bounds); anything else is
        dropped on arrival and counted, so a peer cannot make this rank buffer what it never reads."""

    def identity(self, rank: int) -> str:
        """The fingerprint of the identity key `rank` authenticated with ("psk" in psk mode)."""

    def send(self, dest: int, kind: int, header: dict[str, Any],
             tensors: Mapping[str, Any] | None = None) -> None:
        """Encrypt and send one message; returns when `tensors` may be modified again."""

    def post(self, dest: int, kind: int, header: dict[str, Any],
             tensors: Mapping[str, Any] | None = None) -> Outgoing:
        """Encrypt one message into buffers of its own and start sending it; returns at once."""

    def recv(self, *, source: int | None = None, kinds: Collection[int] | None = None,
             timeout: float | None = None) -> Message | None:
        """The next message (from `source`, of one of `kinds`), or None after `timeout` s; messages that do
        not match are kept for later calls."""

    def poll(self) -> Message | None:
        """A waiting message, if any; never waits."""

    def peer_gone(self, rank: int) -> None:
        """Rank `rank` has ended: a send waiting on it fails at once, and sending to it again raises."""

    def watch_peers(self, look: Callable[[], None] | None) -> None:
        """Call `look()` every few tenths of a second while a send waits (it may call `peer_gone`)."""

    def routes(self) -> dict[int, str]:
        """Per peer, how big messages travel: "ring", "declined" or "mpi"."""

    def set_crypto_threads(self, threads: int | None) -> None:
        """Seal a big message's chunks with this many threads at once; None: the cores available, at most 8."""

    def close(self, timeout: float = 5.0) -> None:
        """Complete (or, after `timeout` s, cancel) outstanding sends and drop the buffers."""
