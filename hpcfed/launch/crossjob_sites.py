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
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any

from hpcfed.comm import port as mpiport
from hpcfed.comm.lifeline import Lifelines
from hpcfed.comm.rendezvous import Knock, Listener, send_go
from hpcfed.comm.spokes import SpokeTransport
from hpcfed.errors import FederationError

log = logging.getLogger("hpcfed")

ACCEPT_S = 30.0  # a site told to connect does so at once; past this its Accept is released
_KNOCK_POLL_S = 1.0  # how often the knock thread looks whether the federation has ended


class SiteDoor:
    """The server job's side of its sites: the knock listener, the MPI port, the spokes and the
    lifelines. `joined` is read by the server's thread and the knock thread (under `_lock`)."""

    def __init__(self, listener: Listener, port_name: str, transport: SpokeTransport, lifeline_timeout: float) -> None:
        self.listener, self.port_name, self.transport = listener, port_name, transport
        self.lifelines = Lifelines(self.on_lost, timeout=lifeline_timeout)
        self.num_sites = transport.size - 1
        self.joined: set[int] = set()  # ranks let in, lost ones included (they cannot knock again)
        self._queued: set[int] = set()  # ranks welcomed and waiting to be let in
        self._knocks: queue.Queue[Knock] = queue.Queue()
        self._lock = threading.Lock()
        self.finished = threading.Event()  # the federation is over: losses no longer matter
        self.server: Any = None  # once built: told of every site lost
        self.lost: dict[int, str] = {}  # client id -> why

    # -- at the start ------------------------------------------------------------------------------
    def gather(self, deadline: float, min_sites: int, hint: str) -> set[int]:
        """Let sites in until all have joined or `deadline`; the client ids of those that have not
        (they may join later). FederationError when fewer than `min_sites` joined."""
        while len(self.joined) < self.num_sites:
            knock = self.listener.next_site(deadline, self.taken())
            if knock is None:
                break
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

    def taken(self) -> set[int]:
        with self._lock:
            return self.joined | self._queued

    def let_in(self, knock: Knock) -> bool:
        """GO, then `Accept` the site's `Connect`: its spoke and its lifeline from now on."""
        try:
            send_go(knock.sock)
            comm = mpiport.accept(self.port_name, ACCEPT_S)
        except OSError as exc:
            comm, why = None, f"it went away after its knock ({exc.strerror or exc})"
        else:
            why = f"it never connected to the MPI port within {ACCEPT_S:g} s"
        with self._lock:
            self._queued.discard(knock.rank)
            if comm is not None:
                self.joined.add(knock.rank)
        if comm is None:
            log.warning("site %d was welcomed but is not let in: %s; it may knock again", knock.rank - 1, why)
            with contextlib.suppress(OSError):
                knock.sock.close()
            return False
        self.transport.add_link(knock.rank, mpiport.intercomm_transport(comm))
        self.lifelines.add(knock.rank, knock.sock)
        log.info("site %d joined as rank %d (key %s)", knock.rank - 1, knock.rank, knock.identity)
        return True

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
            self._knocks.put(knock)

    def admit(self, channel: Any, timeout: float) -> list[int]:
        """From the server's thread: let in the sites that knocked since, and authenticate them on
        `channel`; the client ids now connected."""
        ranks = []
        while True:
            try:
                knock = self._knocks.get_nowait()
            except queue.Empty:
                break
            if self.let_in(knock):
                ranks.append(knock.rank)
        if not ranks:
            return []
        with contextlib.suppress(Exception):  # who failed is read from channel.peers below
            channel.connect(ranks, timeout=timeout, require_all=False)
        for rank in ranks:
            if rank not in channel.peers:
                log.warning("site %d (rank %d) joined but did not authenticate within %g s; it is not let in",
                            rank - 1, rank, timeout)
                self.lifelines.drop(rank)
                self.transport.mark_lost(rank)
        return [r - 1 for r in ranks if r in channel.peers]

    # -- lost ------------------------------------------------------------------------------------------
    def on_lost(self, rank: int, reason: str) -> None:
        """From the lifelines' thread: never send to the site again, and have the server drop it."""
        self.transport.mark_lost(rank)
        if self.finished.is_set():
            return
        log.warning("site %d (rank %d) lost: %s; nothing more is sent to it", rank - 1, rank, reason)
        self.lost[rank - 1] = reason
        if self.server is not None:
            self.server.site_lost(rank - 1, f"lost: {reason}")

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
