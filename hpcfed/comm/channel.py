"""SecureChannel: authenticated, encrypted, chunked messages between MPI ranks.

A message is (kind 0..255, JSON header, named ndarrays), laid out by `wire` and cut into frames of
at most `chunk_bytes`. Every frame is::

    offset  size  field (little-endian)
    0       1     protocol version (1)
    1       1     frame type: 1 DATA, 2 HELLO, 3 REPLY, 4 FINISH, 5 CONFIRM, 6 REFUSE
    2       1     message kind (0..255; 0 for handshake frames)
    3       1     flags (0)
    4       4     source rank
    8       4     destination rank
    12      4     length: ciphertext bytes in this frame (plaintext bytes for handshake frames)
    16      8     sequence number (per direction, strictly increasing; 0 for plaintext frames)
    24      8     message id (per direction)
    32      4     chunk index
    36      4     chunk count
    40      8     offset of this chunk in the message
    48      8     total message length
    56      ...   AES-256-GCM ciphertext (length bytes) + 16-byte tag   | handshake body

The associated data of every sealed frame is ``job_digest (16 bytes) | the 56 header bytes``, and
the nonce is ``direction | sequence number`` (see `crypto`). So a frame authenticates only in this
job, from this source to this destination, with this kind, at this position of this message:
tampering, truncation, misrouting, a wrong key, or splicing chunks of different messages fail the
tag; replays and reordering fail the sequence check (a frame must carry a sequence number above the
last one accepted from its source). A frame that fails is dropped, counted in `stats.rejected` and
`stats.rejected_by_rank`, logged with the rank, and never raises; a rank with `max_rejects`
rejections is cut off.

Sending encrypts chunk n+1 (straight from the tensors' memory) while chunk n is in flight. Receiving
decrypts each chunk straight into its slot of the message buffer, and the decoded tensors are views
into that buffer. With `crypto_threads` > 1 both sides use a pool of threads: a message's chunks
are sealed in parallel, and every chunk after the first is opened on a pool thread while the next
one is received (the first is opened at once, so nothing large is reserved for a frame that does
not authenticate; a later chunk that fails its tag refuses the whole message when it completes).
Waiting never blocks inside MPI: it polls (``Iprobe`` / ``Test``), spinning for
`spin_s` and then sleeping with a doubling back-off up to `backoff_max_s`, so an idle rank uses
well under 20% of a core. While a send waits, incoming frames are still received, so two ranks
sending big messages to each other never deadlock.

A `SecureChannel` is not thread-safe; use one per rank and call it from one thread.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcfed.comm import crypto, wire
from hpcfed.comm.api import ChannelError, Message
from hpcfed.comm.transport import Request, Transport

VERSION = crypto.PROTOCOL_VERSION
FRAME = struct.Struct("<BBBBIIIQQIIQQ")
HDR = FRAME.size  # 56
TAG = crypto.TAG_BYTES
F_DATA, F_HELLO, F_REPLY, F_FINISH, F_CONFIRM, F_REFUSE = 1, 2, 3, 4, 5, 6
F_SHM_OFFER, F_SHM_ACCEPT, F_SHM_DATA, F_SHM_FREE = 7, 8, 9, 10
_HANDSHAKE_TYPES = {F_HELLO, F_REPLY, F_FINISH, F_REFUSE}
_SEALED_TYPES = {F_DATA, F_CONFIRM, F_SHM_OFFER, F_SHM_ACCEPT, F_SHM_DATA}
_SLOT = struct.Struct("<I")
_OFFER = struct.Struct("<II")  # slots, bytes per slot; then the segment name
_RING_SLOTS = 4
_MAX_PLAIN_FRAME = 1024  # handshake bodies and refusal texts
_SMALL_FRAME = 64 << 10  # frames this small have arrived whole when probed (MPI eager protocol)
_LOG_FIRST = 10  # log the first rejections of each rank in full, then every 1000th
_ACTIVE_SPIN_S = 2e-3  # spin while a transfer is under way (a 4 MiB chunk takes ~1 ms) ...
_ACTIVE_SLEEP_S = 2e-4  # ... and then sleep at most this long between polls
# A rank that received a frame less than _CONVERSATION_S ago is in a conversation: its peer's next
# message is likely within a millisecond, so it sleeps at most _CONVERSATION_SLEEP_S between polls.
# Without this, one late reply (a preempted peer) could tip a ping-pong into a stable slow state
# where each side is deep in its back-off sleep whenever the other's message lands (~200 round
# trips/s instead of thousands).
_CONVERSATION_S = 0.05
_STALL_S = 1.0  # a part-received message whose sender has been silent this long no longer holds others back
_CONVERSATION_SLEEP_S = 5e-5


def default_crypto_threads() -> int:
    """The cores this process may run on, at most 8 (sealing threads beyond that buy nothing),
    shared among the ranks the MPI launcher placed on this node (MPICH's MPI_LOCALNRANKS, Open
    MPI's OMPI_COMM_WORLD_LOCAL_SIZE): ranks that share two cores gain nothing from more threads."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or "1"
    if local.isdigit() and int(local) > 1 and cores > 1:
        cores = max(1, cores // int(local))
    return max(1, min(8, cores))


def _seal_timed(sealer: crypto.Sealer, seq: int, data: memoryview | bytes, aad: bytes, out: memoryview) -> float:
    """Seal one chunk (on a pool thread); return the seconds it took."""
    t0 = time.perf_counter()
    sealer.seal_into(seq, data, aad, out)
    return time.perf_counter() - t0


def _open_timed(opener: crypto.Sealer, seq: int, data: memoryview, aad: bytes, out: memoryview) -> float:
    """Open one chunk (on a pool thread); the seconds it took, or -1 when it does not authenticate."""
    t0 = time.perf_counter()
    if not opener.open_into(seq, data, aad, out):
        return -1.0
    return time.perf_counter() - t0


def _free_refs() -> int:
    """References an unused pooled buffer has inside `_payload_buffer`'s loop (interpreter-specific)."""
    for buf in [np.empty(1, dtype=np.uint8)]:
        return sys.getrefcount(buf)
    return 0


_FREE_REFS = _free_refs()


class Outgoing:
    """A message `SecureChannel.post`ed: `done()` once the peer has taken all of it."""

    __slots__ = ("dest", "posted_at", "requests", "ring_slots")

    def __init__(self, dest: int) -> None:
        self.dest = dest
        self.requests: list[Request] = []
        self.ring_slots: list[tuple[_TxRing, int]] = []  # shared-memory slots it still holds
        self.posted_at = time.monotonic()

    def done(self) -> bool:
        """Whether the peer has taken the message (for shared memory: has freed its slots)."""
        if not all(req.test() for req in self.requests):
            return False
        return all(ring.owner[slot] is not self for ring, slot in self.ring_slots)


@dataclass
class ChannelStats:
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0  # frame bytes put on the wire
    bytes_received: int = 0  # frame bytes taken off the wire, rejected ones included
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> frames
    rejected_by_rank: dict[int, int] = field(default_factory=dict)  # rank -> frames
    seal_s: float = 0.0  # seconds spent encrypting frames (this thread's wall time in AES-GCM)
    open_s: float = 0.0  # seconds spent authenticating and decrypting frames
    polls: int = 0  # Iprobe calls: how often the channel looked for a frame
    idle_sleeps: int = 0  # back-off sleeps while waiting (an idle rank sleeps, it does not spin)
    dropped_chunks: int = 0  # later chunks of a message refused at its first chunk, dropped unread

    def as_dict(self) -> dict[str, Any]:
        return {"messages_sent": self.messages_sent, "messages_received": self.messages_received,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "seal_s": self.seal_s, "open_s": self.open_s,
                "polls": self.polls, "idle_sleeps": self.idle_sleeps, "dropped_chunks": self.dropped_chunks,
                "rejected": dict(self.rejected),
                "rejected_by_rank": {str(k): v for k, v in sorted(self.rejected_by_rank.items())}}


class _Assembly:
    __slots__ = (
        "count",
        "filled",
        "kind",
        "last_at",
        "last_seq",
        "msg_id",
        "next_index",
        "opening",
        "payload",
        "total",
    )

    def __init__(self, msg_id: int, kind: int, total: int, count: int, payload: np.ndarray) -> None:
        self.msg_id, self.kind, self.total, self.count = msg_id, kind, total, count
        self.next_index, self.filled, self.payload, self.last_seq = 0, 0, payload, 0
        self.last_at = time.monotonic()  # when its last chunk came: a stalled sender is not waited on
        self.opening: list[Future[float]] = []  # chunks being opened on the pool (write into payload)


class _Peer:
    __slots__ = (
        "asm",
        "cut_off",
        "error",
        "hs",
        "identity",
        "last_seq",
        "next_msg_id",
        "queued",
        "queued_bytes",
        "rank",
        "rejects",
        "role",
        "rx",
        "send_seq",
        "skip_msg",
        "state",
        "tx",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.role = ""  # "initiator" (this rank said HELLO) or "responder"
        self.state = "none"  # none|wait_hello|hello_sent|reply_sent|finish_sent|ready|failed
        self.hs: crypto.Initiator | crypto.Responder | None = None
        self.tx: crypto.Sealer | None = None
        self.rx: crypto.Sealer | None = None
        self.send_seq = 0
        self.last_seq = 0
        self.next_msg_id = 0
        self.asm: _Assembly | None = None
        self.rejects = 0
        self.cut_off = False
        self.error = ""
        self.identity = ""
        self.skip_msg = -1  # a message refused at its first chunk: its later chunks are dropped unread
        self.queued = 0  # messages of this peer in the inbox ...
        self.queued_bytes = 0  # ... and their bundle bytes


class _TxRing:
    """Shared memory this rank encrypts chunks into for one peer on the same node."""

    __slots__ = ("buf", "free", "name", "nslots", "owner", "slot_bytes", "state")

    def __init__(self, name: str, buf: np.ndarray | None, nslots: int, slot_bytes: int, state: str) -> None:
        self.name, self.buf, self.nslots, self.slot_bytes = name, buf, nslots, slot_bytes
        self.free: deque[int] = deque(range(nslots))
        self.owner: list[Outgoing | None] = [None] * nslots  # the posted message a slot holds
        self.state = state  # offered | ready | declined


class _RxRing:
    """A peer's shared memory that this rank decrypts chunks from."""

    __slots__ = ("buf", "name", "nslots", "slot_bytes")

    def __init__(self, name: str, buf: np.ndarray, nslots: int, slot_bytes: int) -> None:
        self.name, self.buf, self.nslots, self.slot_bytes = name, buf, nslots, slot_bytes


_yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))


class _Backoff:
    """Spin for `spin_s` (yielding the core each time), then sleep 10 us, 20 us, ... up to `max_s` between polls."""

    __slots__ = ("max_s", "sleep", "spin_s", "stats", "t0")

    def __init__(self, spin_s: float, max_s: float, stats: ChannelStats | None = None) -> None:
        self.spin_s, self.max_s, self.stats = spin_s, max_s, stats
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.sleep = 1e-5

    def pause(self, deadline: float | None = None) -> None:
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


class SecureChannel:
    """Encrypted, authenticated messages between this rank and its peers (see the module doc)."""

    def __init__(self, transport: Transport, credentials: crypto.Credentials, job_id: bytes, *,
                 chunk_bytes: int = 4 << 20, limits: wire.WireLimits = wire.WireLimits(),
                 max_message_bytes: int = 8 << 30, backoff_max_s: float = 0.005, max_rejects: int = 10000,
                 log: Callable[[str], None] | None = None, spin_s: float = 5e-4,
                 send_timeout_s: float = 600.0, shared_memory: bool = True,
                 max_assembling_bytes: int = 64 << 20, shm_budget_bytes: int = 64 << 20,
                 inbox_max_messages: int = 1024, inbox_max_bytes: int = 16 << 30,
                 crypto_threads: int | None = None) -> None:
        if not 4096 <= chunk_bytes <= crypto.MAX_AEAD_INPUT - HDR - TAG:
            raise ValueError(f"comm.chunk_bytes={chunk_bytes}: use 4096 .. {1 << 30} (4 MiB is a good default)")
        if max_message_bytes < 1:
            raise ValueError(f"comm.max_message_bytes={max_message_bytes} must be positive")
        if not 0 < backoff_max_s <= 1:
            raise ValueError(f"comm.backoff_max_s={backoff_max_s}: use a value in (0, 1] seconds")
        if max_rejects < 1:
            raise ValueError(f"security.max_rejects={max_rejects} must be at least 1")
        self._sealers: ThreadPoolExecutor | None = None
        # With the pool: big frames land in these in turn; a buffer is reused once its chunk is opened.
        self._rx_bigs: list[np.ndarray] = []
        self._rx_opening: list[Future[float] | None] = []
        self._rx_turn = 0
        self.set_crypto_threads(crypto_threads)
        self.transport = transport
        self.credentials = credentials
        self.job_id = bytes(job_id)
        self.rank: int = transport.rank
        self.size: int = transport.size
        self.chunk_bytes = chunk_bytes
        self.limits = limits
        self.max_message_bytes = min(max_message_bytes, limits.max_total_bytes)
        self.max_rejects = max_rejects
        self.backoff_max_s = backoff_max_s
        self.spin_s = spin_s
        self.send_timeout_s = send_timeout_s
        # Part-received messages beyond this many bytes: finish them before taking another sender's
        # first chunk, so a server's memory does not grow with the number of clients uploading at once.
        self.max_assembling_bytes = max_assembling_bytes
        # Shared-memory rings this rank maps (sending and receiving) stay under this many bytes: a
        # server with K clients on its node would otherwise map 2 K rings; the rest go through MPI.
        self.shm_budget_bytes = shm_budget_bytes
        # Optional: called with each message as it is decoded; returning True consumes it instead of
        # queueing it. A server sending K models uses it to fold uploads that complete meanwhile, so
        # they do not pile up in memory. It must not call the channel.
        self.on_message: Callable[[Message], bool] | None = None
        self.shared_memory = shared_memory and hasattr(transport, "shm_create")
        self.stats = ChannelStats()
        self.peers: list[int] = []
        self._log = log or (lambda text: None)
        self._jd = crypto.job_digest(self.job_id)
        self._peer: dict[int, _Peer] = {}
        self._inbox: deque[Message] = deque()
        self._background: deque[tuple[Request, Any]] = deque()  # small sends whose buffers must live on
        self._tx_rings: dict[int, _TxRing] = {}
        self._rx_rings: dict[int, _RxRing] = {}
        self._max_frame = HDR + chunk_bytes + TAG
        self._rx_small = np.empty(_SMALL_FRAME + HDR + TAG, dtype=np.uint8)
        self._rx_big: np.ndarray | None = None
        self._tx_slots: list[np.ndarray] = []
        self._gather: np.ndarray | None = None
        self._gathers: list[np.ndarray] = []  # one per slot of the parallel sealing path
        self._plain0: np.ndarray | None = None
        self._pool: list[np.ndarray] = []  # multi-chunk message buffers, recycled when free
        self._assembling = False  # some peer is part-way through a multi-chunk message
        self._last_frame_at = -float("inf")  # perf_counter() when the last frame arrived
        self._closed = False
        # What this rank accepts (see `expect`): None = every kind from every peer.
        self._accept: dict[int, frozenset[int]] | frozenset[int] | None = None
        self._kind_bytes: dict[int, int] = {}
        self.inbox_max_messages = inbox_max_messages
        self.inbox_max_bytes = inbox_max_bytes

    def set_crypto_threads(self, threads: int | None) -> None:
        """Seal a big message's chunks with this many threads at once (AES-GCM releases the GIL);
        None: the cores available, at most 8. The pool starts with the first such message and is
        joined here and by close()."""
        if threads is None:
            threads = default_crypto_threads()
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ValueError(f"comm.crypto_threads={threads!r}: use an integer in 1..64 "
                             f"(or leave it out for the cores available, at most 8)")
        if self._sealers is not None:
            self._sealers.shutdown(wait=True)  # chunks being opened finish; their results stay readable
            self._sealers = None
        self._rx_bigs.clear()
        self._rx_opening.clear()
        self._rx_turn = 0
        self.crypto_threads = threads

    def _crypto_pool(self) -> ThreadPoolExecutor:
        """The threads that seal and open big messages' chunks (started on first use)."""
        if self._sealers is None:
            self._sealers = ThreadPoolExecutor(max_workers=self.crypto_threads,
                                               thread_name_prefix=f"hpcfed-crypto{self.rank}")
        return self._sealers

    # -- what this rank accepts -------------------------------------------------------------------
    def expect(self, kinds: Collection[int] | Mapping[int, Collection[int]] | None,
               max_bytes: Mapping[int, int] | None = None, *, inbox_max_messages: int | None = None,
               inbox_max_bytes: int | None = None) -> None:
        """Declare what this rank accepts; anything else is dropped on arrival and counted.

        `kinds`: the message kinds accepted from every peer, or {source rank: kinds} (a rank not
        named may send nothing), or None for everything. `max_bytes`: {kind: largest bundle a
        message of that kind may declare}; a first chunk declaring more is refused before any
        buffer is reserved, and the rest of that message is dropped unread. The inbox bounds are
        per peer: a message beyond them is dropped, not buffered."""
        if kinds is None:
            self._accept = None
        elif isinstance(kinds, Mapping):
            self._accept = {int(r): frozenset(int(k) for k in ks) for r, ks in kinds.items()}
        else:
            self._accept = frozenset(int(k) for k in kinds)
        for kind, n in (max_bytes or {}).items():
            if int(n) < 1:
                raise ValueError(f"expect: max_bytes[{kind}]={n} must be positive")
        self._kind_bytes = {int(k): int(n) for k, n in (max_bytes or {}).items()}
        if inbox_max_messages is not None:
            self.inbox_max_messages = inbox_max_messages
        if inbox_max_bytes is not None:
            self.inbox_max_bytes = inbox_max_bytes

    def _refusal(self, src: int, kind: int, total: int) -> tuple[str, str] | None:
        """Why a data message of `kind` and `total` bytes from `src` is not taken (None: taken)."""
        accept = self._accept
        if accept is not None:
            allowed = accept if isinstance(accept, frozenset) else accept.get(src, frozenset())
            if kind not in allowed:
                return "unsolicited kind", f"message kind {kind}, which this rank does not take from rank {src}"
        limit = self._kind_bytes.get(kind)
        if limit is not None and total > limit:
            return "message too large for its kind", f"kind {kind} declares {total} bytes; at most {limit} expected"
        return None

    # -- handshake --------------------------------------------------------------------------------
    def connect(self, peers: Collection[int], timeout: float, *, require_all: bool = True) -> None:
        """Authenticate with each peer (rank 0 answers, the others initiate). Afterwards
        `self.peers` lists the peers with a session. Raises ChannelError naming the ranks that
        did not answer within `timeout` s, or (with `require_all`) that failed authentication."""
        todo = []
        for p in sorted(set(int(x) for x in peers)):
            if p == self.rank or not 0 <= p < self.size:
                raise ValueError(f"connect: rank {p} is not another rank of this {self.size}-rank job")
            peer = self._peer_of(p)
            if peer.state == "ready":
                continue
            if peer.state != "none":
                raise ChannelError(f"rank {p}: a handshake is already under way or failed ({peer.state})")
            if self.rank < p:
                peer.role, peer.state = "responder", "wait_hello"
                peer.hs = crypto.Responder(self.credentials, self.job_id, self.rank, p)
            else:
                peer.role, peer.state = "initiator", "hello_sent"
                hs = crypto.Initiator(self.credentials, self.job_id, self.rank, p)
                peer.hs = hs
                self._send_plain(p, F_HELLO, hs.hello)
            todo.append(peer)
        deadline = time.monotonic() + timeout
        backoff = _Backoff(self.spin_s, self.backoff_max_s)
        while any(p.state not in ("ready", "failed") for p in todo):
            if self._pump():
                backoff.reset()
                continue
            if time.monotonic() >= deadline:
                break
            self._reap_background()
            backoff.pause(deadline)
        self.peers = sorted(r for r, p in self._peer.items() if p.state == "ready")
        silent = [p.rank for p in todo if p.state not in ("ready", "failed")]
        failed = [p for p in todo if p.state == "failed"]
        problems = [p.error for p in failed] if require_all else []
        if silent:
            problems.append(f"rank(s) {', '.join(map(str, silent))} did not complete the secure handshake within "
                            f"{timeout:g} s (not started, crashed, or using another job id)")
        if problems:
            raise ChannelError("; ".join(problems))

    def _on_handshake(self, src: int, ftype: int, body: memoryview) -> None:
        peer = self._peer.get(src)
        state = peer.state if peer else "none"
        expected = {F_HELLO: "wait_hello", F_REPLY: "hello_sent", F_FINISH: "reply_sent"}
        if ftype == F_REFUSE:
            if peer is None or state in ("none", "ready", "failed"):
                self._reject(src, "unexpected handshake frame", "a refusal outside a handshake")
                return
            text = bytes(body).decode("utf-8", "replace")[:300].replace("\n", " ")
            peer.state, peer.error = "failed", f"rank {src} refused the handshake: {text}"
            self._log(f"secure handshake with rank {src} failed: rank {src} refused: {text}")
            return
        if peer is None or state != expected[ftype]:
            self._reject(src, "unexpected handshake frame",
                         f"handshake frame type {ftype} while the session is '{state}'")
            return
        try:
            if ftype == F_HELLO:
                reply = peer.hs.on_hello(bytes(body))  # type: ignore[union-attr]
                self._send_plain(src, F_REPLY, reply)
                peer.state = "reply_sent"
            elif ftype == F_REPLY:
                finish, keys = peer.hs.on_reply(bytes(body))  # type: ignore[union-attr]
                self._install(peer, keys)
                self._send_plain(src, F_FINISH, finish)
                peer.state = "finish_sent"
            else:  # F_FINISH
                keys = peer.hs.on_finish(bytes(body))  # type: ignore[union-attr]
                twin = [p.rank for p in self._peer.values()
                        if p is not peer and keys.peer_identity != "psk" and p.identity == keys.peer_identity]
                if twin:
                    raise crypto.HandshakeError(f"rank {src} presented identity {keys.peer_identity}, which rank "
                                                f"{twin[0]} already holds; one site, one key, one rank")
                self._install(peer, keys)
                peer.state = "ready"
                self._send_sealed_message(peer, F_CONFIRM, 0, None)
        except crypto.HandshakeError as exc:
            peer.state, peer.error = "failed", f"rank {src} failed the secure handshake: {exc}"
            peer.hs = None
            self._reject(src, "handshake failed", str(exc))
            self._send_plain(src, F_REFUSE, str(exc).encode("utf-8")[:_MAX_PLAIN_FRAME])

    def identity(self, rank: int) -> str:
        """The fingerprint of the identity key `rank` authenticated with ("psk" in psk mode)."""
        peer = self._peer.get(rank)
        return peer.identity if peer is not None else ""

    def _install(self, peer: _Peer, keys: crypto.SessionKeys) -> None:
        peer.tx, peer.rx, peer.identity = keys.send, keys.recv, keys.peer_identity
        peer.hs = None

    # -- sending ----------------------------------------------------------------------------------
    def send(self, dest: int, kind: int, header: dict, tensors: Mapping[str, Any] | None = None) -> None:
        """Encrypt and send one message; returns when `tensors` may be modified again."""
        peer, enc = self._prepare(dest, kind, header, tensors)
        self._send_sealed_message(peer, F_DATA, kind, enc)
        self.stats.messages_sent += 1

    def post(self, dest: int, kind: int, header: dict, tensors: Mapping[str, Any] | None = None) -> Outgoing:
        """Encrypt one message into buffers of its own and start sending it; return at once.

        `send` waits until the peer has taken a large message, and a peer busy computing takes
        nothing: a server that answers a fast client must not wait for a slow one. The returned
        `Outgoing` says when the peer has taken the message; the channel keeps its buffers alive
        until then (or until `close`)."""
        peer, enc = self._prepare(dest, kind, header, tensors)
        out = Outgoing(dest)
        self._send_sealed_message(peer, F_DATA, kind, enc, posted=out)
        self.stats.messages_sent += 1
        return out

    def _prepare(self, dest: int, kind: int, header: dict,
                 tensors: Mapping[str, Any] | None) -> tuple[_Peer, wire.Encoded]:
        if not isinstance(kind, int) or not 0 <= kind <= 255:
            raise ValueError(f"message kind {kind!r} must be an int in 0..255")
        peer = self._peer.get(dest)
        if peer is None or peer.state != "ready":
            raise ChannelError(f"no secure session with rank {dest}; connect() first"
                               + (f" ({peer.error})" if peer is not None and peer.error else ""))
        enc = wire.prepare(header, tensors, self.limits)
        if enc.total > self.max_message_bytes:
            raise ValueError(f"message to rank {dest} is {enc.total} bytes; comm.max_message_bytes is "
                             f"{self.max_message_bytes}")
        return peer, enc

    def _slot(self, i: int, need: int) -> memoryview:
        while len(self._tx_slots) <= i:
            self._tx_slots.append(np.empty(0, dtype=np.uint8))
        if len(self._tx_slots[i]) < need:
            self._tx_slots[i] = np.empty(max(need, min(self._max_frame, 1 << 16)), dtype=np.uint8)
        return memoryview(self._tx_slots[i])

    def _send_sealed_message(self, peer: _Peer, ftype: int, kind: int, enc: wire.Encoded | None,
                             posted: Outgoing | None = None) -> None:
        total = enc.total if enc is not None else 0
        chunk = self.chunk_bytes
        count = max(1, -(-total // chunk))
        dest = peer.rank
        if ftype == F_DATA and count > 1 and self.shared_memory:
            ring = self._tx_rings.get(dest)
            if ring is None:
                self._offer_ring(peer)  # this message still goes through MPI; later ones may not
            elif ring.state == "ready" and (posted is None or len(ring.free) >= count):
                self._send_via_ring(peer, ring, kind, enc, total, count, posted)  # type: ignore[arg-type]
                return
        msg_id = peer.next_msg_id
        peer.next_msg_id += 1
        if ftype != F_DATA:
            # A control message (handshake confirmation, shared-memory offer/answer) may be sent
            # from inside another send's wait: give it its own buffer, never the slots in flight.
            frame = self._own_frame(peer, ftype, kind, enc, msg_id, 0, 1, 0, total, total)
            self.stats.bytes_sent += len(frame)
            self._send_small(dest, frame)  # type: ignore[arg-type]
            return
        if posted is not None:
            self._post_chunks(peer, kind, enc, total, count, msg_id, posted)
            return
        if count > 1 and self.crypto_threads > 1:
            self._send_pipelined(peer, kind, enc, total, count, msg_id)  # type: ignore[arg-type]
            return
        inflight: deque[Request] = deque()
        nslots = 1 if count == 1 else 3  # three buffers: encrypt one while two are in flight
        for i in range(count):
            start = i * chunk
            n = min(total - start, chunk)
            if len(inflight) == nslots:
                self._wait_send(inflight.popleft(), dest)
            buf = self._slot(i % nslots, HDR + n + TAG)
            buf[:HDR] = self._seal_chunk(peer, ftype, kind, enc, msg_id, i, count, start, n, total,
                                         buf[HDR:HDR + n + TAG])
            inflight.append(self.transport.isend(buf[:HDR + n + TAG], dest))
            self.stats.bytes_sent += HDR + n + TAG
            for req in inflight:  # nudge MPI's progress on the chunks already out
                req.test()
        while inflight:
            self._wait_send(inflight.popleft(), dest)

    def _send_pipelined(self, peer: _Peer, kind: int, enc: wire.Encoded, total: int, count: int,
                        msg_id: int) -> None:
        """Send a multi-chunk message with `crypto_threads` threads sealing chunks while earlier
        chunks are in flight. Memory: 2 x threads reused chunk buffers (+ gather buffers).

        Sequence numbers are taken in chunk order here, on the calling thread, exactly as the serial
        path does. Every chunk sealed is handed to MPI before this thread waits on a send (which
        receives meanwhile and may send a control frame to this peer with the next sequence
        number): so frames still leave in sequence order."""
        dest, chunk, threads = peer.rank, self.chunk_bytes, self.crypto_threads
        pool = self._crypto_pool()
        nslots = 2 * threads
        free: deque[int] = deque(range(nslots))
        sealing: deque[tuple[int, int, Future[float]]] = deque()  # (slot, n, job) in chunk order
        inflight: deque[tuple[Request, int]] = deque()  # (send, slot) in chunk order
        i = 0
        try:
            while i < count:
                while i < count and free:  # start sealing as many chunks as there are free slots
                    slot = free.popleft()
                    start = i * chunk
                    n = min(total - start, chunk)
                    buf = self._slot(slot, HDR + n + TAG)
                    peer.send_seq += 1
                    hdr = FRAME.pack(VERSION, F_DATA, kind, 0, self.rank, dest, n, peer.send_seq, msg_id, i, count,
                                     start, total)
                    buf[:HDR] = hdr
                    pieces = enc.pieces(start, start + n)
                    data = pieces[0] if len(pieces) == 1 else self._gathered(pieces, n, slot)
                    sealing.append((slot, n, pool.submit(_seal_timed, peer.tx, peer.send_seq, data,
                                                         self._jd + hdr, buf[HDR:HDR + n + TAG])))
                    i += 1
                while sealing:  # hand every sealed chunk to MPI, in order
                    slot, n, job = sealing.popleft()
                    self.stats.seal_s += job.result()
                    inflight.append((self.transport.isend(memoryview(self._tx_slots[slot])[:HDR + n + TAG], dest),
                                     slot))
                    self.stats.bytes_sent += HDR + n + TAG
                    for req, _ in inflight:  # nudge MPI's progress on the chunks already out
                        req.test()
                if i < count:  # wait for the oldest send to free its buffer (and any others done)
                    req, slot = inflight.popleft()
                    self._wait_send(req, dest)
                    free.append(slot)
                    while inflight and inflight[0][0].test():
                        free.append(inflight.popleft()[1])
            while inflight:
                req, _ = inflight.popleft()
                self._wait_send(req, dest)
        except BaseException as exc:
            wait_futures([job for _, _, job in sealing])  # no thread writes into a buffer after this
            self._tx_slots.clear()  # frames may still be read by abandoned sends or half-sealed
            if isinstance(exc, (ChannelError, KeyboardInterrupt, SystemExit)):
                raise
            raise ChannelError(f"sealing a message to rank {dest} failed: {exc}") from exc

    def _seal_chunk(self, peer: _Peer, ftype: int, kind: int, enc: wire.Encoded | None, msg_id: int, index: int,
                    count: int, start: int, n: int, total: int, out: memoryview) -> bytes:
        """Encrypt bytes [start, start + n) of `enc` as chunk `index` of message `msg_id` into `out`
        (n + TAG bytes); return the frame header the ciphertext is bound to (it is the AAD)."""
        peer.send_seq += 1
        hdr = FRAME.pack(VERSION, ftype, kind, 0, self.rank, peer.rank, n, peer.send_seq, msg_id, index, count,
                         start, total)
        if enc is None or n == 0:
            data: memoryview | bytes = b""
        else:
            pieces = enc.pieces(start, start + n)
            data = pieces[0] if len(pieces) == 1 else self._gathered(pieces, n)
        t0 = time.perf_counter()
        peer.tx.seal_into(peer.send_seq, data, self._jd + hdr, out)  # type: ignore[union-attr]
        self.stats.seal_s += time.perf_counter() - t0
        return hdr

    def _own_frame(self, peer: _Peer, ftype: int, kind: int, enc: wire.Encoded | None, msg_id: int, index: int,
                   count: int, start: int, n: int, total: int) -> np.ndarray:
        """One sealed frame (header + ciphertext) in a buffer of its own, not one of the reused slots."""
        frame = np.empty(HDR + n + TAG, dtype=np.uint8)
        view = memoryview(frame)
        view[:HDR] = self._seal_chunk(peer, ftype, kind, enc, msg_id, index, count, start, n, total, view[HDR:])
        return frame

    def _post_chunks(self, peer: _Peer, kind: int, enc: wire.Encoded | None, total: int, count: int,
                     msg_id: int, posted: Outgoing) -> None:
        """Seal every chunk into a buffer of its own and start all their sends (see `post`)."""
        dest, chunk = peer.rank, self.chunk_bytes
        if count > 1 and self.crypto_threads > 1 and enc is not None:
            self._post_pipelined(peer, kind, enc, total, count, msg_id, posted)
            return
        for i in range(count):
            start = i * chunk
            frame = self._own_frame(peer, F_DATA, kind, enc, msg_id, i, count, start, min(total - start, chunk), total)
            req = self.transport.isend(memoryview(frame), dest)
            self._background.append((req, frame))  # close() waits for it, then abandons it
            posted.requests.append(req)
            self.stats.bytes_sent += len(frame)

    def _post_pipelined(self, peer: _Peer, kind: int, enc: wire.Encoded, total: int, count: int,
                        msg_id: int, posted: Outgoing) -> None:
        """`_post_chunks` with the sealing pool: every chunk has its own frame buffer; sequence
        numbers are taken in chunk order here and the sends start in chunk order (nothing else is
        sent in between: this never waits on MPI)."""
        dest, chunk = peer.rank, self.chunk_bytes
        pool = self._crypto_pool()
        jobs: deque[tuple[np.ndarray, Future[float]]] = deque()
        try:
            for i in range(count):
                start = i * chunk
                n = min(total - start, chunk)
                frame = np.empty(HDR + n + TAG, dtype=np.uint8)
                view = memoryview(frame)
                peer.send_seq += 1
                hdr = FRAME.pack(VERSION, F_DATA, kind, 0, self.rank, dest, n, peer.send_seq, msg_id, i, count,
                                 start, total)
                view[:HDR] = hdr
                pieces = enc.pieces(start, start + n)
                data = pieces[0] if len(pieces) == 1 else memoryview(np.concatenate(
                    [np.frombuffer(p, dtype=np.uint8) for p in pieces]))  # a chunk spanning tensors
                jobs.append((frame, pool.submit(_seal_timed, peer.tx, peer.send_seq, data,
                                                self._jd + hdr, view[HDR:])))
                while len(jobs) > 2 * self.crypto_threads or (i == count - 1 and jobs):
                    frame, job = jobs.popleft()
                    self.stats.seal_s += job.result()
                    req = self.transport.isend(memoryview(frame), dest)
                    self._background.append((req, frame))  # close() waits for it, then abandons it
                    posted.requests.append(req)
                    self.stats.bytes_sent += len(frame)
        except BaseException as exc:
            wait_futures([job for _, job in jobs])
            if isinstance(exc, (ChannelError, KeyboardInterrupt, SystemExit)):
                raise
            raise ChannelError(f"sealing a message to rank {dest} failed: {exc}") from exc

    # -- shared-memory chunks (peers on the same node) -----------------------------------------------
    def _offer_ring(self, peer: _Peer) -> None:
        """Offer the peer a shared-memory ring for big messages; it accepts if it can map it
        (same node). The offer and answer are sealed messages like any other."""
        dest = peer.rank
        slot_bytes = (self.chunk_bytes + TAG + 63) & ~63
        over = self._ring_bytes() + _RING_SLOTS * slot_bytes > self.shm_budget_bytes
        got = None if over else self.transport.shm_create(f"{self.rank}to{dest}", _RING_SLOTS * slot_bytes)
        if got is None:
            self._tx_rings[dest] = _TxRing("", None, 0, 0, "declined")
            return
        name, view = got
        self._tx_rings[dest] = _TxRing(name, np.frombuffer(view, dtype=np.uint8), _RING_SLOTS, slot_bytes, "offered")
        body = _OFFER.pack(_RING_SLOTS, slot_bytes) + name.encode()
        self._send_sealed_message(peer, F_SHM_OFFER, 0, wire.Encoded(body, [], len(body)))

    def _ring_bytes(self) -> int:
        """Bytes of shared-memory rings this rank has mapped or offered."""
        return (sum(r.nslots * r.slot_bytes for r in self._tx_rings.values() if r.buf is not None)
                + sum(r.nslots * r.slot_bytes for r in self._rx_rings.values()))

    def _on_ring_control(self, peer: _Peer, ftype: int, body: bytes) -> None:
        src = peer.rank
        if ftype == F_SHM_OFFER:
            if len(body) <= _OFFER.size:
                self._reject(src, "malformed frame", "shared-memory offer without a name")
                return
            nslots, slot_bytes = _OFFER.unpack_from(body)
            name = body[_OFFER.size:].decode("utf-8", "replace")
            view = None
            if (self.shared_memory and 1 <= nslots <= 64 and TAG < slot_bytes <= self._max_frame + 64
                    and self._ring_bytes() + nslots * slot_bytes <= self.shm_budget_bytes):
                view = self.transport.shm_attach(name, nslots * slot_bytes)
            if view is not None:
                self._rx_rings[src] = _RxRing(name, np.frombuffer(view, dtype=np.uint8), nslots, slot_bytes)
                self.transport.shm_unlink(name)  # mapped on both sides now; nothing to leak on a crash
            answer = (b"\x01" if view is not None else b"\x00") + name.encode()
            self._send_sealed_message(peer, F_SHM_ACCEPT, 0, wire.Encoded(answer, [], len(answer)))
            return
        name = body[1:].decode("utf-8", "replace")
        ring = self._tx_rings.get(src)
        if ring is None or ring.state != "offered" or ring.name != name:
            self._reject(src, "unexpected handshake frame", "a shared-memory answer to no offer")
            return
        self.transport.shm_unlink(name)  # both sides have it mapped (or never will): no file left behind
        if body[:1] == b"\x01":
            ring.state = "ready"
        else:
            ring.state, ring.buf = "declined", None

    def _send_via_ring(self, peer: _Peer, ring: _TxRing, kind: int, enc: wire.Encoded, total: int,
                       count: int, posted: Outgoing | None = None) -> None:
        """Encrypt each chunk straight into a free slot of the shared ring and send only its
        56-byte header (+ slot number) through MPI: the receiver decrypts from the ring, so the
        bytes are never copied by MPI."""
        chunk = self.chunk_bytes
        msg_id = peer.next_msg_id
        peer.next_msg_id += 1
        dest = peer.rank
        buf = memoryview(ring.buf)  # type: ignore[arg-type]
        for i in range(count):
            start = i * chunk
            n = min(total - start, chunk)
            slot = self._ring_slot(ring, dest)
            ring.owner[slot] = posted
            if posted is not None:
                posted.ring_slots.append((ring, slot))
            at = slot * ring.slot_bytes
            hdr = self._seal_chunk(peer, F_SHM_DATA, kind, enc, msg_id, i, count, start, n, total, buf[at:at + n + TAG])
            self._send_small(dest, hdr + _SLOT.pack(slot))
            self.stats.bytes_sent += HDR + _SLOT.size + n + TAG

    def _ring_slot(self, ring: _TxRing, dest: int) -> int:
        if not ring.free:
            backoff = _Backoff(max(self.spin_s, _ACTIVE_SPIN_S), min(self.backoff_max_s, _ACTIVE_SLEEP_S))
            deadline = time.monotonic() + self.send_timeout_s
            while not ring.free:
                if self._pump():
                    backoff.reset()
                    continue
                if time.monotonic() > deadline:
                    raise ChannelError(f"rank {dest} took no chunk from shared memory for {self.send_timeout_s:g} s "
                                       f"(is rank {dest} alive and receiving?)")
                self._reap_background()
                backoff.pause()
        return ring.free.popleft()

    def _on_ring_free(self, src: int, view: memoryview) -> None:
        ring = self._tx_rings.get(src)
        slot = _SLOT.unpack_from(view, HDR)[0] if len(view) == HDR + _SLOT.size else -1
        if ring is None or ring.state != "ready" or not 0 <= slot < ring.nslots or slot in ring.free:
            self._reject(src, "malformed frame", f"shared-memory credit for slot {slot}, which is not in use")
            return
        ring.owner[slot] = None
        ring.free.append(slot)

    def _send_small(self, dest: int, frame: bytes | np.ndarray) -> None:
        self._background.append((self.transport.isend(memoryview(frame), dest), frame))
        self._reap_background()

    def _gathered(self, pieces: list[memoryview], n: int, slot: int = -1) -> memoryview:
        """Copy a chunk that spans several tensors into one buffer (per slot when chunks are
        sealed in parallel, the shared one otherwise)."""
        if slot >= 0:
            while len(self._gathers) <= slot:
                self._gathers.append(np.empty(0, dtype=np.uint8))
            if len(self._gathers[slot]) < n:
                self._gathers[slot] = np.empty(max(n, min(self.chunk_bytes, 1 << 16)), dtype=np.uint8)
            out = memoryview(self._gathers[slot])
        else:
            if self._gather is None or len(self._gather) < n:
                self._gather = np.empty(max(n, min(self.chunk_bytes, 1 << 16)), dtype=np.uint8)
            out = memoryview(self._gather)
        pos = 0
        for p in pieces:
            out[pos:pos + len(p)] = p
            pos += len(p)
        return out[:n]

    def _wait_send(self, req: Request, dest: int) -> None:
        if req.test():
            return
        # A send in progress is active work, not idling: spin longer and sleep little, or a
        # sleeping sender stalls the chunk pipeline.
        backoff = _Backoff(max(self.spin_s, _ACTIVE_SPIN_S), min(self.backoff_max_s, _ACTIVE_SLEEP_S))
        deadline = time.monotonic() + self.send_timeout_s
        while not req.test():
            # Keep receiving while we wait: a peer that is itself blocked sending to us must be
            # able to finish, or two big sends in opposite directions would deadlock.
            if self._pump():
                backoff.reset()
                continue
            if time.monotonic() > deadline:
                req.cancel()
                # The abandoned send may still read its buffer whenever the peer wakes up: later
                # messages must be sealed into fresh buffers, not over it.
                self._tx_slots.clear()
                raise ChannelError(f"sending to rank {dest} did not complete within {self.send_timeout_s:g} s "
                                   f"(is rank {dest} alive and receiving?)")
            backoff.pause()

    def _send_plain(self, dest: int, ftype: int, body: bytes) -> None:
        frame = FRAME.pack(VERSION, ftype, 0, 0, self.rank, dest, len(body), 0, 0, 0, 1, 0, len(body)) + body
        self.stats.bytes_sent += len(frame)
        self._send_small(dest, frame)

    def _reap_background(self) -> None:
        bg = self._background
        while bg and bg[0][0].test():
            bg.popleft()
        if len(bg) > 64:  # a send to a busy peer at the head must not pin everything behind it
            self._background = deque(entry for entry in bg if not entry[0].test())

    # -- receiving --------------------------------------------------------------------------------
    def recv(self, *, source: int | None = None, kinds: Collection[int] | None = None,
             timeout: float | None = None) -> Message | None:
        """The next message (from `source`, of one of `kinds`), or None after `timeout` s.
        Messages that do not match are kept for later calls."""
        msg = self._take(source, kinds)
        if msg is not None:
            return msg
        while self._pump():  # fast path: the message is already here
            msg = self._take(source, kinds)
            if msg is not None:
                return msg
        if timeout == 0:
            return None
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        idle = _Backoff(self.spin_s, self.backoff_max_s, self.stats)
        talking = _Backoff(self.spin_s, min(self.backoff_max_s, _CONVERSATION_SLEEP_S), self.stats)
        # while a multi-chunk message is arriving, its next chunk is imminent: spin, sleep little
        busy = _Backoff(_ACTIVE_SPIN_S, min(self.backoff_max_s, _ACTIVE_SLEEP_S), self.stats)
        backoff = self._pick_backoff(busy, talking, idle)
        while True:
            if self._pump():
                backoff = self._pick_backoff(busy, talking, idle)
                backoff.reset()
                msg = self._take(source, kinds)
                if msg is not None:
                    return msg
                continue
            if source is not None:
                peer = self._peer.get(source)
                if peer is not None and peer.cut_off:
                    raise ChannelError(f"rank {source} was cut off after {peer.rejects} rejected messages")
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self._reap_background()
            if backoff is talking and time.perf_counter() - self._last_frame_at >= _CONVERSATION_S:
                backoff = idle  # the conversation is over: back off to the idle pace, not poll on
            backoff.pause(deadline)

    def _pick_backoff(self, busy: _Backoff, talking: _Backoff, idle: _Backoff) -> _Backoff:
        if self._assembling:
            return busy
        return talking if time.perf_counter() - self._last_frame_at < _CONVERSATION_S else idle

    def poll(self) -> Message | None:
        """A waiting message, if any; never waits."""
        return self.recv(timeout=0)

    def _take(self, source: int | None, kinds: Collection[int] | None) -> Message | None:
        if not self._inbox:
            return None
        for i, m in enumerate(self._inbox):
            if (source is None or m.source == source) and (kinds is None or m.kind in kinds):
                del self._inbox[i]
                peer = self._peer.get(m.source)
                if peer is not None:
                    peer.queued -= 1
                    peer.queued_bytes -= m.nbytes
                return m
        return None

    def _probe(self) -> tuple[int, int] | None:
        """The next frame to take. While part-received messages hold `max_assembling_bytes` or more,
        only their senders' frames are taken (K clients uploading at once are received one after
        another, not K buffers at a time); a sender silent for `_STALL_S` is not waited on."""
        if self._assembling:
            now = time.monotonic()
            busy = [p for p in self._peer.values() if p.asm is not None]
            if sum(p.asm.total for p in busy) >= self.max_assembling_bytes:  # type: ignore[union-attr]
                live = [p for p in busy if now - p.asm.last_at < _STALL_S]  # type: ignore[union-attr]
                for p in live:
                    probe = self.transport.iprobe(p.rank)
                    if probe is not None:
                        return probe
                if live:
                    return None
        return self.transport.iprobe()

    def _pump(self) -> bool:
        """Receive and process one frame if one has arrived; True if it did."""
        self.stats.polls += 1
        probe = self._probe()
        if probe is None:
            return False
        src, n = probe
        self._last_frame_at = time.perf_counter()
        self.stats.bytes_received += n if n < (1 << 62) else 0
        peer = self._peer.get(src)
        if peer is not None and peer.cut_off:
            self.transport.discard(src)
            self.stats.rejected["from a cut-off rank"] = self.stats.rejected.get("from a cut-off rank", 0) + 1
            return True
        if n > self._max_frame:
            self.transport.discard(src)
            self._reject(src, "oversize frame", f"{n}-byte frame exceeds the {self._max_frame}-byte limit")
            return True
        view = self._rx_view(n)
        if n <= _SMALL_FRAME + HDR + TAG:
            self.transport.recv_into(src, view)
        else:
            self._wait_recv(self.transport.irecv_into(src, view))
        try:
            self._on_frame(src, view)
        except ChannelError:
            raise
        except Exception as exc:
            self._drop_assembly(src)
            self._reject(src, "frame handling failed", f"{type(exc).__name__}: {str(exc)[:200]}")
        return True

    def _rx_view(self, n: int) -> memoryview:
        if n <= len(self._rx_small):
            return memoryview(self._rx_small)[:n]
        if self.crypto_threads > 1:  # the next of threads + 1 buffers, once the chunk it held is opened
            self._rx_turn = (self._rx_turn + 1) % (self.crypto_threads + 1)
            while len(self._rx_bigs) <= self._rx_turn:
                self._rx_bigs.append(np.empty(self._max_frame, dtype=np.uint8))
                self._rx_opening.append(None)
            pending = self._rx_opening[self._rx_turn]
            if pending is not None:
                wait_futures([pending])
                self._rx_opening[self._rx_turn] = None
            return memoryview(self._rx_bigs[self._rx_turn])[:n]
        if self._rx_big is None:
            self._rx_big = np.empty(self._max_frame, dtype=np.uint8)
        return memoryview(self._rx_big)[:n]

    def _wait_recv(self, req: Request) -> None:
        backoff = _Backoff(max(self.spin_s, 2e-3), self.backoff_max_s)  # the frame is on its way
        deadline = time.monotonic() + self.send_timeout_s
        while not req.test():
            if time.monotonic() > deadline:
                req.cancel()
                raise ChannelError(f"a frame announced to rank {self.rank} never arrived within {self.send_timeout_s:g} s")
            backoff.pause()

    def _on_frame(self, src: int, view: memoryview) -> None:
        n = len(view)
        if n < HDR:
            self._reject(src, "truncated frame", f"{n}-byte frame is shorter than the {HDR}-byte frame header")
            return
        (version, ftype, kind, flags, f_src, f_dst, length, seq, msg_id, index, count,
         offset, total) = FRAME.unpack_from(view, 0)
        if version != VERSION:
            self._reject(src, "unsupported protocol version", f"frame protocol version {version}, expected {VERSION}")
            return
        if f_src != src or f_dst != self.rank:
            self._reject(src, "misrouted frame", f"frame says rank {f_src} -> rank {f_dst}, "
                                                 f"but came from rank {src} to rank {self.rank}")
            return
        if ftype in _HANDSHAKE_TYPES:
            if n != HDR + length or length > _MAX_PLAIN_FRAME or flags:
                self._reject(src, "malformed frame", f"handshake frame of {n} bytes declares {length} body bytes")
                return
            self._on_handshake(src, ftype, view[HDR:])
            return
        if ftype == F_SHM_FREE:
            self._on_ring_free(src, view)
            return
        if ftype not in _SEALED_TYPES or flags:
            self._reject(src, "malformed frame", f"unknown frame type {ftype} / flags {flags}")
            return
        if ftype != F_SHM_DATA:
            if n != HDR + length + TAG:
                self._reject(src, "truncated frame", f"{n}-byte frame should be {HDR + length + TAG} "
                                                     f"({length} ciphertext bytes + header + tag)")
                return
            self._on_sealed(src, view, view[HDR:], ftype, kind, length, seq, msg_id, index, count, offset, total,
                            pooled=n > len(self._rx_small) and self.crypto_threads > 1)
            return
        ring = self._rx_rings.get(src)
        slot = _SLOT.unpack_from(view, HDR)[0] if n == HDR + _SLOT.size else -1
        if ring is None or not 0 <= slot < ring.nslots or length + TAG > ring.slot_bytes:
            self._reject(src, "malformed frame", f"shared-memory chunk in slot {slot} of "
                                                 f"{'no ring' if ring is None else f'a {ring.nslots}-slot ring'}")
            return
        at = slot * ring.slot_bytes
        self.stats.bytes_received += length + TAG  # the ciphertext read from the ring (the sender counts it too)
        try:
            self._on_sealed(src, view, memoryview(ring.buf)[at:at + length + TAG], ftype, kind, length, seq,
                            msg_id, index, count, offset, total)
        finally:  # the slot has been read (or refused): the sender may refill it
            self._send_small(src, FRAME.pack(VERSION, F_SHM_FREE, 0, 0, self.rank, src, _SLOT.size, 0, 0, 0, 1, 0,
                                             _SLOT.size) + _SLOT.pack(slot))

    def _on_sealed(self, src: int, view: memoryview, ciphertext: memoryview, ftype: int, kind: int, length: int,
                   seq: int, msg_id: int, index: int, count: int, offset: int, total: int, *,
                   pooled: bool = False) -> None:
        """`pooled`: the frame sits in one of the rotating receive buffers, so a later chunk of a
        message may be opened on the pool while this thread receives the next one."""
        peer = self._peer.get(src)
        if peer is None or peer.rx is None:
            self._reject(src, "no session", "encrypted frame before a secure handshake")
            return
        if seq <= peer.last_seq:
            self._reject(src, "replayed or reordered frame",
                         f"sequence number {seq}, but {peer.last_seq} was already accepted")
            return
        if ftype in (F_DATA, F_SHM_DATA) and peer.state == "ready":
            if index > 0 and msg_id == peer.skip_msg:
                self.stats.dropped_chunks += 1  # the rest of a message refused at its first chunk
                return
            refusal = self._refusal(src, kind, total) if index == 0 else None
            if refusal is not None:  # before any buffer is reserved or any byte decrypted
                peer.skip_msg = msg_id
                self._reject(src, *refusal)
                return
        problem = self._check_chunk(peer, ftype, msg_id, index, count, offset, length, total, seq)
        if problem:
            self._reject(src, "chunk out of sequence" if problem[0] == "seq" else "malformed frame", problem[1])
            return
        # Decrypt straight into the message buffer; the first chunk of a multi-chunk message goes
        # to scratch first so that no large buffer is allocated before the frame authenticates.
        if index == 0:
            out = self._scratch0(length) if count > 1 else np.empty(length, dtype=np.uint8)
        else:
            out = peer.asm.payload[offset:offset + length]  # type: ignore[union-attr]
            if pooled and ftype == F_DATA and peer.state == "ready":
                job = self._crypto_pool().submit(_open_timed, peer.rx, seq, ciphertext, self._jd + bytes(view[:HDR]),
                                                 memoryview(out))
                self._rx_opening[self._rx_turn] = job
                peer.asm.opening.append(job)  # type: ignore[union-attr]
                peer.last_seq = seq
                self._chunk_taken(src, peer, kind, index, offset, length, seq)
                return
        t0 = time.perf_counter()
        opened = peer.rx.open_into(seq, ciphertext, self._jd + bytes(view[:HDR]), memoryview(out))
        self.stats.open_s += time.perf_counter() - t0
        if not opened:
            self._reject(src, "authentication failed",
                         f"frame {seq} does not authenticate (tampered, truncated, misrouted or wrong key)")
            return
        peer.last_seq = seq
        if ftype == F_CONFIRM:
            if peer.state != "finish_sent" or total != 0:
                self._reject(src, "unexpected handshake frame", "a handshake confirmation outside a handshake")
                return
            peer.state = "ready"
            return
        if peer.state != "ready":
            self._reject(src, "unexpected handshake frame", "data before the handshake was confirmed")
            return
        if ftype in (F_SHM_OFFER, F_SHM_ACCEPT):
            self._on_ring_control(peer, ftype, bytes(out))
            return
        if index == 0:
            if peer.asm is not None:
                asm = peer.asm
                self._drop_assembly(src)
                self._reject(src, "incomplete message abandoned",
                             f"message {asm.msg_id} stopped after {asm.next_index} of {asm.count} chunks")
            if count == 1:
                self._deliver(src, kind, out)
                peer.asm = None
                return
            payload = self._payload_buffer(total)
            payload[:length] = out
            peer.asm = _Assembly(msg_id, kind, total, count, payload)
            self._assembling = True
        self._chunk_taken(src, peer, kind, index, offset, length, seq)

    def _chunk_taken(self, src: int, peer: _Peer, kind: int, index: int, offset: int, length: int, seq: int) -> None:
        """Record a chunk of the peer's message; deliver the message with its last chunk, once every
        chunk opened on the pool has authenticated."""
        asm = peer.asm
        assert asm is not None
        asm.next_index = index + 1
        asm.filled = offset + length
        asm.last_seq = seq
        asm.last_at = time.monotonic()
        if asm.next_index < asm.count:
            return
        peer.asm = None
        self._assembling = any(p.asm is not None for p in self._peer.values())
        if not self._opened(asm):
            self._release(asm.payload)
            self._reject(src, "authentication failed", f"a chunk of message {asm.msg_id} does not authenticate "
                                                       f"(tampered, truncated, misrouted or wrong key)")
            return
        self._deliver(src, kind, asm.payload)

    def _opened(self, asm: _Assembly) -> bool:
        """Wait for the chunks of `asm` being opened on the pool; True if every one authenticated."""
        if not asm.opening:
            return True
        wait_futures(asm.opening)
        times = [job.result() if job.exception() is None else -1.0 for job in asm.opening]
        asm.opening = []
        self.stats.open_s += sum(t for t in times if t > 0)
        return min(times) >= 0

    def _check_chunk(self, peer: _Peer, ftype: int, msg_id: int, index: int, count: int, offset: int,
                     length: int, total: int, seq: int) -> tuple[str, str] | None:
        if total > self.max_message_bytes:
            return "bad", f"message of {total} bytes exceeds comm.max_message_bytes={self.max_message_bytes}"
        if count < 1 or index >= count or count > max(1, -(-total // 4096)):
            return "bad", f"chunk {index} of {count} for a {total}-byte message"
        if offset + length > total or (index < count - 1 and length == 0) or (index == count - 1 and offset + length != total):
            return "bad", f"chunk {index}/{count} covers bytes {offset}..{offset + length} of {total}"
        if ftype == F_CONFIRM and (count != 1 or total != 0):
            return "bad", "a handshake confirmation carries no data"
        if ftype in (F_SHM_OFFER, F_SHM_ACCEPT) and (count != 1 or total > 1024):
            return "bad", "a shared-memory offer or answer is one small chunk"
        if index == 0:
            if offset != 0:
                return "bad", f"first chunk at offset {offset}"
            return None
        asm = peer.asm
        if asm is None or asm.msg_id != msg_id or asm.count != count or asm.total != total:
            return "seq", f"chunk {index} of message {msg_id} without its earlier chunks"
        # (sequence numbers need not be consecutive: a control frame, e.g. a shared-memory answer,
        # may be sent between two chunks of a message while the sender waits)
        if index != asm.next_index or offset != asm.filled:
            return "seq", f"chunk {index} of message {msg_id} where chunk {asm.next_index} was expected"
        return None

    def _payload_buffer(self, n: int) -> np.ndarray:
        """A buffer for an n-byte message: a recycled one when the tensors of an earlier message
        of that size are no longer referenced anywhere (big fresh buffers cost page faults that
        are as slow as the decryption itself), else a new one."""
        pool = self._pool
        for buf in pool:
            # a live view of the tensors holds a reference beyond the pool's and this loop's; a
            # buffer a little larger serves too (K uploads of one model differ by a few header bytes)
            if n <= len(buf) <= n + (n >> 4) and sys.getrefcount(buf) <= _FREE_REFS:
                return buf if len(buf) == n else buf[:n]
        buf = np.empty(n, dtype=np.uint8)
        pool.append(buf)
        if len(pool) > 2:  # a server folding uploads on arrival needs about two of a size
            pool.pop(0)
        return buf

    def _scratch0(self, n: int) -> np.ndarray:
        if self._plain0 is None or len(self._plain0) < n:
            self._plain0 = np.empty(max(n, self.chunk_bytes), dtype=np.uint8)
        return self._plain0[:n]

    def _deliver(self, src: int, kind: int, payload: np.ndarray) -> None:
        peer = self._peer_of(src)
        if peer.queued >= self.inbox_max_messages or peer.queued_bytes + len(payload) > self.inbox_max_bytes:
            self._release(payload)
            self._reject(src, "inbox full", f"{peer.queued} messages ({peer.queued_bytes} bytes) from rank {src} "
                                            f"are waiting unread; the bound is {self.inbox_max_messages} messages / "
                                            f"{self.inbox_max_bytes} bytes")
            return
        try:
            header, tensors = wire.decode(payload, self.limits)
        except Exception as exc:
            self._release(payload)
            self._reject(src, "malformed bundle", str(exc))
            return
        msg = Message(source=src, kind=kind, header=header, tensors=tensors, nbytes=len(payload))
        self.stats.messages_received += 1
        if self.on_message is not None and self.on_message(msg):
            return  # taken as it arrived (e.g. folded during a send): it never waits in the inbox
        self._inbox.append(msg)
        peer.queued += 1
        peer.queued_bytes += len(payload)

    def _release(self, payload: np.ndarray) -> None:
        """Forget a refused message's buffer, so that its memory goes back at once."""
        self._pool[:] = [buf for buf in self._pool if buf is not payload and buf is not payload.base]

    def _drop_assembly(self, src: int) -> None:
        peer = self._peer.get(src)
        if peer is not None and peer.asm is not None:
            self._opened(peer.asm)  # the pool must be done writing into the buffer before it goes
            self._release(peer.asm.payload)
            peer.asm = None
            self._assembling = any(p.asm is not None for p in self._peer.values())

    # -- rejections -------------------------------------------------------------------------------
    def _peer_of(self, rank: int) -> _Peer:
        peer = self._peer.get(rank)
        if peer is None:
            peer = self._peer[rank] = _Peer(rank)
        return peer

    def _reject(self, src: int, reason: str, detail: str) -> None:
        st = self.stats
        st.rejected[reason] = st.rejected.get(reason, 0) + 1
        st.rejected_by_rank[src] = st.rejected_by_rank.get(src, 0) + 1
        peer = self._peer_of(src)
        peer.rejects += 1
        if peer.rejects <= _LOG_FIRST or peer.rejects % 1000 == 0:
            more = f" ({peer.rejects} rejected from this rank so far)" if peer.rejects > _LOG_FIRST else ""
            self._log(f"rejected message from rank {src}: {reason}: {detail}{more}")
        if peer.rejects >= self.max_rejects and not peer.cut_off:
            peer.cut_off = True
            self._drop_assembly(src)
            self._log(f"rank {src} cut off after {peer.rejects} rejected messages (security.max_rejects); "
                      f"its frames are dropped from now on")

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Complete (or, after `timeout` s, cancel) outstanding sends and drop the buffers."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        backoff = _Backoff(self.spin_s, self.backoff_max_s)
        while self._background and time.monotonic() < deadline:
            self._reap_background()
            backoff.pause(deadline)
        for req, _ in self._background:
            try:
                req.cancel()
            except Exception:
                pass
        self._background.clear()
        for ring in self._tx_rings.values():
            if ring.state == "offered":
                self.transport.shm_unlink(ring.name)
        self._tx_rings.clear()
        self._rx_rings.clear()
        self._tx_slots.clear()
        self._gathers.clear()
        if self._sealers is not None:
            self._sealers.shutdown(wait=True, cancel_futures=True)  # joins the sealing threads
            self._sealers = None
        self._rx_big = self._gather = self._plain0 = None
        self._rx_bigs.clear()
        self._rx_opening.clear()
        self._pool.clear()
        self._closed = True
