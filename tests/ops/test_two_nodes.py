"""Across two nodes (../shared/tools/two-nodes.sh: network, hostname, /dev/shm, IPC and PID namespaces
per node; ranks 0-1 on node1, 2-3 on node2; MPICH moves data over TCP between them): a federation
with a model of several chunks finishes, and with `on_client_failure: continue` it goes on without a
site SIGKILLed on the other node; after the whole of node2 is killed, `--resume` finishes the run.
Skipped where the tool cannot run (not root, no iproute2); deselect with `-m "not two_nodes"`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import REPO
from ops_helpers import checkpoints, events, job_pids, kill_all, output, start, wait_for

pytestmark = [pytest.mark.mpi, pytest.mark.two_nodes]

TOOL = Path(os.environ.get("HPCFED_TWO_NODES_TOOL", REPO / ".." / "shared" / "tools" / "two-nodes.sh")).resolve()
# 1,100,000 unused float32 values: a 4.4 MB model, two chunks of the default 4 MiB
BIG = ["task.ballast=1100000"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    """The emulated cluster: the mpiexec wrapper and the state folder; stopped after the module."""
    if not TOOL.is_file() or shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip(f"two-node tests need root, iproute2 and {TOOL}")
    state = tmp_path_factory.mktemp("two-nodes")
    env = {**os.environ, "HPCFED_TWO_NODES": str(state)}
    proc = subprocess.run(["bash", str(TOOL), "start"], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 77:
        pytest.skip(f"two-nodes.sh cannot run here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    try:
        yield state
    finally:
        subprocess.run(["bash", str(TOOL), "stop"], env=env, capture_output=True, timeout=120)


def _run(out: Path, state: Path, overrides: list[str], resume: bool = False):
    return start(out, overrides, np_=4, resume=resume, extra_env={"HPCFED_TWO_NODES": str(state)},
                 launcher=str(state / "mpiexec"))


def _hosts(out: Path) -> list[str]:
    return [(out / "logs" / f"rank{r}.pid").read_text().split()[1] for r in range(4)]


def test_a_site_killed_on_the_other_node_is_dropped_and_the_rest_finish(two_nodes, tmp_path):
    out = tmp_path / "run"
    deadline = 15
    proc = _run(out, two_nodes, [*BIG, "rounds=16", "checkpoint_every=4", "federation.on_client_failure=continue",
                                 "federation.quorum=0.5", f"federation.round_deadline_s={deadline}",
                                 "federation.slowdown={0: 4, 1: 4, 2: 4}"])
    try:
        wait_for(lambda: len(checkpoints(out)) >= 1, 240, "a first checkpoint", proc)
        assert _hosts(out) == ["node1", "node1", "node2", "node2"]
        os.kill(job_pids(out)["rank3"], signal.SIGKILL)  # client 2, on node2
        rc = proc.wait(timeout=240)
    finally:
        kill_all(out, proc)
    text = output(proc)
    assert rc == 0, text[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["clients"]) == ["0", "1"] and summary["accuracy"] > 0.5, summary["clients"]
    [dropped] = summary["dropped"]
    assert dropped["client"] == 2 and "another node" in dropped["cause"], dropped
    part = summary["participation"]
    assert part["0"]["contributed"] == part["1"]["contributed"] == 16 > part["2"]["contributed"], part
    # the two-chunk models crossed the nodes (ranks 2 and 3 are on node2), each round
    assert summary["channel"]["bytes_sent"] > 16 * 2 * 4_400_000, summary["channel"]
    assert summary["cost"]["2"]["bytes_received"] > 16 * 4_400_000, summary["cost"]["2"]


def test_resume_after_the_whole_of_node2_is_killed(two_nodes, tmp_path):
    out = tmp_path / "run"
    common = ["rounds=10", "checkpoint_every=2", "federation.slowdown={0: 4, 1: 4, 2: 4}",
              "federation.round_deadline_s=20"]
    proc = _run(out, two_nodes, common)
    try:
        wait_for(lambda: len(checkpoints(out)) >= 2, 240, "two checkpoints", proc)
        node2 = int((two_nodes / "node2.pid").read_text())
        os.kill(node2, signal.SIGKILL)  # the node's init: every process of node2 (ranks 2, 3, hydra's proxy) ends
        proc.wait(timeout=240)
    finally:
        kill_all(out, proc)
    assert proc.returncode != 0 and not (out / "summary.json").exists()
    newest = checkpoints(out)[-1]
    env = {**os.environ, "HPCFED_TWO_NODES": str(two_nodes)}
    subprocess.run(["bash", str(TOOL), "start"], env=env, capture_output=True, timeout=120, check=True)  # node2 back
    proc = _run(out, two_nodes, common, resume=True)
    try:
        rc = proc.wait(timeout=240)
    finally:
        kill_all(out, proc)
    text = output(proc)
    assert rc == 0, text[-4000:]
    assert f"resumed from {out / 'checkpoints' / newest}" in text or "resumed from" in text, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["clients"]) == ["0", "1", "2"]
    assert max(e["round"] for e in events(out) if e["name"] == "num_updates") == 9
