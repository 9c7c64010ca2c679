"""`hpcfed serve` + separate `mpiexec -n 1 hpcfed join` jobs: the same numbers as one job, and
every way of joining wrong ends with its reason before the deadline, never with a hang."""

from __future__ import annotations

import json
import time

import h5py
import numpy as np
import pytest
from conftest import REPO, run_cli
from crossjob_helpers import CONFIG, SMALL, finish, join, kill_job, prepared, serve, summary, values, wait_for

from hpcfed.cli.commands import main
from hpcfed.store import checkpoint as ck
from hpcfed.store.embeddings import read_export

pytestmark = pytest.mark.mpi


def test_sites_joining_as_separate_jobs_reach_the_numbers_of_one_job(tmp_path):
    one = tmp_path / "one"
    run_cli(["run", CONFIG, *SMALL, "--out", str(one)], np=3, timeout=240)
    srv = tmp_path / "srv"
    server = serve(srv, SMALL)
    sites = [join(srv / "port.json", i, tmp_path / f"site{i}", SMALL) for i in (1, 0)]  # any order
    results = finish([server, *sites], timeout=240)
    assert [code for code, _ in results] == [0, 0, 0], results
    assert "site 0 joined as rank 1" in results[0][1] and "site 1 joined as rank 2" in results[0][1]

    a, b = summary(one), summary(srv)
    assert b["clients"] == a["clients"] and set(a["clients"]) == {"0", "1"}
    assert values(srv) == values(one)
    with h5py.File(ck.list_checkpoints(one / "checkpoints")[0], "r") as f1, \
            h5py.File(ck.list_checkpoints(srv / "checkpoints")[0], "r") as f2:
        assert f1["strategy/global"][()].tobytes() == f2["strategy/global"][()].tobytes()
    for i in (0, 1):  # each site writes its export into its own folder, as on its own cluster
        x, y = read_export(one / "embeddings" / f"site{i}.h5"), read_export(tmp_path / f"site{i}" / "embeddings"
                                                                             / f"site{i}.h5")
        assert np.array_equal(x.vectors, y.vectors) and list(x.ids) == list(y.ids)


def test_a_wrong_key_is_refused_and_too_few_sites_end_the_server_at_its_deadline(tmp_path):
    overrides = [*SMALL, "federation.min_sites=2", "federation.setup_timeout_s=20"]
    srv = tmp_path / "srv"
    # The sites prepare before they knock, then wait that long for the server (its start under load too).
    sites = [*overrides, "federation.setup_timeout_s=40"]
    good = join(srv / "port.json", 0, tmp_path / "site0", sites)
    wrong = join(srv / "port.json", 1, tmp_path / "site1", sites, psk="11" * 32)
    wait_for("both sites ready", lambda: prepared(tmp_path / "site0", 0) and prepared(tmp_path / "site1", 1),
             [good, wrong])
    server = serve(srv, overrides, "--start-deadline", "20")
    wait_for("a port file", lambda: (srv / "port.json").exists(), [server])
    started = time.monotonic()  # the server's deadline runs from here
    (srv_code, srv_text), (good_code, good_text), (wrong_code, wrong_text) = finish([server, good, wrong], 120)
    assert wrong_code == 2 and "the server refused site 1: site 1's proof is invalid (another pre-shared key)" \
        in wrong_text, wrong_text
    assert "knock from 127.0.0.1" in srv_text and "refused: site 1's proof is invalid" in srv_text
    assert srv_code == 2 and "only 1 of 2 sites joined by the start deadline, fewer than federation.min_sites=2; " \
        "missing: site 1" in srv_text, srv_text
    assert good_code != 0 and "the server is gone" in good_text, good_text  # it does not wait forever either
    assert time.monotonic() - started < 90  # 20 s of waiting, then the site's own deadline (40 s)
    assert not (srv / "summary.json").exists()


def test_a_stale_or_garbled_port_file_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
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
    # refused before any MPI or import of torch: in this process (a start of `python -m hpcfed` costs seconds)
    assert main(["join", CONFIG, *overrides, "--server", str(port_file), "--site", "0"]) == 2
    assert f"port file {port_file} is garbled" in capsys.readouterr().err
    assert main(["join", CONFIG, *overrides, "--server", str(port_file), "--site", "7"]) == 2
    assert "--site 7: the config has 2 sites" in capsys.readouterr().err


def test_a_halt_while_the_server_gathers_its_sites_ends_it_cleanly_and_it_never_waits_for_an_excluded_one(tmp_path):
    overrides = [*SMALL, "federation.num_clients=3", "federation.exclude_sites=[2]", "federation.setup_timeout_s=300"]
    srv = tmp_path / "srv"
    server = serve(srv, overrides)  # waits for its sites up to 300 s
    site = join(srv / "port.json", 0, tmp_path / "site0", overrides)
    wait_for("site 0 let in", lambda: "site 0 joined as rank 1" in (srv / "logs" / "rank0.log").read_text()
             if (srv / "logs" / "rank0.log").exists() else False, [server, site])
    (srv / "HALT").touch()  # the operator's halt, while site 1 is still awaited
    halted = time.monotonic()
    (code, text), = finish([server], 60)
    assert code == 0 and "halt requested (" in text and "HALT found) while gathering sites (1 of 2 joined): no " \
        "round was run" in text, text[-3000:]  # of 2: excluded site 2 is not waited for
    assert time.monotonic() - halted < 30 and not (srv / "HALT").exists() and not (srv / "summary.json").exists()
    kill_job(site)
