"""Shared fixtures: the real-data root, the MPI launcher, and a helper to run the CLI."""

from __future__ import annotations

import compileall
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# One intra-op thread for torch, NumPy's BLAS and gensim in every test process and what it starts,
# before anything imports them: three xdist workers share two cores, and an idle OpenMP thread spins
# waiting for work, so two threads a process cost a loaded run up to 4x the CPU for no speed
# (measured: tests/models/test_mapper.py + test_hin_plots.py, 83 s of CPU with the default, 22 s
# with one). The ranks set their own (`threads_per_rank`, default 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
# The quickstart's network in NumPy (`hpcfed.tasks.synthetic_numpy`), for the federations that test
# the server, the channel or the launcher rather than a model: its site ranks never import torch,
# about 3 s of CPU less each, most of what a small federation costs (CONTRIBUTING.md).
NUMPY_SITES = "task.name=synthetic_numpy"
SHARED_DATA = (REPO / ".." / "shared" / "data").resolve()


def pytest_configure(config: pytest.Config) -> None:
    """Compile hpcfed (and tools/) to bytecode once, in the controller before any worker starts. An
    environment with PYTHONDONTWRITEBYTECODE set (this machine's, and CI's) never writes __pycache__
    for a source tree, so every rank of every federation compiled all of hpcfed again: about 0.3 s of
    CPU a process, a second a 3-rank job. Python reads bytecode it finds even with that variable set."""
    if not hasattr(config, "workerinput"):
        for folder in ("hpcfed", "tools"):
            compileall.compile_dir(REPO / folder, quiet=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With HPCFED_SUITE_CPU=<folder>, write each test's CPU seconds (this worker's own, and those of
    the processes it started and waited for: mpiexec and every rank under it) and wall seconds to a
    JSON-lines file per worker; `python tools/suite_cpu.py <folder>` ranks them. CPU says which tests
    to make cheaper better than wall time does, which is mostly waiting on a loaded machine; it still
    moves with load somewhat (MPI ranks poll for a while after each message), so compare runs made
    at a like load."""
    folder = os.environ.get("HPCFED_SUITE_CPU")
    if not folder:
        yield
        return
    own, children, start = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.monotonic()
    yield
    record = {"test": item.nodeid, "own_cpu_s": round(_cpu(resource.RUSAGE_SELF) - own, 3),
              "children_cpu_s": round(_cpu(resource.RUSAGE_CHILDREN) - children, 3),
              "wall_s": round(time.monotonic() - start, 3)}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{worker}.jsonl", "a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real datasets; tests that need them skip with a reason when they are absent."""
    root = Path(os.environ.get("HPCFED_DATA", SHARED_DATA))
    if not root.is_dir():
        pytest.skip(f"real datasets not available at {root} (set HPCFED_DATA)")
    return root


def mpiexec() -> str:
    """Path of mpiexec (or mpirun); skips the test when there is none."""
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        pytest.skip("no mpiexec on PATH (pip install mpich)")
    return exe


def run_cli(args: list[str], *, np: int | None = None, timeout: float = 300, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``hpcfed ARGS`` (under ``mpiexec -n NP`` when `np` is given) and return the process."""
    cmd = [sys.executable, "-m", "hpcfed", *args]
    if np is not None:
        cmd = [mpiexec(), "-n", str(np), *cmd]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.setdefault("HPCFED_PSK", "00" * 32)
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


# -- search tests (tests/search): `pytestmark = pytest.mark.usefixtures("own_keys")` -----------------
@pytest.fixture(scope="session")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keys")


@pytest.fixture
def own_keys(keys_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Index keys in a temporary folder (never the user's ~/.hpcfed), and no job key unless a test sets one."""
    monkeypatch.setenv("HPCFED_KEYS_DIR", str(keys_dir))
    monkeypatch.delenv("HPCFED_STATE_KEY", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# -- running the suite on xdist workers (`pytest -n 3`, pytest-xdist; README "Two commands") ----------
SHARED_SCOPES = ("module", "package", "class")  # a fixture of these scopes runs once per worker that uses it
LONG_MARKS = ("mpi", "slurm", "two_nodes")  # tests that start processes and run a federation


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether `item` uses a fixture that lives longer than one test but not the whole session."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope in SHARED_SCOPES for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--dist loadgroup`` the tests of a module that share a module-scoped fixture (a federation
    run once and asserted on by several tests) stay on one worker, so that fixture runs once; and the
    modules that start a machine-wide cluster (the local Slurm daemons, the emulated two nodes with
    their fixed namespace names) share one worker, so no two of them run at once. Every other test is
    a unit of its own, which either worker may take: a module of independent federations (one run
    each) is spread over both workers instead of holding one of them to the end."""
    shared = {item.nodeid.split("::", 1)[0] for item in items if _shares_a_fixture(item)}
    # Longest first: pytest-xdist deals out the groups (largest first), then single tests in this
    # order. Federations (mpi, slurm, two_nodes) take seconds to minutes, unit tests milliseconds, so
    # with the modules that run federations dealt first the workers end on short tests and finish
    # together, not one waiting for the other's last federation. Whole modules move (the sort is
    # stable), so a module's tests stay together and in their order, and its fixtures run once.
    long = {item.nodeid.split("::", 1)[0] for item in items if any(map(item.get_closest_marker, LONG_MARKS))}
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in long)
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if item.get_closest_marker("slurm") or item.get_closest_marker("two_nodes"):
            item.add_marker(pytest.mark.xdist_group("cluster"))
        elif module in shared:
            item.add_marker(pytest.mark.xdist_group(module))
