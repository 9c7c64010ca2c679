"""A HIN by the name a config gives (``task.dataset``): built-in, a HeCo-layout folder, or a file.

It sits above both readers (`hpcfed.data.hin`: the project's own file and the synthetic HIN;
`hpcfed.data.heco`: the HeCo release layout), so neither imports the other's way back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcfed.data import heco
from hpcfed.data.hin import HIN, load_hin_file, synthetic_hin
from hpcfed.data.root import DataError


def load_dataset(dataset: str, data_root: str | Path | None = None, **synthetic: Any) -> HIN:
    """``synthetic`` | ``hin/acm`` | ``hin/aminer`` | a HeCo-layout folder | a project HIN file (``.npz``)."""
    if dataset == "synthetic":
        return synthetic_hin(**synthetic)
    if dataset in heco.HECO:
        return heco.load_heco(dataset, data_root)
    if dataset.endswith(".npz"):
        return load_hin_file(dataset)
    if Path(dataset).expanduser().is_dir():
        return heco.read_heco_folder(Path(dataset).expanduser())
    raise DataError(f"dataset {dataset!r}: use synthetic, {', '.join(sorted(heco.HECO))}, the path of a HeCo-layout "
                    f"folder (xy.txt edge lists, labels.npy), or a .npz file written by `hpcfed data import-hin`")
