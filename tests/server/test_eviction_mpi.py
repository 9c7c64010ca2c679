"""A site that misbehaves once and then stays quiet cannot stop the federation (real mpiexec).

Each run: the quickstart for 4 rounds, 4 sites, the last one hostile. The honest sites' accuracy
is compared with the same run without that site (`federation.exclude_sites=[3]`)."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.mpi
HONEST = ("0", "1", "2")
SHORT = ["rounds=4", "federation.round_deadline_s=60"]


def _run(folder, *extra, config="configs/quickstart.yaml", resume=False):
    proc = run_cli(["run", str(config), "--out", str(folder), *(["--resume"] if resume else []), *SHORT, *extra],
                   np=5, timeout=400)
    return json.loads((folder / "summary.json").read_text()), proc


def _halt(folder, *extra):
    run_cli(["run", "configs/quickstart.yaml", "--out", str(folder), *SHORT, "halt_after_round=1",
             "checkpoint_every=1", *extra], np=5, timeout=400)
    assert not (folder / "summary.json").exists() and list((folder / "checkpoints").glob("*.h5"))


def _honest_mean(summary):
    return sum(summary["clients"][c]["accuracy"] for c in HONEST) / len(HONEST)


@pytest.fixture(scope="module")
def without_site(tmp_path_factory):
    summary, _ = _run(tmp_path_factory.mktemp("without") / "run", "federation.exclude_sites=[3]")
    return summary


@pytest.mark.parametrize("attack, reason", [
    ("bad_header", "malformed update (header integer beyond int64)"),
    ("bad_shape", "malformed update (tensor of shape (0, 18446744073709551615))"),
    ("bad_count", "malformed update (header integer beyond int64)"),
])
def test_one_malformed_upload_evicts_the_site_and_the_run_completes(tmp_path, without_site, attack, reason):
    summary, proc = _run(tmp_path / "run", f"attack={attack}")
    assert proc.returncode == 0
    assert [(e["client"], e["rank"], e["reason"], e["round"]) for e in summary["evicted"]] == [(3, 4, reason, 0)]
    assert summary["evicted"][0]["first_evidence"].startswith("round 0: malformed bundle")
    assert sorted(summary["clients"]) == list(HONEST) and not summary["dropped_clients"]
    assert abs(_honest_mean(summary) - _honest_mean(without_site)) <= 0.05
    assert f"evicted client 3 (rank 4): {reason}" in proc.stdout + proc.stderr
    assert "MPI_Abort" not in proc.stdout + proc.stderr


def test_uploads_refused_by_bounded_influence_evict_past_the_configured_count(tmp_path, without_site):
    """Honest for two rounds, then x1e30: beyond everything it and the others sent, twice."""
    summary, _ = _run(tmp_path / "run", "attack=scale_later", "security.max_refused_updates=1")
    (ev,) = summary["evicted"]
    assert ev["client"] == 3 and ev["round"] == 3 and ev["reason"].startswith("refused by bounded influence 2 times")
    assert abs(_honest_mean(summary) - _honest_mean(without_site)) <= 0.05


def test_a_site_refused_from_its_first_upload_is_refused_every_time_and_never_evicted(tmp_path, without_site):
    """x1e30 from the start: no accepted upload of its own to judge it against, so the refusals
    are no proof; it holds no influence, and no one is evicted."""
    summary, _ = _run(tmp_path / "run", "attack=scale", "security.max_refused_updates=1")
    assert summary["evicted"] == [] and summary["rejected"]["runtime"]["update out of range"] == 4
    assert abs(_honest_mean(summary) - _honest_mean(without_site)) <= 0.05


def test_an_async_site_is_evicted_alike(tmp_path):
    config = tmp_path / "quickstart_async.yaml"
    config.write_text((REPO / "configs" / "quickstart.yaml").read_text().replace("  weighting: num_examples\n", ""))
    summary, _ = _run(tmp_path / "run", "strategy.name=fedasync", "attack=bad_header", config=config)
    assert [e["client"] for e in summary["evicted"]] == [3]
    assert sorted(summary["clients"]) == list(HONEST) and summary["updates_accepted"] == 16


def test_what_an_evicted_site_sends_afterwards_is_dropped_unread_in_bounded_memory(tmp_path, without_site):
    summary, _ = _run(tmp_path / "run", "attack=bad_header_then_flood")
    assert [e["client"] for e in summary["evicted"]] == [3]
    channel = summary["channel"]
    # every flood message is refused at its first chunk, before decryption; none reaches the server
    assert channel["rejected"].get("unsolicited kind", 0) >= 10
    assert channel["rejected"].get("malformed bundle") == 1 and summary["rejected"]["runtime"] == {}
    # 8 MiB messages: their later chunks are dropped unread; rank 0 never holds the flood
    assert channel["dropped_chunks"] >= channel["rejected"]["unsolicited kind"]
    flood_bytes = channel["rejected"]["unsolicited kind"] * 8 << 20
    assert summary["cost"]["0"]["peak_rss_bytes"] < without_site["cost"]["0"]["peak_rss_bytes"] + min(
        flood_bytes // 2, 200 << 20)


def test_below_min_sites_the_run_stops_cleanly(tmp_path):
    summary, proc = _run(tmp_path / "run", "attack=bad_header", "federation.min_sites=4")
    assert proc.returncode == 0
    assert "federation.min_sites=4" in summary["stopped"] and summary["evicted"][0]["client"] == 3


def test_a_slow_honest_site_is_never_evicted(tmp_path):
    summary, _ = _run(tmp_path / "run", "federation.slowdown={1: 4}")
    assert summary["evicted"] == [] and sorted(summary["clients"]) == ["0", "1", "2", "3"]


def test_an_eviction_is_checkpointed_and_a_resumed_run_keeps_the_site_out(tmp_path, without_site):
    folder = tmp_path / "run"
    _halt(folder, "attack=bad_header")
    summary, _ = _run(folder, "attack=bad_header", "checkpoint_every=1", resume=True)
    assert [e["client"] for e in summary["evicted"]] == [3] and sorted(summary["clients"]) == list(HONEST)
    assert abs(_honest_mean(summary) - _honest_mean(without_site)) <= 0.05


def test_resume_with_exclude_sites_goes_on_without_that_site(tmp_path, without_site):
    folder = tmp_path / "run"
    _halt(folder)
    summary, proc = _run(folder, "checkpoint_every=1", "federation.exclude_sites=[3]", resume=True)
    assert proc.returncode == 0
    assert [(e["client"], e["reason"]) for e in summary["evicted"]] == [(3, "excluded (federation.exclude_sites)")]
    assert sorted(summary["clients"]) == list(HONEST)
