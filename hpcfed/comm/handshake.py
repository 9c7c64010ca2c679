"""The secure handshake over frames: who starts, which step may come when, and what ends it.

The lower rank of a pair responds and the higher one initiates (so rank 0, the server, always
responds): HELLO -> REPLY -> FINISH in plaintext frames (the cryptography is `crypto.Initiator` /
`crypto.Responder`), then the responder's sealed CONFIRM, the first frame under the session keys.
A step out of turn is refused; a step that fails authentication marks the peer failed and is
answered with a REFUSE frame saying why (no secrets in it). In keys mode one identity may hold one
rank only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from hpcfed.comm import crypto
from hpcfed.comm.api import ChannelError
from hpcfed.comm.frame import F_FINISH, F_HELLO, F_REFUSE, F_REPLY, MAX_PLAIN_FRAME
from hpcfed.comm.session import Peer, Session

# The state a peer must be in for each step to be taken.
_EXPECTED = {F_HELLO: "wait_hello", F_REPLY: "hello_sent", F_FINISH: "reply_sent"}


class Handshake:
    """Runs the handshakes of one channel; sends through `send_plain` (a plaintext frame to a rank)
    and `confirm` (the sealed confirmation to a peer)."""

    def __init__(self, session: Session, credentials: crypto.Credentials,
                 send_plain: Callable[[int, int, bytes], None], confirm: Callable[[Peer], None]) -> None:
        self._s = session
        self.credentials = credentials
        self._send_plain = send_plain
        self._confirm = confirm

    def start(self, ranks: Collection[int]) -> list[Peer]:
        """Begin a handshake with each of `ranks` not yet connected (initiators send HELLO now);
        the peers now under way."""
        s, todo = self._s, []
        for p in sorted(set(int(x) for x in ranks)):
            if p == s.rank or not 0 <= p < s.size:
                raise ValueError(f"connect: rank {p} is not another rank of this {s.size}-rank job")
            peer = s.peer_of(p)
            if peer.state == "ready":
                continue
            if peer.state != "none":
                raise ChannelError(f"rank {p}: a handshake is already under way or failed ({peer.state})")
            if s.rank < p:
                peer.role, peer.state = "responder", "wait_hello"
                peer.hs = crypto.Responder(self.credentials, s.job_id, s.rank, p)
            else:
                peer.role, peer.state = "initiator", "hello_sent"
                hs = crypto.Initiator(self.credentials, s.job_id, s.rank, p)
                peer.hs = hs
                self._send_plain(p, F_HELLO, hs.hello)
            todo.append(peer)
        return todo

    @staticmethod
    def outcome(todo: list[Peer], timeout: float, require_all: bool) -> str:
        """What went wrong with the handshakes `todo` ("" when nothing did)."""
        silent = [p.rank for p in todo if p.state not in ("ready", "failed")]
        problems = [p.error for p in todo if p.state == "failed"] if require_all else []
        if silent:
            problems.append(f"rank(s) {', '.join(map(str, silent))} did not complete the secure handshake within "
                            f"{timeout:g} s (not started, crashed, or using another job id)")
        return "; ".join(problems)

    def on_frame(self, src: int, ftype: int, body: memoryview) -> None:
        """A plaintext handshake frame (HELLO, REPLY, FINISH or REFUSE) from `src`."""
        s = self._s
        peer = s.peers.get(src)
        state = peer.state if peer else "none"
        if ftype == F_REFUSE:
            if peer is None or state in ("none", "ready", "failed"):
                s.reject(src, "unexpected handshake frame", "a refusal outside a handshake")
                return
            text = bytes(body).decode("utf-8", "replace")[:300].replace("\n", " ")
            peer.state, peer.error = "failed", f"rank {src} refused the handshake: {text}"
            s.log(f"secure handshake with rank {src} failed: rank {src} refused: {text}")
            return
        if peer is None or state != _EXPECTED[ftype]:
            s.reject(src, "unexpected handshake frame", f"handshake frame type {ftype} while the session is '{state}'")
            return
        try:
            self._step(peer, ftype, bytes(body))
        except crypto.HandshakeError as exc:
            peer.state, peer.error = "failed", f"rank {src} failed the secure handshake: {exc}"
            peer.hs = None
            s.reject(src, "handshake failed", str(exc))
            self._send_plain(src, F_REFUSE, str(exc).encode("utf-8")[:MAX_PLAIN_FRAME])

    def _step(self, peer: Peer, ftype: int, body: bytes) -> None:
        """Take HELLO / REPLY / FINISH from `peer` (in its expected state); raises HandshakeError."""
        hs, src = peer.hs, peer.rank
        if ftype == F_HELLO:
            assert isinstance(hs, crypto.Responder)  # wait_hello is a responder's state
            self._send_plain(src, F_REPLY, hs.on_hello(body))
            peer.state = "reply_sent"
        elif ftype == F_REPLY:
            assert isinstance(hs, crypto.Initiator)  # hello_sent is an initiator's state
            finish, keys = hs.on_reply(body)
            self._install(peer, keys)
            self._send_plain(src, F_FINISH, finish)
            peer.state = "finish_sent"
        else:  # F_FINISH
            assert isinstance(hs, crypto.Responder)  # reply_sent is a responder's state
            keys = hs.on_finish(body)
            twin = [p.rank for p in self._s.peers.values()
                    if p is not peer and keys.peer_identity != "psk" and p.identity == keys.peer_identity]
            if twin:
                raise crypto.HandshakeError(f"rank {src} presented identity {keys.peer_identity}, which rank "
                                            f"{twin[0]} already holds; one site, one key, one rank")
            self._install(peer, keys)
            peer.state = "ready"
            self._confirm(peer)

    def on_confirm(self, peer: Peer, total: int) -> None:
        """The initiator's peer confirmed the session (an authenticated CONFIRM frame)."""
        if peer.state != "finish_sent" or total != 0:
            self._s.reject(peer.rank, "unexpected handshake frame", "a handshake confirmation outside a handshake")
            return
        peer.state = "ready"

    @staticmethod
    def _install(peer: Peer, keys: crypto.SessionKeys) -> None:
        peer.tx, peer.rx, peer.identity = keys.send, keys.recv, keys.peer_identity
        peer.hs = None

