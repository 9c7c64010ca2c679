"""What this rank takes from its peers, and the inbox where taken messages wait to be read.

`expect` declares the kinds each peer may send and the largest bundle each kind may declare; a
first chunk outside them is refused before any buffer is reserved (`refusal`), and the rest of that
message is dropped unread. The inbox is bounded per peer in messages and bytes: a message beyond
the bounds is dropped, not buffered. A message is decoded (`wire.decode`, strict) on its way in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping

import numpy as np

from hpcfed.comm import wire
from hpcfed.comm.api import Message
from hpcfed.comm.frame import Refusal
from hpcfed.comm.reassembly import PayloadPool
from hpcfed.comm.session import Session


class Admission:
    """The acceptance rules of one channel (see the module doc) and its inbox."""

    def __init__(self, session: Session, payloads: PayloadPool) -> None:
        self._s = session
        self._payloads = payloads
        # What this rank accepts: None = every kind from every peer.
        self._accept: dict[int, frozenset[int]] | frozenset[int] | None = None
        self._kind_bytes: dict[int, int] = {}
        self.max_messages = session.opts.inbox_max_messages
        self.max_bytes = session.opts.inbox_max_bytes
        self.inbox: deque[Message] = deque()
        # Optional: called with each message as it is decoded; returning True consumes it instead of
        # queueing it. A server sending K models uses it to fold uploads that complete meanwhile, so
        # they do not pile up in memory. It must not call the channel.
        self.on_message: Callable[[Message], bool] | None = None

    def expect(self, kinds: Collection[int] | Mapping[int, Collection[int]] | None,
               max_bytes: Mapping[int, int] | None = None, *, inbox_max_messages: int | None = None,
               inbox_max_bytes: int | None = None) -> None:
        """Declare what this rank accepts (see `SecureChannel.expect`)."""
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
            self.max_messages = inbox_max_messages
        if inbox_max_bytes is not None:
            self.max_bytes = inbox_max_bytes

    def refusal(self, src: int, kind: int, total: int) -> Refusal | None:
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

    def deliver(self, src: int, kind: int, payload: np.ndarray) -> None:
        """Decode a whole, authenticated message and queue it (or hand it to `on_message`); a full
        inbox or a malformed bundle refuses it."""
        peer = self._s.peer_of(src)
        if peer.queued >= self.max_messages or peer.queued_bytes + len(payload) > self.max_bytes:
            self._payloads.release(payload)
            self._s.reject(src, "inbox full", f"{peer.queued} messages ({peer.queued_bytes} bytes) from rank {src} "
                                              f"are waiting unread; the bound is {self.max_messages} messages / "
                                              f"{self.max_bytes} bytes")
            return
        try:
            header, tensors = wire.decode(payload, self._s.opts.limits)
        except Exception as exc:
            self._payloads.release(payload)
            self._s.reject(src, "malformed bundle", str(exc))
            return
        msg = Message(source=src, kind=kind, header=header, tensors=tensors, nbytes=len(payload))
        self._s.stats.count_received(src, len(payload))
        if self.on_message is not None and self.on_message(msg):
            return  # taken as it arrived (e.g. folded during a send): it never waits in the inbox
        self.inbox.append(msg)
        peer.queued += 1
        peer.queued_bytes += len(payload)

    def drop_from(self, source: int) -> None:
        """Drop every waiting message of `source` (a peer whose session is over)."""
        self.inbox = deque(m for m in self.inbox if m.source != source)
        peer = self._s.peers.get(source)
        if peer is not None:
            peer.queued = peer.queued_bytes = 0

    def take(self, source: int | None, kinds: Collection[int] | None) -> Message | None:
        """The oldest waiting message from `source` of one of `kinds` (None: any), removed from the inbox."""
        if not self.inbox:
            return None
        for i, m in enumerate(self.inbox):
            if (source is None or m.source == source) and (kinds is None or m.kind in kinds):
                del self.inbox[i]
                peer = self._s.peers.get(m.source)
                if peer is not None:
                    peer.queued -= 1
                    peer.queued_bytes -= m.nbytes
                return m
        return None
