"""Bounded influence as the server's loops apply it to the uploads they take.

`hpcfed.server.influence` holds the bounds' arithmetic; this is the procedure around it: weigh and
bound an upload, refuse (and count against its site) one out of range, and while no history bounds
the uploads, measure each and park it on disk (`hpcfed.server.scratch`), then bound and fold the
parked ones once their median is known. Each loop has its own `Bounding`, given what a site's
upload is measured from: the strategy's model for it (sync), or the model it was last answered
with (async).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hpcfed.server.core import ServerCore
from hpcfed.server.influence import Refused
from hpcfed.server.scratch import DiskArray, Parking
from hpcfed.strategies.base import Update

Reference = Callable[[int], "np.ndarray | DiskArray"]


class Bounding:
    """Weigh, measure, park, clip or refuse one loop's uploads (`hpcfed.server.influence`)."""

    def __init__(self, core: ServerCore, reference: Reference) -> None:
        self.core = core
        self.reference = reference  # client id -> what its upload is measured from

    def applies(self) -> bool:
        """Nothing to bound where no site's upload reaches another's model: local-only training,
        or a centralized baseline's one site."""
        return self.core.strategy.shares_updates and self.core.num_clients >= 2

    def bound(self, rank: int, upd: Update, distance: float | None = None) -> bool:
        """Apply bounded influence to one upload, in place; False when it is out of range (rejected
        and counted; the site is answered as usual). With `distance`, it was parked and weighed."""
        if not self.applies():
            return True
        influence = self.core.influence
        if distance is None:  # a parked upload was weighed when it came
            upd.num_examples = influence.weight(upd.client_id, upd.num_examples)
        try:
            influence.bound(upd.client_id, _flat(upd), self.reference(upd.client_id), distance)
        except Refused as exc:
            self.core.reject(rank, "update out of range", str(exc), evidence=exc.evidence)
            return False
        return True

    def open_parking(self) -> Parking | None:
        """Parking for uploads with no history to bound them; None when there is history."""
        if self.applies() and self.core.influence.calibrating:
            return Parking(self.core.out_dir / "scratch" / "parked")
        return None

    def park(self, parking: Parking, rank: int, upd: Update) -> bool:
        """No bounds yet: weigh and measure the upload now, and park it until `fold_parked`. False
        when it is refused already (counted, and answered as usual)."""
        influence = self.core.influence
        upd.num_examples = influence.weight(upd.client_id, upd.num_examples)
        try:
            distance = influence.measure(upd.client_id, _flat(upd), self.reference(upd.client_id))
        except Refused as exc:
            self.core.reject(rank, "update out of range", str(exc), evidence=exc.evidence)
            return False
        parking.park(upd.client_id, _flat(upd), distance)
        upd.flat = None
        return True

    def fold_parked(self, parking: Parking, updates: dict[int, Update], fold: Callable[[Update], object]) -> set[int]:
        """The bounds' first sites are in: take the median of their distances as the typical one,
        then bound each parked upload by it and `fold` it, in client order (a resumed run folds as
        the uninterrupted one did); the parking is closed after. Returns the clients whose upload
        was refused."""
        refused: set[int] = set()
        try:
            self.core.influence.calibrate()
            for cid in parking.clients():
                if cid in self.core.ledger.evicted:  # evicted while parked: nothing of it is folded
                    parking.discard(cid)
                    refused.add(cid)
                    continue
                upd = updates[cid]
                upd.flat, distance = parking.take_measured(cid)  # a disk fault is rank 0's own: it ends the run
                if not self.core.contained(cid + 1, self._fold_bounded, cid + 1, upd, distance, fold):
                    refused.add(cid)
        finally:
            parking.close()
        return refused

    def _fold_bounded(self, rank: int, upd: Update, distance: float, fold: Callable[[Update], object]) -> bool:
        if not self.bound(rank, upd, distance):
            return False
        fold(upd)
        return True


def _flat(upd: Update) -> np.ndarray:
    """The upload's parameters, which are there until it is parked or folded."""
    if upd.flat is None:
        raise RuntimeError(f"client {upd.client_id}'s upload was parked or folded already")
    return upd.flat
