"""kill -9 of the whole job at random moments, and during a checkpoint write, then `--resume`:
the federation ends exactly as an uninterrupted one (sync mode), losing only the rounds since the
newest valid checkpoint; a corrupt newest checkpoint is skipped for the previous one."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from ops_helpers import checkpoints, events, final_state, finish, kill_all, output, start, wait_for

pytestmark = pytest.mark.mpi

ROUNDS = 6
# Clients 20x slower than their real work: rounds take ~0.5 s, so kills land between and inside rounds.
COMMON = [f"rounds={ROUNDS}", "checkpoint_every=1", "keep_checkpoints=3", "federation.slowdown={0: 20, 1: 20}"]


def _finish(out: Path, timeout: float = 240) -> str:
    return finish(start(out, COMMON, resume=True), out, timeout)


def _rounds_logged_once(out: Path) -> None:
    seen: dict[tuple[int, int], int] = {}
    for e in events(out):
        if e["name"] == "val_accuracy" and e["client"] is not None and e["client"] >= 0:
            seen[(e["round"], e["client"])] = seen.get((e["round"], e["client"]), 0) + 1
    assert sorted(seen) == [(r, c) for r in range(ROUNDS) for c in (0, 1)], sorted(seen)
    assert set(seen.values()) == {1}, seen  # rounds redone after a resume are not logged twice


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, dict]:
    """Final metrics and strategy state of an uninterrupted run, the twin to match."""
    out = tmp_path_factory.mktemp("ref") / "run"
    proc = start(out, COMMON)
    try:
        rc = proc.wait(timeout=240)
    finally:
        kill_all(out, proc)
    assert rc == 0, output(proc)[-4000:]
    return final_state(out)


def test_kill9_at_random_moments_then_resume_matches_uninterrupted(tmp_path, reference):
    seed = int(os.environ.get("HPCFED_KILL_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    out = tmp_path / "run"
    kills = []
    proc = start(out, COMMON)
    for attempt in range(2):  # kill the first run, then kill the first resume too
        wait_for(lambda: checkpoints(out), 180, "a first checkpoint", proc)
        delay = rng.uniform(0.0, 2.5)
        time.sleep(delay)
        kills.append((round(delay, 2), checkpoints(out)[-1] if checkpoints(out) else None, proc.poll()))
        kill_all(out, proc)
        if attempt == 0:
            proc = start(out, COMMON, resume=True)
    text = _finish(out)
    assert "resumed from" in text, text[-3000:]
    assert final_state(out) == reference, f"seed {seed}, kills (delay s, newest ckpt, exit) {kills}"
    _rounds_logged_once(out)
    assert not [n for n in os.listdir(out / "checkpoints") if n.startswith(".")]  # no stale temp files


def test_kill9_during_checkpoint_write_and_corrupt_newest_then_resume(tmp_path, reference):
    out = tmp_path / "run"
    caught = None
    for _ in range(3):  # the write takes milliseconds; poll for its temporary file and kill inside it
        proc = start(out, COMMON)
        while proc.poll() is None:
            try:
                names = os.listdir(out / "checkpoints")
            except FileNotFoundError:
                time.sleep(0.005)
                continue
            complete = sorted(n for n in names if n.startswith("ckpt-"))
            partial = [n for n in names if n.startswith(".ckpt-")]
            if partial and len(complete) >= 2:
                kill_all(out, proc)
                caught = (partial, complete)
                break
        kill_all(out, proc)
        if caught:
            break
        os.system(f"rm -rf '{out}'")
    assert caught, "never saw a checkpoint being written in 3 runs"
    partial, complete = caught
    # The kill left a temporary file, never a half-written ckpt-*.h5 ...
    left = os.listdir(out / "checkpoints")
    assert [n for n in left if n.startswith(".ckpt-")] and sorted(n for n in left if n.startswith("ckpt-")) == complete
    # ... and now the newest complete one rots (bit flip on disk): resume must skip it for the previous.
    newest = out / "checkpoints" / complete[-1]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = os.urandom(64)
    newest.write_bytes(bytes(data[: len(data) * 3 // 4]))
    text = _finish(out)
    assert f"skipping checkpoint: {newest}" in text, text[-3000:]
    assert f"resumed from {out / 'checkpoints' / complete[-2]}" in text, text[-3000:]
    assert final_state(out) == reference
    _rounds_logged_once(out)
    assert not [n for n in os.listdir(out / "checkpoints") if n.startswith(".")]
