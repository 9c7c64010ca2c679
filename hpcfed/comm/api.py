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

    def done(self) -> bool: ...


class Channel(Protocol):
    """Encrypted, authenticated point-to-point messages between this rank and its peers."""

    rank: int
    size: int
    peers: list[int]
    shared_memory: bool
    on_message: Callable[[Message], bool] | None
    on_reject: Callable[[int, str, str], None] | None

    @property
    def stats(self) -> Any: ...

    def connect(self, peers: Collection[int], timeout: float, *, require_all: bool = True) -> None: ...

    def expect(self, kinds: Collection[int] | Mapping[int, Collection[int]] | None,
               max_bytes: Mapping[int, int] | None = None, *, inbox_max_messages: int | None = None,
               inbox_max_bytes: int | None = None) -> None: ...

    def identity(self, rank: int) -> str: ...

    def send(self, dest: int, kind: int, header: dict[str, Any],
             tensors: Mapping[str, Any] | None = None) -> None: ...

    def post(self, dest: int, kind: int, header: dict[str, Any],
             tensors: Mapping[str, Any] | None = None) -> Outgoing: ...

    def recv(self, *, source: int | None = None, kinds: Collection[int] | None = None,
             timeout: float | None = None) -> Message | None: ...

    def poll(self) -> Message | None: ...

    def peer_gone(self, rank: int) -> None: ...

    def watch_peers(self, look: Callable[[], None] | None) -> None: ...

    def set_crypto_threads(self, threads: int | None) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...
