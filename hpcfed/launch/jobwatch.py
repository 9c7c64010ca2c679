"""Following the ranks of a job that `hpcfed run --np` started under mpiexec.

Each rank writes ``logs/rank<r>.pid`` and ``logs/rank<r>.exit`` (`hpcfed.store.rank_records`). From
those the launcher can say which rank failed and why, or which ended
first without a word, tell a finished federation from a failed one, and make sure no rank outlives the
job: MPI launchers kill the other ranks when one dies, but a rank stuck in ``MPI_Abort`` or left behind
by a dead proxy would otherwise run on as an orphan.
"""

from __future__ import annotations

import os
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TextIO

# The records themselves live below both the launcher and the server; the names stay importable from
# here for the launcher's callers.
from hpcfed.store.rank_records import (
    HALT_FILE,
    Failure,
    alive,
    clear,
    exit_status,
    failures,
    rank_ended,
    write_exit,
    write_pid,
)

__all__ = [
    "HALT_FILE", "LIFELINES_ENV", "Failure", "RankWatch", "alive", "clear", "exit_status", "failures", "follow",
    "hold_lifeline", "lifeline_slot", "rank_ended", "write_exit", "write_pid",
]

# How Open MPI's mpiexec reports the first rank that ended badly.
_OMPI_REPORT = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal")


# The folder of the lifelines, set by the launcher in the ranks' environment. Node-local on purpose:
# a rank on another node finds none and goes without.
LIFELINES_ENV = "HPCFED_LIFELINES"


def hold_lifeline(rank: int) -> bool:
    """Hold this rank's lifeline (a FIFO the launcher reads) open in the highest descriptor slot
    this process may use.

    Linux releases a dying process's files from the highest descriptor down (it queues each
    release and runs the queue newest first), so the launcher sees the lifeline close before the
    MPI launcher sees this rank's PMI socket or output pipes close, and so before it kills any
    other rank: the order in which lifelines close is the order in which ranks died, however long
    each took to finish dying. (Descriptor 0 would be released last of all.) False (and nothing
    changed) when no launcher is reading, e.g. under plain mpiexec or srun, or on another node."""
    folder = os.environ.get(LIFELINES_ENV)
    if not folder:
        return False
    try:
        fd = os.open(Path(folder) / f"rank{rank}", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: nobody reads it; ENOENT: another node, or a finished launcher
        return False
    slot = lifeline_slot()
    if fd == slot:
        os.set_inheritable(fd, False)
        return True
    try:
        os.dup2(fd, slot, inheritable=False)  # programs the rank runs do not get it
    except OSError:
        return False  # no slot free up there: go without
    finally:
        os.close(fd)
    return True


def lifeline_slot() -> int:
    """The highest descriptor number this process may open (capped: the kernel sizes a process's
    descriptor table to its highest slot in use, and a million slots cost 8 MiB)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = _MAX_LIFELINE_SLOT + 1 if soft == resource.RLIM_INFINITY else min(soft, _MAX_LIFELINE_SLOT + 1)
    return limit - 1


_MAX_LIFELINE_SLOT = 65535


class RankWatch:
    """Which of the job's `np` ranks (on this host) are alive, and in which order they ended.

    All ranks' pidfds sit in one epoll set. The kernel queues ready pidfds in the order their
    processes ended and epoll hands them back in that order, so the order holds however late this
    process is scheduled: on a loaded node mpiexec may have killed every other rank before the
    launcher runs again, and a per-rank timestamp taken on waking (by a thread, after it gets the
    GIL) would then name whichever thread ran first, not the rank that died first."""

    def __init__(self, log_dir: Path, np: int) -> None:
        self.log_dir, self.np = log_dir, np
        self.pids: dict[int, int] = {}  # rank -> pid; -1 for a rank on another host
        self.reported: list[int] = []  # ranks mpiexec itself said ended badly, in order
        self._order: list[int] = []  # ranks in the order they ended
        self._wall_ends: dict[int, float] = {}  # when each end was seen (to compare with files' mtimes)
        self._fds: dict[int, int] = {}  # rank -> pidfd
        self._lifelines: dict[int, int] = {}  # rank -> read end of its lifeline
        self._lifeline_dir: Path | None = None
        self._ranks_by_fd: dict[int, int] = {}  # pidfds and lifelines
        self._epoll = select.epoll() if hasattr(os, "pidfd_open") else None

    def open_lifelines(self) -> dict[str, str]:
        """Before the ranks start: make each rank's lifeline (see `hold_lifeline`) in a private
        folder of this node's temporary space (not the run directory, which users copy) and read
        it. Returns the environment the ranks need to find them. The pidfds alone give the order
        in which ranks *finished* dying; on a loaded node a killed client can finish after the
        server that mpiexec killed because of it."""
        if self._epoll is None:
            return {}
        self._lifeline_dir = Path(tempfile.mkdtemp(prefix="hpcfed-lifelines-"))
        for rank in range(self.np):
            path = self._lifeline_dir / f"rank{rank}"
            try:
                os.mkfifo(path, 0o600)
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                continue  # a temporary space without FIFOs: the pidfds still tell the order
            self._lifelines[rank], self._ranks_by_fd[fd] = fd, rank
            # Only its closing counts (EPOLLHUP, reported unasked, once the rank has opened it and
            # closed it again): bytes a rank writes there are never read and end nothing.
            self._epoll.register(fd, 0)
        return {LIFELINES_ENV: str(self._lifeline_dir)}

    @property
    def ended(self) -> list[int]:
        """The ranks seen to end, in the order they ended."""
        return list(self._order)

    def first_dead(self) -> int | None:
        """The rank that ended first, once every rank had started (None before that)."""
        if self.reported:
            return self.reported[0]
        return self._order[0] if self._order and len(self.pids) == self.np else None

    def ended_at(self, rank: int) -> float | None:
        """Wall-clock time at which `rank`'s end was seen (None if it was not seen end)."""
        return self._wall_ends.get(rank)

    def scan(self, line: str) -> None:
        """Read one line of mpiexec's output for its report of a rank that ended badly. (Open MPI
        names the rank; MPICH's Hydra prints a PID, but that of the first local process, not the
        one that failed, so it is not used.) Called from the output relay threads."""
        found = _OMPI_REPORT.search(line)
        if found:
            self.reported.append(int(found.group(1)))

    def update(self, wait_s: float = 0.2) -> None:
        """Pick up newly started ranks, then wait up to `wait_s` for a rank to end."""
        host = socket.gethostname()
        for rank in range(self.np):
            if rank in self.pids:
                continue
            try:
                pid_text, pid_host = (self.log_dir / f"rank{rank}.pid").read_text().split(maxsplit=1)
            except (OSError, ValueError):
                continue
            if pid_host.strip() != host:
                self.pids[rank] = -1  # on another node: its launcher there looks after it
                continue
            self.pids[rank] = int(pid_text)
            self._watch(rank, int(pid_text))
        if self._epoll is not None:
            for fd, _ in self._epoll.poll(max(wait_s, 0)):
                rank = self._ranks_by_fd[fd]
                # a lifeline closed before this rank's pid file was read: it had started all the same
                self.pids.setdefault(rank, -1)
                self._record(rank)
            return
        time.sleep(wait_s)
        for rank, pid in sorted(self.pids.items()):
            if pid > 0 and rank not in self._wall_ends and not alive(pid):
                self._record(rank)

    def _watch(self, rank: int, pid: int) -> None:
        if self._epoll is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._record(rank)
            return
        self._fds[rank], self._ranks_by_fd[fd] = fd, rank
        if rank in self._wall_ends:
            return  # its lifeline closed already
        self._epoll.register(fd, select.EPOLLIN)

    def _record(self, rank: int) -> None:
        if rank in self._wall_ends:
            return
        self._order.append(rank)
        self._wall_ends[rank] = time.time()
        for fd in (self._fds.get(rank), self._lifelines.get(rank)):
            if fd is not None and self._epoll is not None:  # fds are only held with epoll
                self._epoll.unregister(fd)  # ready for good now: do not report it again

    def running(self) -> list[int]:
        """The ranks that started and have not been seen to end."""
        if self._epoll is not None:
            return sorted(r for r in self._fds if r not in self._wall_ends)
        return [r for r, pid in sorted(self.pids.items()) if pid > 0 and r not in self._wall_ends and alive(pid)]

    def kill(self, ranks: list[int]) -> None:
        """SIGKILL these ranks; through their pidfds where possible, so a recycled pid is never hit."""
        for rank in ranks:
            try:
                if rank in self._fds:
                    if rank not in self._wall_ends:
                        signal.pidfd_send_signal(self._fds[rank], signal.SIGKILL)
                elif self._epoll is None and self.pids.get(rank, -1) > 0:
                    os.kill(self.pids[rank], signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Close the pidfds, the lifelines and the epoll set."""
        for fd in [*self._fds.values(), *self._lifelines.values()]:
            os.close(fd)
        self._fds.clear()
        self._lifelines.clear()
        if self._lifeline_dir is not None:
            shutil.rmtree(self._lifeline_dir, ignore_errors=True)
            self._lifeline_dir = None
        if self._epoll is not None:
            self._epoll.close()


def follow(proc: subprocess.Popen[bytes], watch: RankWatch, *, finished: Callable[[], list[int] | None],
           grace_s: float = 60.0) -> int:
    """Wait for `proc` (mpiexec, started with stdout and stderr piped) while following its ranks,
    passing its output through, and return its status.

    `finished()` returns None while the federation runs, and once its results are written the
    ranks to kill at once (clients the server dropped: nothing they do can change the result, and
    a hung one would hold the job); whatever still runs `grace_s` later is killed too. When mpiexec
    ends, every rank still running on this host is killed."""
    relays = [_relay(stream, sink, watch) for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
              if stream is not None]
    done_at = None
    try:
        while proc.poll() is None:
            watch.update()
            if done_at is None:
                to_kill = finished()
                if to_kill is not None:
                    done_at = time.monotonic()
                    watch.kill(to_kill)
            elif time.monotonic() - done_at > grace_s:
                watch.kill(watch.running())
        code = proc.wait()
        for relay in relays:
            relay.join(timeout=5)
        deadline = time.monotonic() + 5.0  # ranks killed by mpiexec may take a moment to go
        watch.update(0.05)  # at least once: a rank may have registered after the last look
        while watch.running() and time.monotonic() < deadline:
            watch.update(0.05)
        watch.kill(watch.running())
        return code
    finally:
        watch.close()


def _relay(stream: IO[bytes], sink: TextIO, watch: RankWatch) -> threading.Thread:
    """Copy `stream` to `sink` line by line, showing each line to `watch.scan`."""

    def run() -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            watch.scan(line)
            sink.write(line)
            sink.flush()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
