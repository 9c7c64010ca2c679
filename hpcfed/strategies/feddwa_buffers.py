"""FedDWA under secure aggregation: buffers as the unit (`hpcfed.strategies.feddwa` keeps one record
per site; under ``privacy.secure_aggregation`` rank 0 never holds one site's model, so it keeps one
record per buffer instead).

FedAHE §4.2, eqs (9)–(10), with S_W[i] site i's latest model and gap_i = t − S_V[i]::

    w_latest = Σ_i (gap_i + 1)^(−a) · S_W[i],    w_latest_norm = w_latest / Σ_i (gap_i + 1)^(−a)

Here a record is a buffer's (`hpcfed.server.secagg_buffer`: the members' clipped deltas, summed
securely, each weighing 1 at the site). Buffer j, folded at server version t_j, stores

    R_j = x_{t_j − 1} + Σ_{k ∈ j} δ_k / |j|        V_j = t_j       (t counts buffers)

and the model is eqs (9)–(10) over the records in place of S_W: x_t = Σ_j ρ_j R_j / Σ_j ρ_j with
ρ_j = (t − V_j + 1)^(−a). Exactly how this departs from the paper:

1. the unit is a buffer of B uploads, not a site: a record is the mean of its members' models,
   each member's delta applied to the model of the buffer's version (FedBuff's step), not to the
   model the member trained from, which rank 0 cannot add back per site;
2. the records are the last ⌈K / B⌉ buffers (initially the initial model at version 1, as S_W starts
   at w0), not one per site: a fast site may be in several records, and a slow site's model leaves
   the records once ⌈K / B⌉ newer buffers came (in eq 9 it stays, down-weighted by its gap);
3. t and the gaps count buffers, not uploads: a gap is about B times smaller than the paper's for the
   same wall time, so the same exponent a discounts an old record less;
4. Algorithm 1's broadcast (max gap ≥ threshold) does not apply: a buffer's members are answered.

Memory on rank 0: ⌈K / B⌉ + 1 models (fewer than FedDWA's K + 2 once B ≥ 2).
"""

from __future__ import annotations

import math

import numpy as np

from hpcfed.strategies.aggregate import weighted_mean


class BufferRecords:
    """The last ⌈K / B⌉ buffers' records (see the module's docstring)."""

    def __init__(self, initial: np.ndarray, num_sites: int, buffer_size: int) -> None:
        count = max(1, math.ceil(num_sites / buffer_size))
        self.models = np.tile(np.asarray(initial, dtype=np.float32), (count, 1))
        self.versions = np.ones(count, dtype=np.int64)

    def fold(self, model: np.ndarray, delta_sum: np.ndarray, total_weight: float, version: int, a: float,
             out: np.ndarray) -> int:
        """Record buffer `version`'s R_j = `model` + `delta_sum` / `total_weight` in place of the oldest
        record, and write eqs (9)–(10) over the records into `out`; the largest gap."""
        oldest = int(np.argmin(self.versions))
        record = np.add(model, delta_sum / total_weight, dtype=np.float64)
        self.models[oldest] = record.astype(np.float32)
        self.versions[oldest] = version
        gaps = version - self.versions
        weighted_mean(self.models, (gaps + 1.0) ** (-a), out=out)
        return int(gaps.max())

    def state(self) -> dict[str, np.ndarray]:
        return {"buffer_records": self.models, "buffer_versions": self.versions}

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        if "buffer_records" in arrays and "buffer_versions" in arrays:
            self.models = np.array(arrays["buffer_records"], dtype=np.float32)
            self.versions = np.array(arrays["buffer_versions"], dtype=np.int64)
