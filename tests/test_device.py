"""GPU binding of client ranks (`hpcfed.launch.device.select_device`), checked with a given GPU count."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from hpcfed.launch.device import gpu_for, local_rank, select_device


def test_server_rank_always_on_cpu():
    for pref in ("auto", "cuda", "cuda:1", "cpu"):
        assert select_device(0, pref, env={"SLURM_LOCALID": "0"}, num_gpus=4) == "cpu"


def test_clients_round_robin_over_visible_gpus_by_local_rank():
    # 5 ranks on a node with 4 GPUs: the server (local 0) is on CPU, clients take one GPU each.
    got = [select_device(r, "auto", env={"SLURM_LOCALID": str(r)}, num_gpus=4) for r in range(1, 5)]
    assert got == ["cuda:1", "cuda:2", "cuda:3", "cuda:0"]
    # Second node: global rank 7 is local rank 2 there.
    assert select_device(7, "cuda", env={"SLURM_LOCALID": "2"}, num_gpus=4) == "cuda:2"


def test_one_gpu_per_task_layout_gives_cuda0():
    # --gpus-per-task=1: every task sees exactly one GPU.
    assert {select_device(r, "cuda", env={"SLURM_LOCALID": str(r)}, num_gpus=1) for r in (1, 2, 3)} == {"cuda:0"}


def test_local_rank_sources_in_order_and_fallback_to_global_rank():
    assert local_rank(5, {"MPI_LOCALRANKID": "1"}) == 1
    assert local_rank(5, {"OMPI_COMM_WORLD_LOCAL_RANK": "3", "SLURM_LOCALID": "2"}) == 2  # Slurm wins
    assert local_rank(5, {}) == 5
    with pytest.raises(ValueError, match="SLURM_LOCALID='x'"):
        local_rank(1, {"SLURM_LOCALID": "x"})
    assert gpu_for(6, 4) == 2


def test_cpu_fallback_and_errors_when_cuda_is_required():
    assert select_device(1, "auto", env={}, num_gpus=0) == "cpu"
    assert select_device(1, "cpu", env={}, num_gpus=8) == "cpu"
    with pytest.raises(ValueError, match="rank 2: device=cuda but no GPU is visible"):
        select_device(2, "cuda", env={"CUDA_VISIBLE_DEVICES": ""}, num_gpus=0)
    with pytest.raises(ValueError, match="only 2 GPU"):
        select_device(1, "cuda:3", env={}, num_gpus=2)
    assert select_device(1, "cuda:1", env={}, num_gpus=2) == "cuda:1"
    with pytest.raises(ValueError, match="expected one of auto, cpu, cuda"):
        select_device(1, "tpu", env={}, num_gpus=0)


def test_real_torch_count_on_this_machine():
    import torch

    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert select_device(1, "auto", env={"SLURM_LOCALID": "0"}) == want


def test_device_cuda_with_fewer_gpus_than_ranks_on_a_node_names_the_node_and_counts():
    from hpcfed.launch.device import gpus_on_node, node_gpu_problem

    # --gres=gpu:2, every rank sees both: 2 GPUs for the node's ranks
    assert gpus_on_node([("0,1", 2), ("0,1", 2), ("0,1", 2)]) == 2
    # --gpus-per-task=1: each rank sees its own one, the node has their union
    assert gpus_on_node([("0", 1), ("1", 1), ("2", 1), ("3", 1)]) == 4
    assert gpus_on_node([(None, 0), (None, 0)]) == 0
    problem = node_gpu_problem("gpu-node-7", 4, 2, "cuda")
    assert problem is not None
    assert problem.startswith("node gpu-node-7: device=cuda with 4 ranks that train but 2 GPU(s)")
    assert node_gpu_problem("n", 2, 2, "cuda") is None and node_gpu_problem("n", 4, 2, "auto") is None
    assert node_gpu_problem("n", 2, 0, "cuda") is None  # none at all: select_device's own error


def test_a_site_of_a_task_without_torch_never_imports_it(tmp_path) -> None:
    """A doc2vec site (gensim) picks its device, sets its threads, joins the vocabulary, trains a round
    and exports, as a site rank does, without importing torch (seconds of CPU on every rank); the
    quickstart's site does import it."""
    code = f"""
import sys
from hpcfed import registry
from hpcfed.client.client import Client  # noqa: F401 (what a site rank imports)
from hpcfed.config import load
from hpcfed.launch.device import select_device, set_torch_threads
from hpcfed.tasks.base import Site

for path, overrides in (("configs/seec_20ng_joint.yaml", ["task.dataset=gensim", "task.max_docs=20",
                                                           "task.vector_size=8", "task.total_epochs=1"]),
                        ("configs/quickstart.yaml", [])):
    cfg = load(path, overrides)
    task_cls = registry.resolve(cfg).task
    device = select_device(1, "auto", uses_torch=registry.uses_torch(cfg))
    set_torch_threads(1, registry.uses_torch(cfg))
    if task_cls.name == "doc2vec":
        tc = task_cls.Config(**cfg.task.options)
        tasks = [task_cls(tc, Site(client_id=c, num_clients=2, seed=0, out_dir={str(tmp_path)!r})) for c in range(2)]
        replies, init = task_cls.server_setup(tc, {{c: t.setup() for c, t in enumerate(tasks)}})
        tasks[0].on_setup(replies[0])
        tasks[0].set_parameters(init)
        assert tasks[0].fit(0).num_examples > 0 and tasks[0].export_embeddings({str(tmp_path)!r}).is_file()
    print(task_cls.name, device, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["doc2vec cpu False", "synthetic cpu True"]
