"""The accountant against dp-accounting's RDP accountant used directly, and the budget's bisection."""

from __future__ import annotations

import dp_accounting
import pytest

from hpcfed.privacy import accountant as A


def _direct(z: float, rounds: int, delta: float) -> float:
    acc = dp_accounting.rdp.RdpAccountant()
    for _ in range(rounds):
        acc.compose(dp_accounting.GaussianDpEvent(z))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize(("z", "rounds", "delta"), [(1.0, 10, 1e-5), (2.0, 8, 1e-5), (0.8, 3, 1e-6)])
def test_epsilon_matches_dp_accounting_composed_round_by_round(z, rounds, delta):
    assert A.epsilon(z, rounds, delta) == pytest.approx(_direct(z, rounds, delta), rel=1e-9)


def test_epsilon_of_no_round_is_zero_and_grows_with_rounds():
    assert A.epsilon(1.0, 0, 1e-5) == 0.0
    eps = [A.epsilon(2.0, r, 1e-5) for r in range(1, 6)]
    assert eps == sorted(eps) and len(set(eps)) == 5


def test_epsilon_refuses_hostile_parameters():
    for args in [(0.0, 1, 1e-5), (1.0, -1, 1e-5), (1.0, 1, 1.0), (1.0, 1, 0.0)]:
        with pytest.raises(ValueError):
            A.epsilon(*args)


def test_rounds_within_is_the_last_round_under_the_budget():
    eps = [A.epsilon(2.0, r, 1e-5) for r in range(0, 11)]
    budget = (eps[4] + eps[5]) / 2
    assert A.rounds_within(2.0, 1e-5, budget, 10) == 4
    assert A.rounds_within(2.0, 1e-5, eps[10] + 1, 10) == 10
    assert A.rounds_within(2.0, 1e-5, eps[1] / 2, 10) == 0


def test_accountant_counts_rounds_and_allows_what_the_budget_does():
    acc = A.Accountant(2.0, 1e-5, max_epsilon=A.epsilon(2.0, 3, 1e-5))
    assert acc.epsilon == 0.0 and acc.rounds_allowed(10) == 3
    acc.step()
    acc.step()
    assert acc.epsilon == pytest.approx(_direct(2.0, 2, 1e-5))
    assert A.Accountant(2.0, 1e-5).rounds_allowed(10) == 10


def test_rounds_released_at_a_lower_multiplier_compose_at_it():
    """A group round of group testing under distributed DP is released at z*sqrt(g/m) < z: it is
    composed at that multiplier, so the ε of such a run is above the all-z figure (docs/threats.md)."""
    acc = dp_accounting.rdp.RdpAccountant()
    for z in (2.0, 2.0, 0.7, 2.0):
        acc.compose(dp_accounting.GaussianDpEvent(z))
    assert A.epsilon(2.0, 4, 1e-5, [0.7]) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert A.epsilon(2.0, 4, 1e-5, [0.7]) > A.epsilon(2.0, 4, 1e-5)
    tracked = A.Accountant(2.0, 1e-5, max_epsilon=A.epsilon(2.0, 4, 1e-5))
    tracked.step()
    tracked.step(0.7)
    tracked.step(2.0)  # at z: not a lowered round
    assert (tracked.rounds, tracked.lowered) == (3, [0.7])
    assert tracked.epsilon == pytest.approx(A.epsilon(2.0, 3, 1e-5, [0.7]))
    assert tracked.rounds_allowed(10) < 4  # the lowered round spent budget that 4 rounds at z would not


@pytest.mark.parametrize("lowered", [[3.0], [0.0], [0.5, 0.5, 0.5]])
def test_epsilon_refuses_lowered_rounds_that_cannot_be(lowered):
    with pytest.raises(ValueError, match="lowered"):
        A.epsilon(2.0, 2, 1e-5, lowered)
