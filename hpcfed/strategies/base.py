"""The strategy bases: how the server turns client updates into models to dispatch.

A strategy is a small stateful object on rank 0. The math lives in `hpcfed.strategies.aggregate`
(pure functions over flat float32 vectors); a strategy file holds only its state and its rule.

A strategy subclasses exactly one of two bases, and that choice is the federation's mode (the run
config derives ``federation.mode`` from it, `hpcfed.registry.resolve`):

- `SyncStrategy` (``synchronous = True``): implements `aggregate(round, updates)`; the server runs
  rounds;
- `AsyncStrategy` (``synchronous = False``): implements `on_update(update) -> client ids to answer`;
  the server folds each upload as it comes.

Either way `model_for(client_id)` says what a client receives, so personalised dispatch (SEGA,
Local-only) is a strategy decision, not a runtime one.

Capabilities are declared on the class, and the runtime and the privacy layer read the declaration,
never the class (docs/architecture.md, "Capabilities"):

- ``synchronous`` (set by the base): rounds or the async loop;
- ``aggregates``: what a round needs of the uploads. `WEIGHTED_SUM`: only Σ_k w_k·δ_k and Σ_k w_k (a
  weighted mean of the deltas from the model sent), so secure aggregation (rank 0 learns that sum
  only) and the DP wrappers (`hpcfed.strategies.dp`) can carry it; the strategy implements
  `SyncStrategy.fold_sum`. `EACH_UPLOAD`: every upload on its own (median, Krum, SEGA, ...).
  `aggregates_with(config)` refines it for a strategy whose options change it (FedAvg's ``rule``);
- ``shares_updates``: whether one site's upload reaches another's model (bounded influence).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal

import numpy as np

from hpcfed.config import DPConfig
from hpcfed.params import ParamLayout, Params

Aggregates = Literal["weighted_sum", "each_upload"]
# A round folds from Σ_k w_k·δ_k and Σ_k w_k alone (`SyncStrategy.fold_sum`): secure aggregation and DP can carry it.
WEIGHTED_SUM: Final = "weighted_sum"
# A round needs every upload on its own (robust rules, clustering): rank 0 must see each.
EACH_UPLOAD: Final = "each_upload"


@dataclass
class Update:
    """One client upload, already decrypted and shape-checked against the layout."""

    client_id: int
    flat: np.ndarray | None  # float32 (layout.size,); None once a streaming strategy has folded it
    num_examples: int
    base_version: int = 0  # server version of the model the client trained from
    client_version: int = 0  # the client's own counter (FedDWA's v)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def vector(self) -> np.ndarray:
        """The uploaded vector; an update a streaming strategy has folded has none left."""
        if self.flat is None:
            raise ValueError(f"client {self.client_id}'s update was folded already; its vector is gone")
        return self.flat


@dataclass(kw_only=True)
class StrategyContext:
    """What the runtime tells a strategy about the federation."""

    num_clients: int
    seed: int
    task_cls: Any = None  # the Task class, for strategies that need server-side model code
    task_config: Any = None
    log: Callable[[str], None] = print
    dp: DPConfig | None = None  # the run's privacy.dp section (DP-FedAvg), when it has one
    # A seed derived from the job's key (`hpcfed.credentials.RankKeys.secret_seed`): for randomness that must
    # be reproducible on resume yet unknown to whoever reads the outputs (DP noise). None in tests.
    secret_seed: int | None = None
    buffer_size: int | None = None  # federation.buffer_size: uploads per buffer (FedBuff); None: its default


class Strategy(ABC):
    """What every server-side rule shares. Subclass `SyncStrategy` or `AsyncStrategy`, never this
    directly; define a nested keyword-only ``Config`` dataclass."""

    name: ClassVar[str] = ""
    # Set by the base a strategy subclasses, never by the strategy: the run's mode follows from it.
    synchronous: ClassVar[bool]
    # Does one site's upload reach another site's model? Then the server bounds its influence
    # (`hpcfed.server.influence`); a strategy that keeps every site to itself says False.
    shares_updates: ClassVar[bool] = True
    # What a round needs of the uploads: WEIGHTED_SUM or EACH_UPLOAD (see the module's docstring).
    aggregates: ClassVar[Aggregates] = EACH_UPLOAD
    # An async strategy that needs each upload in the clear, yet can fold a secure buffer's sum in
    # another form (FedDWA: each buffer as a record): `fold_sum` under secure aggregation.
    folds_buffers: ClassVar[bool] = False

    layout: ParamLayout  # the model's parameter layout; set by `initialize`
    global_flat: np.ndarray  # the global model, float32 (layout.size,); set by `initialize` / `load_state_dict`

    @dataclass(kw_only=True)
    class Config:
        pass

    @classmethod
    def aggregates_with(cls, config: Any) -> Aggregates:
        """What a round needs of the uploads under `config` (this strategy's built ``Config``):
        the class's declaration, unless an option changes it (FedAvg's robust ``rule``)."""
        return cls.aggregates

    def __init__(self, config: Any, context: StrategyContext) -> None:
        problem = kind_problem(type(self))
        if problem:
            raise TypeError(problem)
        self.config = config
        self.context = context
        self.version = 1  # bumped on every accepted aggregation (FedDWA: "initialised to 1")

    # -- lifecycle ----------------------------------------------------------------------------
    def initialize(self, initial: Params) -> None:
        self.layout = ParamLayout.of(initial)
        self.global_flat = self.layout.flatten(initial)

    def model_for(self, client_id: int) -> np.ndarray:
        """Flat model to send to `client_id` now (default: the global model)."""
        return self.global_flat

    def final_model_for(self, client_id: int) -> np.ndarray:
        """Flat model a client evaluates and exports at the end (default: what `model_for` gives)."""
        return self.model_for(client_id)

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """JSON-able scalars + named arrays that restore this strategy exactly."""
        return {"version": self.version}, {"global": self.global_flat}

    def load_state_dict(self, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        header, arrays = state
        self.version = int(header["version"])
        self.global_flat = np.array(arrays["global"], dtype=np.float32)

    def metrics(self) -> dict[str, float]:
        """Extra numbers to log after an aggregation (e.g. number of SEGA clusters)."""
        return {}

    def report(self) -> dict[str, Any]:
        """Extra top-level entries for summary.json (DP-FedAvg: ``privacy``)."""
        return {}

    def forget(self, client_id: int) -> None:
        """Site `client_id` is evicted: take what it put in out of the state where the strategy
        keeps per-site records (FedDWA's S_W). Default: nothing is kept per site (a FedAvg round
        already folded stays folded; docs/threats.md bounds what remains)."""
        return None  # (a hook with a default, not an abstract method)


def kind_problem(cls: type) -> str | None:
    """Why strategy class `cls` is neither plainly a `SyncStrategy` nor an `AsyncStrategy` (one
    line naming the fix), or None. The registry refuses such a class at lookup, `Strategy` when built."""
    mro = getattr(cls, "__mro__", ())
    name = f"{cls.__module__}.{cls.__qualname__}"
    if SyncStrategy in mro and AsyncStrategy in mro:
        return (f"strategy class {name} subclasses both SyncStrategy and AsyncStrategy; choose one "
                f"(the base decides the federation's mode)")
    if SyncStrategy not in mro and AsyncStrategy not in mro:
        return (f"strategy class {name} subclasses Strategy but neither SyncStrategy nor AsyncStrategy; "
                f"subclass hpcfed.strategies.base.SyncStrategy (implement aggregate) or AsyncStrategy "
                f"(implement on_update): the base decides the federation's mode")
    base = SyncStrategy if SyncStrategy in mro else AsyncStrategy
    if getattr(cls, "synchronous", None) is not base.synchronous:
        return (f"strategy class {name} sets synchronous = {getattr(cls, 'synchronous', None)!r} but subclasses "
                f"{base.__name__}; remove the line (the base sets it) or subclass the other base")
    return None


class SyncStrategy(Strategy):
    """A rule for synchronous rounds: the server collects a round's updates, then `aggregate` folds them.

    The server calls begin_round, then fold(update) for each update as it arrives, then end_round.
    By default fold keeps the update and end_round hands them all to `aggregate` (strategies that
    need every update at once: median, trimmed mean, Krum, SEGA: rank 0 holds K models). A
    streaming strategy (FedAvg's mean) overrides the three, folds each update into an accumulator
    and sets ``update.flat = None``, so rank 0 holds one update at a time whatever K is.
    """

    synchronous: ClassVar[bool] = True

    def round_limit(self, rounds: int) -> int:
        """How many of the configured `rounds` may run (DP-FedAvg: as many as its ε budget allows);
        the server ends the run, checkpoint and summary, after the last one."""
        return rounds

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

    def fold_sum(self, delta_sum: np.ndarray, total_weight: float, count: int) -> None:
        """Fold a round's weighted sum instead of its uploads, between `begin_round` and `end_round`:
        `delta_sum` = Σ_k w_k·δ_k (float64, δ_k = site k's model minus the model it was sent; taken
        over, not copied), `total_weight` = Σ_k w_k > 0, from `count` sites. Secure aggregation hands
        rank 0 only this; the DP wrappers hand their noised mean as (step, 1.0). Only a strategy that
        declares ``aggregates = WEIGHTED_SUM`` implements it; the config checks refuse the others first.

        Example (FedAvg, global model g = [1, 1]; two sites of weight 1 sent deltas [1, 2] and [1, 2]):
        ``begin_round(r); fold_sum(np.array([2.0, 4.0]), 2.0, 2); end_round(r)`` leaves g = [2, 3].
        """
        raise TypeError(f"strategy {self.name!r} declares aggregates={self.aggregates!r}: it cannot fold a "
                        f"weighted sum (only a strategy that declares {WEIGHTED_SUM!r} can)")

    @abstractmethod
    def aggregate(self, round: int, updates: list[Update]) -> None:
        """Fold one round's updates (sorted by client id) into the state."""


class AsyncStrategy(Strategy):
    """A rule for an asynchronous federation: each upload is folded as it comes (`on_update`)."""

    synchronous: ClassVar[bool] = False
    # Does an uploader wait for its answer until `on_update` names it (FedBuff: once its buffer is applied)?
    # False: the loop answers every uploader at once, whatever `on_update` returns.
    defers_answers: ClassVar[bool] = False

    @abstractmethod
    def on_update(self, update: Update) -> list[int]:
        """Fold one upload into the state; return the client ids to send `model_for` to now."""

    def flush(self) -> list[int]:
        """Every live site waits on an answer `on_update` deferred (sites left, so a buffer cannot fill):
        apply what is held and return the sites to answer (default: nothing is held)."""
        return []

    def fold_sum(self, delta_sum: np.ndarray, total_weight: float, count: int) -> None:
        """Fold one securely aggregated buffer (`hpcfed.server.secagg_buffer`): `delta_sum` = Σ_k s_k·δ_k
        (float64, s_k the strategy's staleness weight, applied by each site), `total_weight` = Σ_k s_k > 0,
        from `count` sites; one new version. Only a strategy that declares ``aggregates = WEIGHTED_SUM``
        (FedBuff) or ``folds_buffers`` (FedDWA) implements it; the config checks refuse the others first."""
        raise TypeError(f"strategy {self.name!r} cannot fold a secure buffer's sum (it needs each upload)")

