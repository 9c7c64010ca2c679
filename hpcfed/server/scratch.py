"""Per-site arrays on rank 0's disk, so that bounded influence keeps rank 0's memory O(model).

Two uses (`hpcfed.server.influence`):

- **Parking.** Bounds need a typical distance before they can clip an upload. With no history
  (the first synchronous round; an asynchronous run until ``min(3, K)`` sites have uploaded) the
  server measures each upload, parks it here, and bounds and folds it once the typical distance
  is known: K x model bytes at most, once per run.
- **Sent models.** An asynchronous site trains from the model it was last answered with, while
  the global model moves on under the others' uploads; what the site did is its distance from
  *that* model. Measured from the current model instead, every stale honest upload would carry
  the drift the others caused (a fast attacker's included) and the bound would grow with the
  attack. The server keeps each site's last answer here: K x model bytes, rewritten per answer.

Arrays are written with plain file writes and read back a block at a time (`DiskArray`), never
memory-mapped: a mapping would count every page read in rank 0's resident set.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import numpy as np

from hpcfed.errors import FederationError


class DiskArray:
    """A flat array in a file, read one slice at a time (``array[start:stop]``)."""

    def __init__(self, path: Path, dtype: np.dtype, size: int) -> None:
        self.path, self.dtype, self.size = path, dtype, size

    def __getitem__(self, part: slice) -> np.ndarray:
        start, stop, _ = part.indices(self.size)
        count = max(0, stop - start)
        try:
            block = np.fromfile(self.path, dtype=self.dtype, count=count, offset=start * self.dtype.itemsize)
        except OSError as exc:
            raise FederationError(f"cannot read {self.path} on rank 0's scratch disk: {exc}") from exc
        if block.size != count:
            raise FederationError(f"{self.path} is shorter than the {self.size} values written to it; "
                                  f"did something else write to {self.path.parent}?")
        return block


class Scratch:
    """One array per client in `folder` (emptied on opening: what a crashed run left)."""

    def __init__(self, folder: Path, what: str, fix: str) -> None:
        self.folder, self.what, self.fix = folder, what, fix
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, mode=0o700)  # what is read back here bounds the sites' uploads
        self._arrays: dict[int, DiskArray] = {}

    def put(self, cid: int, flat: np.ndarray) -> None:
        """Keep client `cid`'s array (replacing the one kept before)."""
        path = self.folder / f"client{cid}.bin"
        try:
            np.ascontiguousarray(flat).tofile(path)
        except OSError as exc:  # rank 0's own fault, not the site's: it ends the run, named
            raise FederationError(f"cannot keep client {cid}'s {self.what} in {self.folder}: {exc}; "
                                  f"free space there, or {self.fix}") from exc
        self._arrays[cid] = DiskArray(path, flat.dtype, flat.size)

    def view(self, cid: int) -> DiskArray | None:
        return self._arrays.get(cid)

    def clients(self) -> list[int]:
        """The clients with an array kept, in client order."""
        return sorted(self._arrays)

    def take(self, cid: int) -> np.ndarray:
        """Client `cid`'s array, read back into memory; the file is gone after this."""
        array = self._arrays.pop(cid)
        flat = array[0:array.size]
        array.path.unlink(missing_ok=True)
        return flat

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.folder.parent.rmdir()  # OUT/scratch, once nothing else is kept there


class Parking(Scratch):
    """Uploads waiting for their bounds, each with the distance it was measured at."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, "upload (parked while the bounds calibrate)",
                         "set influence.calibrate_first_round=false")
        self._distances: dict[int, float] = {}

    def park(self, cid: int, flat: np.ndarray, distance: float) -> None:
        self.put(cid, flat)
        self._distances[cid] = distance

    def discard(self, cid: int) -> None:
        """Fold nothing of `cid` (its site left): its parked upload is deleted unread."""
        array = self._arrays.pop(cid, None)
        self._distances.pop(cid, None)
        if array is not None:
            array.path.unlink(missing_ok=True)

    def take_measured(self, cid: int) -> tuple[np.ndarray, float]:
        """The upload parked for `cid` and its distance; the file is gone after this."""
        return self.take(cid), self._distances.pop(cid)
