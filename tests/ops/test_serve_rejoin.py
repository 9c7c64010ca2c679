"""A long-lived federation of `hpcfed serve`: a site joins late and a site comes back, both into
secure aggregation rounds (issue 37 item 4, issue 38 item 1).

One real server job and three site jobs, secure aggregation on: sites 0 and 1 start, site 2 joins
late; site 1's whole job is SIGKILLed, dropped, and knocks again -- first with a stale pre-shared
key (refused), while a second job of live site 0 is refused too -- then with its own key: it is
back on a fresh session, resumes from its own shard of the newest checkpoint, and takes part in
the masked sums from the round after its knock (it loaded its data and model before knocking).
Judged by what the server wrote (metrics.jsonl, summary.json, its log)."""

from __future__ import annotations

import json
import sys

import crossjob_helpers as H
import pytest
from conftest import REPO, run_cli

sys.path.insert(0, str(REPO))
from tools.chaos_checks import rejoin_rounds

pytestmark = pytest.mark.mpi

SECURE = [*H.SMALL, "federation.num_clients=3", "rounds=100000", "checkpoint_every=2",
          "federation.on_client_failure=continue", "federation.quorum=0.5", "federation.slowdown={0: 5}",
          "privacy.secure_aggregation=true", "influence.reject_factor=1000"]


def _sums(out, cid: int) -> list[int]:
    """The rounds whose masked sum folded site `cid`'s input (its metrics travel in the clear)."""
    return H.trained(out, cid)


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """The whole story, once: (server's log, server's output, OUT, the refusals the bad knocks got)."""
    tmp = tmp_path_factory.mktemp("rejoin")
    out, port = tmp / "srv", tmp / "srv" / "port.json"
    server = H.serve(out, SECURE, "--start-deadline", "60")  # sites 0 and 1 (site 0 brings the initial model)
    sites = {i: H.join(port, i, tmp / f"site{i}", SECURE) for i in (0, 1)}
    H.wait_for("a checkpoint with sites 0 and 1", lambda: any((out / "checkpoints").glob("ckpt-*.h5"))
               and len(_sums(out, 1)) >= 2, [server, *sites.values()], timeout=240)
    sites[2] = H.join(port, 2, tmp / "site2", SECURE)  # late, into secure rounds
    H.wait_for("a round with site 2", lambda: len(_sums(out, 2)) >= 1, [server, *sites.values()], timeout=240)
    H.kill_job(sites.pop(1))  # the whole job, mid-round
    H.wait_for("site 1 dropped", lambda: H.logged(out, "client 1 (rank 2) lost: its job ended"),
               [server, *sites.values()])
    # the operator's view reads live.json, which the server rewrites after the log line: wait for it
    H.wait_for("live.json showing site 1 away", lambda: _live_state(out, 1) not in (None, "present"),
               [server, *sites.values()])
    bad = {"view_away": run_cli(["status", str(out), "--once"], env={"COLUMNS": "200"}).stdout}  # the operator's view
    stale = H.join(port, 1, tmp / "site1", SECURE, psk="11" * 32)  # credentials of another federation
    twin = H.join(port, 0, tmp / "site0-twin", SECURE)  # a second job for a live site
    bad.update({name: proc.communicate(timeout=120)[0] for name, proc in (("stale", stale), ("twin", twin))})
    sites[1] = H.join(port, 1, tmp / "site1", SECURE)  # the same command as the first time
    H.wait_for("two rounds with site 1 back", lambda: len([e for e in H.events(out) if e["name"] == "rejoined"]) == 1
               and len([r for r in _sums(out, 1) if r >= _back(out)]) >= 2, [server, *sites.values()], timeout=300)
    bad["view_back"] = run_cli(["status", str(out), "--once"], env={"COLUMNS": "200"}).stdout
    (out / "HALT").touch()
    (code, text), *ends = H.finish([server, *sites.values()], 180)
    assert code == 0 and all(c == 0 for c, _ in ends), text[-4000:] + "".join(t[-1500:] for _, t in ends)
    return (out / "logs" / "rank0.log").read_text(), text, out, bad


def _live_state(out, cid: int) -> str | None:
    """Site `cid`'s state in the server's newest live.json (None while there is none, or mid-write)."""
    try:
        live = json.loads((out / "live.json").read_text())
    except (OSError, ValueError):
        return None
    return next((s["state"] for s in live.get("sites", []) if s.get("client") == cid), None)


def _back(out) -> int:
    back = [e["value"] for e in H.events(out) if e["name"] == "rejoined"]
    return back[0] if back else 1 << 30


def test_a_rejoining_site_takes_part_in_secure_rounds_from_its_own_shard(federation):
    log, text, out, _ = federation
    back, dropped = _back(out), [e["round"] for e in H.events(out) if e["client"] == 1 and e["name"] == "client_failed"]
    assert len(dropped) == 1 and dropped[0] < back, (dropped, back)
    ones = _sums(out, 1)
    assert not [r for r in ones if dropped[0] < r < back]  # nothing of it while it was away
    assert [r for r in ones if r >= back][:2] == [back, back + 1]  # in the sum from the round it was let in
    assert "site 1 is back as rank 2" in log and "client 1 (rank 2) is back: it takes part from round" in log
    # ready before it knocked: folded at the latest in the round after the one in progress at its knock
    # (issue 38; 0 where its knock fell before that round's masks were set up)
    rejoins = rejoin_rounds(out)
    assert [r["site"] for r in rejoins] == [1] and rejoins[0]["rounds"] in (0, 1), rejoins
    assert "client 1 (rank 2) resumes from its own shard of round" in log  # not from the global model
    live = json.loads((out / "live.json").read_text())  # its last snapshot (a halted run writes no summary)
    sites = {s["client"]: s for s in live["sites"]}
    assert sites[1]["gaps"] == [[dropped[0], back]] and sites[1]["rejoins"] == 1 and sites[1]["state"] == "present"
    assert [s["state"] for s in live["sites"]] == ["present"] * 3 and live["status"] == "ended"
    assert "Traceback" not in text and "halted after round" in text


def test_late_and_returning_sites_are_summed_with_the_others(federation):
    _, _, out, _ = federation
    back = _back(out)
    joined = [e["value"] for e in H.events(out) if e["client"] == 2 and e["name"] == "joined"]
    assert len(joined) == 1 and _sums(out, 2)[0] == joined[0]  # the late site: in the sum of its first round
    # after the return, every completed round's masked sum holds all three inputs
    full = [e["round"] for e in H.events(out) if e["name"] == "num_updates" and e["round"] >= back]
    assert full and all(e["value"] == 3 for e in H.events(out) if e["name"] == "num_updates" and e["round"] in full)


def test_a_stale_key_and_a_second_job_for_a_live_site_are_refused_at_the_knock(federation):
    log, _, _, bad = federation
    assert "site 1's proof is invalid (another pre-shared key)" in bad["stale"]
    assert "site 0 is present and alive in this federation" in bad["twin"]
    assert "site 0 is present and alive" in log and "site 1's proof is invalid" in log


def test_the_operators_view_draws_each_sites_gaps(federation):
    """`hpcfed status` during the run: site 1 away since the round it was dropped, then back."""
    _, _, out, views = federation
    back = _back(out)
    dropped = next(e["round"] for e in H.events(out) if e["client"] == 1 and e["name"] == "client_failed")
    away = [line for line in views["view_away"].splitlines() if f"{dropped}→" in line]  # site 1's row: away
    assert len(away) == 1 and "dropped" in away[0], views["view_away"]
    again = next(line for line in views["view_back"].splitlines() if f"{dropped}→{back}" in line)
    assert "present" in again, views["view_back"]
