"""Uploads parked on rank 0's disk while the first synchronous round calibrates its bounds.

Bounded influence needs a typical distance before it can clip an upload; the first round has no
history, so the server measures each upload of that round, parks it here, and bounds and folds it
once the round's own median is known (`hpcfed.server.influence`). The uploads are written with
plain file writes and read back one at a time, so rank 0's memory stays O(model) (a memory map
would count every parked page in its resident set); the disk holds K x model bytes for one round.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from hpcfed.errors import FederationError


class Parking:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        shutil.rmtree(folder, ignore_errors=True)  # what a crashed first round left
        folder.mkdir(parents=True)
        self._parked: dict[int, tuple[np.dtype, int, float]] = {}  # cid -> dtype, size, distance

    def park(self, cid: int, flat: np.ndarray, distance: float) -> None:
        """Keep client `cid`'s upload on disk, with the distance it was measured at."""
        try:
            flat.tofile(self._path(cid))
        except OSError as exc:  # rank 0's own fault, not the site's: it ends the run, named
            raise FederationError(f"cannot park client {cid}'s first-round upload in {self.folder}: {exc}; "
                                  f"free space there, or set influence.calibrate_first_round=false") from exc
        self._parked[cid] = (flat.dtype, flat.size, distance)

    def clients(self) -> list[int]:
        """The clients with an upload parked, in client order (the order they are folded in)."""
        return sorted(self._parked)

    def take(self, cid: int) -> tuple[np.ndarray, float]:
        """The upload parked for `cid`, read back into memory, and its distance; the file is gone after this."""
        dtype, size, distance = self._parked.pop(cid)
        path = self._path(cid)
        try:
            flat = np.fromfile(path, dtype=dtype)
            path.unlink()
        except OSError as exc:
            raise FederationError(f"cannot read back client {cid}'s parked first-round upload {path}: {exc}") from exc
        if flat.size != size:
            raise FederationError(f"{path}: client {cid}'s parked first-round upload has {flat.size} values, "
                                  f"{size} were written; did something else write to {self.folder}?")
        return flat, distance

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _path(self, cid: int) -> Path:
        return self.folder / f"client{cid}.bin"
