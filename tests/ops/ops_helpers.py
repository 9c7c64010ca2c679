"""Helpers for the fault tests: start a federation in the background, find its rank processes,
signal them, and compare runs. Processes are found by their unique output folder on the command
line, so a test only ever touches the processes it started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from conftest import NUMPY_SITES, REPO, mpiexec

QUICKSTART = "configs/quickstart.yaml"


def start(out: Path, overrides: list[str], *, np_: int = 3, resume: bool = False,
          extra_env: dict | None = None, config: str = QUICKSTART, launcher: str | None = None,
          torch_sites: bool = False) -> subprocess.Popen:
    """`hpcfed run quickstart OVERRIDES --np NP --out OUT [--resume]` (the user's path: it relaunches
    itself under mpiexec and watches the ranks), in the background. The quickstart's network runs
    in NumPy (`NUMPY_SITES`) unless `torch_sites`: these tests are about the launcher and the server."""
    mpiexec()  # skips without MPI
    task = [NUMPY_SITES] if config == QUICKSTART and not torch_sites else []
    cmd = [sys.executable, "-m", "hpcfed", "run", str(config), *task, *overrides, "--np", str(np_), "--out", str(out)]
    if resume:
        cmd.append("--resume")
    if launcher:  # another mpiexec (e.g. the two-node wrapper)
        cmd += ["--mpiexec", launcher]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HPCFED_PSK": "ab" * 32, **(extra_env or {})}
    log_path = out.parent / f"{out.name}.{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.ops_log = log_path  # type: ignore[attr-defined]
    return proc


def output(proc: subprocess.Popen) -> str:
    """Everything the job printed so far (stdout and stderr of mpiexec and all ranks)."""
    return Path(proc.ops_log).read_text()  # type: ignore[attr-defined]


def finish(proc: subprocess.Popen, out: Path, timeout: float) -> str:
    """Wait for the run to end (then kill whatever of it is left); its output, asserting it succeeded."""
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        kill_all(out, proc)
    text = output(proc)
    assert rc == 0, text[-4000:]
    return text


def job_pids(out: Path) -> dict[str, int]:
    """PIDs of the processes whose command line names `out`: 'rank0', 'rank1', ..., and 'launcher'."""
    found: dict[str, int] = {}
    marker = str(out).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            if marker not in cmdline:
                continue
            environ = (d / "environ").read_bytes()
        except OSError:
            continue
        rank = next((kv[len(b"PMI_RANK="):] for kv in environ.split(b"\0") if kv.startswith(b"PMI_RANK=")), None)
        if b"hpcfed.launch.rank_guard" in cmdline:
            continue  # a rank's parent (federation.on_client_failure=continue), not the rank
        if rank is not None and b"hydra_pmi_proxy" not in cmdline:
            found[f"rank{int(rank)}"] = int(d.name)
        elif b"mpiexec" in cmdline.split(b"\0")[0]:
            found["launcher"] = int(d.name)
    return found


def kill_all(out: Path, proc: subprocess.Popen | None = None) -> None:
    """kill -9 every process of the job at once (the whole job dies, as on a node failure)."""
    pids = job_pids(out)
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc is not None:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 0.05):
    """Poll `predicate` until it is truthy and return its value; AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            return predicate()
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def checkpoints(out: Path) -> list[str]:
    """The checkpoint file names in OUT/checkpoints, oldest first (none yet: empty)."""
    try:
        return sorted(n for n in os.listdir(out / "checkpoints") if n.startswith("ckpt-"))
    except FileNotFoundError:
        return []


def events(out: Path) -> list[dict]:
    """The records of OUT/metrics.jsonl, skipping lines that are not complete JSON yet."""
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def final_state(out: Path) -> tuple[dict, dict[str, bytes]]:
    """(per-client final metrics from summary.json, the newest checkpoint's strategy arrays as bytes)."""
    from hpcfed.store import checkpoint as ck

    summary = json.loads((out / "summary.json").read_text())
    newest = ck.latest_valid(out / "checkpoints", warn=lambda _: None)
    arrays = {k: np.ascontiguousarray(v).tobytes() for k, v in sorted(newest.strategy[1].items())} if newest else {}
    return summary["clients"], arrays


def spy_launcher(tmp: Path, spy_args: list[str]) -> Path:
    """An mpiexec that starts a test-side spy (``python SPY_ARGS... hpcfed-args``) in place of
    ``python -m hpcfed``, the rank guard kept: for `start(..., launcher=...)`."""
    path = tmp / "mpiexec"
    path.write_text(f"""#!/bin/bash
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "-m" ] && [ "${{2:-}}" = "hpcfed" ]; then args+=({" ".join(f'"{a}"' for a in spy_args)}); shift 2
  else args+=("$1"); shift; fi
done
exec "{mpiexec()}" "${{args[@]}}"
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path
