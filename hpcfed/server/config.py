"""What rank 0's server reads of the run's configuration: its own sections, built once by the server's
builder (`hpcfed.server.server.Server`, through `ServerConfig.from_config`), so that no other module of
`hpcfed.server` reads the whole `Config` (as `hpcfed.client.config` does for a site).

- `RunSection`: what the run is (its name, mode, strategy, length) and the config as recorded.
- `DeadlineSection`: how long the server waits for a round, a setup and between status lines.
- `RosterSection`: the membership rules (quorum, the floor of live sites, failures, exclusions).
- `CheckpointSection`: when rank 0 checkpoints and halts, and how many checkpoints it keeps.
- `TrackingSection`: the live trackers (`tracking:`) and what they are told of the run.
- `influence`, `security`, `privacy`: the run's sections as they are (bounded influence, rejections
  and eviction, secure aggregation and DP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hpcfed.config import Config, InfluenceConfig, PrivacyConfig, SecurityConfig


@dataclass(frozen=True, kw_only=True)
class RunSection:
    """What the run is: for the logs, the live status, checkpoints and summary.json."""

    name: str
    mode: Literal["sync", "async"] | None  # federation.mode: set once the strategy is looked up
    strategy: str  # the strategy's name
    rounds: int
    seed: int
    max_updates: int | None  # async: accepted updates before the run ends; None: rounds x K
    buffer_size: int | None  # federation.buffer_size: a buffered strategy's uploads per version; None: K / 2
    recorded: dict[str, Any]  # the whole config as checkpoints and summary.json record it (`Config.to_dict`)
    config_hash: str


@dataclass(frozen=True, kw_only=True)
class DeadlineSection:
    """How long the server waits: for a round's uploads, for a setup message, between status lines."""

    round_deadline_s: float
    setup_timeout_s: float
    status_every_s: float


@dataclass(frozen=True, kw_only=True)
class RosterSection:
    """Who may be missing: a round's quorum, the floor of live sites, what a site's failure does, and
    the sites left out from the start."""

    quorum: float
    min_sites: int
    on_client_failure: str  # "abort" | "continue"
    exclude_sites: tuple[int, ...]
    ranks_per_site: int | tuple[int, ...]  # federation.ranks_per_site: a site's ranks (its leader speaks for it)


@dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    """When rank 0 checkpoints (every `every` rounds; async: every `every` x K updates), the round a
    test halts after, and how many checkpoints stay on disk."""

    every: int
    keep: int
    halt_after_round: int | None


@dataclass(frozen=True, kw_only=True)
class TrackingSection:
    """The live trackers (`tracking:`, e.g. "tensorboard,mlflow") and what they are told of the run."""

    trackers: str
    run_name: str
    params: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The server's configuration: the sections of the run's `Config` it reads, nothing more."""

    run: RunSection
    deadlines: DeadlineSection
    roster: RosterSection
    checkpoints: CheckpointSection
    tracking: TrackingSection | None  # None: no `tracking:`
    influence: InfluenceConfig
    security: SecurityConfig
    privacy: PrivacyConfig

    @classmethod
    def from_config(cls, cfg: Config) -> ServerConfig:
        """The server's sections of a resolved run config (`hpcfed.registry.resolve` has set the mode)."""
        fed = cfg.federation
        run = RunSection(name=cfg.name, mode=fed.mode, strategy=cfg.strategy.name, rounds=cfg.rounds, seed=cfg.seed,
                         max_updates=fed.max_updates, buffer_size=fed.buffer_size, recorded=cfg.to_dict(),
                         config_hash=cfg.hash())
        deadlines = DeadlineSection(round_deadline_s=fed.round_deadline_s, setup_timeout_s=fed.setup_timeout_s,
                                    status_every_s=fed.status_every_s)
        roster = RosterSection(quorum=fed.quorum, min_sites=fed.min_sites, on_client_failure=fed.on_client_failure,
                               exclude_sites=tuple(fed.exclude_sites),
                               ranks_per_site=fed.ranks_per_site if isinstance(fed.ranks_per_site, int)
                               else tuple(fed.ranks_per_site))
        checkpoints = CheckpointSection(every=cfg.checkpoint_every, keep=cfg.keep_checkpoints,
                                        halt_after_round=cfg.halt_after_round)
        tracking = None
        if cfg.tracking:
            params = {"config_hash": cfg.hash(), "seed": cfg.seed, "rounds": cfg.rounds, "method": cfg.method,
                      "strategy": cfg.strategy.name, "task": cfg.task.name,
                      **{f"task.{k}": v for k, v in cfg.task.options.items()}}
            tracking = TrackingSection(trackers=cfg.tracking, run_name=cfg.name, params=params)
        return cls(run=run, deadlines=deadlines, roster=roster, checkpoints=checkpoints, tracking=tracking,
                   influence=cfg.influence, security=cfg.security, privacy=cfg.privacy)
