"""Robust FedAvg variants as strategies: a poisoned upload does not move the aggregate far."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.registry import strategy_class
from hpcfed.schema import build
from hpcfed.strategies.base import StrategyContext, Update


def run(name: str, vectors: list[np.ndarray], **options) -> np.ndarray:
    """The model after one round of strategy `name` over `vectors` (one client each)."""
    cls = strategy_class(name)
    logs: list[str] = []
    s = cls(build(cls.Config, options), StrategyContext(num_clients=len(vectors), seed=0, log=logs.append))
    s.initialize({"w": np.zeros(3, np.float32)})
    s.aggregate(0, [Update(i, v.astype(np.float32), 10) for i, v in enumerate(vectors)])
    return s.model_for(0)


HONEST = [np.array([1.0, 2.0, 3.0]), np.array([1.2, 2.2, 2.8]), np.array([0.8, 1.8, 3.2]), np.array([1.0, 2.1, 3.1])]
POISON = np.array([100.0, -100.0, 100.0])


def test_median_trimmed_krum_resist_one_poisoned_client():
    vectors = [*HONEST, POISON]
    assert run("median", vectors) == pytest.approx([1.0, 2.0, 3.1])
    assert run("trimmed_mean", vectors, trim_ratio=0.2) == pytest.approx([1.0666667, 1.9666667, 3.1])
    krum = run("krum", vectors, num_byzantine=1)
    assert any(np.allclose(krum, h) for h in HONEST)
    assert np.abs(run("fedavg", vectors) - HONEST[0]).max() > 10  # plain FedAvg is dragged away


def test_non_finite_uploads_are_rejected_and_krum_checks_its_minimum():
    vectors = [*HONEST, np.array([np.nan, 0.0, 0.0])]
    assert np.isfinite(run("median", vectors)).all()
    with pytest.raises(ValueError, match="at least num_byzantine"):
        run("krum", HONEST[:3], num_byzantine=1)
