"""`hpcfed serve` with a site that is a job of two ranks (`hpcfed join` with `federation.ranks_per_site`),
under real mpiexec: the site's leader knocks and speaks the sealed channel, its other rank trains with
it, and the federation reaches the numbers of the same sites in one job of one rank each. A hostile
non-leader, holding the site's key, knocks at the server as its site: it is refused, and changes nothing.
"""

from __future__ import annotations

import subprocess
import sys

import crossjob_helpers as H
import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.mpi

# site 0 is a job of 2 ranks (started by `hpcfed join` itself: mpiexec -n 2), site 1 of one; a
# loaded 2-core machine can take a minute to start three Pythons with torch, hence the longer setup
SMALL = [*H.SMALL, "federation.setup_timeout_s=180", "task.name=synthetic"]  # torch: a site of two ranks
RANKS = [*SMALL, "federation.ranks_per_site=[2,1]"]


def test_a_site_of_two_ranks_joins_and_a_non_leader_cannot_knock_for_it(tmp_path):
    one = tmp_path / "one"
    run_cli(["run", H.CONFIG, *SMALL, "--out", str(one)], np=3, timeout=300)
    srv = tmp_path / "srv"
    server = H.serve(srv, RANKS)
    site0_out = tmp_path / "site0"
    # without mpiexec, as a user would type it: it starts its own job of R = 2 ranks
    site0 = subprocess.Popen([sys.executable, "-m", "hpcfed", "join", H.CONFIG, *RANKS, "--server",
                              str(srv / "port.json"), "--site", "0", "--out", str(site0_out)], cwd=REPO,
                             env={**H.env(), "HPCFED_FAULT_NON_LEADER_KNOCKS": "2"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    site1 = H.join(srv / "port.json", 1, tmp_path / "site1", RANKS)
    results = H.finish([server, site0, site1], timeout=300)
    assert [code for code, _ in results] == [0, 0, 0], results
    srv_text = results[0][1]
    assert "site 0 joined as rank 1" in srv_text and "site 1 joined as rank 2" in srv_text, srv_text[-3000:]

    # the site's other rank trained with its leader, over the site's own torch.distributed group
    member = (site0_out / "logs" / "rank1.1.log").read_text()
    assert "site 0: rank 1 of 2 joined its torch.distributed group (gloo)" in member, member[-2000:]
    # ... and, with the site's own key, could not be let in as the site
    assert "fault injection: non-leader rank 2 was refused: the server refused site 0: site 0 is present and " \
           "alive" in member, member[-2000:]
    assert "let in as site" not in member
    assert "refused: site 0 is present and alive" in srv_text, srv_text[-3000:]

    a, b = H.summary(one), H.summary(srv)
    assert sorted(b["clients"]) == ["0", "1"] and b["evicted"] == [] and b["dropped"] == [], b
    for site in ("0", "1"):  # the global batch is R = 1's: the same model, up to the all-reduce's sums
        assert abs(b["clients"][site]["accuracy"] - a["clients"][site]["accuracy"]) <= 0.01, (a, b)
        assert abs(b["clients"][site]["loss"] - a["clients"][site]["loss"]) <= 1e-3, (a, b)
    assert all(v > 0 for v in b["throughput"].values()), b["throughput"]


def test_a_site_job_of_the_wrong_size_is_refused_with_the_arithmetic(tmp_path):
    proc = run_cli(["join", H.CONFIG, *RANKS, "--server", "127.0.0.1:9", "--site", "0", "--out",
                    str(tmp_path / "site0")], np=1, timeout=120, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "hpcfed join --site 0: federation.ranks_per_site gives site 0 2 rank(s) but this job has 1; start it " \
           "with mpiexec -n 2" in text, text[-3000:]
