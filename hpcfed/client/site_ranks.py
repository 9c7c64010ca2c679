"""A site of many ranks (`federation.ranks_per_site`), seen from inside: the leader's task hands
each round to the site's other ranks, and they follow it.

The leader (local rank 0) runs the ordinary client loop (`hpcfed.client.client.Client`): it alone
holds the channel with rank 0. Its task is wrapped in `SiteLeader`, which, before each round's
`fit`, broadcasts a command and the model it received over the site's gloo group; the other ranks
run `follow_leader`: load that model, and call the same `fit`, whose DDP all-reduce
(`hpcfed.tasks.data_parallel`) makes the site's ranks train as one. Evaluation, the embedding
export and the site's checkpoint shard are the leader's alone; a shard it resumes from is
broadcast to the others (wire bundle, no pickle), so every rank continues from the same state.

Commands (int64[3] broadcasts: what, round, bytes that follow): FIT, STATE, STOP. A rank of the
site that ends breaks the next collective of the others (gloo sees the connection close); they
leave too, and rank 0 drops the site (`hpcfed.server.departures`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.comm import wire
from hpcfed.errors import FederationError
from hpcfed.params import Params
from hpcfed.tasks import torch_state
from hpcfed.tasks.base import Bundle, FitResult, Task
from hpcfed.tasks.data_parallel import SiteRanks

log = logging.getLogger("hpcfed.client")

FIT, STATE, STOP = 1, 2, 3
_NAMES = {FIT: "FIT", STATE: "STATE", STOP: "STOP"}


class SiteControl:
    """The leader's commands to its site's ranks, over the site's gloo group."""

    def __init__(self, ranks: SiteRanks) -> None:
        self.ranks = ranks

    def _broadcast(self, tensor: Any) -> Any:
        import torch.distributed as dist

        dist.broadcast(tensor, 0, group=self.ranks.control)
        return tensor

    def command(self, what: int, rnd: int = 0, nbytes: int = 0) -> tuple[int, int, int]:
        """Leader: send (what, round, bytes); the others: receive it."""
        import torch

        sent = self._broadcast(torch.tensor([what, rnd, nbytes], dtype=torch.int64))
        return int(sent[0]), int(sent[1]), int(sent[2])

    def model(self, params: Params) -> Params:
        """Leader: broadcast `params`; the others: receive into arrays shaped like their own `params`."""
        out = {}
        for name, value in params.items():
            tensor = torch_state.to_torch(np.ascontiguousarray(value)).contiguous()
            out[name] = torch_state.to_numpy(self._broadcast(tensor))
        return out

    def bundle(self, data: bytes | None, nbytes: int) -> Bundle:
        """Leader: broadcast an encoded bundle of `nbytes`; the others: receive and decode it."""
        import torch

        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else \
            torch.empty(nbytes, dtype=torch.uint8)
        self._broadcast(buf)
        return wire.decode(buf.numpy().tobytes(), wire.WireLimits(max_total_bytes=max(nbytes, 1)))


class SiteLeader(Task):
    """The leader's task: the site's task, with each round (and a resumed state) handed to the
    site's other ranks first. Everything else is the task's own."""

    def __init__(self, task: Task, ranks: SiteRanks) -> None:
        super().__init__(task.config, task.site)
        self.task, self.control = task, SiteControl(ranks)

    def __getattr__(self, name: str) -> Any:  # task-specific attributes (attacks, plots) stay reachable
        return getattr(self.__dict__["task"], name)

    def setup(self) -> Bundle:
        return self.task.setup()

    def on_setup(self, reply: Bundle) -> None:
        self.task.on_setup(reply)

    def get_parameters(self) -> Params:
        return self.task.get_parameters()

    def set_parameters(self, params: Params) -> None:
        self.task.set_parameters(params)

    def fit(self, round: int) -> FitResult:
        self.control.command(FIT, round)
        self.control.model(self.task.get_parameters())  # the model this round trains from
        return self.task.fit(round)

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        return self.task.evaluate(round, final)

    def export_embeddings(self, out_dir: Path) -> Path | None:
        return self.task.export_embeddings(out_dir)

    def state_dict(self) -> Bundle:
        return self.task.state_dict()

    def load_state_dict(self, state: Bundle) -> None:
        self.task.load_state_dict(state)
        data = wire.encode(*state)
        self.control.command(STATE, 0, len(data))
        self.control.bundle(data, len(data))

    def stop(self) -> None:
        """The run is over for this site: its other ranks leave."""
        self.control.command(STOP)


def follow_leader(task: Task, ranks: SiteRanks) -> None:
    """A non-leader rank's loop: do what the leader says until STOP (a dead leader or sibling ends
    it with the collective's error)."""
    control = SiteControl(ranks)
    while True:
        what, rnd, nbytes = control.command(0)
        if what == STOP:
            return
        if what == FIT:
            task.set_parameters(control.model(task.get_parameters()))
            task.fit(rnd)
        elif what == STATE:
            task.load_state_dict(control.bundle(None, nbytes))
        else:
            raise FederationError(f"site rank {ranks.local_rank}: its leader sent an unknown command {what}")
        log.debug("site rank %d: %s %d done", ranks.local_rank, _NAMES.get(what, what), rnd)


def stop_site(task: Task) -> None:
    """At the end of the leader's run: tell the site's other ranks to leave (nothing on a one-rank site)."""
    if isinstance(task, SiteLeader):
        task.stop()
