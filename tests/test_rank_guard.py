"""The rank guard: a child ended by a signal becomes an exit status (hydra's proxy would otherwise
kill the node's other ranks), and the signals hydra sends a rank's process group do not end the guard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from hpcfed.launch.rank_guard import exit_code


def _guard(code: str) -> subprocess.Popen:
    # its own process group, as hydra gives each rank
    return subprocess.Popen([sys.executable, "-m", "hpcfed.launch.rank_guard", sys.executable, "-c", code],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def test_exit_codes():
    assert exit_code(0) == 0 and exit_code(3) == 3
    assert exit_code(-signal.SIGKILL) == 137 and exit_code(-signal.SIGSEGV) == 139


def test_a_child_killed_by_a_signal_is_an_exit_not_a_signal():
    proc = _guard("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.wait(timeout=60) == 137  # a plain exit status: the guard itself was not signalled
    proc.stdout.close()


def test_signals_to_the_process_group_reach_the_rank_and_spare_the_guard():
    proc = _guard("import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *_: sys.exit(5)); "
                  "print('ready', flush=True); time.sleep(60)")
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGUSR2)  # the halt signal: a rank's default would end it, but it
        os.killpg(proc.pid, signal.SIGUSR1)  # ... ends here by its own SIGUSR1 handler first or after
        assert proc.wait(timeout=60) in (5, 128 + signal.SIGUSR2)  # an exit either way: never the guard's death
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
