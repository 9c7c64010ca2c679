"""What the parts of one channel share: the transport, this rank, the job, the options, the counters,
and one `Peer` record per other rank, with the bookkeeping of what each has had refused.

A frame that fails any check is dropped, counted in `stats.rejected` and `stats.rejected_by_rank`,
logged with the rank (the first `LOG_FIRST` of each rank in full, then every 1000th), and never
raises; a rank with `max_rejects` rejections is cut off: its frames are dropped unread from then on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hpcfed.comm import crypto
from hpcfed.comm.options import ChannelOptions
from hpcfed.comm.reassembly import Assembly
from hpcfed.comm.stats import ChannelStats
from hpcfed.comm.transport import Transport

LOG_FIRST = 10  # log the first rejections of each rank in full, then every 1000th
WATCH_EVERY_S = 0.2  # how often a waiting send asks whether a peer has ended


class Peer:
    """This rank's session with one other rank: handshake state, keys, counters, the message it is
    part-way through receiving, and what of it waits in the inbox."""

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
        "violated",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.role = ""  # "initiator" (this rank said HELLO) or "responder"
        self.state = "none"  # none|wait_hello|hello_sent|reply_sent|finish_sent|ready|failed
        self.hs: crypto.Initiator | crypto.Responder | None = None
        self.tx: crypto.Sealer | None = None
        self.rx: crypto.Sealer | None = None
        self.send_seq = 0  # the last sequence number sent
        self.last_seq = 0  # the last sequence number accepted
        self.next_msg_id = 0
        self.asm: Assembly | None = None
        self.rejects = 0
        self.cut_off = False
        self.error = ""
        self.identity = ""
        self.skip_msg = -1  # a message refused at its first chunk: its later chunks are dropped unread
        # an authenticated first chunk of a kind or size this rank does not take came from it: proof
        # on record, its later such chunks are refused unread (`Receiver._refuse_first_chunk`)
        self.violated = False
        self.queued = 0  # messages of this peer in the inbox ...
        self.queued_bytes = 0  # ... and their bundle bytes


class Session:
    """The state every part of a channel reads: see the module doc. `transport` may be replaced
    (a test or tool wraps it); every part reads it from here at each use."""

    def __init__(self, transport: Transport, job_id: bytes, opts: ChannelOptions,
                 log: Callable[[str], None] | None) -> None:
        self.transport = transport
        self.rank: int = transport.rank
        self.size: int = transport.size
        self.job_id = bytes(job_id)
        self.jd = crypto.job_digest(self.job_id)  # bound into every sealed frame's AAD
        self.opts = opts
        self.stats = ChannelStats()
        self.log: Callable[[str], None] = log or (lambda text: None)
        self.peers: dict[int, Peer] = {}
        # Called with a rank as it is cut off: its part-received message is dropped.
        self.on_cut_off: Callable[[int], None] = lambda rank: None
        # The channel's owner, told of every refused frame (rank, reason, detail); see SecureChannel.on_reject.
        self.on_reject: Callable[[int, str, str], None] | None = None
        # Ranks known to have ended (SecureChannel.peer_gone): nothing more is sent to them, and a
        # send already waiting on one fails at once instead of at its timeout.
        self.gone: set[int] = set()
        self.generations: dict[int, int] = {}  # rank -> how often its session was started anew (forget)
        self.watch: Callable[[], None] | None = None  # see SecureChannel.watch_peers
        self._watched = 0.0

    def peer_of(self, rank: int) -> Peer:
        """The record of `rank` (made on first use)."""
        peer = self.peers.get(rank)
        if peer is None:
            peer = self.peers[rank] = Peer(rank)
        return peer

    def reject(self, src: int, reason: str, detail: str) -> None:
        """Count, log and hold against `src` one refused frame; cut `src` off at `max_rejects`."""
        self.stats.count_rejection(src, reason)
        if self.on_reject is not None:
            self.on_reject(src, reason, detail)
        peer = self.peer_of(src)
        peer.rejects += 1
        if peer.rejects <= LOG_FIRST or peer.rejects % 1000 == 0:
            more = f" ({peer.rejects} rejected from this rank so far)" if peer.rejects > LOG_FIRST else ""
            self.log(f"rejected message from rank {src}: {reason}: {detail}{more}")
        if peer.rejects >= self.opts.max_rejects and not peer.cut_off:
            peer.cut_off = True
            self.on_cut_off(src)
            self.log(f"rank {src} cut off after {peer.rejects} rejected messages (security.max_rejects); "
                     f"its frames are dropped from now on")

    def look_for_gone(self) -> None:
        """While a send waits: let the owner mark ended peers gone (at most every WATCH_EVERY_S)."""
        now = time.monotonic()
        if self.watch is not None and now - self._watched >= WATCH_EVERY_S:
            self._watched = now
            self.watch()

    def count_cut_off_frame(self) -> None:
        """A frame from a cut-off rank, dropped unread (counted by reason only)."""
        self.stats.rejected["from a cut-off rank"] = self.stats.rejected.get("from a cut-off rank", 0) + 1
