"""What a site may send the server, checked before any of it is used: pure functions, no channel.

Every value from a site is hostile, sealed or not. A header's numbers are bounded before any
arithmetic (a JSON integer such as 10**400 raises OverflowError in float() and would end the
server); texts are cut before they reach a log; an upload's tensors must carry the layout's own
names, dtypes and shapes, and be finite. A check returns the parsed value, or a `Rejection`: a fixed
category (counted per run and per rank) and a detail (logged only), which the caller counts against
the sender.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, TypeGuard

import numpy as np

from hpcfed import protocol as P
from hpcfed.cost import parse_cost
from hpcfed.params import ParamLayout
from hpcfed.strategies.base import Update

# 2**53 is the largest integer a float64 holds exactly, far above any legitimate count, version or round.
HEADER_INT_MAX = 2**53
MAX_METRICS = 64  # named numbers in an UPDATE's or RESULT's "metrics"
MAX_NAME = 128  # characters of one metric's name
MAX_SHARD_REPORTS = 64  # [round, digest] pairs a site may list on --resume
MAX_PATH = 4096  # characters of a shard's path
MAX_ERROR = 500  # characters of a FAILED message's error kept for logs and summary.json
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Rejection:
    """Why a message is refused: `category` is counted (summary.json), `detail` only logged."""

    category: str
    detail: str


class ShardRef(TypedDict):
    """A site's report of the checkpoint shard it wrote (the manifest records digest and path)."""

    round: int
    digest: str
    path: str


def is_int(value: object) -> TypeGuard[int]:
    """An integer (not a bool) within +-`HEADER_INT_MAX`."""
    return isinstance(value, int) and not isinstance(value, bool) and -HEADER_INT_MAX <= value <= HEADER_INT_MAX


def is_number(value: object) -> TypeGuard[int | float]:
    """A finite float, or an integer within +-`HEADER_INT_MAX`."""
    if isinstance(value, float):
        return math.isfinite(value)
    return is_int(value)


def metrics_ok(metrics: object) -> TypeGuard[dict[str, int | float | None]]:
    """At most `MAX_METRICS` short names, each a number (see `is_number`) or null."""
    return isinstance(metrics, dict) and len(metrics) <= MAX_METRICS and all(
        isinstance(k, str) and len(k) <= MAX_NAME and (is_number(v) or v is None) for k, v in metrics.items())


def short(text: object, limit: int = 300) -> str:
    """A peer's text as it may appear in our logs and errors: one line, bounded."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit] + f"... ({len(line)} characters)"


def error_text(header: Mapping[str, object]) -> str:
    """A FAILED message's error, as at most `MAX_ERROR` characters of text (it goes into logs and summary.json)."""
    error = header.get("error")
    return " ".join(error[:MAX_ERROR].split()) if isinstance(error, str) else "unknown error"


def shard_ref(value: object) -> ShardRef | None:
    """A site's report of the shard it wrote: {round, digest (64 hex), path}, or None if malformed."""
    if not isinstance(value, dict):
        return None
    rnd, digest, path = value.get("round"), value.get("digest"), value.get("path")
    if not is_int(rnd) or rnd < 0 or not isinstance(digest, str) or len(digest) != 64 \
            or not _HEX.issuperset(digest) or not isinstance(path, str) or len(path) > MAX_PATH:
        return None
    return {"round": rnd, "digest": digest, "path": path}


def held_shards(value: object) -> set[tuple[int, str]]:
    """A site's --resume report [[round, digest], ...], bounded; anything malformed counts as not held."""
    if not isinstance(value, list):
        return set()
    out = set()
    for item in value[:MAX_SHARD_REPORTS]:
        if isinstance(item, list) and len(item) == 2:
            ref = shard_ref({"round": item[0], "digest": item[1], "path": ""})
            if ref:
                out.add((ref["round"], ref["digest"]))
    return out


def task_header(header: Mapping[str, object]) -> dict[str, Any] | Rejection:
    """A SETUP message's task header (a mapping the task's `server_setup` reads)."""
    task = header.get("task", {})
    if not isinstance(task, dict):
        return Rejection("malformed header", "SETUP task header is not a mapping")
    return task


def parse_update(client_id: int, header: Mapping[str, object], tensors: dict[str, np.ndarray],
                 layout: ParamLayout, allow_state: bool) -> tuple[Update, ShardRef | None] | Rejection:
    """An UPDATE checked against the model layout: the update, and the shard it reports when the
    round is a checkpoint's (`allow_state`); or why it is refused."""
    keys = {P.params_key(name) for name in layout.groups}
    unknown = [k for k in tensors if k not in keys]  # site state never crosses the wire
    if unknown:
        return Rejection("unknown tensor name", f"{unknown[:3]}")
    groups = P.params_groups(tensors, layout.groups)
    wrong = layout.check_packed(groups)
    if wrong:  # e.g. bf16 where the layout says float32, or a truncated buffer
        return Rejection("wrong dtype or shape", f"parameters: {wrong}")
    if not layout.packed_finite(groups):
        return Rejection("non-finite parameters", "parameters contain NaN or Inf")
    flat = layout.unpack_flat(groups)
    num = header.get("num_examples")
    metrics = header.get("metrics", {})
    if not is_int(num) or num < 0 or not metrics_ok(metrics):
        return Rejection("malformed header", "UPDATE num_examples/metrics")
    version, client_version = header.get("version", 0), header.get("client_version", 0)
    upd = Update(client_id=client_id, flat=flat, num_examples=num,
                 base_version=version if is_int(version) else 0,
                 client_version=client_version if is_int(client_version) else 0,
                 metrics={k: (float(v) if v is not None else math.nan) for k, v in metrics.items()})
    return upd, shard_ref(header.get("shard")) if allow_state else None


def parse_result(header: Mapping[str, object]) -> tuple[dict[str, float], dict[str, Any] | None] | Rejection:
    """A RESULT's final metrics (finite ones only) and the rank's cost (None when it sent none)."""
    metrics = header.get("metrics", {})
    if not metrics_ok(metrics):
        return Rejection("malformed header", f"RESULT metrics are not at most {MAX_METRICS} named numbers")
    cost = parse_cost(header["cost"]) if "cost" in header else None
    if "cost" in header and cost is None:
        return Rejection("malformed header", "RESULT cost is not bounded counters and seconds")
    return {k: float(v) for k, v in metrics.items() if is_number(v)}, cost
