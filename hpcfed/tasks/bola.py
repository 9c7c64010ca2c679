"""BOLA: local aggregation weight by Bayesian optimisation (DAMe paper §4.2, eq. 2–8; spec 1.5).

    λ* = argmax_{λ∈[α,1]} f(λθ^l + (1−λ)θ^g),    θ̃ = λ*θ^l + (1−λ*)θ^g          (eq. 2–3)

f is the NMI of k-means on the client's validation split. The default (`bola`) is the paper-faithful
fix of the reference code: a scikit-optimize `Optimizer` over ``Real(α, 1)`` with a GP surrogate and
the ``gp_hedge`` acquisition portfolio (EI, PI, LCB: the paper's "EI + UCB", eq. 7–8), driven by
ask/tell, and λ is the weight of the LOCAL model.

``reference_compat=True`` (`bola_reference`) reproduces the published code's behaviour for
comparison: the search runs with the weight on the *better* of the two models, the GP is queried
with raw λ values although skopt normalised the space to [0, 1], and EI uses ``y_opt = 0``
(spec 1.5 [QUIRK] a–c); on a toy objective peaked at 0.8 it proposes 0.6 every time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np


def merge(theta_local: np.ndarray, theta_global: np.ndarray, lam: float) -> np.ndarray:
    """``λθ^l + (1−λ)θ^g`` on flat float32 vectors."""
    return (np.float32(lam) * theta_local + np.float32(1.0 - lam) * theta_global).astype(np.float32)


def _finite(y: float) -> float:
    return float(y) if math.isfinite(y) else 0.0  # [RECON] NaN/inf guard


def bola(f: Callable[[float], float], lo: float = 0.6, hi: float = 1.0, n_init: int = 5, n_calls: int = 20,
         seed: int = 42, anchors: Sequence[float] = ()) -> tuple[float, list[tuple[float, float]]]:
    """Maximise f(λ) over [lo, hi]; returns (best λ, [(λ, f(λ)) in call order]).

    `anchors` (points of [lo, hi]) are scored first and count towards `n_calls`; the safe DAMe passes
    λ = 1, so the purely local model is always a candidate (`hpcfed.tasks.dame_safe`). Of equal scores
    the larger λ (more local) wins. ``hi − lo < 1e-12`` (α = 1) returns `hi` without calling f.
    """
    if hi - lo < 1e-12:
        return hi, []
    if any(not lo <= a <= hi for a in anchors):
        raise ValueError(f"BOLA anchors {list(anchors)} must lie in [{lo}, {hi}]")
    from skopt import Optimizer
    from skopt.space import Real

    # acq_optimizer="sampling": in one dimension dense sampling finds the acquisition's maximum as well
    # as L-BFGS restarts do, at a fraction of the cost
    opt = Optimizer([Real(lo, hi)], base_estimator="GP", acq_func="gp_hedge", acq_optimizer="sampling",
                    n_initial_points=min(n_init, n_calls), random_state=seed)
    history: list[tuple[float, float]] = []
    best = (-math.inf, hi)
    for i in range(n_calls):
        lam = float(anchors[i]) if i < len(anchors) else float(opt.ask()[0])
        y = _finite(f(lam))
        opt.tell([lam], -y)
        history.append((lam, y))
        best = max(best, (y, lam))
    return best[1], history


def bola_reference(f_pair: Callable[[float, bool], float], f_local: float, f_global: float, lo: float = 0.6,
                   hi: float = 1.0, n_init: int = 5, n_calls: int = 20,
                   seed: int = 42) -> tuple[float, list[tuple[float, float]]]:
    """The reference procedure with its quirks (a)–(c), for comparison only.

    `f_pair(w, local_is_best)` scores ``w·best + (1−w)·second``; `f_local`/`f_global` are the two models'
    scores that decide which one is "best" (tie -> local). The returned weight is applied to the LOCAL
    model by the caller, whatever model was better (quirk a).
    """
    from skopt import Optimizer
    from skopt.acquisition import gaussian_ei
    from skopt.space import Real

    local_best = f_local >= f_global
    rng = np.random.default_rng(seed)
    opt = Optimizer([Real(lo, hi)], n_initial_points=n_init, random_state=seed)
    history: list[tuple[float, float]] = []
    for w in rng.choice(np.linspace(lo, hi, 40), size=n_init, replace=False):
        y = _finite(f_pair(float(w), local_best))
        opt.tell([float(w)], -y)
        history.append((float(w), y))
    best_score, best_w = -math.inf, hi
    grid = np.linspace(lo, hi, 100).reshape(-1, 1)
    for _ in range(n_init, n_calls):
        w = float(grid[int(np.argmax(gaussian_ei(grid, opt.models[-1])))][0])  # raw x, y_opt = 0: quirks b, c
        y = _finite(f_pair(w, local_best))
        opt.tell([w], -y)
        history.append((w, y))
        if y > best_score:
            best_score, best_w = y, w
    return best_w, history
