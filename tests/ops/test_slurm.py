"""Real Slurm: a single-node cluster on localhost (../shared/tools/local-slurm.sh), `sbatch` jobs
running 3-rank quickstart federations end to end, and a requeued job that resumes from its
checkpoint and ends with the same final metrics as an uninterrupted run (sync mode)."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from ops_helpers import checkpoints, final_state, kill_all, output, start, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]

LOCAL_SLURM = Path(os.environ.get("HPCFED_LOCAL_SLURM", REPO / ".." / "shared" / "tools" / "local-slurm.sh")).resolve()
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
               "PREEMPTED"}


SLURM_DIR = Path(os.environ.get("LOCAL_SLURM_DIR", "/tmp/hpcfed-slurm"))
DAEMONS = ("slurmd", "slurmctld", "munged")  # the order to stop them in


def running_daemons(folder: Path = SLURM_DIR) -> dict[str, int]:
    """Daemon name -> pid, for each of local-slurm.sh's daemons whose pid file names a live process
    of that name (a stale pid file, or a pid reused by another program, does not count)."""
    found = {}
    for name in DAEMONS:
        try:
            pid = int((folder / f"{name}.pid").read_text().split()[0])
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        if comm == name:
            found[name] = pid
    return found


def stop_daemons(pids: dict[str, int], timeout: float = 20.0) -> list[str]:
    """SIGTERM each daemon in `pids` (slurmd first, munged last) and wait for it to go; SIGKILL
    what is still there after `timeout`. Returns the names that had to be killed."""
    killed = []
    for name in DAEMONS:
        pid = pids.get(name)
        if pid is None:
            continue
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGTERM)
            if not select.select([fd], [], [], timeout)[0]:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed.append(name)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return killed


@pytest.fixture(scope="module")
def slurm_env():
    """A local Slurm cluster for this module: started if needed, and afterwards exactly the daemons
    this fixture started are stopped again (a cluster someone else started keeps running)."""
    if not LOCAL_SLURM.is_file():
        pytest.skip(f"{LOCAL_SLURM} is missing: cannot start a local Slurm cluster")
    if os.geteuid() != 0:
        pytest.skip("starting the local Slurm cluster needs root (munged, slurmctld, slurmd)")
    before = running_daemons()
    try:
        proc = subprocess.run(["bash", str(LOCAL_SLURM), "start"], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        stop_daemons({k: v for k, v in running_daemons().items() if before.get(k) != v})
        pytest.skip("local-slurm.sh start did not finish within 600 s (apt mirror unreachable?)")
    started = {k: v for k, v in running_daemons().items() if before.get(k) != v}
    try:
        m = re.search(r"export SLURM_CONF=(\S+)", proc.stdout)
        if proc.returncode != 0 or not m:
            pytest.skip(f"Slurm could not be installed/started here: {(proc.stderr or proc.stdout)[-500:]}")
        env = {**os.environ, "SLURM_CONF": m.group(1), "HPCFED_PYTHON": sys.executable,
               "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
        if shutil.which("sbatch", path=env["PATH"]) is None:
            pytest.skip("sbatch is not on PATH after starting Slurm")
        yield env
    finally:
        stop_daemons(started)


def test_the_fixture_stops_only_what_it_started(tmp_path):
    """`stop_daemons` ends the daemons it is given, by pid, and nothing else (here: stand-in
    processes named like the daemons, found through pid files the way local-slurm.sh writes them)."""
    procs = {}
    for name in ("slurmd", "munged"):
        exe = tmp_path / name
        os.symlink(shutil.which("sleep"), exe)
        procs[name] = subprocess.Popen([str(exe), "300"])
        (tmp_path / f"{name}.pid").write_text(f"{procs[name].pid}\n")
    (tmp_path / "slurmctld.pid").write_text(f"{os.getpid()}\n")  # a pid of another program: not a daemon
    try:
        # A stand-in is named like the daemon only once its exec has happened (slow on a busy host).
        wait_for(lambda: len(running_daemons(tmp_path)) == 2, 30, "the stand-ins to exec")
        found = running_daemons(tmp_path)
        assert found == {"slurmd": procs["slurmd"].pid, "munged": procs["munged"].pid}
        before = dict(found)
        stop_daemons({k: v for k, v in found.items() if k == "slurmd" and before.get(k) == v})
        assert procs["slurmd"].wait(timeout=30) == -signal.SIGTERM
        assert procs["munged"].poll() is None and running_daemons(tmp_path) == {"munged": procs["munged"].pid}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def _sbatch(env: dict, script: str, args: list[str], log: Path) -> str:
    proc = subprocess.run(["sbatch", "--parsable", f"--chdir={REPO}", f"--output={log}", script, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job(env: dict, job: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                          timeout=30).stdout
    return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)


def _in_queue(env: dict, job: str) -> str:
    """The job's state as `squeue` shows it ('' once it has left the queue)."""
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True,
                          timeout=30).stdout.strip()


def _wait_done(env: dict, job: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _in_queue(env, job)
        if state in ("", *DONE_STATES) or state.split()[0] in DONE_STATES:
            info = _job(env, job)
            if info.get("JobState", "") in DONE_STATES or not info:
                return info
        time.sleep(1)
    subprocess.run(["scancel", job], env=env, timeout=30)
    raise AssertionError(f"job {job} did not finish within {timeout:g} s: {_job(env, job)}")


def test_sbatch_runs_a_three_rank_federation_end_to_end(slurm_env, tmp_path):
    out = tmp_path / "qs"
    log = tmp_path / "job.out"
    job = _sbatch(slurm_env, "slurm/hpcfed.sbatch", ["configs/quickstart.yaml", str(out), "rounds=3"], log)
    info = _wait_done(slurm_env, job, 300)
    text = log.read_text()
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (info, text[-3000:])
    assert "srun --mpi=pmi2 -n 3" in text  # one MPI world of SLURM_NTASKS ranks via PMI-2
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["clients"]) == {"0", "1"} and summary["rounds"] == 3
    assert summary["config"]["name"] == "quickstart"
    assert sorted(p.name for p in (out / "embeddings").iterdir()) == ["site0.h5", "site1.h5"]
    assert {(e["round"], e["client"]) for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if e["name"] == "val_accuracy"} == {(r, c) for r in range(3) for c in (0, 1)}


def test_sbatch_refuses_a_launch_that_is_not_one_mpi_world(slurm_env, tmp_path):
    # Plain srun without PMI starts 3 one-rank programs: the script must notice and say so.
    log = tmp_path / "job.out"
    env = {**slurm_env, "HPCFED_LAUNCHER": "srun", "HPCFED_SRUN_MPI": "none"}
    job = _sbatch(env, "slurm/hpcfed.sbatch", ["configs/quickstart.yaml", str(tmp_path / "x")], log)
    info = _wait_done(slurm_env, job, 120)
    assert info.get("JobState") == "FAILED", info
    assert "gave MPI world size '1', not SLURM_NTASKS=3" in log.read_text()
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def _restart_when_pending(env: dict, job: str, restarts: int) -> None:
    """Wait until the requeued job is back in the queue, then let it start at once (Slurm would
    otherwise hold it for its requeue delay). Starting it too soon after the previous attempt
    ended gets it killed ("job credential revoked"), hence the wait for PENDING and the pause."""
    wait_for(lambda: (j := _job(env, job)).get("Restarts") == str(restarts) and j.get("JobState") == "PENDING",
             180, f"requeue number {restarts}")
    # slurmd refuses a launch credential created in the same second as the revocation of the previous
    # attempt's one (whole-second timestamps), so start the new attempt a little later.
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, timeout=30)


SCANCEL_ERRORS: list[str] = []


def _signal_batch(env: dict, job: str, sig: str) -> bool:
    """True once Slurm delivered the signal (it refuses while the batch step is still starting)."""
    proc = subprocess.run(["scancel", "-v", f"--signal={sig}", "--batch", job], env=env, capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        SCANCEL_ERRORS.append(proc.stderr.strip()[-300:])
    return proc.returncode == 0


def test_requeued_job_resumes_from_checkpoint_with_the_same_final_metrics(slurm_env, tmp_path):
    # 8 rounds, the first requeue at the first checkpoint: however far the first attempt gets while
    # it is being stopped, the second has rounds left to checkpoint one and then take SIGUSR2.
    common = ["rounds=8", "checkpoint_every=1", "federation.slowdown={0: 15, 1: 15}"]
    ref_out = tmp_path / "reference"
    # the uninterrupted run, side by side (plain mpiexec, the same config: the quickstart on torch, whose
    # slowed rounds leave the second attempt time to take SIGUSR2)
    ref = start(ref_out, common, torch_sites=True)
    out = tmp_path / "rq"
    log = tmp_path / "job.out"
    job = _sbatch(slurm_env, "slurm/requeue.sbatch", ["configs/quickstart.yaml", str(out), *common], log)
    try:
        # 1. A hard requeue (SIGTERM to every rank) once the job has a checkpoint.
        wait_for(lambda: len(checkpoints(out)) >= 1 or _job(slurm_env, job).get("JobState") in DONE_STATES,
                 420, "the job's first checkpoint")
        assert not (out / "summary.json").exists(), "the job finished before it could be requeued; slow it down"
        first = checkpoints(out)[-1]
        subprocess.run(["scontrol", "requeue", job], env=slurm_env, check=True, timeout=30)
        _restart_when_pending(slurm_env, job, 1)
        # 2. A graceful one in the second attempt: SIGUSR2 (what Slurm sends before the time limit)
        #    makes the server checkpoint after the current round and stop, then the script requeues.
        #    The first attempt may have written one more checkpoint while it was being stopped, so
        #    "newer" is measured from what is on disk once the job is back in the queue.
        restart_point = checkpoints(out)[-1]
        wait_for(lambda: (checkpoints(out)[-1] > restart_point and _job(slurm_env, job).get("JobState") == "RUNNING")
                 or _job(slurm_env, job).get("JobState") in DONE_STATES, 420, "a checkpoint of the second attempt")
        assert not (out / "summary.json").exists(), "the second attempt finished before SIGUSR2; slow it down"
        assert _job(slurm_env, job).get("JobState") == "RUNNING", log.read_text()[-3000:]
        try:
            wait_for(lambda: _signal_batch(slurm_env, job, "USR2"), 30,
                     "scancel --signal=USR2 to reach the batch script")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; job {_job(slurm_env, job).get('JobState')}, checkpoints {checkpoints(out)}, "
                                 f"scancel said {SCANCEL_ERRORS[-1:]}\n{log.read_text()[-3000:]}") from None
        _restart_when_pending(slurm_env, job, 2)
        info = _wait_done(slurm_env, job, 420)
    finally:
        if _in_queue(slurm_env, job):
            subprocess.run(["scancel", job], env=slurm_env, timeout=30)
        if ref.poll() is None and sys.exc_info()[0] is not None:
            kill_all(ref_out, ref)  # the test failed: do not leave the reference run behind
    text = log.read_text()
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (info, text[-3000:])
    assert info.get("Restarts") == "2"
    assert "SIGTERM (requeue, preemption or scancel)" in text
    assert "attempt 2: resuming from the newest valid checkpoint" in text
    assert "SIGUSR2 (time limit near)" in text and "halted after round" in text
    assert "attempt 3: resuming from the newest valid checkpoint" in text
    resumed = [int(r) for r in re.findall(r"resumed from \S+ckpt-\d+\.h5 \(round (\d+)\)", text)]
    assert len(resumed) == 2 and resumed[0] >= int(first[5:11]) and resumed[1] > resumed[0], (resumed, text[-3000:])
    assert ref.wait(timeout=420) == 0, output(ref)[-3000:]
    kill_all(ref_out)
    assert final_state(out) == final_state(ref_out)


def test_a_site_job_requeued_near_its_time_limit_rejoins_the_running_server(slurm_env, tmp_path):
    """slurm/join.sbatch: SIGUSR2 (what `--signal=B:USR2@120` sends before the time limit) makes the
    script requeue its own job; the server, which was never told, drops the site when its lifeline
    closes and lets the next attempt back in, from the site's own newest shard."""
    import crossjob_helpers as H

    overrides = [*H.SMALL, "rounds=100000", "checkpoint_every=2", "federation.on_client_failure=continue",
                 "federation.slowdown={0: 5}", "influence.reject_factor=1000"]
    out, port = tmp_path / "srv", tmp_path / "srv" / "port.json"
    server = H.serve(out, overrides, "--start-deadline", "120")
    site0 = H.join(port, 0, tmp_path / "site0", overrides)
    env = {**slurm_env, "HPCFED_PSK": H.PSK, "PYTHONPATH": str(REPO)}
    log = tmp_path / "site1.out"
    job = _sbatch(env, "slurm/join.sbatch", [H.CONFIG, str(port), "1", str(tmp_path / "site1"), *overrides], log)
    try:
        H.wait_for("two rounds of the site job", lambda: len(H.trained(out, 1)) >= 2
                   and any((out / "checkpoints").glob("ckpt-*.h5")), [server, site0], timeout=300)
        wait_for(lambda: _signal_batch(slurm_env, job, "USR2"), 30, "scancel --signal=USR2 to reach the script")
        _restart_when_pending(slurm_env, job, 1)
        H.wait_for("the requeued site back and training", lambda: [e for e in H.events(out) if e["name"] == "rejoined"]
                   and len([r for r in H.trained(out, 1) if r >= _rejoined(out)]) >= 2, [server, site0], timeout=300)
        (out / "HALT").touch()
        (code, text), (code0, _) = H.finish([server, site0], 180)
        info = _wait_done(slurm_env, job, 120)
    finally:
        if _in_queue(slurm_env, job):
            subprocess.run(["scancel", job], env=slurm_env, timeout=30)
        for proc in (server, site0):
            H.kill_job(proc)
    site_log = log.read_text()
    assert code == 0 and code0 == 0, text[-3000:]
    assert info.get("JobState") == "COMPLETED" and info.get("Restarts") == "1", (info, site_log[-3000:])
    assert "SIGUSR2 (time limit near): requeueing job" in site_log and "site 1, attempt 2" in site_log
    assert "site 1 is back as rank 2" in text and "client 1 (rank 2) resumes from its own shard of round" in text
    live = json.loads((out / "live.json").read_text())  # its last snapshot (a halted run writes no summary)
    assert [(s["state"], s["rejoins"]) for s in live["sites"]] == [("present", 0), ("present", 1)]


def _rejoined(out: Path) -> int:
    import crossjob_helpers as H

    back = [e["value"] for e in H.events(out) if e["name"] == "rejoined"]
    return back[0] if back else 1 << 30
