"""Following the ranks of a job that `hpcfed run --np` started under mpiexec.

Each rank writes ``logs/rank<r>.pid`` (pid and host) when it starts and ``logs/rank<r>.exit`` (its
exit status) just before it leaves. From those the launcher can say which rank ended first, tell a
finished federation from a failed one, and make sure no rank outlives the job: MPI launchers kill
the other ranks when one dies, but a rank stuck in ``MPI_Abort`` or left behind by a dead proxy
would otherwise run on as an orphan.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def write_pid(log_dir: Path, rank: int) -> None:
    _write(log_dir / f"rank{rank}.pid", f"{os.getpid()} {socket.gethostname()}")


def write_exit(log_dir: Path, rank: int, code: int) -> None:
    _write(log_dir / f"rank{rank}.exit", str(code))


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        pass  # bookkeeping only: a read-only or full disk must not fail the rank


def clear(log_dir: Path) -> None:
    """Forget an earlier attempt's ranks (the output folder is reused by --resume)."""
    for stale in [*log_dir.glob("rank*.pid"), *log_dir.glob("rank*.exit")]:
        stale.unlink(missing_ok=True)


def exit_status(log_dir: Path, rank: int) -> int | None:
    """The status rank `rank` reported on leaving, or None if it never reported (killed, crashed)."""
    try:
        return int((log_dir / f"rank{rank}.exit").read_text())
    except (OSError, ValueError):
        return None


@dataclass
class RankWatch:
    """Which of the job's `np` ranks (on this host) are alive, and which ended first."""

    log_dir: Path
    np: int
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid, ranks on this host
    ended: list[int] = field(default_factory=list)  # in the order their ends were seen
    _fds: dict[int, int] = field(default_factory=dict)  # pidfd -> rank
    _poller: object = None

    def __post_init__(self) -> None:
        self._poller = select.poll() if hasattr(os, "pidfd_open") else None

    def first_dead(self) -> int | None:
        """The rank seen ending first, once every rank had started (None before that)."""
        return self.ended[0] if self.ended and len(self.pids) == self.np else None

    def update(self, wait_s: float = 0.2) -> None:
        """Pick up newly started ranks and record ends, waiting up to `wait_s` for one."""
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
        if self._poller is not None and self._fds:
            for fd, _ in sorted(self._poller.poll(wait_s * 1000), key=lambda e: self._fds[e[0]]):  # type: ignore[attr-defined]
                self._record(self._fds.pop(fd))
                self._poller.unregister(fd)  # type: ignore[attr-defined]
                os.close(fd)
        else:
            time.sleep(wait_s)
            for rank, pid in sorted(self.pids.items()):
                if pid > 0 and rank not in self.ended and not alive(pid):
                    self._record(rank)

    def _watch(self, rank: int, pid: int) -> None:
        if self._poller is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._record(rank)
            return
        self._fds[fd] = rank
        self._poller.register(fd, select.POLLIN)  # type: ignore[attr-defined]

    def _record(self, rank: int) -> None:
        if rank not in self.ended:
            self.ended.append(rank)

    def running(self) -> list[int]:
        if self._poller is not None:
            return sorted(self._fds.values())
        return [r for r, pid in sorted(self.pids.items()) if pid > 0 and r not in self.ended and alive(pid)]

    def kill(self, ranks: list[int]) -> None:
        """SIGKILL these ranks; through their pidfds where possible, so a recycled pid is never hit."""
        fd_of = {rank: fd for fd, rank in self._fds.items()}
        for rank in ranks:
            try:
                if rank in fd_of:
                    signal.pidfd_send_signal(fd_of[rank], signal.SIGKILL)
                elif self._poller is None and self.pids.get(rank, -1) > 0:
                    os.kill(self.pids[rank], signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def follow(proc: subprocess.Popen, watch: RankWatch, *, on_server_done, grace_s: float = 60.0) -> int:
    """Wait for `proc` (mpiexec) while following its ranks, and return its status.

    When rank 0 reports status 0 the federation has finished: `on_server_done()` returns the ranks
    to kill at once (clients the server dropped: nothing they do can change the result, and a hung
    one would hold the job), and whatever still runs `grace_s` later is killed. When mpiexec ends,
    every rank still running on this host is killed too."""
    done_at = None
    try:
        while proc.poll() is None:
            watch.update()
            if done_at is None and exit_status(watch.log_dir, 0) == 0:
                done_at = time.monotonic()
                watch.kill(on_server_done())
            elif done_at is not None and time.monotonic() - done_at > grace_s:
                watch.kill(watch.running())
        code = proc.wait()
        deadline = time.monotonic() + 5.0  # ranks killed by mpiexec may take a moment to go
        while watch.running() and time.monotonic() < deadline:
            watch.update(0.05)
        watch.kill(watch.running())
        return code
    finally:
        watch.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited even though kill(0) succeeds
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True
