"""Receiving: take the next frame if one has arrived, check it, open it, and put messages together.

Waiting never blocks inside MPI: `wait` polls (``Iprobe``), pacing itself with `polling.Pacer`. A
frame is checked in this order, and the first failure refuses it (see `session` for what a
refusal does): its size against the largest frame; its header (`frame.check`); its session (a
handshake step goes to `handshake`); its sequence number (strictly above the last one accepted from
its source: replays and reordering fail); what this rank takes (`admission`, at a message's first
chunk, before any buffer is reserved; the first such refusal of each peer is authenticated, so that
it is proof against the peer); its place in its message (`reassembly.check_chunk`); and its
tag (tampering, truncation, misrouting, a wrong key, or chunks spliced from another message fail).
Each chunk is decrypted straight into its slot of the message buffer, and the decoded tensors are
views into that buffer. A later chunk opened on the pool that fails its tag refuses its whole
message when the message completes.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import numpy as np

from hpcfed.comm import frame, polling
from hpcfed.comm.admission import Admission
from hpcfed.comm.api import ChannelError, Message
from hpcfed.comm.frame import F_CONFIRM, F_DATA, F_SHM_DATA, F_SHM_FREE, F_SHM_OFFER, HDR, SMALL_FRAME, TAG, Header
from hpcfed.comm.handshake import Handshake
from hpcfed.comm.reassembly import STALL_S, Assembly, PayloadPool, check_chunk, opened
from hpcfed.comm.ring import Rings
from hpcfed.comm.sealing import CryptoPool
from hpcfed.comm.sender import Sender
from hpcfed.comm.session import Peer, Session
from hpcfed.comm.transport import Request


class Receiver:
    """The receiving half of a channel."""

    def __init__(self, session: Session, pool: CryptoPool, rings: Rings, sender: Sender, handshake: Handshake,
                 admission: Admission, payloads: PayloadPool) -> None:
        self._s = session
        self._crypto = pool
        self._rings = rings
        self._sender = sender
        self._handshake = handshake
        self._admission = admission
        self.payloads = payloads
        self.assembling = False  # some peer is part-way through a multi-chunk message
        self.last_frame_at = -float("inf")  # perf_counter() when the last frame arrived
        self._rx_small = np.empty(SMALL_FRAME + HDR + TAG, dtype=np.uint8)
        self._rx_big: np.ndarray | None = None

    def wait(self, source: int | None, kinds: Collection[int] | None, timeout: float | None) -> Message | None:
        """The next message (from `source`, of one of `kinds`), or None after `timeout` s; messages
        that do not match stay in the inbox."""
        take = self._admission.take
        msg = take(source, kinds)
        if msg is not None:
            return msg
        while self.pump():  # fast path: the message is already here
            msg = take(source, kinds)
            if msg is not None:
                return msg
        if timeout == 0:
            return None
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        opts = self._s.opts
        pacer = polling.Pacer(opts.spin_s, opts.backoff_max_s, self._s.stats)
        backoff = pacer.pick(self.assembling, self.last_frame_at)
        while True:
            if self.pump():
                backoff = pacer.pick(self.assembling, self.last_frame_at)
                backoff.reset()
                msg = take(source, kinds)
                if msg is not None:
                    return msg
                continue
            if source is not None:
                peer = self._s.peers.get(source)
                if peer is not None and peer.cut_off:
                    raise ChannelError(f"rank {source} was cut off after {peer.rejects} rejected messages")
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self._sender.reap()
            backoff = pacer.settle(backoff, self.last_frame_at)
            backoff.pause(deadline)

    def _probe(self) -> tuple[int, int] | None:
        """The next frame to take. While part-received messages hold `max_assembling_bytes` or more,
        only their senders' frames are taken (K clients uploading at once are received one after
        another, not K buffers at a time); a sender silent for `STALL_S` is not waited on."""
        transport = self._s.transport
        if self.assembling:
            now = time.monotonic()
            busy = [(p.rank, p.asm) for p in self._s.peers.values() if p.asm is not None]
            if sum(asm.total for _, asm in busy) >= self._s.opts.max_assembling_bytes:
                live = [rank for rank, asm in busy if now - asm.last_at < STALL_S]
                for rank in live:
                    probe = transport.iprobe(rank)
                    if probe is not None:
                        return probe
                if live:
                    return None
        return transport.iprobe()

    def pump(self) -> bool:
        """Receive and process one frame if one has arrived; True if it did."""
        s = self._s
        s.stats.polls += 1
        probe = self._probe()
        if probe is None:
            return False
        src, n = probe
        self.last_frame_at = time.perf_counter()
        s.stats.bytes_received += n if n < (1 << 62) else 0
        peer = s.peers.get(src)
        if peer is not None and peer.cut_off:
            self._wait_recv(src, n, s.transport.discard(src))
            s.count_cut_off_frame()
            return True
        max_frame = s.opts.max_frame
        if n > max_frame:
            self._wait_recv(src, n, s.transport.discard(src))
            s.reject(src, "oversize frame", f"{n}-byte frame exceeds the {max_frame}-byte limit")
            return True
        view = self._rx_view(n)
        if not self._wait_recv(src, n, s.transport.irecv_into(src, view)):
            self._retire_rx_buffers()  # MPI may still write into `view`
            return True
        try:
            self._on_frame(src, view)
        except ChannelError:
            raise
        except Exception as exc:
            self.drop_assembly(src)
            s.reject(src, "frame handling failed", f"{type(exc).__name__}: {str(exc)[:200]}")
        return True

    def _rx_view(self, n: int) -> memoryview:
        if n <= len(self._rx_small):
            return self._rx_small.data[:n]
        if self._crypto.threads > 1:
            return self._crypto.rx_buffer(n, self._s.opts.max_frame)
        if self._rx_big is None:
            self._rx_big = np.empty(self._s.opts.max_frame, dtype=np.uint8)
        return self._rx_big.data[:n]

    def _wait_recv(self, src: int, n: int, req: Request) -> bool:
        """Wait for the frame `iprobe` announced. Past MPI's eager limit only its envelope has
        arrived, and a sender that dies (or stalls) before the rest leaves the receive pending
        for ever: it is given up, with the message it belonged to, once the sender is known to
        have ended (`peer_gone`) or after `send_timeout_s`. Whether the frame arrived."""
        if req.test():  # the usual case, every frame: no pacing to set up
            return True
        opts = self._s.opts
        backoff = polling.Backoff(max(opts.spin_s, polling.ACTIVE_SPIN_S), opts.backoff_max_s)  # it is on its way
        deadline = time.monotonic() + opts.send_timeout_s
        while not req.test():
            self._s.look_for_gone()
            gone = src in self._s.gone
            if gone or time.monotonic() > deadline:
                req.cancel()
                self.drop_assembly(src)
                self._s.stats.abandoned_frames += 1
                self._s.log(f"a {n}-byte frame from rank {src} was given up: "
                            + ("its sender ended before all of it arrived" if gone else
                               f"it did not arrive within {opts.send_timeout_s:g} s (is rank {src} alive?)"))
                return False
            backoff.pause()
        return True

    def _retire_rx_buffers(self) -> None:
        """A receive was given up and MPI may still write into its buffer: never use it again."""
        self._rx_small = np.empty_like(self._rx_small)
        self._rx_big = None
        self._crypto.retire_rx_buffers()

    def _on_frame(self, src: int, view: memoryview) -> None:
        h = frame.check(view, src, self._s.rank)
        if not isinstance(h, Header):
            self._s.reject(src, *h)
            return
        if h.ftype in frame.HANDSHAKE_TYPES:
            self._handshake.on_frame(src, h.ftype, view[HDR:])
            return
        if h.ftype == F_SHM_FREE:
            self._rings.on_free(src, view)
            return
        if h.ftype != F_SHM_DATA:
            pooled = len(view) > len(self._rx_small) and self._crypto.threads > 1
            self._on_sealed(src, view, view[HDR:], h, pooled=pooled)
            return
        got = self._rings.chunk(src, view, h.length)
        if got is None:
            return
        ciphertext, slot = got
        self._s.stats.bytes_received += h.length + TAG  # the ciphertext read from the ring (the sender counts it too)
        try:
            self._on_sealed(src, view, ciphertext, h)
        finally:  # the slot has been read (or refused): the sender may refill it
            self._sender.small(src, frame.slot_credit(self._s.rank, src, slot))

    def _on_sealed(self, src: int, view: memoryview, ciphertext: memoryview, h: Header, *,
                   pooled: bool = False) -> None:
        """`pooled`: the frame sits in one of the rotating receive buffers, so a later chunk of a
        message may be opened on the pool while this thread receives the next one."""
        s = self._s
        peer = s.peers.get(src)
        if peer is None or peer.rx is None:
            s.reject(src, "no session", "encrypted frame before a secure handshake")
            return
        _, ftype, kind, _, _, _, length, seq, msg_id, index, count, offset, total = h
        if seq <= peer.last_seq:
            s.reject(src, "replayed or reordered frame",
                     f"sequence number {seq}, but {peer.last_seq} was already accepted")
            return
        if ftype in (F_DATA, F_SHM_DATA) and peer.state == "ready":
            if index > 0 and msg_id == peer.skip_msg:
                s.stats.dropped_chunks += 1  # the rest of a message refused at its first chunk
                return
            refusal = self._admission.refusal(src, kind, total) if index == 0 else None
            if refusal is not None:  # before any buffer is reserved
                peer.skip_msg = msg_id
                self._refuse_first_chunk(src, peer, view, ciphertext, h, refusal)
                return
        problem = check_chunk(peer.asm, ftype, msg_id, index, count, offset, length, total, s.opts.max_message_bytes)
        if problem:
            s.reject(src, *problem)
            return
        # Decrypt straight into the message buffer; the first chunk of a multi-chunk message goes
        # to scratch first so that no large buffer is allocated before the frame authenticates.
        if index == 0:
            out = self.payloads.scratch0(length) if count > 1 else np.empty(length, dtype=np.uint8)
        else:
            asm = peer.asm
            assert asm is not None  # check_chunk refuses a later chunk without its message
            out = asm.payload[offset:offset + length]
            if pooled and ftype == F_DATA and peer.state == "ready":
                aad = s.jd + bytes(view[:HDR])
                asm.opening.append(self._crypto.open_later(peer.rx, seq, ciphertext, aad, out.data))
                peer.last_seq = seq
                self._chunk_taken(src, peer, h)
                return
        t0 = time.perf_counter()
        authentic = peer.rx.open_into(seq, ciphertext, s.jd + bytes(view[:HDR]), out.data)
        s.stats.open_s += time.perf_counter() - t0
        if not authentic:
            s.reject(src, "authentication failed",
                     f"frame {seq} does not authenticate (tampered, truncated, misrouted or wrong key)")
            return
        peer.last_seq = seq
        if ftype == F_CONFIRM:
            self._handshake.on_confirm(peer, total)
            return
        if peer.state != "ready":
            s.reject(src, "unexpected handshake frame", "data before the handshake was confirmed")
            return
        if ftype == F_SHM_OFFER:
            answer = self._rings.on_offer(src, bytes(out))
            if answer is not None:
                self._sender.control(peer, frame.F_SHM_ACCEPT, answer)
            return
        if ftype == frame.F_SHM_ACCEPT:
            self._rings.on_answer(src, bytes(out))
            return
        if index == 0:
            self._first_chunk(src, peer, h, out)
            if count == 1:
                return
        self._chunk_taken(src, peer, h)

    def _refuse_first_chunk(self, src: int, peer: Peer, view: memoryview, ciphertext: memoryview, h: Header,
                            refusal: frame.Refusal) -> None:
        """A first chunk of a message this rank does not take (`admission`). Its kind and declared
        size are in the authenticated header, so the peer's first such chunk is opened (one chunk,
        into the reused first-chunk scratch): authentic, the refusal is the peer's own protocol
        violation, and the owner may hold it against the peer (`SecureChannel.on_reject`); not, it
        is refused as unauthenticated bytes that nobody can be blamed for. Once a peer has one on
        record, its later refusals are dropped unread: one proof is enough, and a flood costs no
        decryption. So a refusal of these kinds is reported for a peer only after an authentic one."""
        s = self._s
        if not peer.violated:
            scratch = self.payloads.scratch0(h.length)
            t0 = time.perf_counter()
            authentic = peer.rx is not None and peer.rx.open_into(h.seq, ciphertext, s.jd + bytes(view[:HDR]),
                                                                  scratch.data)
            s.stats.open_s += time.perf_counter() - t0
            if not authentic:
                s.reject(src, "authentication failed",
                         f"frame {h.seq} does not authenticate (tampered, truncated, misrouted or wrong key)")
                return
            peer.last_seq = h.seq
            peer.violated = True
        s.reject(src, *refusal)

    def _first_chunk(self, src: int, peer: Peer, h: Header, out: np.ndarray) -> None:
        """An authenticated first chunk: a whole message is delivered, a longer one gets its buffer.
        A message the peer left unfinished is refused."""
        if peer.asm is not None:
            asm = peer.asm
            self.drop_assembly(src)
            self._s.reject(src, "incomplete message abandoned",
                           f"message {asm.msg_id} stopped after {asm.next_index} of {asm.count} chunks")
        if h.chunks == 1:
            self._admission.deliver(src, h.kind, out)
            peer.asm = None
            return
        payload = self.payloads.buffer(h.total)
        payload[:h.length] = out
        peer.asm = Assembly(h.msg_id, h.kind, h.total, h.chunks, payload)
        self.assembling = True

    def _chunk_taken(self, src: int, peer: Peer, h: Header) -> None:
        """Record a chunk of the peer's message; deliver the message with its last chunk, once every
        chunk opened on the pool has authenticated."""
        asm = peer.asm
        assert asm is not None
        if not asm.took(h.chunk, h.offset, h.length, h.seq):
            return
        peer.asm = None
        self.assembling = any(p.asm is not None for p in self._s.peers.values())
        if not opened(asm, self._s.stats):
            self.payloads.release(asm.payload)
            self._s.reject(src, "authentication failed", f"a chunk of message {asm.msg_id} does not authenticate "
                                                         f"(tampered, truncated, misrouted or wrong key)")
            return
        self._admission.deliver(src, h.kind, asm.payload)

    def drop_assembly(self, src: int) -> None:
        """Forget the message `src` is part-way through (its chunks being opened finish first)."""
        peer = self._s.peers.get(src)
        if peer is not None and peer.asm is not None:
            opened(peer.asm, self._s.stats)  # the pool must be done writing into the buffer before it goes
            self.payloads.release(peer.asm.payload)
            peer.asm = None
            self.assembling = any(p.asm is not None for p in self._s.peers.values())

    def close(self) -> None:
        """Drop the receive buffers."""
        self._rx_big = None
        self.payloads.clear()
