"""A rank's parent process, so that a site killed by a signal does not take its node's ranks with it.

MPICH's hydra proxy kills every rank it started on a node as soon as one of them ends *by a
signal* (`src/pm/hydra/proxy/pmip.c`: ``WIFSIGNALED`` -> ``PMIP_bcast_signal(SIGKILL)``), whatever
``-disable-auto-cleanup`` says; it only spares them when the rank *exits*. Measured with hydra
5.0.2: a client SIGKILLed mid-run took the server and the other clients down within 0.1 s.

``hpcfed run`` with ``federation.on_client_failure=continue`` therefore starts each rank as
``python -m hpcfed.launch.rank_guard python -m hpcfed run ...``: this process runs the rank as its child
and exits with 128+N when the child is ended by signal N. The proxy then sees an exit, tells the
other ranks (SIGUSR1) and leaves them running. Signals hydra sends to a rank go to its whole
process group, so the child gets them directly; this process only ignores them (it must not die
of them itself) and forwards SIGTERM and SIGHUP, which an operator may send to it alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

_IGNORED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)  # hydra delivers these to the child as well
_FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def exit_code(returncode: int) -> int:
    """The status this process exits with for a child that ended with `returncode` (negative: by a signal)."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str]) -> int:
    """Run `argv` as the rank and return the status to exit with."""
    if not argv:
        print("usage: python -m hpcfed.launch.rank_guard PROGRAM [ARG...]", file=sys.stderr)
        return 2
    for sig in _IGNORED:
        signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN: the child must not inherit "ignored"
    child = subprocess.Popen(argv, close_fds=False)  # the child needs hydra's PMI socket (PMI_FD)
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(child, signum))
    return exit_code(child.wait())


def _forward(child: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it has ended already
        os.kill(child.pid, signum)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # At once: Python's shutdown would restore SIGUSR1's default action, and a SIGUSR1 from hydra
    # (the other ranks leave too) would then end this process by a signal after all.
    os._exit(code)
