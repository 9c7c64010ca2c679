"""A resumed `hpcfed serve` does not wait for a site its checkpoint records as evicted (issue 38).

One real server job and three site jobs; site 2 turns malicious (attack=bad_header) and is evicted
at once. The server's job is SIGKILLed after a checkpoint that records the eviction, and started
again with --resume and a start deadline far longer than the test waits: it must start its rounds
with sites 0 and 1 (which knock again by themselves) without waiting for site 2, say so in its log,
and refuse site 2's new job at the knock, naming the eviction."""

from __future__ import annotations

import crossjob_helpers as H
import pytest

pytestmark = pytest.mark.mpi

OVERRIDES = [*H.SMALL, "federation.num_clients=3", "rounds=100000", "checkpoint_every=1", "attack=bad_header",
             "federation.on_client_failure=continue", "federation.slowdown={0: 3}",
             "federation.setup_timeout_s=900"]  # the sites knock again while the server restarts (a loaded host)


def _ckpt_after_eviction(out) -> bool:
    evs = H.events(out)
    evicted = [e["round"] for e in evs if e["name"] == "evicted"]
    return bool(evicted) and any(e["name"] == "checkpoint" and e["round"] > evicted[0] for e in evs)


def test_a_resumed_server_does_not_wait_for_a_site_evicted_in_its_checkpoint(tmp_path):
    out, port = tmp_path / "srv", tmp_path / "srv" / "port.json"
    server = H.serve(out, OVERRIDES, "--start-deadline", "900")
    sites = {i: H.join(port, i, tmp_path / f"site{i}", OVERRIDES) for i in range(3)}
    H.wait_for("a checkpoint after site 2's eviction", lambda: _ckpt_after_eviction(out), [server, sites[0], sites[1]],
               timeout=900)
    H.kill_job(server)
    H.kill_job(sites.pop(2))
    setups = (out / "logs" / "rank0.log").read_text().count("setup done")
    # The deadline is far past the wait below: a server that waited for site 2 would fail the test.
    server = H.serve(out, OVERRIDES, "--resume", "--start-deadline", "900")
    H.wait_for("the resumed server's rounds", lambda: (out / "logs" / "rank0.log").read_text().count("setup done")
               > setups, [server, *sites.values()], timeout=900)
    log = (out / "logs" / "rank0.log").read_text()
    assert "site 2 was evicted in the checkpoint this run resumes from (" in log and "it is not expected" in log
    back = H.join(port, 2, tmp_path / "site2", OVERRIDES)  # a new job of the evicted site: refused at the knock
    text, _ = back.communicate(timeout=600)
    assert back.returncode != 0 and "the server refused site 2: site 2 " in text, text[-3000:]
    assert "cannot rejoin" in text
    assert "knock from 127.0.0.1" in (out / "logs" / "rank0.log").read_text().split("resumes from")[-1]
    (out / "HALT").touch()
    (code, text), *ends = H.finish([server, *sites.values()], 180)
    assert code == 0 and all(c == 0 for c, _ in ends), text[-4000:] + "".join(t[-1500:] for _, t in ends)
    assert "Traceback" not in text
