"""Starting `hpcfed serve` and `hpcfed join` as separate jobs, as a user would, for the tests of
federations across jobs (tests/ops/test_serve_join*.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import NUMPY_SITES, REPO, mpiexec

CONFIG = "configs/quickstart.yaml"
# The smallest quickstart that proves a point: 2 sites, 2 rounds, 100 samples, short deadlines, and
# its network in NumPy (no torch on the sites: these tests are about the jobs, not the model).
SMALL = ["rounds=2", "task.samples_per_site=100", "federation.num_clients=2", "eval_every=0",
         "federation.setup_timeout_s=60", "federation.round_deadline_s=30", NUMPY_SITES]
PSK = "00" * 32


def async_config(folder: Path) -> str:
    """The quickstart as an asynchronous federation (FedAsync takes no `weighting`)."""
    path = folder / "quickstart_async.yaml"
    path.write_text((REPO / CONFIG).read_text().replace("  weighting: num_examples\n", "").replace(
        "name: fedavg ", "name: fedasync "))
    return str(path)


def env(psk: str = PSK) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HPCFED_PSK": psk}


def serve(out: Path, overrides: list[str], *extra: str, wrap: list[str] | None = None,
          config: str = CONFIG) -> subprocess.Popen:
    """`mpiexec -n 1 hpcfed serve` (a user may leave out the mpiexec: it relaunches itself, at the
    cost of a second start of Python). `wrap`: a prefix, e.g. to run it inside a network namespace."""
    cmd = [*(wrap or []), mpiexec(), "-n", "1", sys.executable, "-m", "hpcfed", "serve", config, *overrides,
           "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def join(server: Path | str, site: int, out: Path, overrides: list[str], *extra: str, psk: str = PSK,
         wrap: list[str] | None = None, config: str = CONFIG) -> subprocess.Popen:
    """One site as a job of its own, in a session of its own (so that it can be killed whole)."""
    cmd = [*(wrap or []), mpiexec(), "-n", "1", sys.executable, "-m", "hpcfed", "join", config, *overrides,
           "--server", str(server), "--site", str(site), "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env(psk), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a whole job: mpiexec, its proxy and its rank (and reap it, its output unread)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=30)


def wait_for(what: str, ready, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    """Poll `ready()` until true; fail at once if one of `procs` ends first, or at `timeout`."""
    deadline = time.monotonic() + timeout
    while not ready():
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            for p in procs:
                kill_job(p)
            texts = "\n".join(f"--- {' '.join(p.args[3:8])}\n{p.communicate()[0][-3000:]}" for p in procs)
            raise AssertionError(f"never {what}" + (" (a job ended first)" if ended else "") + f"\n{texts}")
        time.sleep(0.1)


def events(out: Path) -> list[dict]:
    """The events of metrics.jsonl so far (the line being written left out)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [e for e in map(_event, lines) if e is not None]


def trained(out: Path, cid: int) -> list[int]:
    """The rounds (sync) or accepted updates (async) with an upload of client `cid` folded in."""
    return sorted({e["round"] for e in events(out) if e["client"] == cid and e["name"] == "train_loss"})


def _event(line: str) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:
        return None  # the line being written


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Wait for every job; kill them all and fail naming the first one still running at `timeout`."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_job(p)
            raise AssertionError(f"{' '.join(proc.args)} still running after {timeout} s") from None
        results.append((proc.returncode, text))
    return results


def values(out: Path) -> dict:
    """Every figure of metrics.jsonl but wall-clock times, keyed by (round, client, name)."""
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {(e["round"], e["client"], e["name"]): e["value"] for e in events if not e["name"].endswith("time_s")}


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def logged(out: Path, text: str) -> bool:
    """Whether the server's log (OUT/logs/rank0.log) has a line with `text` yet."""
    try:
        return text in (out / "logs" / "rank0.log").read_text()
    except OSError:
        return False


def prepared(site_out: Path, site: int) -> bool:
    """Whether site `site`'s job (writing to `site_out`) has its data and model ready: it knocks next
    (a site prepares before it knocks, so a short --start-deadline starts after this)."""
    try:
        return "ready in" in (site_out / "logs" / f"rank{site + 1}.log").read_text()
    except OSError:
        return False
