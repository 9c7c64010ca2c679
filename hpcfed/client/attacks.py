"""Malicious-site behaviours the runtime itself can play (``attack=NAME``: the last client turns
malicious), for measuring what bounded influence leaves an attacker (`tools/insider_attacks.py`).

Task-defined attacks (DAMe's ``model`` / ``data``) live in their tasks; these work with any task
because they only rewrite what the site uploads:

- ``claim_examples``: a constant model, claiming 10**12 training examples (FedAvg's weight).
- ``scale``: the trained model times 1e30 (finite, enormous).
- ``sign_flip``: the received model minus 10 x the site's honest step.
- ``flood``: 20 copies of every upload, none of them asked for (async).
"""

from __future__ import annotations

import numpy as np

from hpcfed.params import Params

RUNTIME_ATTACKS = ("claim_examples", "scale", "sign_flip", "flood")
FLOOD_COPIES = 20


def tamper(attack: str, trained: Params, received: Params, num_examples: int) -> tuple[Params, int, int]:
    """(parameters to upload, claimed examples, copies to send) for one malicious upload."""
    if attack == "claim_examples":
        return {k: np.full_like(v, 0.5) if _is_float(v) else v for k, v in trained.items()}, 10**12, 1
    if attack == "scale":
        return {k: (v * np.float32(1e30)).astype(v.dtype) if _is_float(v) else v
                for k, v in trained.items()}, num_examples, 1
    if attack == "sign_flip":
        return {k: (received[k] - 10 * (v - received[k])).astype(v.dtype) if _is_float(v) else v
                for k, v in trained.items()}, num_examples, 1
    if attack == "flood":
        return trained, num_examples, FLOOD_COPIES
    raise ValueError(f"unknown runtime attack {attack!r}; choose one of: {', '.join(RUNTIME_ATTACKS)}")


def _is_float(v: np.ndarray) -> bool:
    return np.asarray(v).dtype.kind == "f" or str(np.asarray(v).dtype) == "bfloat16"
