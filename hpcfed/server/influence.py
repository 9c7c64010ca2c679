"""Bounded influence: what one authenticated site can do to the model, whatever it claims.

A site is not trusted just because its messages are sealed. Before an upload reaches the strategy
the server bounds the two levers a site holds over a mean-based aggregate:

- **Its weight.** A site's weight is the example count it claims, capped at
  ``max_weight_factor`` x the median of the sizes the sites claimed with their first upload. Until
  every live site has made that first claim (the first synchronous round) the sites weigh the same,
  so a site that opens with ``num_examples = 1e12`` gains nothing.
- **How far it moves the model.** The distance ``||θ_k - θ_ref||`` of the upload from the model it
  was sent is clipped to ``clip_factor`` x the typical distance (or x the site's own recent
  accepted distances where they are larger, up to ``_OWN_CLIP`` = 2 x the typical one: an honest
  site whose data differ is not clipped round after round), and an upload farther than
  ``reject_factor`` x the typical distance is refused outright (finite but enormous parameters,
  e.g. x1e30), unless the site's own recent uploads were as far (see below).
  The typical distance is the median of the distances each site's last
  two uploads asked for, refused and clipped ones included: a median follows the honest majority
  as their steps grow or shrink, and one site of K holds at most 1/K of the history however often
  it uploads (an async site that trains fast would fill a shared "last 2K uploads" history with
  its own distances), since each site puts in as many as the site with the fewest has
  (`_median_of_equal_shares`). It is used once at least ``min(3, K)`` sites have one, so that one site
  never sets it alone. (Recording the clipped distances instead ratchets the bound down round
  after round until every honest upload is refused.)
  In a synchronous round ``θ_ref`` is the strategy's model for the site (``model_for(k)``), which
  holds still until the round ends. An asynchronous site trains from the model it was last
  answered with while the others' uploads move the global model on; the server keeps that model
  on its disk (`hpcfed.server.scratch`) and measures from it. Measured from the current model,
  every stale honest upload carried the drift the others had caused: a sign-flipper four times as
  fast as the honest sites drove the model away, the honest distances (and so the bound) grew
  with it, and the honest mean accuracy fell from 0.58 to 0.12.
- **The first uploads**, with no history, calibrate on themselves (``calibrate_first_round``): the
  server measures each (`measure`, refusing non-finite ones and any beyond ``reject_factor`` x
  ``max(||θ_ref||, sqrt(P))``) and parks it on disk, and only once the first synchronous round is
  in, or once ``min(3, K)`` asynchronous sites have one parked (each waiting, unanswered, so a fast
  site is one of them however fast), takes the median of their distances as the typical one
  (`calibrate`) and bounds and folds the parked uploads against it. So the first uploads are
  bounded like every later one: one site moves the model by at most ``clip_factor`` x the honest
  median, not by the model's own norm; and a model initialised near zero (gensim's vectors, LoRA's
  B matrices), whose honest first steps are many times its norm, is not clipped at all. Without
  calibration (``calibrate_first_round: false``) the first uploads are clipped to the model's own
  norm ``||θ_ref||`` (``sqrt(P)`` for an all-zero model) and refused beyond the same limit.

**Only a bound no honest step comes near is evidence.** An upload is refused beyond
``reject_factor`` x the larger of the typical distance and the farthest of the site's own last two
*accepted* uploads (asked distances, before clipping) that asked for at most half the limit
(``_OWN_SHARE``: a site far from the start, a sign flip x10, never builds such a history and stays
judged by the typical step). That refusal keeps the upload out of the model, but it is a statistic,
and honest heterogeneity crosses it: late in 1,000 asynchronous rounds an honest site's step
jumped from the typical size to up to 144 x both it and the site's own last ones, from one upload
to the next (`tools/false_positives.py`, docs/benchmarks.md), and when such refusals counted,
honest sites would have been evicted in three of the quickstart's four asynchronous cells. So it
never counts toward eviction.
What counts (`Refused.evidence`, toward eviction past ``security.max_refused_updates``) is an upload
beyond ``reject_factor`` x the model's own scale ``max(||θ_ref||, sqrt(P))`` (x1e30,
finite but enormous parameters), from a site that has had an upload accepted: a local round that
moves every parameter by ten times the model's whole norm is no training step. One refused with no
accepted upload of its own (its first uploads) is refused and answered, never counted: an x1e30
site that never sent a sane upload is refused every time and holds no influence; one that did and
then jumps is evicted. A non-finite upload is refused the same way. The largest ratio of an honest
upload to ``max(typical, own)`` measured over `tools/false_positives.py` is on the benchmarks page.

There is deliberately no rule on an upload's direction (e.g. refusing one that points against the
last aggregate step): one skewed step would then make the honest majority's corrections look hostile
and refuse them, round after round. A sign-flipping site is bounded by the clip like any other.

Clipping is done in blocks, so it needs no second copy of the model in memory (rank 0 stays
O(model); the sent and parked models are read back from disk a block at a time). The
state (claimed sizes, recent distances) is part of the server checkpoint, so a resumed run repeats
the uninterrupted one. Robust aggregators (median, trimmed mean, Krum) remain selectable on top.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from hpcfed.config import InfluenceConfig
from hpcfed.server.scratch import DiskArray

_BLOCK = 1 << 20  # elements per block of the distance and clipping passes
_PER_SITE = 2  # recent distances kept per site
# An accepted upload joins its site's own history only if it asked for at most this share of the
# refusal limit (0.5 x reject_factor x typical): a site whose first uploads are already far (a
# sign flip x10) is judged against the typical step alone, one whose steps grew slowly keeps the
# last of them it was in range with.
_OWN_SHARE = 0.5
# A site whose own accepted steps are larger than the typical one is clipped to them, up to this x
# the typical step. Clipped to the median (1 x), an honest site whose data differ was clipped round
# after round, its steps grew as the model left it behind, and honest accuracy fell (feature-shifted
# cells -0.011/-0.015, the 300-round quickstart -0.021); the sign flip x10 never has such a history
# (its steps are beyond _OWN_SHARE of the limit) and stays clipped to the median.
_OWN_CLIP = 2.0


class Refused(Exception):
    """The upload is out of range; the message says why (it becomes the rejection's detail).
    `evidence`: whether it counts against the site (it had accepted uploads to be judged against)."""

    def __init__(self, message: str, evidence: bool = False) -> None:
        super().__init__(message)
        self.evidence = evidence


class InfluenceGuard:
    """Bounds what one site can do to the model (see the module doc): caps its claimed weight, clips or
    refuses an upload far from the others, and keeps the per-site history that needs."""

    def __init__(self, config: InfluenceConfig, num_clients: int) -> None:
        self.config = config
        self.claimed: dict[int, int] = {}  # client id -> the size it claimed with its first upload
        self.distances: dict[int, deque[float]] = {}  # client id -> its last uploads' distances
        self.accepted: dict[int, deque[float]] = {}  # client id -> its last accepted uploads' distances
        self._quorum = min(3, max(1, num_clients))  # sites with a distance before the median is used
        self._weigh_by_size = False
        self._cap = math.inf
        self._typical: float | None = None
        self._pending: list[tuple[int, float]] = []  # this round's distances, kept in client order
        self.clipped = 0
        # the largest distance / max(typical, own) of any upload measured with both known: how close
        # the run came to a refusal that counts (docs/threats.md, tools/false_positives.py)
        self.peak_ratio = 0.0

    # -- rounds ---------------------------------------------------------------------------------
    def begin_round(self, live: AbstractSet[int]) -> None:
        """Fix this round's bounds from what came before it, so that they do not depend on the
        order in which the round's uploads arrive (a resumed run repeats the uninterrupted one).
        Sizes weigh only once every live site has claimed one."""
        self._weigh_by_size = bool(live) and live <= set(self.claimed)
        if self.claimed:
            self._cap = self.config.max_weight_factor * float(np.median(list(self.claimed.values())))
        if len(self.distances) >= self._quorum:
            self._typical = _median_of_equal_shares(self.distances)
        elif not self.distances:
            self._typical = None
        # else: fewer sites with a history than the quorum (an async run whose other sites are
        # silent, or a site evicted): the bound calibrated on the first uploads stands

    # -- one upload -----------------------------------------------------------------------------
    def weight(self, cid: int, claimed: int) -> int:
        """The example count the strategy sees for this upload."""
        if not self.config.enabled:
            return claimed
        self.claimed.setdefault(cid, claimed)
        if not self._weigh_by_size:
            return 1
        return max(1, int(min(claimed, self._cap)))

    @property
    def quorum(self) -> int:
        """How many sites must have a distance before their median is the typical one."""
        return self._quorum

    @property
    def calibrating(self) -> bool:
        """No history bounds the uploads yet (the first synchronous round; an asynchronous run
        until min(3, K) sites are in): `measure` them first, then `calibrate` on their own
        distances, then `bound` the measured uploads."""
        return self.config.enabled and self.config.calibrate_first_round and self._typical is None

    def measure(self, cid: int, flat: np.ndarray, reference: np.ndarray | DiskArray,
                norm: float | None = None) -> float:
        """Record how far the upload asked to move the model (it joins the history whatever is
        done with it) and return it. Raises `Refused` for a distance that is not finite or beyond
        ``reject_factor`` x the model's own scale ``max(||θ_ref||, sqrt(P))`` (evidence, once the site
        has an accepted upload: no honest step comes near it), and for one beyond ``reject_factor`` x
        the typical distance (never evidence: honest heterogeneity crosses it). `norm` is
        ``||θ_ref||`` where the caller has it already."""
        if norm is None:
            distance, norm = _distance_and_norm(flat, reference)
        else:
            distance = _distance(flat, reference)
        if not math.isfinite(distance):
            raise Refused(f"moves the model {distance:.3g} away (not a finite distance)",
                          evidence=self._own(cid) is not None)
        self._pending.append((cid, distance))
        scale = max(norm, math.sqrt(flat.size))
        if distance > self.config.reject_factor * scale:
            raise Refused(f"moves the model {distance:.3g} away, {self.config.reject_factor:g} x the model's own scale "
                          f"{scale:.3g} (its norm, at least sqrt(P)) is the limit", evidence=self._own(cid) is not None)
        if self._typical is not None:
            self._refuse_beyond(cid, distance, self._typical)
        return distance

    def calibrate(self) -> None:
        """The first uploads are in: the median of their distances is the typical one, one per
        site (its latest: an async site whose upload was refused is answered and may try again,
        and must not fill the median with its tries). Fewer sites than the quorum (an async run
        whose other sites are silent): two give the smaller of their distances (a hostile site
        that came first cannot set the bound with one honest site), one gives none, and the
        upload is bounded by the model's own norm."""
        if self._typical is not None or not self._pending:
            return
        distances = sorted(dict(self._pending).values())
        if len(distances) >= self._quorum:
            self._typical = float(np.median(distances))
        elif len(distances) >= 2:
            self._typical = distances[0]

    def bound(self, cid: int, flat: np.ndarray, reference: np.ndarray | DiskArray,
              distance: float | None = None) -> float:
        """Clip `flat` (in place) to the allowed distance from `reference`; return the distance it
        had. Raises `Refused` when it is beyond ``reject_factor`` x the typical distance. With
        `distance`, the upload was `measure`d already (a calibrated first round)."""
        if not self.config.enabled:
            return 0.0
        norm = _norm(reference) if self._typical is None else None  # one pass, shared with `measure`
        if distance is None:
            distance = self.measure(cid, flat, reference, norm)
        elif self._typical is not None:  # measured before the round calibrated: refuse on its median
            self._refuse_beyond(cid, distance, self._typical)
        limit = self.config.clip_factor * max(self._clip_scale(cid, norm or math.sqrt(flat.size)), 1e-12)
        if distance > limit:
            _scale_towards(flat, reference, limit / distance)
            self.clipped += 1
        if self._typical is not None and distance <= _OWN_SHARE * self.config.reject_factor * self._typical:
            self.accepted.setdefault(cid, deque(maxlen=_PER_SITE)).append(distance)
        return distance

    def _clip_scale(self, cid: int, no_history: float) -> float:
        """What the site's upload is clipped to (x clip_factor): the typical step, or the site's own
        recent accepted steps where they are larger, up to `_OWN_CLIP` x the typical step
        (`no_history`, the model's norm, before there is a typical step)."""
        if self._typical is None:
            return no_history
        return max(self._typical, min(self._own(cid) or 0.0, _OWN_CLIP * self._typical))

    def _own(self, cid: int) -> float | None:
        """The farthest of the site's own last accepted uploads (None: it has none yet)."""
        own = self.accepted.get(cid)
        return max(own) if own else None

    def _refuse_beyond(self, cid: int, distance: float, typical: float) -> None:
        """Refuse an upload beyond ``reject_factor`` x the larger of the typical step and the site's own
        recent ones. Never evidence: late in 1,000 asynchronous rounds an honest site's step jumped to
        up to 144 x both from one upload to the next (tools/false_positives.py), so this judgement
        keeps such an upload out of the model but never evicts."""
        own = self._own(cid)
        scale = max(typical, own or 0.0, 1e-12)
        if own is not None and self._typical is not None:
            self.peak_ratio = max(self.peak_ratio, distance / scale)
        if distance > self.config.reject_factor * scale:
            whose = "the typical" if own is None or own <= typical else "its own recent"
            raise Refused(f"moves the model {distance:.3g} away, {self.config.reject_factor:g} x {whose} "
                          f"{scale:.3g} is the limit")

    def settle(self) -> None:
        """The round (or async upload) is over: its distances join their sites' histories."""
        for cid, distance in sorted(self._pending):
            self.distances.setdefault(cid, deque(maxlen=_PER_SITE)).append(distance)
        self._pending.clear()

    # -- checkpointing --------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"claimed": {str(k): v for k, v in self.claimed.items()},
                "distances": {str(k): list(v) for k, v in self.distances.items()},
                "accepted": {str(k): list(v) for k, v in self.accepted.items()}, "clipped": self.clipped,
                "peak_ratio": self.peak_ratio}

    def load_state(self, state: Any) -> None:
        if not isinstance(state, dict):
            return
        self.claimed = {int(k): int(v) for k, v in dict(state.get("claimed", {})).items()}
        for name, into in (("distances", self.distances), ("accepted", self.accepted)):
            into.clear()
            saved = state.get(name, {})
            if isinstance(saved, dict):  # an older checkpoint's list names no sites: calibrate again
                for k, v in saved.items():
                    # read from a verified checkpoint of ours; still, a NaN would disable every bound
                    kept = [float(d) for d in list(v)[-_PER_SITE:] if math.isfinite(float(d)) and float(d) >= 0]
                    if kept:
                        into[int(k)] = deque(kept, maxlen=_PER_SITE)
        self.clipped = int(state.get("clipped", 0))
        peak = float(state.get("peak_ratio", 0.0))
        self.peak_ratio = peak if math.isfinite(peak) else 0.0

    def forget(self, cid: int) -> None:
        """Site `cid` is out (evicted): its distances no longer set the typical one."""
        self.distances.pop(cid, None)
        self.accepted.pop(cid, None)
        self._pending = [(c, d) for c, d in self._pending if c != cid]


def _median_of_equal_shares(distances: dict[int, deque[float]]) -> float:
    """The median of every site's latest distances, as many from each as the site with the fewest
    has. A fast asynchronous site has its last two in while a slow one has its first: pooled
    whole, a sign-flipper x10 held two of four values, the median was half its own distance, and
    its flips were accepted (and became its own history: every later one too). Where every site
    uploads every round, each has as many, and this is the median of them all."""
    share = min(len(per_site) for per_site in distances.values())
    return float(np.median([d for per_site in distances.values() for d in list(per_site)[-share:]]))


def _blocks(n: int) -> Iterator[slice]:
    for start in range(0, n, _BLOCK):
        yield slice(start, min(n, start + _BLOCK))


def _distance(flat: np.ndarray | DiskArray, reference: np.ndarray | DiskArray | None) -> float:
    """||flat - reference|| (||flat|| for no reference): differences and squares in float32 (a
    float32 square overflows only for a difference beyond 1.8e19, which is refused anyway), summed
    in float64. One reused block buffer instead of a fresh float64 block per step: at 16 M
    parameters 10.6 vs 19.6 ms on an idle host, 24 vs 280 ms on a loaded one (page faults)."""
    buf = np.empty(min(flat.size, _BLOCK), dtype=np.float32)
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for s in _blocks(flat.size):
            d = buf[: s.stop - s.start]
            if reference is None:
                d[:] = flat[s]
            else:
                np.subtract(flat[s], reference[s], out=d, dtype=np.float32)
            np.square(d, out=d)
            total += float(d.sum(dtype=np.float64))
    return _root(total)


def _norm(x: np.ndarray | DiskArray) -> float:
    return _distance(x, None)


def _distance_and_norm(flat: np.ndarray | DiskArray, reference: np.ndarray | DiskArray) -> tuple[float, float]:
    """(||flat - reference||, ||reference||) in one pass over `reference` (it may come off rank 0's
    disk), each as `_distance` computes it."""
    diff = np.empty(min(flat.size, _BLOCK), dtype=np.float32)
    sq = np.empty_like(diff)
    total, ref_total = 0.0, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for s in _blocks(flat.size):
            d, r2 = diff[: s.stop - s.start], sq[: s.stop - s.start]
            ref = reference[s]
            np.subtract(flat[s], ref, out=d, dtype=np.float32)
            np.square(d, out=d)
            total += float(d.sum(dtype=np.float64))
            np.square(ref, out=r2, dtype=np.float32)
            ref_total += float(r2.sum(dtype=np.float64))
    return _root(total), _root(ref_total)


def _root(total: float) -> float:
    return math.sqrt(total) if math.isfinite(total) else math.inf


def _scale_towards(flat: np.ndarray, reference: np.ndarray | DiskArray, factor: float) -> None:
    """flat <- reference + factor * (flat - reference), block by block."""
    buf = np.empty(min(flat.size, _BLOCK), dtype=np.float32)  # reused: no fresh pages per block
    for s in _blocks(flat.size):
        d = buf[: s.stop - s.start]
        ref = reference[s]  # read once: it may come off rank 0's disk (`hpcfed.server.scratch`)
        np.subtract(flat[s], ref, out=d, dtype=np.float32)
        d *= np.float32(factor)
        np.add(ref, d, out=flat[s], dtype=np.float32)
