"""The secure channel in a real ``mpiexec -n 3`` job with a hostile rank (see comm_live.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from comm_attacks import ANY
from conftest import mpiexec

pytestmark = pytest.mark.mpi
HERE = Path(__file__).resolve().parent


def _run_script(script: str, ranks: int, out: Path) -> dict:
    """Run tests/comm/SCRIPT under `mpiexec -n RANKS`; it writes its findings as JSON to OUT."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(HERE / script), str(out)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_hostile_rank_is_rejected_while_the_honest_one_is_served(tmp_path):
    out = tmp_path / "live.json"
    got = _run_script("comm_live.py", 3, out)
    plan = json.loads(Path(str(out) + ".plan").read_text())

    # the honest site: every message arrived intact and was answered
    assert [h[0] for h in got["honest"]] == list(range(12))
    assert {h[2] for h in got["honest"]} == {200_000, 100}

    # the hostile site: every bad frame rejected and counted against rank 2, nothing against rank 1
    bad = [(name, reason) for name, reason in plan if reason is not None]
    stats = got["stats"]
    assert stats["rejected_by_rank"] == {"2": len(bad)}
    for name, reason in bad:
        if reason != ANY:
            assert stats["rejected"].get(reason, 0) >= 1, (name, stats["rejected"])
    assert sum(stats["rejected"].values()) == len(bad)
    assert got["hostile_texts"] == ["legit 1", "legit 2", "legit 3"]
    assert any(line.startswith("rejected message from rank 2:") for line in got["log"])

    # an idle rank does not burn a core: it sleeps between polls (a spinning loop would Iprobe
    # hundreds of thousands of times in 2 s); counted, not timed, so a loaded host cannot fail it
    assert not got["idle_got_message"]
    assert got["idle_polls"] <= 5000 and got["idle_sleeps"] >= 20, got


def test_post_returns_at_once_while_the_peer_is_busy_and_delivers_in_order(tmp_path):
    got = _run_script("post_live.py", 2, tmp_path / "post.json")
    # Every post returned while the peer made no MPI call at all (it waits for a file that rank 0
    # writes only after its last post returned; were post to wait for the peer, this would hang
    # and fail on the timeout) ...
    # ... and the channel reports a message taken only once the peer is back.
    assert got["done_before_peer_back"] == [False] * 4, got
    assert all(got["done_after"]), got
    assert got["ack"] == {"got": [[0, True], [1, True], [2, True], [3, True]]}
