"""A star made of intercommunicators: K site jobs joined to rank 0 look like ranks 1..K of one job.

`hpcfed serve` and `hpcfed join` run the server and each site as MPI jobs of their own, joined
by one intercommunicator per site (hub and spoke: no communicator spans two sites, since a
`Merge` across sites that cannot reach each other hangs). `SpokeTransport` presents them as the
`Transport` of a star -- rank 0 the server, ranks 1..K the sites -- so `SecureChannel` and
everything above it (server, client) run over it exactly as over COMM_WORLD.

MPI never reports a dead peer job: an `Irecv` from it stays pending forever, and a send to it may
hang or crash the process. So the transport is told which peers are lost (`mark_lost`, fed by
`hpcfed.comm.lifeline`) and never sends to one again: a frame for a lost peer is dropped here and
counted. Frames that already arrived from it may still be read.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from hpcfed.comm.transport import Request, Transport


class _Dropped:
    """The request of a frame not sent (its peer is lost): complete at once."""

    __slots__ = ()

    def test(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


_DROPPED = _Dropped()


class SpokeTransport:
    """This process as rank `rank` of a star of `size` ranks whose peers are reached through
    `links` ({peer rank: a transport over the intercommunicator to that peer, whose remote rank
    is 0}). The server has links to 1..K, a site one link to 0."""

    def __init__(self, rank: int, size: int, links: Mapping[int, Transport]) -> None:
        bad = [r for r in links if not 0 <= r < size or r == rank]
        if bad:
            raise ValueError(f"spoke links to ranks {bad}: not peers of rank {rank} in a star of {size}")
        self.rank = rank
        self.size = size
        self._links = dict(links)
        self._order = sorted(self._links)
        self._next = 0  # where the next any-source probe starts: no peer starves the others
        self._lost: set[int] = set()
        self._lock = threading.Lock()  # mark_lost comes from the lifeline's thread
        self.dropped_frames: dict[int, int] = {}

    def add_link(self, rank: int, link: Transport) -> None:
        """A peer that has joined (the server gathers its sites one by one)."""
        if not 0 <= rank < self.size or rank == self.rank or rank in self._links:
            raise ValueError(f"rank {rank} cannot join rank {self.rank}'s star of {self.size} (taken or out of range)")
        self._links[rank] = link
        self._order = sorted(self._links)

    def replace_link(self, rank: int, link: Transport) -> None:
        """A lost peer is back as a new job (`hpcfed serve`: a site rejoins): `link` reaches it now,
        and it is no longer lost. The old intercommunicator is left as it is: its peer is gone,
        and a `Disconnect` or `Free` would wait for it."""
        with self._lock:
            if rank not in self._lost:
                raise ValueError(f"rank {rank} is not lost: it cannot be replaced")
            self._links[rank] = link
            self._lost.discard(rank)

    # -- liveness ---------------------------------------------------------------------------------
    def mark_lost(self, rank: int) -> None:
        """Never send to `rank` again (its job is gone: MPI would hang or crash on a send)."""
        with self._lock:
            self._lost.add(rank)

    def lost(self) -> set[int]:
        """The peers declared lost so far."""
        with self._lock:
            return set(self._lost)

    def links(self) -> dict[int, Transport]:
        """{peer rank: its link}, lost peers included."""
        return dict(self._links)

    # -- the Transport interface ------------------------------------------------------------------
    def isend(self, frame: memoryview, dest: int) -> Request:
        link = self._link(dest)
        with self._lock:
            lost = dest in self._lost
        if lost:
            self.dropped_frames[dest] = self.dropped_frames.get(dest, 0) + 1
            return _DROPPED
        return link.isend(frame, 0)

    def iprobe(self, source: int | None = None) -> tuple[int, int] | None:
        if source is not None:
            found = self._link(source).iprobe(0)
            return None if found is None else (source, found[1])
        n = len(self._order)
        for i in range(n):
            rank = self._order[(self._next + i) % n]
            found = self._links[rank].iprobe(0)
            if found is not None:
                self._next = (self._next + i + 1) % n
                return rank, found[1]
        return None

    def irecv_into(self, source: int, out: memoryview) -> Request:
        return self._link(source).irecv_into(0, out)

    def discard(self, source: int) -> Request:
        return self._link(source).discard(0)

    def bcast_bytes(self, data: bytes | None, nbytes: int, root: int = 0) -> bytes:
        raise RuntimeError("a star of separate jobs has no collective across sites (hub and spoke): "
                           "the job id travels in the rendezvous instead")

    # Shared memory: none across jobs (the channel then sends every chunk over MPI).
    def shm_create(self, tag: str, nbytes: int) -> tuple[str, memoryview] | None:
        return None

    def shm_attach(self, name: str, nbytes: int) -> memoryview | None:
        return None

    def shm_unlink(self, name: str) -> None:
        pass

    def _link(self, rank: int) -> Transport:
        link = self._links.get(rank)
        if link is None:
            raise ValueError(f"rank {rank} is not a peer of rank {self.rank} in this star")
        return link
