"""The hostile-input campaign against a live server (tools/hostile_campaign.py under mpiexec)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import NUMPY_SITES, REPO, mpiexec

pytestmark = pytest.mark.mpi


def test_thousand_crafted_messages_are_all_rejected_and_change_nothing(tmp_path):
    mpiexec()  # skips without MPI
    proc = subprocess.run(
        [sys.executable, "tools/hostile_campaign.py", "--json", "--messages", "1000", "--out", str(tmp_path),
         "rounds=3", "checkpoint_every=1", NUMPY_SITES],
        cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    logs = "".join((tmp_path / f).read_text()[-3000:] for f in ("baseline.log", "attacked.log")
                   if (tmp_path / f).exists())
    assert result["sent"] >= 1000, logs
    assert result["accepted"] == 0, result["rejected_by_server"]
    assert result["server_alive"] is True, logs
    assert result["honest_result_equal"] is True, result["final_metrics"]
    assert proc.returncode == 0
    # Every family of attack was exercised, and the server counted rejections in every layer.
    by_attack = result["by_attack"]
    for name in ("tampered_ciphertext", "replayed_frame", "reordered_seq", "reordered_chunk", "truncated_frame",
                 "wrong_key", "wrong_source_rank", "wrong_destination_rank", "oversize_frame", "lying_length",
                 "bundle_lying_tensor_nbytes", "bundle_header_huge_int", "bundle_empty_tensor_huge_dim",
                 "nan_params", "inf_params", "wrong_dtype_float64",
                 "wrong_dtype_bfloat16", "wrong_dtype_group", "wrong_shape_short", "unknown_name_extra"):
        assert by_attack.get(name, 0) > 0, name
    channel, runtime = result["rejected_by_server"]["channel"], result["rejected_by_server"]["runtime"]
    for reason in ("authentication failed", "replayed or reordered frame", "misrouted frame", "truncated frame",
                   "oversize frame", "malformed bundle"):
        assert channel.get(reason, 0) > 0, (reason, channel)
    for category in ("non-finite parameters", "wrong dtype or shape", "unknown tensor name", "malformed header",
                     "stale update"):
        assert runtime.get(category, 0) > 0, (category, runtime)
    assert result["baseline_rejected"] == 0
    # The server logged the hostile rank by number.
    server_log = (tmp_path / "attacked" / "logs" / "rank0.log").read_text()
    assert f"rejected message from rank {result['hostile_rank']}" in server_log


def test_two_gib_flood_of_unsolicited_and_oversize_messages_leaves_server_memory_flat(tmp_path):
    """An authenticated rank sends 2 GiB of validly sealed messages the server never asked for
    (kind 99), UPDATEs beyond their kind's bound, and first chunks declaring 8 GiB: each is dropped
    on arrival, before any buffer, counted against that rank; the federation's result is unchanged."""
    mpiexec()  # skips without MPI
    proc = subprocess.run(
        [sys.executable, "tools/hostile_campaign.py", "--json", "--messages", "0", "--flood-mib", "2048",
         "--out", str(tmp_path), "rounds=2", "checkpoint_every=1", NUMPY_SITES],
        cwd=REPO, capture_output=True, text=True, timeout=500)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    logs = "".join((tmp_path / f).read_text()[-3000:] for f in ("baseline.log", "attacked.log")
                   if (tmp_path / f).exists())
    by_attack = result["by_attack"]
    assert by_attack["flood_unsolicited_kind"] == 24 and by_attack["flood_declared_8gib"] == 4, by_attack
    assert by_attack["flood_oversize_update"] >= 1, by_attack
    assert result["accepted"] == 0 and result["server_alive"] is True, (result["rejected_by_server"], logs)
    assert result["honest_result_equal"] is True, result["final_metrics"]
    channel = result["rejected_by_server"]["channel"]
    assert channel == {"unsolicited kind": 24,
                       "message too large for its kind": by_attack["flood_oversize_update"] + 4}, channel
    assert result["server_peak_rss_mib"]["baseline"] > 0
    assert result["server_peak_rss_growth_mib"] <= 64, result["server_peak_rss_mib"]
