"""The launcher's rank watch on real processes: who ended first, and nothing outlives the job."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpcfed.launch import jobwatch


def _fake_rank(log_dir, rank: int, then: str = "", env: dict | None = None) -> subprocess.Popen:
    """A process that registers as rank `rank` the way `run_rank` does, runs `then`, then sleeps."""
    code = f"from pathlib import Path; from hpcfed.launch import jobwatch; import os, time; " \
           f"log = Path({str(log_dir)!r}); jobwatch.write_pid(log, {rank}); " \
           f"jobwatch.hold_lifeline({rank}); {then or 'pass'}; time.sleep(120)"
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **(env or {})})


def _reap(procs: list[subprocess.Popen]) -> None:
    """Kill and wait for each: a Popen dropped unwaited warns (ResourceWarning) in whichever test
    the garbage collector happens to run in."""
    for proc in procs:
        proc.kill()
        proc.wait(timeout=30)


def _registered(log_dir, n: int) -> None:
    deadline = time.monotonic() + 30
    while not all((log_dir / f"rank{r}.pid").exists() for r in range(n)):
        assert time.monotonic() < deadline, "the fake ranks never registered"
        time.sleep(0.05)


def test_first_dead_rank_is_named_and_leftovers_are_killed(tmp_path):
    ranks = [_fake_rank(tmp_path, r) for r in range(3)]
    try:
        _registered(tmp_path, 3)
        launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])  # stands in for mpiexec
        watch = jobwatch.RankWatch(tmp_path, 3)
        watch.update(0)
        ranks[1].kill()
        code = jobwatch.follow(launcher, watch, finished=lambda: None)
        assert code == 0
        assert watch.first_dead() == 1
        # mpiexec has gone; ranks 0 and 2 would be orphans: the watch has killed them.
        for proc in ranks:
            assert proc.wait(timeout=10) != 0
    finally:
        _reap(ranks)


def test_the_order_of_ends_holds_when_the_watch_looks_late(tmp_path):
    """On a loaded node the launcher may run again only after mpiexec has killed every other rank:
    the rank that died first is still the one named (the CI failure of stop 18 named the server)."""
    ranks = [_fake_rank(tmp_path, r) for r in range(3)]
    watch = jobwatch.RankWatch(tmp_path, 3)
    try:
        _registered(tmp_path, 3)
        watch.update(0)
        for r in (2, 0, 1):  # each one dead before the next is killed, all before the watch looks
            ranks[r].kill()
            ranks[r].wait(timeout=30)
        watch.update(0)
        assert watch.ended == [2, 0, 1] and watch.first_dead() == 2
        assert watch.running() == []
    finally:
        watch.close()
        _reap(ranks)


def test_a_rank_slow_to_finish_dying_is_still_named_first(tmp_path):
    """Under load a SIGKILLed client can finish dying after the server that mpiexec killed because
    of it. Its lifeline (released first of all its files) is what tells: here rank 2 closes it
    (as a dying process does first) but lingers while the server dies and is reaped."""
    watch = jobwatch.RankWatch(tmp_path, 3)
    env = watch.open_lifelines()
    ranks = [_fake_rank(tmp_path, 0, env=env), _fake_rank(tmp_path, 1, env=env),
             _fake_rank(tmp_path, 2, then="time.sleep(1.5); os.close(jobwatch.lifeline_slot())", env=env)]
    try:
        _registered(tmp_path, 3)
        watch.update(0)
        deadline = time.monotonic() + 30
        while 2 not in watch.ended:  # its lifeline has closed; the process lives on
            assert time.monotonic() < deadline, "rank 2's lifeline never closed"
            watch.update(0.1)
        assert ranks[2].poll() is None
        ranks[0].kill()
        ranks[0].wait(timeout=30)
        ranks[2].kill()
        ranks[2].wait(timeout=30)
        watch.update(0)
        assert watch.ended[:2] == [2, 0] and watch.first_dead() == 2
    finally:
        watch.close()
        _reap(ranks)
    assert not Path(env[jobwatch.LIFELINES_ENV]).exists()  # nothing left behind, and none in the run folder
    assert not list(tmp_path.glob("*lifeline*"))


def test_a_killed_rank_releases_its_lifeline_before_its_pipes_and_sockets(tmp_path):
    """What the lifelines rest on: the kernel releases a SIGKILLed process's files from the highest
    descriptor down, so the lifeline closes before the pipes and the PMI socket through which the
    MPI launcher learns of the death. (Held as descriptor 0, as first built, it closed last: the CI
    failure of stop 18 named the server again.)"""
    watch = jobwatch.RankWatch(tmp_path, 1)
    env = watch.open_lifelines()
    # A second reader of the lifeline, opened before the rank opens it (a FIFO reports the hang-up
    # only to readers that were there when the writer came), in one epoll with the rank's pipes.
    lifeline = os.open(Path(env[jobwatch.LIFELINES_ENV]) / "rank0", os.O_RDONLY | os.O_NONBLOCK)
    pipe_read, pipe_write = os.pipe()  # stands in for the PMI socket, at a low descriptor
    rank = subprocess.Popen([sys.executable, "-c", "from hpcfed.launch import jobwatch; import time; "
                             "assert jobwatch.hold_lifeline(0); print('held', flush=True); time.sleep(120)"],
                            env={**os.environ, **env}, stdout=subprocess.PIPE, pass_fds=(pipe_write,))
    os.close(pipe_write)
    ends = select.epoll()
    try:
        assert rank.stdout.readline() == b"held\n"
        names = {lifeline: "lifeline", pipe_read: "pipe", rank.stdout.fileno(): "stdout"}
        for fd in names:
            ends.register(fd, 0)
        rank.kill()
        order: list[str] = []
        deadline = time.monotonic() + 30
        while len(order) < len(names) and time.monotonic() < deadline:
            for fd, _ in ends.poll(1):
                order.append(names[fd])
                ends.unregister(fd)
        assert order[0] == "lifeline" and sorted(order) == ["lifeline", "pipe", "stdout"], order
    finally:
        ends.close()
        os.close(lifeline)
        os.close(pipe_read)
        rank.kill()
        rank.wait(timeout=30)
        rank.stdout.close()
        watch.close()


def test_writing_to_a_lifeline_ends_nothing(tmp_path):
    """A rank that writes to its lifeline (a hostile plugin, a stray write) is not
    taken for dead: only the lifeline's closing counts, so the rank is still watched and killed
    with the job."""
    watch = jobwatch.RankWatch(tmp_path, 2)
    env = watch.open_lifelines()
    ranks = [_fake_rank(tmp_path, 0, env=env),
             _fake_rank(tmp_path, 1, then="os.write(jobwatch.lifeline_slot(), b'x' * 4096)", env=env)]
    try:
        _registered(tmp_path, 2)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            watch.update(0.1)
        assert watch.ended == [] and watch.running() == [0, 1]
        ranks[1].kill()
        ranks[1].wait(timeout=30)
        watch.update(0)
        assert watch.ended == [1]
    finally:
        watch.close()
        _reap(ranks)


def test_without_a_launcher_a_rank_keeps_its_stdin(tmp_path, monkeypatch):
    monkeypatch.delenv(jobwatch.LIFELINES_ENV, raising=False)
    assert jobwatch.hold_lifeline(0) is False  # plain mpiexec or srun
    monkeypatch.setenv(jobwatch.LIFELINES_ENV, str(tmp_path))
    assert jobwatch.hold_lifeline(0) is False  # another node: no such FIFO here
    os.mkfifo(tmp_path / "rank1")
    assert jobwatch.hold_lifeline(1) is False  # a FIFO nobody reads (a finished launcher's)


def test_server_done_kills_dropped_clients_at_once(tmp_path):
    ranks = [_fake_rank(tmp_path, r) for r in range(3)]
    try:
        _registered(tmp_path, 3)
        launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        watch = jobwatch.RankWatch(tmp_path, 3)
        jobwatch.write_exit(tmp_path, 0, 0)  # the server leaves with status 0
        dropped = []

        def on_done():
            dropped.append(True)
            return [2]

        ranks[0].kill()  # the server's process ends after reporting

        def end_launcher():  # follow() returns when the launcher ends: end it once rank 2 is gone
            ranks[2].wait(timeout=30)
            ranks[1].kill()
            launcher.kill()

        threading.Thread(target=end_launcher, daemon=True).start()
        jobwatch.follow(launcher, watch, finished=on_done)
        # called once the server reported (the launcher ends only after rank 2 is killed by follow)
        assert len(dropped) == 1
        assert ranks[2].wait(timeout=5) != 0
        assert jobwatch.exit_status(tmp_path, 0) == 0 and jobwatch.exit_status(tmp_path, 2) is None
    finally:
        _reap([*ranks, launcher])


def test_open_mpi_report_names_the_first_rank(tmp_path):
    watch = jobwatch.RankWatch(tmp_path, 3)
    watch.pids = {0: 100, 1: 101, 2: 102}
    watch.scan("mpiexec noticed that process rank 1 with PID 101 on node n1 exited on signal 9 (Killed).\n")
    assert watch.first_dead() == 1


def test_exit_markers_carry_the_reason_and_whether_it_was_the_cause(tmp_path):
    import os

    jobwatch.write_exit(tmp_path, 0, 0)
    jobwatch.write_exit(tmp_path, 2, 1, "dataset 'hin/acm' not found at /x;\n set HPCFED_DATA")
    jobwatch.write_exit(tmp_path, 1, 1, "MPI error talking to another rank", secondary=True)
    os.utime(tmp_path / "rank1.exit", (1, 1))  # recorded first, but only as a consequence
    assert [jobwatch.exit_status(tmp_path, r) for r in range(4)] == [0, 1, 1, None]
    found = jobwatch.failures(tmp_path, 4)
    assert [(f.rank, f.secondary) for f in found] == [(1, True), (2, False)]
    assert found[1].reason == "dataset 'hin/acm' not found at /x; set HPCFED_DATA"  # one line


def test_rank_ended_reads_the_exit_record_or_a_vanished_process(tmp_path):
    assert jobwatch.rank_ended(tmp_path, 1) is None  # not started: no evidence
    proc = _fake_rank(tmp_path, 1)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "rank1.pid").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert jobwatch.rank_ended(tmp_path, 1) is None  # running
        proc.kill()
        proc.wait(timeout=30)
        assert jobwatch.rank_ended(tmp_path, 1) == "ended without a word (killed or crashed)"
        jobwatch.write_exit(tmp_path, 1, 2, "bad config")
        assert jobwatch.rank_ended(tmp_path, 1) == "exited with status 2: bad config"
    finally:
        _reap([proc])
    (tmp_path / "rank2.pid").write_text("1 another-host")  # pid 1 of another node: not ours to judge
    assert jobwatch.rank_ended(tmp_path, 2) is None
