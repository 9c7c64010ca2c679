"""A live view of a running federation: rank 0 mirrors its metrics to TensorBoard and/or MLflow.

    tracking: tensorboard          # OUT/tensorboard/ event files   (pip install hpcfed[report])
    tracking: mlflow               # OUT/mlruns/ MLflow file store  (pip install hpcfed[tracking])
    tracking: tensorboard,mlflow

Every numeric record of ``metrics.jsonl`` that has a round goes to each tracker as it is written:
the scalar ``<name>/site<k>`` (``<name>/server`` for the server's own figures) at step = round.
``tensorboard --logdir OUT/tensorboard`` or ``MLFLOW_ALLOW_FILE_STORE=true mlflow ui
--backend-store-uri OUT/mlruns`` follow the run while it goes (MLflow 3 wants that variable for a
file store). A tracker that fails (disk full, a broken package) is closed with one warning
and the run goes on: metrics.jsonl stays the record of the run.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

from hpcfed.config import TRACKING_KINDS

log = logging.getLogger("hpcfed.server")

KINDS = TRACKING_KINDS


class Tracker(Protocol):
    """Where a metric goes besides metrics.jsonl."""

    def scalar(self, tag: str, value: float, step: int, wall_time: float) -> None: ...

    def close(self) -> None: ...


def parse_kinds(spec: str | None) -> list[str]:
    """``"tensorboard,mlflow"`` -> ["tensorboard", "mlflow"]; ValueError naming a kind not in KINDS."""
    kinds = [k.strip() for k in (spec or "").split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"tracking: {bad[0]!r} is not a tracker; use {', '.join(KINDS)} (comma-separated)")
    return list(dict.fromkeys(kinds))


def tag_of(name: str, client: int | None) -> str:
    """``loss/site1``, ``round_time_s/server``."""
    return f"{name}/{'server' if client is None or client < 0 else f'site{client}'}"


class TensorBoard:
    """Event files in `log_dir`, readable by TensorBoard while the run goes (flushed every 10 s)."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ValueError(f"tracking: tensorboard needs the tensorboard package ({exc}); "
                             f"pip install hpcfed[report], or leave tracking out") from None
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=10)

    def scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        self.writer.add_scalar(tag, value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        self.writer.close()


class MLflow:
    """One MLflow run in a local file store (`store`), named after the config, its keys as params."""

    def __init__(self, store: Path, experiment: str, params: dict[str, Any]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ValueError(f"tracking: mlflow needs the mlflow package ({exc}); pip install hpcfed[tracking], "
                             f"or leave tracking out") from None
        store.mkdir(parents=True, exist_ok=True)
        # MLflow 3 keeps the file store in maintenance mode and refuses it unless asked: a plain folder
        # beside metrics.jsonl needs no database or server on a compute node
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=store.resolve().as_uri())
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=experiment).info.run_id
        for key, value in list(params.items())[:100]:  # MLflow caps a run's params; the config hash is among them
            self.client.log_param(self.run_id, key[:250], str(value)[:500])

    def scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        self.client.log_metric(self.run_id, tag.replace("/", "."), value, timestamp=int(wall_time * 1000), step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(spec: str | None, out_dir: Path, name: str, params: dict[str, Any]) -> list[Tracker]:
    """The trackers `spec` names, writing under `out_dir`; one that cannot start (its package is not
    installed, the folder is not writable) is left out with a warning that says how to fix it."""
    trackers: list[Tracker] = []
    for kind in parse_kinds(spec):
        try:
            trackers.append(TensorBoard(out_dir / "tensorboard") if kind == "tensorboard"
                            else MLflow(out_dir / "mlruns", name, params))
        except Exception as exc:  # a live view is optional: the run goes on without it
            log.warning("tracking: %s is off for this run: %s", kind, exc)
    return trackers


class Mirror:
    """Fans one metric record out to the trackers; a tracker that raises is dropped with a warning."""

    def __init__(self, trackers: list[Tracker], start_wall_time: float) -> None:
        self.trackers = list(trackers)
        self.start = start_wall_time

    def record(self, round: int | None, client: int | None, name: str, value: Any, elapsed: float) -> None:
        if round is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if not math.isfinite(value):
            return
        for tracker in list(self.trackers):
            try:
                tracker.scalar(tag_of(name, client), float(value), int(round), self.start + elapsed)
            except Exception as exc:  # any tracker fault: drop the tracker, keep the run
                log.warning("tracking: %s failed (%s); it is closed, metrics.jsonl goes on",
                            type(tracker).__name__, exc)
                self._drop(tracker)

    def close(self) -> None:
        for tracker in list(self.trackers):
            self._drop(tracker)

    def _drop(self, tracker: Tracker) -> None:
        self.trackers.remove(tracker)
        try:
            tracker.close()
        except Exception as exc:  # closing a broken tracker must not end the run either
            log.warning("tracking: closing %s failed (%s)", type(tracker).__name__, exc)
