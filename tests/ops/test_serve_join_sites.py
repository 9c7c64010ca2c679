"""Sites of `hpcfed serve` that come late or die: a site joins a running federation, takes part,
is SIGKILLed with its whole job, the federation goes on without it, and the same command brings it
back (a rejoin) -- sync and async, each a real server job and real site jobs, judged by what the
server wrote. Async then loses every site at once, and waits for one to rejoin."""

from __future__ import annotations

import re
import time

import crossjob_helpers as H
import pytest

pytestmark = pytest.mark.mpi

# A run with no end of its own (the test ends it with OUT/HALT once it has seen what it needs);
# site 0 trains 5x slower than it could, so that the rounds do not spin while site 1 starts. A site
# that joins a model fitted to another site's data for a hundred rounds moves it far more than the
# typical step (measured: 70x): bounded influence would refuse it (see docs/cluster.md).
ENDLESS = [*H.SMALL, "rounds=100000", "checkpoint_every=0", "federation.on_client_failure=continue",
           "federation.slowdown={0: 5}", "influence.reject_factor=1000", "federation.setup_timeout_s=120"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_late_site_takes_part_is_dropped_when_killed_and_comes_back(tmp_path, mode):
    config = H.async_config(tmp_path) if mode == "async" else H.CONFIG
    out, port = tmp_path / "srv", tmp_path / "srv" / "port.json"
    # site 0 first: it prepares before it knocks; once it is ready the server starts and has to wait
    # only for its knock (site 1 comes later)
    site0 = H.join(port, 0, tmp_path / "site0", ENDLESS, config=config)
    H.wait_for("site 0 ready", lambda: H.prepared(tmp_path / "site0", 0), [site0])
    server = H.serve(out, ENDLESS, "--start-deadline", "10", config=config)
    H.wait_for("a first round with site 0 alone", lambda: H.trained(out, 0), [server, site0])
    assert H.logged(out, "starting with 1 of 2 sites; site 1 may join later")
    site1 = H.join(port, 1, tmp_path / "site1", ENDLESS, config=config)
    H.wait_for("two rounds with site 1", lambda: len(H.trained(out, 1)) >= 2, [server, site0, site1])
    H.kill_job(site1)  # mpiexec, its proxy and the site: the whole job, mid-round
    killed_at = time.monotonic()
    H.wait_for("site 1 dropped", lambda: H.logged(out, "client 1 (rank 2) lost: its job ended"), [server, site0])
    dropped_after = time.monotonic() - killed_at
    after = max(H.trained(out, 0))
    H.wait_for("two more rounds", lambda: max(H.trained(out, 0)) >= after + 2, [server, site0])
    site1 = H.join(port, 1, tmp_path / "site1", ENDLESS, config=config)  # the same command: it comes back
    H.wait_for("site 1 back, twice in the model", lambda: len([r for r in H.trained(out, 1) if r > after + 1]) >= 2,
               [server, site0, site1])
    if mode == "async":  # every site away at once: the loop waits for a rejoin (federation.setup_timeout_s)
        H.kill_job(site0)
        H.kill_job(site1)
        # (its last updates may still be on their way into metrics.jsonl until the server waits)
        H.wait_for("the server waiting for a site", lambda: H.logged(out, "0 site(s) present, it needs 1: waiting "
                                                                           "up to 120 s"), [server])
        last = max(H.trained(out, 1))
        site1 = H.join(port, 1, tmp_path / "site1", ENDLESS, config=config)
        H.wait_for("site 1 back after every site was away", lambda: max(H.trained(out, 1)) > last, [server, site1],
                   timeout=180)
    (out / "HALT").touch()  # checkpoint and stop cleanly
    (srv_code, srv_text), *ends = H.finish([server, *([site0] if mode == "sync" else []), site1], 120)
    assert srv_code == 0 and all(c == 0 for c, _ in ends), srv_text[-3000:] + ends[0][1][-2000:]

    log = H.events(out)
    joined = [e["value"] for e in log if e["client"] == 1 and e["name"] == "joined"]
    failed = [e["round"] for e in log if e["client"] == 1 and e["name"] == "client_failed"]
    back = [e["value"] for e in log if e["client"] == 1 and e["name"] == "rejoined"]
    times = 1 if mode == "sync" else 2  # async: back again after every site was away
    assert len(joined) == 1 and len(failed) == times and len(back) == times, (joined, failed, back)
    ones = H.trained(out, 1)
    assert ones[0] >= joined[0] >= 1 and len(ones) >= 4  # it joined a running federation, from then on
    assert not [r for r in ones if failed[0] < r < back[0]]  # nothing of it while it was away; the rest went on
    assert failed[0] < after + 2 <= back[0]
    if mode == "sync":  # in the sum of the round it was let in at (async: its next update, whenever it lands)
        assert next(r for r in ones if r >= back[0]) == back[0]
    assert H.trained(out, 0)[0] < joined[0]  # site 0 alone before
    assert dropped_after < 15, f"the drop took {dropped_after:.1f} s"  # the lifeline, not a 30 s deadline
    assert "halted after round" in srv_text and "Traceback" not in srv_text


def test_the_sites_reconnect_to_a_resumed_server_and_the_run_completes(tmp_path):
    overrides = [*H.SMALL, "rounds=40", "checkpoint_every=2", "federation.slowdown={0: 20, 1: 20}"]
    out, port = tmp_path / "srv", tmp_path / "srv" / "port.json"
    server = H.serve(out, overrides)
    sites = [H.join(port, i, tmp_path / f"site{i}", overrides) for i in (0, 1)]
    H.wait_for("four rounds and a checkpoint", lambda: len(H.trained(out, 0)) >= 4
               and any((out / "checkpoints").glob("ckpt-*.h5")), [server, *sites])
    H.kill_job(server)  # the server's whole job, mid-round: no STOP reaches the sites
    assert max(H.trained(out, 0)) < 39
    resumed = H.serve(out, overrides, "--resume")  # a new job: a new knock port, MPI port and job id
    (code, text), *joined = H.finish([resumed, *sites], 240)
    assert code == 0 and [c for c, _ in joined] == [0, 0], text[-3000:] + joined[0][1][-2000:]
    assert re.search(r"resumed from \S*ckpt-0000\d\d\.h5", text), text[-3000:]
    for i, (_, site_text) in enumerate(joined):
        assert f"the server is gone: its job ended (its lifeline closed); site {i} knocks again" in site_text
        assert (tmp_path / f"site{i}" / "logs" / f"rank{i + 1}.log").read_text().count("joined the server") == 2
        assert H.trained(out, i) == list(range(40))  # every round once, as in a run never interrupted
    assert set(H.summary(out)["clients"]) == {"0", "1"}
