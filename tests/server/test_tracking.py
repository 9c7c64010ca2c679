"""`tracking:`: rank 0 mirrors metrics to TensorBoard event files and an MLflow file store, read back here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import NUMPY_SITES, run_cli

from hpcfed.config import ConfigError, load
from hpcfed.server.metrics import MetricsLog
from hpcfed.server.tracking import Mirror, MLflow, TensorBoard, parse_kinds


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_metrics_reach_tensorboard_as_they_are_logged(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    log = MetricsLog(tmp_path / "metrics.jsonl", mirror=Mirror([TensorBoard(tmp_path / "tb")], 1.7e9))
    log.log(0, 1, "loss", 0.5)
    log.log(1, 1, "loss", 0.25)
    log.log(1, -1, "round_time_s", 2.0)
    log.log(None, None, "num_clients", 2)  # no round: not a point of a curve
    log.log(1, None, "checkpoint", "ckpt-000001.h5")  # text: metrics.jsonl only
    log.log(2, 0, "loss", float("nan"))  # non-finite: null in metrics.jsonl, left out here
    log.close()
    assert _scalars(tmp_path / "tb") == {"loss/site1": [(0, 0.5), (1, 0.25)], "round_time_s/server": [(1, 2.0)]}
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6


def test_a_tracker_that_fails_is_dropped_and_the_log_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("mlflow")
    flow = MLflow(tmp_path / "mlruns", "demo", {"seed": 0})
    mirror = Mirror([flow], 1.7e9)
    log = MetricsLog(tmp_path / "metrics.jsonl", mirror=mirror)
    log.log(0, 0, "loss", 0.5)
    shutil.rmtree(tmp_path / "mlruns")  # the store vanishes under the run (a cleaned scratch disk)
    log.log(1, 0, "loss", 0.4)
    log.log(2, 0, "loss", 0.3)
    log.close()
    assert mirror.trackers == [] and "tracking: MLflow failed" in caplog.text
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_bad_tracker_names_are_config_errors(tmp_path: Path) -> None:
    assert parse_kinds("tensorboard, mlflow,tensorboard") == ["tensorboard", "mlflow"]
    with pytest.raises(ValueError, match="'wandb' is not a tracker"):
        parse_kinds("wandb")
    with pytest.raises(ConfigError, match=r"tracking.*'wandb' is not a tracker; use tensorboard, mlflow"):
        load("configs/quickstart.yaml", ["tracking=tensorboard,wandb"])


@pytest.mark.mpi
def test_a_federation_tracked_live_in_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    run_cli(["run", "configs/quickstart.yaml", NUMPY_SITES,
             "--out", str(out), "rounds=2", "tracking=tensorboard,mlflow"],
            np=3, timeout=240)
    scalars = _scalars(out / "tensorboard")
    assert [step for step, _ in scalars["round_time_s/server"]] == [0, 1]
    assert {"site0", "site1"} <= {tag.split("/")[1] for tag in scalars}
    # MLflow 3 reads a file store only when told to (the server tells itself: hpcfed.server.tracking)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])[0]
    assert run.info.status == "FINISHED" and run.data.params["rounds"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "round_time_s.server")] == [0, 1]
