"""The sites of `hpcfed serve`: who is let in at the start, who joins later, who is lost.

- **At the start** (`gather`) the server lets sites in as they knock until every site has joined
  or the start deadline passes (``hpcfed serve --start-deadline``, default
  ``federation.setup_timeout_s``); it then starts with the sites present, if they are at least
  ``federation.min_sites``, and otherwise ends naming the missing ones.
- **Later** (`take_knocks`, `admit`) a thread answers knocks (plain TCP: it never calls MPI) and
  queues the welcomed sites; the server's own thread lets them in at its next safe point (a sync
  round's start, an async step): `GO`, `Accept`, the channel's handshake, one site at a time so an
  `Accept` takes the site it was meant for. The server then runs the site's setup exchange
  (`hpcfed.server.joining`) and sends it the model from then on.
- **Lost** (`on_lost`, from the lifelines' thread): the transport never sends to the site again
  and the server drops it (`Server.site_lost`), as a one-job run drops a rank that ended.
- **Back** (a rejoin): a lost site may knock again with the same key. It is let in like a late
  site, on a new intercommunicator (`SpokeTransport.replace_link`) and a fresh channel session
  (`SecureChannel.forget`: new keys, nothing of the old session replayable). A site present and
  alive cannot be knocked for (refused at the knock), and a site is let back in at most once per
  `REJOIN_INTERVAL_S`: a flapping site waits, queued once, and each rejoin replaces the old
  link's records rather than adding to them, so rank 0's memory stays bounded.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

from hpcfed.comm import port as mpiport
from hpcfed.comm.lifeline import Lifelines
from hpcfed.comm.rendezvous import Knock, Listener, send_go
from hpcfed.comm.spokes import SpokeTransport
from hpcfed.errors import FederationError

log = logging.getLogger("hpcfed")

ACCEPT_S = 30.0  # a site told to connect does so at once; past this its Accept is released
REJOIN_INTERVAL_S = 10.0  # a site is let back in at most this often (a flapping site waits its turn)
_KNOCK_POLL_S = 1.0  # how often the knock thread looks whether the federation has ended


class HaltedAtStart(Exception):
    """The operator asked the server to halt while it gathered its sites (nothing ran yet)."""


class SiteDoor:
    """The server job's side of its sites: the knock listener, the MPI port, the spokes and the
    lifelines. `joined` is read by the server's thread and the knock thread (under `_lock`)."""

    def __init__(self, listener: Listener, port_name: str, transport: SpokeTransport, lifeline_timeout: float) -> None:
        self.listener, self.port_name, self.transport = listener, port_name, transport
        self.lifelines = Lifelines(self.on_lost, timeout=lifeline_timeout)
        self.num_sites = transport.size - 1
        self.joined: set[int] = set()  # ranks let in, lost ones included (they may knock again: `lost`)
        self._queued: set[int] = set()  # ranks welcomed and waiting to be let in
        self._knocks: queue.Queue[tuple[Knock, float]] = queue.Queue()  # with when it came (monotonic)
        self._let_in_at: dict[int, float] = {}  # rank -> when it was last let in (one entry per site)
        self._lock = threading.Lock()
        self.finished = threading.Event()  # the federation is over: losses no longer matter
        self.server: Any = None  # once built: told of every site lost
        self.lost: dict[int, str] = {}  # client id -> why
        self.refused_at_start: dict[int, str] = {}  # client id -> why (evicted in the checkpoint resumed from)

    # -- at the start ------------------------------------------------------------------------------
    def gather(self, deadline: float, min_sites: int, hint: str, *, left_out: AbstractSet[int] = frozenset(),
               halted: Callable[[], str | None] = lambda: None) -> set[int]:
        """Let sites in until all but `left_out` (excluded by the operator, or evicted in the checkpoint
        a resumed server continues from: never waited for) have joined or `deadline`; the client ids
        of those that have not (they may join later).
        FederationError when fewer than `min_sites` joined; `HaltedAtStart` when `halted()` gives
        a reason (OUT/HALT, SIGUSR2), looked at every second while it waits."""
        wanted = self.num_sites - len(left_out)
        while len(self.joined) < wanted:
            why = halted()
            if why is not None:
                raise HaltedAtStart(f"halt requested ({why}) while gathering sites ({len(self.joined)} of {wanted} "
                                    f"joined): no round was run; start the server again to go on")
            knock = self.listener.next_site(min(deadline, time.monotonic() + _KNOCK_POLL_S), self.taken())
            if knock is None and time.monotonic() >= deadline:
                break
            if knock is not None and knock.rank - 1 in left_out:
                log.warning("site %d is excluded (federation.exclude_sites): not let in", knock.rank - 1)
                knock.sock.close()
            elif knock is not None:
                self.let_in(knock)
        absent = set(range(self.num_sites)) - {r - 1 for r in self.joined}
        if len(self.joined) < min_sites:
            raise FederationError(
                f"only {len(self.joined)} of {self.num_sites} sites joined by the start deadline, fewer than "
                f"federation.min_sites={min_sites}; missing: site{'s' if len(absent) > 1 else ''} "
                f"{', '.join(map(str, sorted(absent)))}: {hint}")
        if absent:
            log.warning("starting with %d of %d sites; site%s %s may join later (from the next round)",
                        len(self.joined), self.num_sites, "s" if len(absent) > 1 else "",
                        ", ".join(map(str, sorted(absent))))
        return absent

    def taken(self) -> dict[int, str]:
        """The ranks no knock may claim: joined and not lost (present and alive), queued, or
        evicted (with the reason its knock is refused; "" for the listener's own)."""
        with self._lock:
            taken = dict.fromkeys((self.joined - {cid + 1 for cid in self.lost}) | self._queued, "")
        for cid, reason in self.refused_at_start.items():
            taken[cid + 1] = f"site {cid} was evicted from this federation ({reason}): it cannot rejoin"
        for cid, reason in self.server.refused() if self.server is not None else ():
            taken[cid + 1] = f"site {cid} is out of this federation ({reason}): it cannot rejoin"
        return taken

    def let_in(self, knock: Knock) -> bool:
        """GO, then `Accept` the site's `Connect`: its spoke and its lifeline from now on."""
        def gone() -> bool:
            if not _closed(knock.sock):
                return False
            log.warning("site %d's job ended after its GO, before its MPI Connect: its pending Accept is released",
                        knock.rank - 1)
            return True

        try:
            send_go(knock.sock)
            comm = mpiport.accept(self.port_name, ACCEPT_S, gone=gone)
        except OSError as exc:
            comm, why = None, f"it went away after its knock ({exc.strerror or exc})"
        except mpiport.PortStuck as exc:
            comm, why = None, f"{exc} (it was killed in the middle of its Connect)"
            self._fresh_port()
        else:
            why = (f"it never connected to the MPI port within {ACCEPT_S:g} s" if not _closed(knock.sock) else
                   "its job ended before it connected to the MPI port (its knock's socket closed)")
        with self._lock:
            self._queued.discard(knock.rank)
            back = knock.rank in self.joined
            if comm is not None:
                self.joined.add(knock.rank)
                self._let_in_at[knock.rank] = time.monotonic()
                self.lost.pop(knock.rank - 1, None)
        if comm is None:
            log.warning("site %d was welcomed but is not let in: %s; it may knock again", knock.rank - 1, why)
            with contextlib.suppress(OSError):
                knock.sock.close()
            return False
        link = mpiport.intercomm_transport(comm)
        if back:
            self.transport.replace_link(knock.rank, link)
        else:
            self.transport.add_link(knock.rank, link)
        self.lifelines.add(knock.rank, knock.sock)
        log.info("site %d %s as rank %d (key %s)", knock.rank - 1, "is back" if back else "joined", knock.rank,
                 knock.identity)
        return True

    def _fresh_port(self) -> None:
        """An Accept is stuck on the old port (its thread stays in MPI): sites are told a new one."""
        self.port_name = self.listener.port_name = mpiport.open_port()
        log.warning("an MPI Accept could not be released: sites are let in on a fresh MPI port from now on")

    # -- later ---------------------------------------------------------------------------------------
    def take_knocks(self) -> None:
        """In a thread of its own until the federation ends: answer knocks, queue the welcomed."""
        while not self.finished.is_set():
            try:
                knock = self.listener.next_site(time.monotonic() + _KNOCK_POLL_S, self.taken())
            except (OSError, ValueError):  # ValueError: select() on the closed socket
                return  # the listener was closed: the server is ending
            except Exception as exc:  # one knock's fault is that knock's: the door stays open
                log.warning("a knock failed: %s: %s", type(exc).__name__, exc)
                continue
            if knock is None:
                continue
            with self._lock:
                self._queued.add(knock.rank)
            log.info("site %d knocked (key %s): it is let in at the next round or step", knock.rank - 1,
                     knock.identity)
            self._knocks.put((knock, time.monotonic()))

    def admit(self, channel: Any, timeout: float) -> dict[int, float]:
        """From the server's thread: let in the sites that knocked since, and authenticate them on
        `channel`; the client ids now connected, each with when its knock came (`time.monotonic`)."""
        ranks: dict[int, float] = {}
        not_yet = []
        while True:
            try:
                knock, knocked = self._knocks.get_nowait()
            except queue.Empty:
                break
            if time.monotonic() - self._let_in_at.get(knock.rank, -float("inf")) < REJOIN_INTERVAL_S:
                not_yet.append((knock, knocked))  # back too soon after its last let-in: it waits, queued (one a site)
            elif self.let_in(knock):
                ranks[knock.rank] = knocked
        for entry in not_yet:
            self._knocks.put(entry)
        if not ranks:
            return {}
        for rank in ranks:
            channel.forget(rank)  # a site back from a lost job: a fresh session (a new site: nothing to forget)
        with contextlib.suppress(Exception):  # who failed is read from channel.peers below
            channel.connect(ranks, timeout=timeout, require_all=False)
        for rank in ranks:
            if rank not in channel.peers:
                log.warning("site %d (rank %d) joined but did not authenticate within %g s; it is not let in",
                            rank - 1, rank, timeout)
                self.lifelines.drop(rank)
                self.transport.mark_lost(rank)
        return {r - 1: knocked for r, knocked in ranks.items() if r in channel.peers}

    # -- lost ------------------------------------------------------------------------------------------
    def on_lost(self, rank: int, reason: str) -> None:
        """From the lifelines' thread: never send to the site again, and have the server drop it."""
        self.transport.mark_lost(rank)
        if self.finished.is_set():
            return
        log.warning("site %d (rank %d) lost: %s; nothing more is sent to it (it may rejoin with `hpcfed join`)",
                    rank - 1, rank, reason)
        if self.server is not None:  # told before the door opens to the site again (`taken`)
            self.server.site_lost(rank - 1, f"lost: {reason}")
        with self._lock:
            self.lost[rank - 1] = reason

    def serve(self, server: Any) -> None:
        """The server is built: tell it of the sites lost so far, and of every later one."""
        self.server = server
        for cid, reason in list(self.lost.items()):
            server.site_lost(cid, f"lost: {reason}")

    def alive(self) -> list[int]:
        """The ranks joined and not lost."""
        return sorted(set(self.transport.links()) - self.transport.lost())

    def close(self) -> None:
        self.finished.set()
        self.listener.close()


def _closed(sock: socket.socket) -> bool:
    """Whether a welcomed site's knock socket (its lifeline to be) was closed by its end: its job died."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True
