"""The strategy bases: a strategy is a SyncStrategy or an AsyncStrategy, and that is its mode."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hpcfed.registry import STRATEGIES, strategy_class
from hpcfed.strategies.base import (
    EACH_UPLOAD,
    WEIGHTED_SUM,
    AsyncStrategy,
    Strategy,
    StrategyContext,
    SyncStrategy,
    Update,
)

CONTEXT = StrategyContext(num_clients=2, seed=0)


def test_builtin_strategies_take_their_mode_from_their_base_and_declare_what_a_round_needs():
    modes = {name: strategy_class(name).synchronous for name in STRATEGIES}
    assert modes == {"fedavg": True, "fedavgm": True, "sega": True, "median": True, "trimmed_mean": True,
                     "krum": True, "local": True, "feddwa": False, "fedasync": False, "afed": False,
                     "fedbuff": False}
    # the declaration secure aggregation and DP read (hpcfed.privacy.requirements), never the class
    weighted = {name for name in STRATEGIES if strategy_class(name).aggregates == WEIGHTED_SUM}
    assert weighted == {"fedavg", "fedavgm", "fedbuff"}
    assert {name for name in STRATEGIES if strategy_class(name).folds_buffers} == {"feddwa"}
    assert {strategy_class(name).aggregates for name in STRATEGIES} == {WEIGHTED_SUM, EACH_UPLOAD}
    for name in STRATEGIES:
        cls = strategy_class(name)
        assert issubclass(cls, SyncStrategy) != issubclass(cls, AsyncStrategy)


def test_a_strategy_missing_its_method_cannot_be_instantiated():
    class NoAggregate(SyncStrategy):
        pass

    class NoOnUpdate(AsyncStrategy):
        def aggregate(self, round: int, updates: list[Update]) -> None:  # the other base's method
            pass

    with pytest.raises(TypeError, match=r"abstract.*aggregate"):
        NoAggregate(NoAggregate.Config(), CONTEXT)
    with pytest.raises(TypeError, match=r"abstract.*on_update"):
        NoOnUpdate(NoOnUpdate.Config(), CONTEXT)


def test_a_complete_strategy_runs_with_its_base_defaults():
    class Last(SyncStrategy):
        def aggregate(self, round: int, updates: list[Update]) -> None:
            self.global_flat = updates[-1].flat

    s = Last(Last.Config(), CONTEXT)
    s.initialize({"w": np.zeros(2, np.float32)})
    s.begin_round(0)
    s.fold(Update(1, np.array([3, 4], np.float32), 1))
    s.fold(Update(0, np.array([1, 2], np.float32), 1))
    s.end_round(0)  # updates reach aggregate sorted by client id
    assert list(s.model_for(0)) == [3, 4] and Last.synchronous is True


def test_a_strategy_of_neither_base_is_refused_when_built():
    class Old(Strategy):
        def aggregate(self, round: int, updates: list[Update]) -> None:
            pass

    with pytest.raises(TypeError, match=r"subclasses Strategy but neither SyncStrategy nor AsyncStrategy; "
                                        r"subclass hpcfed\.strategies\.base\.SyncStrategy"):
        Old(Old.Config(), CONTEXT)


def test_a_strategy_cannot_be_both_or_contradict_its_base():
    class Both(SyncStrategy, AsyncStrategy):
        def aggregate(self, round: int, updates: list[Update]) -> None:
            pass

        def on_update(self, update: Update) -> list[int]:
            return []

    class Contradicts(SyncStrategy):
        synchronous = False

        def aggregate(self, round: int, updates: list[Update]) -> None:
            pass

    with pytest.raises(TypeError, match="subclasses both SyncStrategy and AsyncStrategy; choose one"):
        Both(Both.Config(), CONTEXT)
    with pytest.raises(TypeError, match=r"sets synchronous = False but subclasses SyncStrategy; remove the line"):
        Contradicts(Contradicts.Config(), CONTEXT)


@pytest.fixture
def plugin_folder(tmp_path: Path):
    """A folder holding module `oldplug` (strategies written against the old single base), found
    next to a config file there, and forgotten afterwards."""
    (tmp_path / "oldplug.py").write_text(textwrap.dedent('''
        from hpcfed.strategies.base import Strategy, SyncStrategy

        class Neither(Strategy):
            def aggregate(self, round, updates):
                pass

        class Abstract(SyncStrategy):
            def on_update(self, update):
                return []
    '''))
    yield tmp_path / "config.yaml"
    sys.modules.pop("oldplug", None)
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def test_lookup_refuses_a_strategy_of_neither_base_in_one_line(plugin_folder):
    with pytest.raises(ValueError) as err:
        strategy_class("oldplug:Neither", str(plugin_folder))
    message = str(err.value)
    assert message.startswith("import path 'oldplug:Neither': strategy class oldplug.Neither subclasses Strategy "
                              "but neither SyncStrategy nor AsyncStrategy")
    assert "AsyncStrategy (implement on_update)" in message and "\n" not in message


def test_lookup_refuses_a_strategy_missing_its_method(plugin_folder):
    with pytest.raises(ValueError, match=r"^import path 'oldplug:Abstract': Abstract does not implement aggregate; "
                                         r"define it in the class$"):
        strategy_class("oldplug:Abstract", str(plugin_folder))
