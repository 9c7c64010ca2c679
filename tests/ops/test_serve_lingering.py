"""`hpcfed serve` ends with its run when a site's job will not (real separate mpiexec jobs): a site
that ignores STOP and everything after it keeps its own job alive, never the server's."""

from __future__ import annotations

import re

import pytest
from crossjob_helpers import SMALL, finish, join, kill_job, serve, summary

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
