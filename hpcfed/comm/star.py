"""The star of secure channels a job runs on: rank 0 talks to ranks 1..K, each of them to rank 0.

The federation (`hpcfed run`) and live search (`hpcfed search live`) open it the same way:

    job_id = draw_job_id(transport, tag)          # collective: rank 0 draws, every rank gets it
    credentials = ...                             # this rank's, from its own configuration
    channel = open_star(transport, credentials, job_id, timeout=..., log=..., chunk_bytes=...)

The job id is bound into every handshake transcript and every frame's associated data, so messages
of another job (or of an earlier attempt of a requeued one) never authenticate here.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Unpack

from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.options import ChannelSettings
from hpcfed.comm.transport import Transport

JOB_NONCE_BYTES = 16


def draw_job_id(transport: Transport, tag: bytes) -> bytes:
    """`tag` followed by 16 random bytes rank 0 draws and broadcasts (every rank must call this)."""
    nonce = transport.bcast_bytes(secrets.token_bytes(JOB_NONCE_BYTES) if transport.rank == 0 else None,
                                  JOB_NONCE_BYTES)
    return bytes(tag) + nonce


def star_peers(rank: int, size: int) -> list[int]:
    """The ranks `rank` has a channel with: all others for rank 0, rank 0 for the rest."""
    return list(range(1, size)) if rank == 0 else [0]


def open_star(transport: Transport, credentials: Credentials, job_id: bytes, *, timeout: float,
              log: Callable[[str], None] | None = None, ended: Callable[[int], object] | None = None,
              **channel_options: Unpack[ChannelSettings]) -> SecureChannel:
    """This rank's channel, authenticated with its star peers within `timeout` s (ChannelError
    naming the ranks that did not answer or failed). `ended(rank)`: true once that rank is known to
    have ended; it is then left out of `channel.peers` at once instead of failing the whole star
    (its owner goes on without it). `channel_options`: `ChannelOptions`' fields."""
    channel = SecureChannel(transport, credentials, job_id, log=log, **channel_options)
    if ended is not None:
        peers = star_peers(transport.rank, transport.size)

        def look() -> None:
            for r in peers:
                if ended(r):
                    channel.peer_gone(r)

        channel.watch_peers(look)
    channel.connect(star_peers(transport.rank, transport.size), timeout=timeout)
    channel.watch_peers(None)
    return channel
