"""Data-parallel training inside a site of many ranks (`federation.ranks_per_site`).

The site's ranks build the same task (same site data, same seeded model) and run the same
`fit(round)`; each takes its share of every batch (``batch / R`` rows, `shard`), and the model is
wrapped in torch's `DistributedDataParallel` (`wrap`), whose all-reduce leaves every rank with the
gradient of the whole batch. The local loss is scaled by ``R · n_r / n`` (`scale`), so that DDP's
average over R ranks is the batch's mean loss even when the shards differ by a row: the step each
rank takes is the one a single rank takes on the whole batch (equal up to the all-reduce's order of
summation). The optimizer state stays the same on every rank, since the gradients are.

The runtime (`hpcfed.launch.site_group`) starts torch.distributed before the task is built and
passes `SiteRanks` in `Site.ranks`; a task that supports it declares ``site_parallel = True``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SiteRanks:
    """This rank's place in its site's torch.distributed group (started by the launch)."""

    local_rank: int
    size: int
    backend: str  # gloo | nccl: the training group (the default process group)
    control: Any = None  # the gloo group the leader's commands travel on (hpcfed.client.site_ranks)

    def shard(self, rows: int) -> slice:
        """This rank's contiguous share of a batch of `rows` rows (the first ``rows % R`` ranks take one more)."""
        base, extra = divmod(rows, self.size)
        start = self.local_rank * base + min(self.local_rank, extra)
        return slice(start, start + base + (1 if self.local_rank < extra else 0))

    def scale(self, local_rows: int, rows: int) -> float:
        """Factor on the local mean loss so that DDP's average over the ranks is the batch's mean."""
        return self.size * local_rows / rows if rows else 0.0

    def sum_tensors(self, tensors: list[Any]) -> list[Any]:
        """Each tensor summed over the site's ranks, in place (NCCL for GPU tensors, gloo otherwise)."""
        import torch.distributed as dist

        for t in tensors:
            dist.all_reduce(t, group=None if t.is_cuda else self.control)
        return tensors

    def sum(self, *values: float) -> list[float]:
        """Each value summed over the site's ranks (e.g. the round's loss and examples)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return [float(v) for v in t]


def parallel(ranks: SiteRanks | None) -> bool:
    """Whether training is split over several ranks."""
    return ranks is not None and ranks.size > 1


def wrap(model: Any, ranks: SiteRanks | None, device: Any) -> Any:
    """`model` inside DistributedDataParallel when the site trains on several ranks, else itself."""
    if not parallel(ranks):
        return model
    from torch.nn.parallel import DistributedDataParallel

    on_gpu = getattr(device, "type", "cpu") == "cuda"
    # A model on the CPU all-reduces over gloo (the control group) even where the site's training
    # group is NCCL. Buffers (batch-norm statistics) are the leader's, broadcast at each forward (the default).
    return DistributedDataParallel(model, device_ids=[device] if on_gpu else None,
                                   process_group=None if on_gpu else ranks.control)  # type: ignore[union-attr]  # parallel() checked


def shard_rows(value: Any, part: slice) -> Any:
    """Rows `part` of every tensor in a (nested) batch; other values are left as they are."""
    if hasattr(value, "shape") and getattr(value, "ndim", 0) >= 1:
        return value[part]
    if isinstance(value, dict):
        return {k: shard_rows(v, part) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(shard_rows(v, part) for v in value)
    return value


@contextlib.contextmanager
def training(task: Any) -> Iterator[SiteRanks | None]:
    """While a round of `task` (a `TorchTask`) trains: its site's ranks, with ``task.model`` the DDP
    wrapper (built at the first round: a collective); the plain model again after. None (and the
    model left alone) on a site of one rank."""
    ranks = task.site.ranks
    if not parallel(ranks):
        yield None
        return
    if getattr(task, "_ddp", None) is None:
        task._ddp = wrap(task.model, ranks, task.device)
    plain = task.model
    task.model = task._ddp
    try:
        yield ranks
    finally:
        task.model = plain
