"""Which device a rank trains on: GPU binding of client ranks.

Rank 0 (the parameter server) only averages flat buffers, so it always stays on the CPU and leaves
the node's GPUs to the clients. A client rank picks ``cuda:N`` with

    N = local_rank mod num_visible_gpus

where `local_rank` is the rank's index among the ranks on its own node, taken from the first
launcher variable that is set (`LOCAL_RANK_ENV`: Slurm's ``SLURM_LOCALID``, MPICH/Hydra's
``MPI_LOCALRANKID``, Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK``, ...). Counting visible GPUs through
torch respects ``CUDA_VISIBLE_DEVICES``, so both common Slurm layouts work:

- ``--gpus-per-task=1`` / ``--gpu-bind=single:1``: every task sees exactly one GPU -> ``cuda:0``;
- ``--gres=gpu:4`` with 5 tasks on a node: the tasks see all 4 GPUs and local ranks 1..4 (the
  clients next to the server) land on ``cuda:1, cuda:2, cuda:3, cuda:0`` — one client per GPU.

``device: auto`` falls back to the CPU when no GPU is visible; ``device: cuda`` makes a missing GPU
an error, because a job that asked for GPUs and silently trains on the CPU wastes its allocation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("hpcfed.launch.device")

# Node-local rank, by launcher; the first one set wins (Slurm first: with `srun` it is authoritative).
LOCAL_RANK_ENV: tuple[str, ...] = (
    "SLURM_LOCALID",  # srun
    "MPI_LOCALRANKID",  # MPICH / Hydra (also Intel MPI)
    "OMPI_COMM_WORLD_LOCAL_RANK",  # Open MPI
    "PMI_LOCAL_RANK",  # some PMI-2 launchers
    "PALS_LOCAL_RANKID",  # HPE Cray PALS
    "MV2_COMM_WORLD_LOCAL_RANK",  # MVAPICH2
    "LOCAL_RANK",  # torchrun-style environments
)

PREFERENCES = ("auto", "cpu", "cuda")


def local_rank(rank: int, env: Mapping[str, str] | None = None) -> int:
    """This rank's index among the ranks on its node; the global rank when no launcher says.

    Falling back to the global rank is right on one node and still spreads ranks over GPUs on many.
    """
    env = os.environ if env is None else env
    for name in LOCAL_RANK_ENV:
        text = env.get(name, "").strip()
        if text:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"environment variable {name}={text!r} is not an integer local rank; "
                                 f"unset it or fix the launcher") from None
            if value < 0:
                raise ValueError(f"environment variable {name}={value} is negative; it must be a local rank >= 0")
            return value
    return rank


def gpu_for(local: int, num_gpus: int) -> int:
    """GPU index for a node-local rank: ``local mod num_gpus`` (one client per GPU, round robin)."""
    if num_gpus <= 0:
        raise ValueError("gpu_for needs at least one GPU")
    return local % num_gpus


def _num_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except RuntimeError:  # a broken driver: treat as no GPU rather than crash the rank
        return 0


def set_torch_threads(threads_per_rank: int, uses_torch: bool) -> None:
    """torch's intra-op threads for a site's rank (`threads_per_rank`); a site whose task does not
    train with torch never imports it."""
    if uses_torch:
        import torch

        torch.set_num_threads(max(1, threads_per_rank))


def select_device(rank: int, preference: str, *, env: Mapping[str, str] | None = None,
                  num_gpus: int | None = None, uses_torch: bool = True) -> str:
    """The torch device string for MPI rank `rank` under config ``device: preference``.

    `preference` is ``auto`` (GPU when visible, else CPU), ``cpu``, ``cuda`` (GPU required), or an
    explicit ``cuda:N`` (pins every client to GPU N). Rank 0, the server, always gets ``cpu``, and so
    does a site whose task does not train with torch (`uses_torch` false: gensim's), which then never
    imports it (torch's import is seconds of CPU per rank).
    `env` and `num_gpus` exist so the binding can be tested without GPUs; they default to the
    process environment and torch's count of visible GPUs.
    """
    pref = (preference or "auto").strip().lower()
    explicit: int | None = None
    if pref.startswith("cuda:"):
        try:
            explicit = int(pref.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"device={preference!r}: expected auto, cpu, cuda or cuda:N") from None
    elif pref not in PREFERENCES:
        raise ValueError(f"device={preference!r}: expected one of auto, cpu, cuda, cuda:N")
    if rank == 0 or pref == "cpu" or not uses_torch:
        return "cpu"
    count = _num_gpus() if num_gpus is None else int(num_gpus)
    if count == 0:
        if pref == "auto":
            return "cpu"
        visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
        raise ValueError(
            f"rank {rank}: device={preference} but no GPU is visible (CUDA_VISIBLE_DEVICES="
            f"{visible!r}, torch.cuda.is_available() is false); request GPUs from Slurm "
            f"(--gpus-per-task=1 or --gres=gpu:N), install a CUDA build of torch, or set device=auto")
    if explicit is not None:
        if explicit >= count:
            raise ValueError(f"rank {rank}: device={preference} but only {count} GPU(s) are visible "
                             f"(cuda:0..cuda:{count - 1})")
        return f"cuda:{explicit}"
    device = f"cuda:{gpu_for(local_rank(rank, env), count)}"
    log.debug("rank %d -> %s (%d GPUs visible)", rank, device, count)
    return device


def gpus_on_node(reports: list[tuple[str | None, int]]) -> int:
    """The GPUs a node's ranks can use together, from each rank's (CUDA_VISIBLE_DEVICES, GPUs it sees).

    Ranks that all see the same devices share them (``--gres=gpu:N``: N); ranks bound one GPU each
    (``--gpus-per-task=1``: each sees a different ``CUDA_VISIBLE_DEVICES``) have the union of theirs."""
    visible = {v for v, _ in reports}
    if len(visible) <= 1 or None in visible:
        return max((count for _, count in reports), default=0)
    return len({d.strip() for v in visible if v for d in v.split(",") if d.strip()})


def node_gpu_problem(node: str, training_ranks: int, gpus: int, preference: str) -> str | None:
    """The error for ``device: cuda`` with fewer GPUs than ranks that train on a node (None: enough)."""
    if (preference or "").strip().lower() != "cuda" or training_ranks <= gpus or gpus == 0:
        return None  # (no GPU at all: `select_device` says so, with what to check)
    return (f"node {node}: device=cuda with {training_ranks} ranks that train but {gpus} GPU(s) visible to them; "
            f"start at most {gpus} training rank(s) per node (one rank per GPU: srun --gpus-per-task=1, or "
            f"fewer --ntasks-per-node), or set device=auto to share")


def check_node_gpus(comm: object, preference: str, rank0_trains: bool = False) -> None:
    """``device: cuda``: every node has a GPU for each of its ranks that trains (rank 0, the server,
    does not; in a site's job of `hpcfed join` it is the leader, and does: `rank0_trains`);
    ValueError naming the node and the counts otherwise. Collective over `comm` (no pickle: each
    rank's report is a fixed-size buffer)."""
    if (preference or "").strip().lower() != "cuda":
        return
    import socket

    import numpy as np
    from mpi4py import MPI

    world: MPI.Comm = comm  # type: ignore[assignment]  # mpi4py's Comm, typed `object` like the rest of launch
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    mine = np.zeros(264, dtype=np.uint8)
    text = (visible if visible is not None else "\0unset").encode()[:255]
    mine[:len(text)] = np.frombuffer(text, dtype=np.uint8)
    trains = world.Get_rank() != 0 or rank0_trains
    mine[256:264] = np.frombuffer(np.array([_num_gpus() * 2 + trains], dtype="<i8").tobytes(), dtype=np.uint8)
    table = np.zeros((node.Get_size(), 264), dtype=np.uint8)
    node.Allgather(mine, table)
    node.Free()
    reports, trainers = [], 0
    for row in table:
        word = int(np.frombuffer(row[256:264].tobytes(), dtype="<i8")[0])
        trainers += word & 1
        raw = bytes(row[:256]).rstrip(b"\0")
        reports.append((None if raw == b"\0unset" or raw.startswith(b"\0") else raw.decode("ascii", "replace"),
                        word >> 1))
    problem = node_gpu_problem(socket.gethostname(), trainers, gpus_on_node(reports), preference)
    if problem is not None:
        raise ValueError(problem)
