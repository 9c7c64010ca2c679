"""SecureChannel: authenticated, encrypted, chunked messages between MPI ranks.

A message is (kind 0..255, JSON header, named ndarrays), laid out by `wire` and cut into frames of
at most `chunk_bytes` (`frame` gives the layout). Each pair of ranks first runs the secure handshake
(`handshake`, `crypto`); then every frame is sealed with AES-256-GCM under the pair's session key,
bound to this job, its source and destination, its kind and its place in its message, and carries a
sequence number above the last one accepted: tampering, truncation, misrouting, a wrong key,
splicing chunks of different messages, replays and reordering all fail. A frame that fails is
dropped, counted in `stats.rejected` and `stats.rejected_by_rank`, logged with the rank, and never
raises; a rank with `max_rejects` rejections is cut off (`session`).

This class is the front; each concern has a module of its own:

- `sender`: the send paths (one thread, a pool of sealing threads, `post`); `sealing`: the pool;
- `receiver`: taking frames off the transport, checking and opening them; `reassembly`: putting
  multi-chunk messages together; `admission`: what this rank takes, and the bounded inbox;
- `ring`: big messages to a peer on the same node through shared memory;
- `polling`: waiting with a back-off, never blocking inside MPI, so an idle rank uses well under
  20% of a core; `stats`: the counters; `options`: the settings.

A `SecureChannel` is not thread-safe; use one per rank and call it from one thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Unpack

from hpcfed.comm import crypto, polling
from hpcfed.comm.admission import Admission
from hpcfed.comm.api import ChannelError, Message
from hpcfed.comm.frame import F_CONFIRM
from hpcfed.comm.handshake import Handshake
from hpcfed.comm.options import ChannelOptions, ChannelSettings
from hpcfed.comm.reassembly import PayloadPool
from hpcfed.comm.receiver import Receiver
from hpcfed.comm.ring import Rings
from hpcfed.comm.sealing import CryptoPool
from hpcfed.comm.sender import Outgoing, Sender
from hpcfed.comm.session import Peer, Session
from hpcfed.comm.stats import ChannelStats
from hpcfed.comm.transport import Transport

__all__ = ["ChannelError", "Message", "Outgoing", "SecureChannel"]


class SecureChannel:
    """Encrypted, authenticated messages between this rank and its peers (see the module doc).

    `settings` are `ChannelOptions`' fields (chunk_bytes, limits, max_message_bytes, ...); `log`
    receives one line per refusal and failed handshake."""

    def __init__(self, transport: Transport, credentials: crypto.Credentials, job_id: bytes, *,
                 log: Callable[[str], None] | None = None, **settings: Unpack[ChannelSettings]) -> None:
        opts = ChannelOptions(**settings)
        self._crypto = CryptoPool(opts.crypto_threads, transport.rank)
        opts.shared_memory = opts.shared_memory and hasattr(transport, "shm_create")
        self._session = session = Session(transport, job_id, opts, log)
        self.credentials = credentials
        self.rank: int = session.rank
        self.size: int = session.size
        self.peers: list[int] = []  # the ranks with a session, after `connect`
        self._rings = Rings(session)
        self._tx = Sender(session, self._crypto, self._rings, self._pump)
        self._handshake = Handshake(session, credentials, self._tx.plain,
                                    lambda peer: self._tx.control(peer, F_CONFIRM, None))
        self._admission = Admission(session, payloads := PayloadPool(opts.chunk_bytes))
        self._rx = Receiver(session, self._crypto, self._rings, self._tx, self._handshake, self._admission, payloads)
        session.on_cut_off = self._rx.drop_assembly  # a rank cut off leaves no half-received message behind
        self._closed = False

    # -- settings and state -----------------------------------------------------------------------
    @property
    def options(self) -> ChannelOptions:
        """The settings this channel runs with."""
        return self._session.opts

    @property
    def stats(self) -> ChannelStats:
        """This rank's counters (messages, bytes, refusals by reason and rank, crypto time)."""
        return self._session.stats

    @property
    def transport(self) -> Transport:
        """The transport the frames move over."""
        return self._session.transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        self._session.transport = transport  # a tool may wrap it to watch the frames

    @property
    def job_id(self) -> bytes:
        """The job id bound into every handshake transcript and frame."""
        return self._session.job_id

    @property
    def chunk_bytes(self) -> int:
        """Plaintext bytes per frame."""
        return self._session.opts.chunk_bytes

    @property
    def crypto_threads(self) -> int:
        """Threads sealing and opening big messages' chunks (see `set_crypto_threads`)."""
        return self._crypto.threads

    @property
    def shared_memory(self) -> bool:
        """Whether big messages to a peer on this node may go through a shared ring."""
        return self._session.opts.shared_memory

    @shared_memory.setter
    def shared_memory(self, on: bool) -> None:
        self._session.opts.shared_memory = on

    @property
    def on_reject(self) -> Callable[[int, str, str], None] | None:
        """Optional: called with (rank, reason, detail) for every frame or message this channel refuses,
        as it refuses it (a server holds an authenticated but malformed bundle against its sender). It
        must not call the channel."""
        return self._session.on_reject

    @on_reject.setter
    def on_reject(self, fn: Callable[[int, str, str], None] | None) -> None:
        self._session.on_reject = fn

    @property
    def on_message(self) -> Callable[[Message], bool] | None:
        """Optional: called with each message as it is decoded; returning True consumes it instead of
        queueing it (a server sending K models folds uploads that complete meanwhile). It must not
        call the channel."""
        return self._admission.on_message

    @on_message.setter
    def on_message(self, fn: Callable[[Message], bool] | None) -> None:
        self._admission.on_message = fn

    def set_crypto_threads(self, threads: int | None) -> None:
        """Seal a big message's chunks with this many threads at once (AES-GCM releases the GIL);
        None: the cores available, at most 8. The pool starts with the first such message and is
        joined here and by close()."""
        self._crypto.set_threads(threads)

    def expect(self, kinds: Collection[int] | Mapping[int, Collection[int]] | None,
               max_bytes: Mapping[int, int] | None = None, *, inbox_max_messages: int | None = None,
               inbox_max_bytes: int | None = None) -> None:
        """Declare what this rank accepts; anything else is dropped on arrival and counted.

        `kinds`: the message kinds accepted from every peer, or {source rank: kinds} (a rank not
        named may send nothing), or None for everything. `max_bytes`: {kind: largest bundle a
        message of that kind may declare}; a first chunk declaring more is refused before any
        buffer is reserved, and the rest of that message is dropped unread. The inbox bounds are
        per peer: a message beyond them is dropped, not buffered."""
        self._admission.expect(kinds, max_bytes, inbox_max_messages=inbox_max_messages,
                               inbox_max_bytes=inbox_max_bytes)

    # -- handshake --------------------------------------------------------------------------------
    def connect(self, peers: Collection[int], timeout: float, *, require_all: bool = True) -> None:
        """Authenticate with each peer (rank 0 answers, the others initiate). Afterwards
        `self.peers` lists the peers with a session. Raises ChannelError naming the ranks that
        did not answer within `timeout` s, or (with `require_all`) that failed authentication. A
        peer marked gone meanwhile (`watch_peers`, `peer_gone`) is left out, named by no error."""
        todo = self._handshake.start(peers)
        deadline = time.monotonic() + timeout
        backoff = polling.Backoff(self.options.spin_s, self.options.backoff_max_s)
        while any(p.state not in ("ready", "failed") for p in todo):
            self._give_up_on_gone(todo)
            if self._rx.pump():
                backoff.reset()
                continue
            if time.monotonic() >= deadline:
                break
            self._tx.reap()
            backoff.pause(deadline)
        self.peers = sorted(r for r, p in self._session.peers.items() if p.state == "ready")
        problems = Handshake.outcome([p for p in todo if p.rank not in self._session.gone], timeout, require_all)
        if problems:
            raise ChannelError(problems)

    def _give_up_on_gone(self, todo: list[Peer]) -> None:
        """A peer its owner found ended (`peer_gone`, via `watch_peers`) fails its handshake at
        once: waiting out the timeout for a dead rank would only delay the others."""
        self._session.look_for_gone()
        for p in todo:
            if p.rank in self._session.gone and p.state not in ("ready", "failed"):
                p.state, p.error, p.hs = "failed", f"rank {p.rank} ended during the secure handshake", None

    def identity(self, rank: int) -> str:
        """The fingerprint of the identity key `rank` authenticated with ("psk" in psk mode)."""
        peer = self._session.peers.get(rank)
        return peer.identity if peer is not None else ""

    # -- peers that end ---------------------------------------------------------------------------
    def peer_gone(self, rank: int) -> None:
        """Rank `rank` has ended (its owner knows how): a send waiting on it fails at once, and
        sending to it again raises, instead of each waiting for `send_timeout_s`."""
        self._session.gone.add(rank)

    def forget(self, rank: int) -> None:
        """Rank `rank` comes back as a new process (`hpcfed serve`: a lost site rejoins): its old
        session, the message it was part-way through and its unread messages are dropped, it is
        no longer gone, and the next `connect` runs a fresh handshake with it (new keys, counters
        from zero: nothing of the old session can be replayed into the new one)."""
        self._rx.drop_assembly(rank)
        self._admission.drop_from(rank)
        self._session.peers.pop(rank, None)
        self._session.gone.discard(rank)
        self._session.generations[rank] = self._session.generations.get(rank, 0) + 1  # its posts: done
        self.peers = [r for r in self.peers if r != rank]

    def routes(self) -> dict[int, str]:
        """Per peer, how big messages travel: "ring", "declined" or "mpi" (see `Rings.route`)."""
        return {rank: self._rings.route(rank) for rank in self.peers}

    def watch_peers(self, look: Callable[[], None] | None) -> None:
        """Call `look()` every few tenths of a second while a send waits; it may call `peer_gone`."""
        self._session.watch = look

    # -- messages ---------------------------------------------------------------------------------
    def send(self, dest: int, kind: int, header: dict[str, Any], tensors: Mapping[str, Any] | None = None) -> None:
        """Encrypt and send one message; returns when `tensors` may be modified again."""
        peer, enc = self._tx.prepare(dest, kind, header, tensors)
        self._tx.data(peer, kind, enc)
        self._session.stats.count_sent(dest, enc.total)

    def post(self, dest: int, kind: int, header: dict[str, Any],
             tensors: Mapping[str, Any] | None = None) -> Outgoing:
        """Encrypt one message into buffers of its own and start sending it; return at once.

        `send` waits until the peer has taken a large message, and a peer busy computing takes
        nothing: a server that answers a fast client must not wait for a slow one. The returned
        `Outgoing` says when the peer has taken the message; the channel keeps its buffers alive
        until then (or until `close`)."""
        peer, enc = self._tx.prepare(dest, kind, header, tensors)
        out = Outgoing(dest, self._session.generations)
        self._tx.data(peer, kind, enc, posted=out)
        self._session.stats.count_sent(dest, enc.total)
        return out

    def recv(self, *, source: int | None = None, kinds: Collection[int] | None = None,
             timeout: float | None = None) -> Message | None:
        """The next message (from `source`, of one of `kinds`), or None after `timeout` s.
        Messages that do not match are kept for later calls."""
        return self._rx.wait(source, kinds, timeout)

    def poll(self) -> Message | None:
        """A waiting message, if any; never waits."""
        return self._rx.wait(None, None, 0)

    def _pump(self) -> bool:
        """Receive and process one frame if one has arrived; True if it did."""
        return self._rx.pump()

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Complete (or, after `timeout` s, cancel) outstanding sends and drop the buffers."""
        if self._closed:
            return
        self._tx.close(timeout)
        self._rings.close()
        self._crypto.close()  # joins the sealing threads
        self._rx.close()
        self._closed = True


if TYPE_CHECKING:  # SecureChannel is what the server, client and live search call as a Channel
    from hpcfed.comm.api import Channel

    def _is_a_channel(channel: SecureChannel) -> Channel:
        return channel
