"""A hostile rank that ignores STOP (and everything after it) cannot keep the job alive, nor hold
the honest sites up (real mpiexec). Async FedDWA, 3 honest sites and the last one hostile: its one
malformed upload evicts it at once, the honest uploads keep being folded, and after the summary
rank 0 ends the job (MPI_Abort with status 0) once the hostile rank has not left within its grace."""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.mpi
HONEST = ("0", "1", "2")
COMMON = ["rounds=4", "federation.round_deadline_s=60", "federation.on_client_failure=continue",
          "federation.status_every_s=2"]


def _run(folder, config, *extra):
    t0 = time.monotonic()
    proc = run_cli(["run", str(config), "--out", str(folder), *COMMON, *extra], np=5, timeout=300)
    return json.loads((folder / "summary.json").read_text()), proc, time.monotonic() - t0


def _honest_mean(summary):
    return sum(summary["clients"][c]["accuracy"] for c in HONEST) / len(HONEST)


@pytest.fixture(scope="module")
def async_config(tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "quickstart_async.yaml"
    config.write_text((REPO / "configs" / "quickstart.yaml").read_text().replace("  weighting: num_examples\n", ""))
    return config


@pytest.fixture(scope="module")
def async_without(tmp_path_factory, async_config):
    summary, _, _ = _run(tmp_path_factory.mktemp("without") / "run", async_config, "strategy.name=feddwa",
                         "federation.exclude_sites=[3]")
    return summary


@pytest.mark.parametrize("attack", ["bad_header", "bad_shape", "bad_count"])
def test_async_a_malformed_upload_evicts_at_once_and_a_rank_that_stays_does_not_keep_the_job(
        tmp_path, async_config, async_without, attack):
    folder = tmp_path / "run"
    summary, _, wall = _run(folder, async_config, "strategy.name=feddwa", f"attack={attack}_then_linger")
    (ev,) = summary["evicted"]
    assert ev["client"] == 3 and ev["reason"].startswith("malformed update")
    assert sorted(summary["clients"]) == list(HONEST) and summary["updates_accepted"] == 16
    # costs the honest sites at most 0.05; async runs differ by arrival order (both ways: a run with
    # the site evicted at once ended 0.059 above the one without it), so a gain is not a failure
    assert _honest_mean(async_without) - _honest_mean(summary) <= 0.05
    assert re.search(r"rank\(s\) 4 still running .* ending the job", (folder / "logs" / "rank0.log").read_text())
    print(f"{attack}: the mpiexec job took {wall:.1f} s")  # reported, not asserted (a loaded host)


def test_sync_a_rank_that_ignores_stop_does_not_keep_the_job(tmp_path):
    folder = tmp_path / "run"
    summary, _, wall = _run(folder, REPO / "configs" / "quickstart.yaml", "attack=ignore_stop")
    assert sorted(summary["clients"]) == ["0", "1", "2", "3"] and summary["evicted"] == []
    assert re.search(r"rank\(s\) 4 still running .* ending the job", (folder / "logs" / "rank0.log").read_text())
    print(f"sync ignore_stop: the mpiexec job took {wall:.1f} s")
