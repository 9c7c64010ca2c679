"""The settings of a secure channel: one keyword-only dataclass, checked where it is made.

`ChannelSettings` names the same keys for ``**kwargs`` (`SecureChannel(...)`, `open_star(...)`),
so a caller passes plain values and a typo or a wrong type is caught by mypy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from hpcfed.comm import crypto, wire
from hpcfed.comm.frame import HDR, TAG


class ChannelSettings(TypedDict, total=False):
    """Any subset of `ChannelOptions`' fields, as keyword arguments."""

    chunk_bytes: int
    limits: wire.WireLimits
    max_message_bytes: int
    backoff_max_s: float
    max_rejects: int
    spin_s: float
    send_timeout_s: float
    shared_memory: bool
    max_assembling_bytes: int
    shm_budget_bytes: int
    inbox_max_messages: int
    inbox_max_bytes: int
    crypto_threads: int | None


@dataclass(kw_only=True)
class ChannelOptions:
    """How a channel cuts, bounds and paces its messages (see `SecureChannel`)."""

    chunk_bytes: int = 4 << 20  # plaintext bytes per frame
    limits: wire.WireLimits = field(default_factory=wire.WireLimits)
    max_message_bytes: int = 8 << 30  # at most limits.max_total_bytes
    backoff_max_s: float = 0.005  # the longest sleep between polls of an idle rank
    max_rejects: int = 10000  # a rank with this many refused frames is cut off
    spin_s: float = 5e-4  # spin this long before sleeping
    send_timeout_s: float = 600.0  # a send (or a frame announced to this rank) that takes longer fails
    shared_memory: bool = True  # big messages to a peer on the same node through a shared ring
    # Part-received messages beyond this many bytes: finish them before taking another sender's
    # first chunk, so a server's memory does not grow with the number of clients uploading at once.
    max_assembling_bytes: int = 64 << 20
    # Shared-memory rings this rank maps (sending and receiving) stay under this many bytes: a
    # server with K clients on its node would otherwise map 2 K rings; the rest go through MPI.
    shm_budget_bytes: int = 64 << 20
    inbox_max_messages: int = 1024  # per peer: received messages not yet read ...
    inbox_max_bytes: int = 16 << 30  # ... and their bundle bytes
    crypto_threads: int | None = None  # None: the cores available, at most 8
    max_frame: int = field(init=False, default=0)  # the largest frame a peer may send: HDR + chunk + TAG

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_bytes <= crypto.MAX_AEAD_INPUT - HDR - TAG:
            raise ValueError(f"comm.chunk_bytes={self.chunk_bytes}: use 4096 .. {1 << 30} (4 MiB is a good default)")
        if self.max_message_bytes < 1:
            raise ValueError(f"comm.max_message_bytes={self.max_message_bytes} must be positive")
        if not 0 < self.backoff_max_s <= 1:
            raise ValueError(f"comm.backoff_max_s={self.backoff_max_s}: use a value in (0, 1] seconds")
        if self.max_rejects < 1:
            raise ValueError(f"security.max_rejects={self.max_rejects} must be at least 1")
        self.max_message_bytes = min(self.max_message_bytes, self.limits.max_total_bytes)
        self.max_frame = HDR + self.chunk_bytes + TAG
