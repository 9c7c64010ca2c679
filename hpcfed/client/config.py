"""What a client site reads of the run's configuration: its own sections, built once at the entry
point (`ClientConfig.from_config`), so that nothing in `hpcfed.client` reads the whole `Config`.

- `SiteSection`: who the site is and what it trains (the task, its data, the attack of the run).
- `LoopSection`: the site's loop (mode, deadlines, the straggler knob, evaluation, its shards).
- `UploadSection`: what assembles the upload pipeline (`hpcfed.client.assemble`).
- `security`: the run's `SecurityConfig` as it is (keys for the site's shards, exports, secure aggregation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hpcfed.config import Config, PrivacyConfig, RecordDPConfig, SecurityConfig
from hpcfed.privacy.buffered import StalenessRule
from hpcfed.registry import strategy_class, task_class
from hpcfed.schema import build
from hpcfed.tasks.base import Task


@dataclass(frozen=True, kw_only=True)
class SiteSection:
    """Who the site is and what it trains."""

    task_cls: type[Task]
    task_config: Any  # the task's own keyword-only Config, built and checked
    seed: int
    method: str | None
    data_root: str | None
    attack: str | None  # the run's ``attack=``: the last client plays it (`attack_played_by`)
    config_hash: str
    record_dp: RecordDPConfig | None  # DP-SGD inside the site (`hpcfed.privacy.record_dp`)
    rounds: int  # the run's rounds: what the record-DP budget is spread over
    source: str  # the config file, for errors that name a key

    def attack_played_by(self, client_id: int, num_clients: int) -> str | None:
        """The attack site `client_id` plays: the run's, on the last client only; None elsewhere."""
        return self.attack if client_id == num_clients - 1 else None


@dataclass(frozen=True, kw_only=True)
class LoopSection:
    """The site's loop: its mode, its deadlines, the straggler knob, evaluation and its own shards."""

    mode: Literal["sync", "async"]
    eval_every: int
    client_timeout_s: float
    setup_timeout_s: float
    slowdown: dict[int, float] = field(default_factory=dict)  # client_id -> factor
    exclude_sites: tuple[int, ...] = ()
    site_state_dir: str
    keep_checkpoints: int


@dataclass(frozen=True, kw_only=True)
class UploadSection:
    """What the upload pipeline is assembled from (`hpcfed.client.assemble.upload_pipeline`)."""

    privacy: PrivacyConfig  # secure aggregation and its encoding, site-side DP under it
    quorum: float  # the fewest sites a securely aggregated sum may hold, as a fraction of K
    uniform_weighting: bool  # strategy weighting=uniform: every site weighs 1
    client_timeout_s: float  # how long a secure aggregation stage waits for the server
    mode: Literal["sync", "async"] = "sync"  # async under secure aggregation: the site joins buffers
    # the async strategy's s(τ), applied by the site under secure aggregation
    staleness: StalenessRule = field(default_factory=StalenessRule)


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """A client site's configuration: the sections of the run's `Config` it reads, nothing more."""

    site: SiteSection
    loop: LoopSection
    upload: UploadSection
    security: SecurityConfig

    @classmethod
    def from_config(cls, cfg: Config) -> ClientConfig:
        """The client's sections of a resolved run config (`hpcfed.registry.resolve` has set the mode);
        the task is looked up and its options checked here, as the client starts."""
        task_cls = task_class(cfg.task.name, cfg.source)
        fed = cfg.federation
        site = SiteSection(task_cls=task_cls, seed=cfg.seed, method=cfg.method, data_root=cfg.data_root,
                           task_config=build(task_cls.Config, cfg.task.options, where=cfg.source, prefix="task."),
                           attack=cfg.attack, config_hash=cfg.hash(), record_dp=cfg.privacy.record_dp,
                           rounds=cfg.rounds, source=str(cfg.source))
        loop = LoopSection(mode=cfg.mode, eval_every=cfg.eval_every, client_timeout_s=fed.client_timeout_s,
                           setup_timeout_s=fed.setup_timeout_s, slowdown=dict(fed.slowdown),
                           exclude_sites=tuple(fed.exclude_sites), site_state_dir=fed.site_state_dir,
                           keep_checkpoints=cfg.keep_checkpoints)
        upload = UploadSection(privacy=cfg.privacy, quorum=fed.quorum,
                               uniform_weighting=cfg.strategy.options.get("weighting", "num_examples") == "uniform",
                               client_timeout_s=fed.client_timeout_s, mode=cfg.mode, staleness=_staleness(cfg))
        return cls(site=site, loop=loop, upload=upload, security=cfg.security)


def _staleness(cfg: Config) -> StalenessRule:
    """The staleness weight s(τ) the run's async strategy declares (its ``rule``: FedBuff), else constant 1."""
    if cfg.mode != "async":
        return StalenessRule()
    cls = strategy_class(cfg.strategy.name, cfg.source)
    built = build(cls.Config, cfg.strategy.options, where=cfg.source, prefix="strategy.")
    kind = getattr(built, "staleness", None)
    if kind is None:
        return StalenessRule("constant")
    return StalenessRule(kind, float(getattr(built, "a", 0.5)), int(getattr(built, "b", 4)))
