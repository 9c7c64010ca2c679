"""`metrics.jsonl`: one JSON object per event, written by rank 0.

Each line: ``{"round": r, "client": k or null, "name": "loss", "value": 0.41, "time": 12.3}``
where `time` is seconds since the federation started (resumed runs continue the clock).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from hpcfed.server.tracking import Mirror


class MetricsLog:
    """rank 0's ``metrics.jsonl``: one JSON line per figure, line-buffered so a killed run keeps what it
    measured; on resume, the lines of rounds after the checkpoint are dropped (they will be redone)."""

    def __init__(self, path: Path, resume_round: int | None = None, time_offset: float = 0.0,
                 mirror: Mirror | None = None) -> None:
        self.path = path
        self.t0 = time.monotonic() - time_offset
        self.mirror = mirror  # TensorBoard / MLflow (`tracking:`), fed every record as it is written
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_round is not None and path.exists():
            self._truncate_after(resume_round)
        elif resume_round is None:
            path.write_text("")
        self._fh = open(path, "a", buffering=1)  # noqa: SIM115 -- open for the whole run; close() closes it

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, round: int | None, client: int | None, name: str, value: Any, **extra: Any) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            value = None  # JSON has no NaN; null marks a non-finite value
        record = {"round": round, "client": client, "name": name, "value": value, "time": round_time(self.elapsed())}
        record.update(extra)
        self._fh.write(json.dumps(record) + "\n")
        if self.mirror is not None:
            self.mirror.record(round, client, name, value, record["time"])

    def log_many(self, round: int | None, client: int | None, values: dict[str, Any]) -> None:
        for name, value in values.items():
            self.log(round, client, name, value)

    def close(self) -> None:
        self._fh.close()
        if self.mirror is not None:
            self.mirror.close()

    def _truncate_after(self, last_round: int) -> None:
        """On resume, drop events of rounds the checkpoint does not contain (they will be redone)."""
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by kill -9
            r = record.get("round")
            if r is None or (isinstance(r, int) and r <= last_round):
                kept.append(line)
        self.path.write_text("".join(k + "\n" for k in kept))


def round_time(seconds: float) -> float:
    """Seconds rounded to 0.1 ms for the log (finer digits are timer noise on a loaded node)."""
    return float(f"{seconds:.4f}")
