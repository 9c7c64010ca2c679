"""`hpcfed serve` + separate `mpiexec -n 1 hpcfed join` jobs: the same numbers as one job, and
every way of joining wrong ends with its reason before the deadline, never with a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import REPO, mpiexec, run_cli

from hpcfed.store import checkpoint as ck
from hpcfed.store.embeddings import read_export

pytestmark = pytest.mark.mpi

CONFIG = "configs/quickstart.yaml"
SMALL = ["rounds=2", "task.samples_per_site=200", "federation.num_clients=2"]
PSK = "00" * 32


def _env(psk: str = PSK) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HPCFED_PSK": psk}


def _serve(out: Path, overrides: list[str]) -> subprocess.Popen:
    """`hpcfed serve` as a user types it (it relaunches itself as a one-rank MPI job)."""
    cmd = [sys.executable, "-m", "hpcfed", "serve", CONFIG, *overrides, "--out", str(out)]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _join(port_file: Path, site: int, out: Path, overrides: list[str], psk: str = PSK) -> subprocess.Popen:
    """One site as a job of its own: `mpiexec -n 1 python -m hpcfed join ...`."""
    cmd = [mpiexec(), "-n", "1", sys.executable, "-m", "hpcfed", "join", CONFIG, *overrides,
           "--server", str(port_file), "--site", str(site), "--out", str(out)]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(psk), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, server: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert server.poll() is None and time.monotonic() < deadline, "the server never wrote its port file"
        time.sleep(0.2)


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{' '.join(proc.args)} still running after {timeout} s") from None
        results.append((proc.returncode, text))
    return results


def _values(out: Path) -> dict:
    """Every figure of metrics.jsonl but wall-clock times, keyed by (round, client, name)."""
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {(e["round"], e["client"], e["name"]): e["value"] for e in events if not e["name"].endswith("time_s")}


def test_sites_joining_as_separate_jobs_reach_the_numbers_of_one_job(tmp_path):
    one = tmp_path / "one"
    run_cli(["run", CONFIG, *SMALL, "--out", str(one)], np=3, timeout=240)
    srv = tmp_path / "srv"
    server = _serve(srv, SMALL)
    sites = [_join(srv / "port.json", i, tmp_path / f"site{i}", SMALL) for i in (1, 0)]  # any order
    results = _finish([server, *sites], timeout=240)
    assert [code for code, _ in results] == [0, 0, 0], results
    assert "site 0 joined as rank 1" in results[0][1] and "site 1 joined as rank 2" in results[0][1]

    a, b = (json.loads((d / "summary.json").read_text()) for d in (one, srv))
    assert b["clients"] == a["clients"] and set(a["clients"]) == {"0", "1"}
    assert _values(srv) == _values(one)
    with h5py.File(ck.list_checkpoints(one / "checkpoints")[0], "r") as f1, \
            h5py.File(ck.list_checkpoints(srv / "checkpoints")[0], "r") as f2:
        assert f1["strategy/global"][()].tobytes() == f2["strategy/global"][()].tobytes()
    for i in (0, 1):  # each site writes its export into its own folder, as on its own cluster
        x, y = read_export(one / "embeddings" / f"site{i}.h5"), read_export(tmp_path / f"site{i}" / "embeddings"
                                                                             / f"site{i}.h5")
        assert np.array_equal(x.vectors, y.vectors) and list(x.ids) == list(y.ids)


def test_a_wrong_key_is_refused_and_a_missing_site_ends_the_server_at_its_deadline(tmp_path):
    overrides = [*SMALL, "federation.setup_timeout_s=20"]
    srv = tmp_path / "srv"
    server = _serve(srv, overrides)
    _wait_for(srv / "port.json", server)
    started = time.monotonic()  # the server's deadline runs from here
    good = _join(srv / "port.json", 0, tmp_path / "site0", overrides)
    wrong = _join(srv / "port.json", 1, tmp_path / "site1", overrides, psk="11" * 32)
    (srv_code, srv_text), (good_code, good_text), (wrong_code, wrong_text) = _finish([server, good, wrong], 120)
    assert wrong_code == 2 and "the server refused site 1: site 1's proof is invalid (another pre-shared key)" \
        in wrong_text, wrong_text
    assert "knock from 127.0.0.1" in srv_text and "refused: site 1's proof is invalid" in srv_text
    assert srv_code == 2 and "site 1 did not join within federation.setup_timeout_s=20 s" in srv_text, srv_text
    assert good_code != 0 and "the server is gone" in good_text, good_text  # it does not wait forever either
    assert time.monotonic() - started < 90  # 20 s of waiting, then the site's own deadline
    assert not (srv / "summary.json").exists()


def test_a_stale_or_garbled_port_file_is_a_clear_error(tmp_path):
    port_file = tmp_path / "port.json"
    with __import__("socket").socket() as s:  # a port nothing listens on any more
        s.bind(("127.0.0.1", 0))
        stale = s.getsockname()[1]
    port_file.write_text(json.dumps({"hpcfed_rendezvous": 1, "address": f"127.0.0.1:{stale}", "pid": 1,
                                     "host": "gone", "written": "yesterday"}))
    overrides = [*SMALL, "federation.setup_timeout_s=2"]
    out = tmp_path / "site"
    proc = run_cli(["join", CONFIG, *overrides, "--server", str(port_file), "--site", "0", "--out", str(out)],
                   timeout=120, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "site 0: no server within 2 s" in text and "written yesterday by pid 1" in text
    assert "the port file is stale" in text and "Connection refused" in text, text
    port_file.write_text('{"hpcfed_rendezvous": 1, "addr')
    proc = run_cli(["join", CONFIG, *overrides, "--server", str(port_file), "--site", "0"], timeout=60, check=False)
    assert proc.returncode == 2 and f"port file {port_file} is garbled" in proc.stderr, proc.stderr
    proc = run_cli(["join", CONFIG, *overrides, "--server", str(port_file), "--site", "7"], timeout=60, check=False)
    assert proc.returncode == 2 and "--site 7: the config has 2 sites" in proc.stderr
