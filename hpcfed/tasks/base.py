"""The `Task` protocol: what one site learns.

A task owns its data, model and optimizer on one client rank. The runtime calls, in order::

    task = TaskCls(config, site)             # load this site's data, build the model
    payload = task.setup()                   # optional bundle for the server (word counts, sizes)
    task.on_setup(reply)                     # the server's answer (vocabulary, initial arrays)
    loop:  task.set_parameters(p); result = task.fit(round); task.get_parameters(); task.evaluate(...)
    final: task.set_parameters(p); task.evaluate(final=True); task.export_embeddings(dir)

Server-side work that needs the task's knowledge but no private data (merging vocabularies,
building a model to probe client updates) lives in classmethods, which the server calls without
instantiating the task.

Reproducibility contract: every random draw inside `fit(round)` comes from generators seeded with
(site.seed, site.client_id, round) or from state returned by `state_dict`, so a resumed synchronous run
repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from hpcfed.params import Params

if TYPE_CHECKING:
    from hpcfed.privacy.record_dp import SiteSettings
    from hpcfed.tasks.data_parallel import SiteRanks

# A bundle is what travels in one message: a small JSON-able header plus named arrays.
Bundle = tuple[dict[str, Any], dict[str, np.ndarray]]
EMPTY_BUNDLE: Bundle = ({}, {})


@dataclass(kw_only=True)
class Site:
    """Where a task runs: which client it is, among how many, and where it writes."""

    client_id: int
    num_clients: int
    seed: int
    out_dir: Path
    data_root: Path | None = None
    device: str = "cpu"
    method: str | None = None
    attack: str | None = None  # set on the malicious site only
    config_hash: str = ""
    record_dp: SiteSettings | None = None  # privacy.record_dp: this site trains by DP-SGD (tasks/private_training.py)
    ranks: SiteRanks | None = None  # federation.ranks_per_site > 1: the site's ranks (tasks/data_parallel.py)


@dataclass(frozen=True, kw_only=True)
class MethodPreset:
    """What ``method=NAME`` stands for: a strategy and the task options it implies (a row of a
    task's `Task.METHODS`). `hpcfed.registry.apply_method` applies it to the run config before
    anything is validated; the task itself never edits the run config.

    A strategy other than the configured one starts from its own defaults (the configured options
    belong to the other strategy); the configured strategy keeps its options.
    """

    strategy: str
    strategy_defaults: Mapping[str, Any] = field(default_factory=dict)  # where the config leaves them out
    task_options: Mapping[str, Any] = field(default_factory=dict)  # always, over the config's
    task_defaults: Mapping[str, Any] = field(default_factory=dict)  # where the config leaves them out
    num_clients: int | None = None  # 1 for a centralized method: `hpcfed run` without --np starts 2 ranks

    def __post_init__(self) -> None:
        for name in ("strategy_defaults", "task_options", "task_defaults"):  # a table row is read-only
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


@dataclass
class FitResult:
    """What a round of local training reports: the examples it used (the upload's weight) and its metrics."""

    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


class Task(ABC):
    """One site's learner. Subclasses define a nested keyword-only ``Config`` dataclass."""

    name: ClassVar[str] = ""
    # ``method=NAME`` shortcuts (a run's whole federation in one word); empty: the task has none.
    METHODS: ClassVar[Mapping[str, MethodPreset]] = MappingProxyType({})
    # Why ``privacy.record_dp`` does not apply (one clause, refused at config time); "" where the task
    # trains by DP-SGD over independent records under it (`hpcfed.tasks.private_training`).
    record_dp_refusal: ClassVar[str] = "its training is not DP-SGD over independent records"
    # Whether its ranks can train one site together (`federation.ranks_per_site` > 1): fit shards
    # each batch over `Site.ranks` and all-reduces the gradients (`hpcfed.tasks.data_parallel`).
    site_parallel: ClassVar[bool] = False
    # Whether it trains with torch. A site of a task that does not (gensim's) runs on the CPU and
    # never imports torch, seconds of CPU saved on every rank (`hpcfed.launch.device.select_device`).
    uses_torch: ClassVar[bool] = True

    @dataclass(kw_only=True)
    class Config:
        pass

    def __init__(self, config: Any, site: Site) -> None:
        self.config = config
        self.site = site

    # -- setup exchange -----------------------------------------------------------------------
    def setup(self) -> Bundle:
        """Bundle sent to the server before training (default: nothing)."""
        return EMPTY_BUNDLE

    def on_setup(self, reply: Bundle) -> None:
        """Receive the server's setup answer (default: ignore)."""
        return None

    @classmethod
    def server_setup(cls, config: Any, payloads: dict[int, Bundle]) -> tuple[dict[int, Bundle], Params | None]:
        """Server side of the setup exchange: per-client replies and, optionally, initial parameters.

        When it returns None for the parameters, client 0's initial model is the global start.
        """
        return {cid: EMPTY_BUNDLE for cid in payloads}, None

    # -- learning -----------------------------------------------------------------------------
    @abstractmethod
    def get_parameters(self) -> Params:
        """Current model parameters (float32 arrays; the dict order is the model's)."""

    @abstractmethod
    def set_parameters(self, params: Params) -> None:
        """Load parameters received from the server."""

    @abstractmethod
    def fit(self, round: int) -> FitResult:
        """Train locally for one round (or one async step) and report examples and metrics."""

    @abstractmethod
    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        """Metrics of the current model; `final` asks for the test split."""

    def export_embeddings(self, out_dir: Path) -> Path | None:
        """Write this site's embedding export (`hpcfed.store.embeddings`), or return None."""
        return None

    # -- resumable state ----------------------------------------------------------------------
    def state_dict(self) -> Bundle:
        """Optimizer and RNG state needed to resume bit-exactly (header + arrays)."""
        return EMPTY_BUNDLE

    def load_state_dict(self, state: Bundle) -> None:
        """Restore what `state_dict` returned (default: nothing to restore)."""
        return None
