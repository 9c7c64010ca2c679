"""The records each rank of a run leaves in ``OUT/logs``, and the halt file an operator leaves in ``OUT``.

Each rank writes ``logs/rank<r>.pid`` (pid and host) when it starts and ``logs/rank<r>.exit`` (its
exit status; for a failure also its one-line reason, and whether it only followed from another rank's
end) just before it leaves. The launcher (`hpcfed.launch.jobwatch`) reads them to say how a job ended;
rank 0's server reads them to tell a site that ended from one that is slow (`hpcfed.server.departures`)
and polls for ``OUT/HALT``. Both import this module, which imports neither: so the packages ``server``
and ``launch`` never import each other.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path


def write_pid(log_dir: Path, rank: int) -> None:
    """Record that this rank started: its pid and host in logs/rank<r>.pid."""
    _write(log_dir / f"rank{rank}.pid", f"{os.getpid()} {socket.gethostname()}")


def write_exit(log_dir: Path, rank: int, code: int, reason: str = "", *, secondary: bool = False) -> None:
    """Record how this rank ends: its status and, for a failure, the one-line reason (what the
    launcher prints last, after MPI's own messages). `secondary`: the failure followed from
    another rank's end (an MPI error talking to a peer that is gone), so it is not the cause."""
    reason = " ".join(reason.split())[:_MAX_REASON]
    text = f"{code}\n{reason}\n{_SECONDARY if secondary else ''}" if reason or secondary else str(code)
    _write(log_dir / f"rank{rank}.exit", text)


_SECONDARY = "secondary"


_MAX_REASON = 1000


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # whole or absent: the launcher polls these files and must never read one half-written
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(text)
        os.replace(partial, path)
    except OSError:
        pass  # bookkeeping only: a read-only or full disk must not fail the rank


def clear(log_dir: Path) -> None:
    """Forget an earlier attempt's ranks (the output folder is reused by --resume)."""
    for stale in [*log_dir.glob("rank*.pid"), *log_dir.glob("rank*.exit")]:
        stale.unlink(missing_ok=True)


# `touch OUT/HALT`: the server checkpoints after the current round and stops (any launcher, any node).
HALT_FILE = "HALT"


def exit_status(log_dir: Path, rank: int) -> int | None:
    """The status rank `rank` reported on leaving, or None if it never reported (killed, crashed)."""
    try:
        return int((log_dir / f"rank{rank}.exit").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def rank_ended(log_dir: Path, rank: int) -> str | None:
    """How rank `rank` ended, as far as this host can tell: from its exit record, or (a rank on this
    host that recorded nothing) from its process being gone; None while it runs, or when it runs on
    another host, whose processes this one cannot see."""
    try:
        lines = (log_dir / f"rank{rank}.exit").read_text().split("\n")
        code = int(lines[0])
        reason = lines[1].strip() if len(lines) > 1 else ""
        return f"exited with status {code}" + (f": {reason}" if reason else "")
    except (OSError, ValueError):
        pass
    try:
        pid_text, host = (log_dir / f"rank{rank}.pid").read_text().split(maxsplit=1)
        pid = int(pid_text)
    except (OSError, ValueError):
        return None  # not started yet, or its record is unreadable: no evidence either way
    if host.strip() != socket.gethostname() or pid <= 0:
        return None
    return None if alive(pid) else "ended without a word (killed or crashed)"


@dataclass(frozen=True)
class Failure:
    """One rank's recorded failure: rank, exit code, one-line reason, when, and whether it was secondary."""

    rank: int
    code: int
    reason: str
    when: float  # wall-clock time the rank recorded it
    secondary: bool  # it followed from another rank's end (see write_exit)


def failures(log_dir: Path, np: int) -> list[Failure]:
    """Every rank that recorded ending with an error, the earliest first. Ranks that MPI killed
    because another one aborted record nothing."""
    found = []
    for rank in range(np):
        path = log_dir / f"rank{rank}.exit"
        try:
            lines = path.read_text().split("\n")
            code, when = int(lines[0]), path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if code != 0:
            reason = lines[1].strip() if len(lines) > 1 else ""
            found.append(Failure(rank, code, reason, when, len(lines) > 2 and lines[2].strip() == _SECONDARY))
    return sorted(found, key=lambda f: (f.when, f.rank))


def alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie (one we may not signal counts as alive)."""
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
