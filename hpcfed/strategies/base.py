"""The `Strategy` protocol: how the server turns client updates into models to dispatch.

A strategy is a small stateful object on rank 0. The math lives in `hpcfed.strategies.aggregate`
(pure functions over flat float32 vectors); a strategy file holds only its state and its rule.

Synchronous strategies implement `aggregate(round, updates)`; asynchronous ones set
``synchronous = False`` and implement `on_update(update) -> client ids to answer`. Either way
`model_for(client_id)` says what a client receives, so personalised dispatch (SEGA, Local-only)
is a strategy decision, not a runtime one.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from hpcfed.params import ParamLayout, Params


@dataclass
class Update:
    """One client upload, already decrypted and shape-checked against the layout."""

    client_id: int
    flat: np.ndarray | None  # float32 (layout.size,); None once a streaming strategy has folded it
    num_examples: int
    base_version: int = 0  # server version of the model the client trained from
    client_version: int = 0  # the client's own counter (FedDWA's v)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class StrategyContext:
    """What the runtime tells a strategy about the federation."""

    num_clients: int
    seed: int
    task_cls: Any = None  # the Task class, for strategies that need server-side model code
    task_config: Any = None
    log: Callable[[str], None] = print


class Strategy(ABC):
    """Server-side aggregation rule. Subclasses define a nested keyword-only ``Config`` dataclass."""

    name: ClassVar[str] = ""
    synchronous: ClassVar[bool] = True
    # Does one site's upload reach another site's model? Then the server bounds its influence
    # (`hpcfed.server.influence`); a strategy that keeps every site to itself says False.
    shares_updates: ClassVar[bool] = True

    @dataclass(kw_only=True)
    class Config:
        pass

    def __init__(self, config: Any, context: StrategyContext) -> None:
        self.config = config
        self.context = context
        self.layout: ParamLayout | None = None
        self.global_flat: np.ndarray | None = None
        self.version = 1  # bumped on every accepted aggregation (FedDWA: "initialised to 1")

    # -- lifecycle ----------------------------------------------------------------------------
    def initialize(self, initial: Params) -> None:
        self.layout = ParamLayout.of(initial)
        self.global_flat = self.layout.flatten(initial)

    def model_for(self, client_id: int) -> np.ndarray:
        """Flat model to send to `client_id` now (default: the global model)."""
        assert self.global_flat is not None, "initialize() first"
        return self.global_flat

    def final_model_for(self, client_id: int) -> np.ndarray:
        """Flat model a client evaluates and exports at the end (default: what `model_for` gives)."""
        return self.model_for(client_id)

    # -- synchronous --------------------------------------------------------------------------
    # The server calls begin_round, then fold(update) for each update as it arrives, then end_round.
    # By default fold keeps the update and end_round hands them all to `aggregate` (strategies that
    # need every update at once: median, trimmed mean, Krum, SEGA: rank 0 holds K models). A
    # streaming strategy (FedAvg's mean) overrides the three, folds each update into an accumulator
    # and sets ``update.flat = None``, so rank 0 holds one update at a time whatever K is.
    def begin_round(self, round: int) -> None:
        """A synchronous round starts; no update has arrived yet."""
        self._held: list[Update] = []

    def fold(self, update: Update) -> None:
        """Take one validated update as it arrives (default: keep it for `end_round`)."""
        self._held.append(update)

    def end_round(self, round: int) -> None:
        """Every update of the round that will come has come: aggregate them."""
        held, self._held = sorted(self._held, key=lambda u: u.client_id), []
        self.aggregate(round, held)

    def aggregate(self, round: int, updates: list[Update]) -> None:
        """Fold one round's updates (sorted by client id) into the state."""
        raise NotImplementedError(f"strategy {self.name!r} is asynchronous; use federation.mode=async")

    # -- asynchronous -------------------------------------------------------------------------
    def on_update(self, update: Update) -> list[int]:
        """Fold one upload into the state; return the client ids to send `model_for` to now."""
        raise NotImplementedError(f"strategy {self.name!r} is synchronous; use federation.mode=sync")

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """JSON-able scalars + named arrays that restore this strategy exactly."""
        assert self.global_flat is not None
        return {"version": self.version}, {"global": self.global_flat}

    def load_state_dict(self, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        header, arrays = state
        self.version = int(header["version"])
        self.global_flat = np.array(arrays["global"], dtype=np.float32)

    def metrics(self) -> dict[str, float]:
        """Extra numbers to log after an aggregation (e.g. number of SEGA clusters)."""
        return {}
