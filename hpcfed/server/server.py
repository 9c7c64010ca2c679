"""Rank 0: the parameter server.

The server never sees raw data. It runs the setup exchange (`hpcfed.server.setup`), then either
synchronous rounds (`.sync_rounds`: quorum + per-round deadline; stragglers are reported, never
waited on forever) or an asynchronous loop (`.async_loop`: every accepted upload goes through
`Strategy.on_update`), as the strategy says (``Strategy.synchronous``), and ends with a final
evaluation round whose results become ``summary.json`` (`.summary`). What the stages share --
sending, receiving, rejecting, checkpoint manifests -- is `hpcfed.server.core.ServerCore`.

Every message is validated before use (`hpcfed.server.validation`): unknown tensor names, wrong
dtypes or shapes, and NaN/Inf parameters are rejected, counted and logged with the rank, and the
server keeps serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcfed.comm.api import Channel
from hpcfed.config import Config
from hpcfed.credentials import RankKeys
from hpcfed.registry import strategy_class, task_class
from hpcfed.schema import build
from hpcfed.server import setup, summary
from hpcfed.server.async_loop import AsyncLoop
from hpcfed.server.buffered import SecureBufferedLoop
from hpcfed.server.config import ServerConfig
from hpcfed.server.core import BelowFloor, ServerCore
from hpcfed.server.sync_rounds import SyncRounds
from hpcfed.strategies.base import Strategy, StrategyContext
from hpcfed.strategies.dp import with_privacy

log = logging.getLogger("hpcfed.server")


class Server:
    """Rank 0 of a federation over `channel`, writing into `out_dir`; `run()` it once."""

    def __init__(self, cfg: Config, channel: Channel, out_dir: Path, resume: bool = False,
                 keys: RankKeys | None = None) -> None:
        keys = keys or RankKeys(cfg.security, 0)  # one rank's keys, read once (the launch passes them)
        task_cls = task_class(cfg.task.name, cfg.source)
        task_config = build(task_cls.Config, cfg.task.options, where=cfg.source, prefix="task.")
        strategy_cls = strategy_class(cfg.strategy.name, cfg.source)
        context = StrategyContext(num_clients=channel.size - 1, seed=cfg.seed, task_cls=task_cls,
                                  task_config=task_config, log=log.info, dp=cfg.privacy.dp,
                                  secret_seed=_noise_seed(cfg, keys), buffer_size=cfg.federation.buffer_size)
        strategy: Strategy = with_privacy(  # privacy.dp wraps the strategy (hpcfed.strategies.dp)
            strategy_cls(build(strategy_cls.Config, cfg.strategy.options, where=cfg.source, prefix="strategy."),
                         context), cfg.privacy, context, cfg.federation.quorum)
        # the server's own sections of the config, built once: nothing else in hpcfed.server reads `cfg`
        self.core = ServerCore(ServerConfig.from_config(cfg), channel, out_dir, strategy, task_cls, task_config, keys)
        self.resume = resume

    def run(self) -> dict[str, Any]:
        """The whole federation: setup, rounds or the async loop, and the end; returns the summary
        (or, after a halt, the round it halted after and the checkpoint to resume from)."""
        status = "failed"
        try:
            result = self._run()
            status = "ended"
            return result
        except BelowFloor as exc:
            status = "ended"
            return summary.below_floor(self.core, str(exc))
        finally:
            self.core.live_file.maybe_write(self.core, status, force=True)
            self.core.channel.on_reject = None
            self.core.channel.watch_peers(None)

    def _run(self) -> dict[str, Any]:
        core = self.core
        start_round = setup.exchange(core, self.resume)
        core.metrics.log(None, None, "num_clients", core.num_clients)
        cpu0 = time.process_time()
        if core.strategy.synchronous:
            halted = SyncRounds(core, start_round).run()
            core.loop_cpu_s = time.process_time() - cpu0
            if halted is not None:
                return summary.halt(core, halted)
        else:
            # under secure aggregation, FedBuff's buffers summed securely; else each upload as it comes
            loop: AsyncLoop | SecureBufferedLoop = SecureBufferedLoop(core) if core.config.privacy.secure_aggregation \
                else AsyncLoop(core)
            stopped_early = loop.run()
            core.loop_cpu_s = time.process_time() - cpu0
            loop.forget_owed()  # STOP or FINAL supersedes every model still owed
            if stopped_early:
                return summary.halt(core, core.updates_accepted)
        return summary.finish(core)

    def request_halt(self) -> None:
        """Finish the current sync round (async: the update being handled), checkpoint, and stop (Slurm pre-emption)."""
        self.core.request_halt("SIGUSR2")

    def peer_ended(self) -> None:
        """Hydra says a rank of the job ended (SIGUSR1): the server finds out which and goes on without it."""
        self.core.peer_ended()

    def late_sites(self, absent: set[int], admit: Callable[[], dict[int, float]]) -> None:
        """Sites `absent` at the start (`hpcfed serve`) may join later: `admit()`, called at each
        safe point (a sync round's start, an async step), returns those connected since, each with
        when its knock came (`time.monotonic`)."""
        self.core.roster.start_late(absent)
        self.core.joiners = admit

    def refused(self) -> list[tuple[int, str]]:
        """The sites evicted or excluded, with the reason: a knock for one is refused. Safe from
        any thread (a copy taken in one step)."""
        return [(cid, ev.reason) for cid, ev in tuple(self.core.ledger.evicted.items())]

    def site_lost(self, cid: int, cause: str) -> None:
        """Site `cid` is known to have ended (its lifeline, `hpcfed serve`): dropped at the next
        chance as after SIGUSR1 (federation.on_client_failure). Safe from any thread."""
        self.core.departures.report(cid, cause)


def _noise_seed(cfg: Config, keys: RankKeys) -> int | None:
    """The DP noise seed, from the job's key: the config's seed is in summary.json, and noise anyone
    can regenerate from it can be subtracted from the released model."""
    if cfg.privacy.dp is None:
        return None
    return keys.secret_seed("dp-noise")
