"""The secure sums' audit trail, for the chaos soak (`tools/chaos_soak.py`); off unless the
environment sets ``HPCFED_AUDIT`` to a folder.

Each site writes ``site<N>.jsonl`` there: per round, a probe of the fixed-point input it masked
(⟨v, codes⟩ mod 2³², v a fixed pseudo-random vector). Rank 0 logs to metrics.jsonl, per round, the
probe of each sum it unmasked with the sites that sum lists (``audit_sum``), the probe of the model
at the round's start and end (``audit_model``: ⟨u, g⟩, u fixed Gaussian) and of the step it folded
(``audit_step``). The probes are linear, so a checker can tell, from these records only, that each
folded sum is exactly the sum of the listed sites' inputs (mod 2³²: the masks cancel exactly), and
that every round moved the model by its own step once (end − start = step; a lost round, 0), and
that each round starts from the model the previous one ended with (across a server's resume too).
Nothing here is read back by the federation; the probes reveal one number per input and are
meant for test runs, never a production federation.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

ENV = "HPCFED_AUDIT"
_MOD = 0xFFFFFFFF  # the fixed-point inputs add up mod 2**32


def folder() -> Path | None:
    """The audit folder (None: no audit, the default)."""
    where = os.environ.get(ENV)
    return Path(where) if where else None


@lru_cache(maxsize=2)
def _int_vector(size: int) -> np.ndarray:
    return np.random.default_rng(0xA0D17).integers(0, 2**32, size=size, dtype=np.uint64)


@lru_cache(maxsize=2)
def _float_vector(size: int) -> np.ndarray:
    return np.random.default_rng(0xA0D18).standard_normal(size)


def sum_probe(codes: np.ndarray) -> int:
    """⟨v, codes⟩ mod 2³² (uint64 arithmetic wraps mod 2⁶⁴, a multiple of 2³²)."""
    flat = np.asarray(codes).ravel().astype(np.uint64)
    return int(np.sum(flat * _int_vector(flat.size), dtype=np.uint64) & np.uint64(_MOD))


def model_probe(vector: np.ndarray) -> float:
    """⟨u, vector⟩ in float64."""
    flat = np.asarray(vector, dtype=np.float64).ravel()
    return float(np.dot(flat, _float_vector(flat.size)))


def site_input(client: int, rnd: int, codes: np.ndarray) -> None:
    """Site `client` masks `codes` as its input of round `rnd`: one line in its audit file."""
    where = folder()
    if where is None:
        return
    where.mkdir(parents=True, exist_ok=True)
    with open(where / f"site{client}.jsonl", "a") as fh:
        fh.write(json.dumps({"round": rnd, "probe": sum_probe(codes)}) + "\n")


def site_inputs(where: Path, client: int) -> dict[int, int]:
    """Round -> the probe of the last input site `client` masked for it (a redone round's last)."""
    found: dict[int, int] = {}
    try:
        lines = (where / f"site{client}.jsonl").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            doc = json.loads(line)
            found[int(doc["round"])] = int(doc["probe"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the site's kill
    return found


def sums_match(site_probes: list[int], total: int) -> bool:
    """Whether a sum's probe is the sum of its sites' probes (mod 2³²)."""
    return sum(site_probes) & _MOD == total & _MOD
