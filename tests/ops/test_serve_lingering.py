"""`hpcfed serve` ends with its run when a site's job will not (real separate mpiexec jobs): a site
that ignores STOP and everything after it keeps its own job alive, never the server's."""

from __future__ import annotations

import re

import pytest
from crossjob_helpers import CONFIG, SMALL, async_config, finish, join, kill_job, serve, summary

pytestmark = pytest.mark.mpi


def test_a_site_job_that_ignores_stop_does_not_keep_the_server_job_alive(tmp_path):
    overrides = [*SMALL, "attack=ignore_stop"]  # the last site (1) uploads honestly, then stays for ever
    srv = tmp_path / "srv"
    server = serve(srv, overrides)
    sites = [join(srv / "port.json", i, tmp_path / f"site{i}", overrides) for i in (0, 1)]
    try:
        (srv_code, srv_text), (site0_code, _) = finish([server, sites[0]], timeout=300)
        assert srv_code == 0, srv_text  # the run succeeded: the site that stayed does not change that
        assert sorted(summary(srv)["clients"]) == ["0", "1"] and summary(srv)["evicted"] == []
        assert re.search(r"site\(s\) 1 still connected .* ending the server's job", srv_text), srv_text
        assert site0_code == 0
        assert sites[1].poll() is None  # its own job stays (its cluster's wall time ends it), not the server's
    finally:
        kill_job(sites[1])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_served_federation_with_the_guard_on_evicts_the_hostile_site_only_and_ends(tmp_path, mode):
    """`hpcfed serve` with bounded influence on (the default): three site jobs, the last one sends a
    malformed upload and then stays for ever. It is evicted on that proof, no honest message is
    refused and no honest site evicted, the mean is over the honest sites, their uploads keep being
    folded, and the server's job ends with its run while the hostile site's job stays (its own
    cluster's wall time ends it)."""
    config = async_config(tmp_path) if mode == "async" else CONFIG
    overrides = [*SMALL, "federation.num_clients=3", "rounds=4", "federation.on_client_failure=continue",
                 "federation.setup_timeout_s=180",  # three site jobs start side by side on a loaded host
                 "attack=bad_header_then_linger"]
    srv = tmp_path / "srv"
    server = serve(srv, overrides, config=config)
    sites = [join(srv / "port.json", i, tmp_path / f"site{i}", overrides, config=config) for i in (0, 1, 2)]
    try:
        (srv_code, srv_text), *honest = finish([server, *sites[:2]], timeout=300)
        assert srv_code == 0 and [code for code, _ in honest] == [0, 0], srv_text[-3000:]
        done = summary(srv)
        (ev,) = done["evicted"]
        assert ev["client"] == 2 and ev["reason"].startswith("malformed update"), ev
        assert done["mean_over"] == [0, 1] and sorted(done["clients"]) == ["0", "1"]
        assert done["config"]["influence"]["enabled"] is True and done["influence_peak_ratio"] < 10
        assert not re.search(r"rejected message from rank [12]\b", (srv / "logs" / "rank0.log").read_text())
        assert done["updates_accepted"] == (12 if mode == "async" else 8)  # the honest uploads kept flowing
        assert re.search(r"site\(s\) 2 still connected .* ending the server's job", srv_text), srv_text[-3000:]
        assert sites[2].poll() is None
    finally:
        kill_job(sites[2])
