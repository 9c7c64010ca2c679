"""Sending: a message cut into chunks, each sealed under the next sequence number and handed to MPI
(or to a shared-memory ring) while the next one is sealed.

Three paths, with the same frames on the wire: `send` seals chunk n+1 (straight from the tensors'
memory) while chunk n is in flight and returns when the tensors may change again; with
`crypto_threads` > 1 a message's chunks are sealed in parallel (`_pipelined`); `post` seals every
chunk into a buffer of its own and returns at once. Sequence numbers are always taken in chunk
order on the calling thread. While a send waits, incoming frames are still received (`pump`), so
two ranks sending big messages to each other never deadlock.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np

from hpcfed.comm import crypto, frame, polling, wire
from hpcfed.comm.api import ChannelError
from hpcfed.comm.frame import F_DATA, F_SHM_DATA, FRAME, HDR, SLOT, TAG, VERSION
from hpcfed.comm.frame_buffers import FrameBuffers
from hpcfed.comm.ring import Rings, TxRing
from hpcfed.comm.sealing import CryptoPool, seal_timed
from hpcfed.comm.session import Peer, Session
from hpcfed.comm.transport import Request


class Outgoing:
    """A message `SecureChannel.post`ed: `done()` once the peer has taken all of it."""

    __slots__ = ("_generation", "_generations", "dest", "posted_at", "requests", "ring_slots")

    def __init__(self, dest: int, generations: dict[int, int] | None = None) -> None:
        self.dest = dest
        self.requests: list[Request] = []
        self.ring_slots: list[tuple[TxRing, int]] = []  # shared-memory slots it still holds
        self.posted_at = time.monotonic()
        # the peer's session it was posted in: one posted before the peer came back (forget) is done
        self._generations = generations if generations is not None else {}
        self._generation = self._generations.get(dest, 0)

    def done(self) -> bool:
        """Whether the peer has taken the message (shared memory: freed its slots), or never will."""
        if self._generations.get(self.dest, 0) != self._generation:
            return True
        if not all(req.test() for req in self.requests):
            return False
        return all(ring.owner[slot] is not self for ring, slot in self.ring_slots)


def _sealer(peer: Peer) -> crypto.Sealer:
    """The peer's sending key (a session is ready before anything sealed is sent to it)."""
    assert peer.tx is not None, f"no session keys for rank {peer.rank}"
    return peer.tx


class Sender:
    """The sending half of a channel; `pump` receives one frame if one has arrived (True if it did)."""

    def __init__(self, session: Session, pool: CryptoPool, rings: Rings, pump: Callable[[], bool]) -> None:
        self._s = session
        self._crypto = pool
        self._rings = rings
        self._pump = pump
        self.background: deque[tuple[Request, object]] = deque()  # small sends whose buffers must live on
        self._buffers = FrameBuffers(session.opts)

    # -- messages -------------------------------------------------------------------------------
    def prepare(self, dest: int, kind: int, header: dict[str, Any],
                tensors: Mapping[str, Any] | None) -> tuple[Peer, wire.Encoded]:
        """The session with `dest` and the message laid out; raises for a bad kind, no session, or a
        message over `max_message_bytes`."""
        if not isinstance(kind, int) or not 0 <= kind <= 255:
            raise ValueError(f"message kind {kind!r} must be an int in 0..255")
        peer = self._s.peers.get(dest)
        if dest in self._s.gone:
            raise ChannelError(f"rank {dest} has ended: nothing more is sent to it")
        if peer is None or peer.state != "ready":
            raise ChannelError(f"no secure session with rank {dest}; connect() first"
                               + (f" ({peer.error})" if peer is not None and peer.error else ""))
        opts = self._s.opts
        enc = wire.prepare(header, tensors, opts.limits)
        if enc.total > opts.max_message_bytes:
            raise ValueError(f"message to rank {dest} is {enc.total} bytes; comm.max_message_bytes is "
                             f"{opts.max_message_bytes}")
        return peer, enc

    def data(self, peer: Peer, kind: int, enc: wire.Encoded, posted: Outgoing | None = None) -> None:
        """Send a data message: through the peer's ring when it has one ready, else through MPI
        (waiting until MPI is done with the buffers, unless `posted`)."""
        total, chunk, dest = enc.total, self._s.opts.chunk_bytes, peer.rank
        count = max(1, -(-total // chunk))
        if count > 1 and self._s.opts.shared_memory:
            ring = self._rings.tx.get(dest)
            if ring is None:
                offer = self._rings.offer(dest)  # this message still goes through MPI; later ones may not
                if offer is not None:
                    self.control(peer, frame.F_SHM_OFFER, offer)
            elif ring.state == "ready" and (posted is None or len(ring.free) >= count):
                self._via_ring(peer, ring, kind, enc, total, count, posted)
                return
        msg_id = peer.next_msg_id
        peer.next_msg_id += 1
        if posted is not None:
            self._post_chunks(peer, kind, enc, total, count, msg_id, posted)
        elif count > 1 and self._crypto.threads > 1:
            self._pipelined(peer, kind, enc, total, count, msg_id)
        else:
            self._serial(peer, kind, enc, total, count, msg_id)

    def control(self, peer: Peer, ftype: int, body: bytes | None) -> None:
        """A sealed one-chunk control message (handshake confirmation, ring offer or answer). It may
        be sent from inside another send's wait: it gets its own buffer, never the slots in flight."""
        enc = None if body is None else wire.Encoded(body, [], len(body))
        total = 0 if body is None else len(body)
        msg_id = peer.next_msg_id
        peer.next_msg_id += 1
        buf = self._own_frame(peer, ftype, 0, enc, msg_id, 0, 1, 0, total, total)
        self._s.stats.bytes_sent += len(buf)
        self._small(peer.rank, buf.data, buf)

    def _serial(self, peer: Peer, kind: int, enc: wire.Encoded, total: int, count: int, msg_id: int) -> None:
        """One thread seals chunk n+1 into one of three reused buffers while earlier chunks are in flight."""
        dest, chunk, transport, stats = peer.rank, self._s.opts.chunk_bytes, self._s.transport, self._s.stats
        inflight: deque[Request] = deque()
        nslots = 1 if count == 1 else 3  # three buffers: encrypt one while two are in flight
        for i in range(count):
            start = i * chunk
            n = min(total - start, chunk)
            if len(inflight) == nslots:
                self.wait_send(inflight.popleft(), dest)
            buf = self._buffers.slot(i % nslots, HDR + n + TAG)
            buf[:HDR] = self._seal_chunk(peer, F_DATA, kind, enc, msg_id, i, count, start, n, total,
                                         buf[HDR:HDR + n + TAG])
            inflight.append(transport.isend(buf[:HDR + n + TAG], dest))
            stats.bytes_sent += HDR + n + TAG
            for req in inflight:  # nudge MPI's progress on the chunks already out
                req.test()
        while inflight:
            self.wait_send(inflight.popleft(), dest)

    def _pipelined(self, peer: Peer, kind: int, enc: wire.Encoded, total: int, count: int, msg_id: int) -> None:
        """Send a multi-chunk message with the pool's threads sealing chunks while earlier chunks
        are in flight. Memory: 2 x threads reused chunk buffers (+ gather buffers).

        Every chunk sealed is handed to MPI before this thread waits on a send (which receives
        meanwhile and may send a control frame to this peer with the next sequence number): so
        frames still leave in sequence order."""
        dest, chunk, stats, s = peer.rank, self._s.opts.chunk_bytes, self._s.stats, self._s
        pool, sealer = self._crypto.pool(), _sealer(peer)
        free: deque[int] = deque(range(2 * self._crypto.threads))
        sealing: deque[tuple[int, int, Future[float]]] = deque()  # (slot, n, job) in chunk order
        inflight: deque[tuple[Request, int]] = deque()  # (send, slot) in chunk order
        i = 0
        try:
            while i < count:
                while i < count and free:  # start sealing as many chunks as there are free slots
                    slot = free.popleft()
                    start = i * chunk
                    n = min(total - start, chunk)
                    buf = self._buffers.slot(slot, HDR + n + TAG)
                    peer.send_seq += 1
                    hdr = frame.pack(F_DATA, kind, s.rank, dest, n, peer.send_seq, msg_id, i, count, start, total)
                    buf[:HDR] = hdr
                    pieces = enc.pieces(start, start + n)
                    data = pieces[0] if len(pieces) == 1 else self._buffers.gathered(pieces, n, slot)
                    sealing.append((slot, n, pool.submit(seal_timed, sealer, peer.send_seq, data, s.jd + hdr,
                                                         buf[HDR:HDR + n + TAG])))
                    i += 1
                while sealing:  # hand every sealed chunk to MPI, in order
                    slot, n, job = sealing.popleft()
                    stats.seal_s += job.result()
                    inflight.append((s.transport.isend(self._buffers.view(slot)[:HDR + n + TAG], dest), slot))
                    stats.bytes_sent += HDR + n + TAG
                    for req, _ in inflight:  # nudge MPI's progress on the chunks already out
                        req.test()
                if i < count:  # wait for the oldest send to free its buffer (and any others done)
                    req, slot = inflight.popleft()
                    self.wait_send(req, dest)
                    free.append(slot)
                    while inflight and inflight[0][0].test():
                        free.append(inflight.popleft()[1])
            while inflight:
                req, _ = inflight.popleft()
                self.wait_send(req, dest)
        except BaseException as exc:
            wait_futures([job for _, _, job in sealing])  # no thread writes into a buffer after this
            self._buffers.drop_slots()  # frames may still be read by abandoned sends or half-sealed
            if isinstance(exc, (ChannelError, KeyboardInterrupt, SystemExit)):
                raise
            raise ChannelError(f"sealing a message to rank {dest} failed: {exc}") from exc

    def _seal_chunk(self, peer: Peer, ftype: int, kind: int, enc: wire.Encoded | None, msg_id: int, index: int,
                    count: int, start: int, n: int, total: int, out: memoryview) -> bytes:
        """Encrypt bytes [start, start + n) of `enc` as chunk `index` of message `msg_id` into `out`
        (n + TAG bytes); return the frame header the ciphertext is bound to (it is the AAD)."""
        peer.send_seq += 1
        hdr = FRAME.pack(VERSION, ftype, kind, 0, self._s.rank, peer.rank, n, peer.send_seq, msg_id, index, count,
                         start, total)
        if enc is None or n == 0:
            data: memoryview | bytes = b""
        else:
            pieces = enc.pieces(start, start + n)
            data = pieces[0] if len(pieces) == 1 else self._buffers.gathered(pieces, n)
        tx = peer.tx
        assert tx is not None, f"no session keys for rank {peer.rank}"  # sealed frames follow the handshake
        t0 = time.perf_counter()
        tx.seal_into(peer.send_seq, data, self._s.jd + hdr, out)
        self._s.stats.seal_s += time.perf_counter() - t0
        return hdr

    def _own_frame(self, peer: Peer, ftype: int, kind: int, enc: wire.Encoded | None, msg_id: int, index: int,
                   count: int, start: int, n: int, total: int) -> np.ndarray:
        """One sealed frame (header + ciphertext) in a buffer of its own, not one of the reused slots."""
        buf = np.empty(HDR + n + TAG, dtype=np.uint8)
        view = buf.data
        view[:HDR] = self._seal_chunk(peer, ftype, kind, enc, msg_id, index, count, start, n, total, view[HDR:])
        return buf

    # -- posting (returns at once) --------------------------------------------------------------
    def _post_chunks(self, peer: Peer, kind: int, enc: wire.Encoded, total: int, count: int,
                     msg_id: int, posted: Outgoing) -> None:
        """Seal every chunk into a buffer of its own and start all their sends (see `post`)."""
        dest, chunk = peer.rank, self._s.opts.chunk_bytes
        if count > 1 and self._crypto.threads > 1:
            self._post_pipelined(peer, kind, enc, total, count, msg_id, posted)
            return
        for i in range(count):
            start = i * chunk
            buf = self._own_frame(peer, F_DATA, kind, enc, msg_id, i, count, start, min(total - start, chunk), total)
            self._posted(dest, buf, posted)

    def _post_pipelined(self, peer: Peer, kind: int, enc: wire.Encoded, total: int, count: int,
                        msg_id: int, posted: Outgoing) -> None:
        """`_post_chunks` with the sealing pool: every chunk has its own frame buffer; sequence
        numbers are taken in chunk order here and the sends start in chunk order (nothing else is
        sent in between: this never waits on MPI)."""
        dest, chunk, s = peer.rank, self._s.opts.chunk_bytes, self._s
        pool, sealer = self._crypto.pool(), _sealer(peer)
        jobs: deque[tuple[np.ndarray, Future[float]]] = deque()
        try:
            for i in range(count):
                start = i * chunk
                n = min(total - start, chunk)
                buf = np.empty(HDR + n + TAG, dtype=np.uint8)
                view = buf.data
                peer.send_seq += 1
                hdr = frame.pack(F_DATA, kind, s.rank, dest, n, peer.send_seq, msg_id, i, count, start, total)
                view[:HDR] = hdr
                pieces = enc.pieces(start, start + n)
                data = pieces[0] if len(pieces) == 1 else np.concatenate(
                    [np.frombuffer(p, dtype=np.uint8) for p in pieces]).data  # a chunk spanning tensors
                jobs.append((buf, pool.submit(seal_timed, sealer, peer.send_seq, data, s.jd + hdr, view[HDR:])))
                while len(jobs) > 2 * self._crypto.threads or (i == count - 1 and jobs):
                    buf, job = jobs.popleft()
                    s.stats.seal_s += job.result()
                    self._posted(dest, buf, posted)
        except BaseException as exc:
            wait_futures([job for _, job in jobs])
            if isinstance(exc, (ChannelError, KeyboardInterrupt, SystemExit)):
                raise
            raise ChannelError(f"sealing a message to rank {dest} failed: {exc}") from exc

    def _posted(self, dest: int, buf: np.ndarray, posted: Outgoing) -> None:
        req = self._s.transport.isend(buf.data, dest)
        self.background.append((req, buf))  # close() waits for it, then abandons it
        posted.requests.append(req)
        self._s.stats.bytes_sent += len(buf)

    # -- shared memory --------------------------------------------------------------------------
    def _via_ring(self, peer: Peer, ring: TxRing, kind: int, enc: wire.Encoded, total: int,
                  count: int, posted: Outgoing | None = None) -> None:
        """Encrypt each chunk straight into a free slot of the shared ring and send only its
        56-byte header (+ slot number) through MPI: the receiver decrypts from the ring, so the
        bytes are never copied by MPI."""
        chunk, dest = self._s.opts.chunk_bytes, peer.rank
        msg_id = peer.next_msg_id
        peer.next_msg_id += 1
        assert ring.buf is not None  # a ready ring is mapped
        buf = ring.buf.data
        for i in range(count):
            start = i * chunk
            n = min(total - start, chunk)
            slot = self._ring_slot(ring, dest)
            ring.owner[slot] = posted
            if posted is not None:
                posted.ring_slots.append((ring, slot))
            at = slot * ring.slot_bytes
            hdr = self._seal_chunk(peer, F_SHM_DATA, kind, enc, msg_id, i, count, start, n, total, buf[at:at + n + TAG])
            self.small(dest, hdr + SLOT.pack(slot))
            self._s.stats.bytes_sent += HDR + SLOT.size + n + TAG

    def _ring_slot(self, ring: TxRing, dest: int) -> int:
        """A free slot of `ring`, waiting (and receiving meanwhile) until the peer frees one."""
        if not ring.free:
            opts = self._s.opts
            backoff = polling.active(opts.spin_s, opts.backoff_max_s)
            deadline = time.monotonic() + opts.send_timeout_s
            while not ring.free:
                if self._pump():
                    backoff.reset()
                    continue
                self._s.look_for_gone()
                if dest in self._s.gone:
                    raise ChannelError(f"rank {dest} has ended")
                if time.monotonic() > deadline:
                    raise ChannelError(f"rank {dest} took no chunk from shared memory for {opts.send_timeout_s:g} s "
                                       f"(is rank {dest} alive and receiving?)")
                self.reap()
                backoff.pause()
        return ring.free.popleft()

    # -- buffers and waits ----------------------------------------------------------------------
    def wait_send(self, req: Request, dest: int) -> None:
        """Wait until MPI is done with a send, receiving meanwhile; ChannelError after `send_timeout_s`."""
        if req.test():
            return
        opts = self._s.opts
        backoff = polling.active(opts.spin_s, opts.backoff_max_s)
        deadline = time.monotonic() + opts.send_timeout_s
        while not req.test():
            # Keep receiving while we wait: a peer that is itself blocked sending to us must be
            # able to finish, or two big sends in opposite directions would deadlock.
            if self._pump():
                backoff.reset()
                continue
            self._s.look_for_gone()
            gone = dest in self._s.gone
            if gone or time.monotonic() > deadline:
                req.cancel()
                # The abandoned send may still read its buffer whenever the peer wakes up: later
                # messages must be sealed into fresh buffers, not over it.
                self._buffers.drop_slots()
                raise ChannelError(f"rank {dest} has ended" if gone else
                                   f"sending to rank {dest} did not complete within {opts.send_timeout_s:g} s "
                                   f"(is rank {dest} alive and receiving?)")
            backoff.pause()

    def plain(self, dest: int, ftype: int, body: bytes) -> None:
        """Send a plaintext frame (a handshake step or refusal)."""
        buf = frame.plain(ftype, self._s.rank, dest, body)
        self._s.stats.bytes_sent += len(buf)
        self.small(dest, buf)

    def small(self, dest: int, buf: bytes) -> None:
        """Start sending a small frame; its buffer lives on until the send completes."""
        self._small(dest, memoryview(buf), buf)

    def _small(self, dest: int, view: memoryview, keep: object) -> None:
        self.background.append((self._s.transport.isend(view, dest), keep))
        self.reap()

    def reap(self) -> None:
        """Forget the small sends that have completed."""
        bg = self.background
        while bg and bg[0][0].test():
            bg.popleft()
        if len(bg) > 64:  # a send to a busy peer at the head must not pin everything behind it
            self.background = deque(entry for entry in bg if not entry[0].test())

    def close(self, timeout: float) -> None:
        """Complete (or, after `timeout` s, cancel) outstanding sends and drop the buffers."""
        deadline = time.monotonic() + timeout
        backoff = polling.Backoff(self._s.opts.spin_s, self._s.opts.backoff_max_s)
        while self.background and time.monotonic() < deadline:
            self.reap()
            backoff.pause(deadline)
        for req, _ in self.background:
            with contextlib.suppress(Exception):  # closing: a request MPI will not cancel is left to finish
                req.cancel()
        self.background.clear()
        self._buffers.clear()
