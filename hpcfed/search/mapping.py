"""Train the mappers m_{i→j} of every ordered pair of sites from their public-corpus vectors.

Each site of a ``method=mapping`` run exports, besides its own documents, its vectors of the
public corpus D_p (entity ``public``). Those vectors are shared among the sites (Alg. 2 implies the
exchange; [RECON]) and every pair gets a mapper trained on the documents both vectorised
(`hpcfed.models.mapper`). Mappers are written to ``<run>/mappers/mapper_site<i>_to_site<j>.h5``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from hpcfed.models.mapper import MapperConfig, mapper_path, mean_cosine, save_mapper, train_mapper
from hpcfed.search.global_search import site_exports
from hpcfed.store.embeddings import read_export


def train_mappers(folder: str | Path, out_dir: str | Path | None = None, config: MapperConfig | None = None,
                  log: Callable[[str], None] | None = None, holdout: float = 0.0) -> dict[str, dict[str, float]]:
    """Fit and store m_{i→j} for all i ≠ j; returns per pair the first/last loss and the mean cosine.

    ``holdout`` > 0 keeps that share of the public documents (drawn with ``config.seed``) out of
    training and adds ``heldout_mean_cosine``: the way to choose the learning rate and epochs
    without the private data or a central model.
    """
    config = config or MapperConfig()
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    exports = site_exports(folder)
    if len(exports) < 2:
        raise ValueError(f"{folder}: mapping needs at least two sites' exports, found {len(exports)}")
    out = Path(out_dir) if out_dir else (Path(folder) / "mappers" if Path(folder).name != "embeddings"
                                         else Path(folder).parent / "mappers")
    public = {}
    for site, path in exports.items():
        es = read_export(path, "public") if _has_entity(path, "public") else None
        if es is None:
            raise ValueError(f"{path} has no 'public' entity: run the task with method=mapping and a public_corpus")
        public[site] = dict(zip(es.ids, es.vectors))
    report: dict[str, dict[str, float]] = {}
    for i in public:
        for j in public:
            if i == j:
                continue
            common = sorted(set(public[i]) & set(public[j]))
            if not common:
                raise ValueError(f"sites {i} and {j} vectorised no public document in common")
            x = np.stack([public[i][d] for d in common])
            y = np.stack([public[j][d] for d in common])
            held = _holdout_mask(len(common), holdout, config.seed)
            mapper = train_mapper(x[~held], y[~held], config, src=i, dst=j, log=log)
            save_mapper(mapper_path(out, i, j), mapper)
            report[f"{i}->{j}"] = {"loss_first_epoch": mapper.history[0] if mapper.history else float("nan"),
                                   "loss_last_epoch": mapper.history[-1] if mapper.history else float("nan"),
                                   "mean_cosine": mean_cosine(mapper(x[~held]), y[~held]),
                                   "num_public": float((~held).sum())}
            if held.any():
                report[f"{i}->{j}"].update(heldout_mean_cosine=mean_cosine(mapper(x[held]), y[held]),
                                           num_heldout=float(held.sum()))
            if log:
                log(f"mapper site{i}->site{j}: {report[f'{i}->{j}']}")
    return report


def _holdout_mask(n: int, share: float, seed: int) -> np.ndarray:
    held = np.zeros(n, dtype=bool)
    count = round(n * share)
    if count and n - count < 1:
        raise ValueError(f"holdout {share} leaves no public document to train on ({n} in common)")
    held[np.random.default_rng(seed).permutation(n)[:count]] = True
    return held


def _has_entity(path: Path, entity: str) -> bool:
    import h5py

    with h5py.File(path, "r") as f:
        return entity in f
