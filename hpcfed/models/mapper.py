"""SEEC vector-space mapper m_{i→j} (paper §IV.B, Alg. 2, §V.A.2; spec §4.3).

Sites i and j train their models independently, so their vector spaces are unrelated. Both
vectorise the same public corpus D_p; an MLP learns to carry site i's vectors into site j's space:

    m(x) = W_2 · Dropout_0.2(ReLU(W_1 x + b_1)) + b_2,     W_1: 1200 × d_i,  W_2: d_j × 1200
    L = mean_b (1 − cos(m(V_i[b]), V_j[b]))                 (CosineEmbeddingLoss, target +1)

trained with Adam, 20 epochs, batch 64, lr 1e-4 (the paper's 1e-5 leaves the mapper under-fitted
after 20 epochs on 20NG: cosine on held-out public documents .716 against .767). d_i ≠ d_j is
allowed. The activation is not stated in the paper (ReLU here, [RECON]). Mappers are stored in
HDF5 (weights + attributes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.schema import build
from hpcfed.store.models import AttrValue, read_model_file, write_model_file

MAPPER_FORMAT = "hpcfed-mapper"
WEIGHTS = ("w1", "b1", "w2", "b2")


@dataclass(kw_only=True)
class MapperConfig:
    """How a cross-site mapper is built and trained (SEEC's mapping between two sites' embedding spaces)."""

    hidden: int = 1200
    dropout: float = 0.2
    lr: float = 1e-4  # paper 1e-5 under-fits in 20 epochs: held-out cosine .716 vs .767 (docs/seec.md)
    epochs: int = 20
    batch_size: int = 64
    seed: int = 0

    def validate(self) -> None:
        if self.hidden < 1 or self.epochs < 0 or self.batch_size < 1 or not 0 <= self.dropout < 1 or self.lr <= 0:
            raise ValueError(f"mapper settings out of range: {self}")


def build_mapper(d_in: int, d_out: int, hidden: int = 1200, dropout: float = 0.2) -> Any:
    """The mapper network: one hidden ReLU layer with dropout from `d_in` to `d_out` (SEEC §IV)."""
    from torch import nn

    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, d_out))


def cosine_loss(pred: Any, target: Any) -> Any:
    """CosineEmbeddingLoss with target +1: mean(1 − cos); a zero vector has cos 0 (loss 1)."""
    import torch
    from torch import nn

    return nn.CosineEmbeddingLoss()(pred, target, torch.ones(pred.shape[0], dtype=pred.dtype))


@dataclass
class Mapper:
    """A trained m_{i→j}: numpy weights, applied without torch at search time."""

    src: str
    dst: str
    w1: np.ndarray  # (hidden, d_in)
    b1: np.ndarray
    w2: np.ndarray  # (d_out, hidden)
    b2: np.ndarray
    history: list[float]
    config: MapperConfig

    @property
    def dims(self) -> tuple[int, int]:
        return int(self.w1.shape[1]), int(self.w2.shape[0])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Map (n, d_in) -> (n, d_out); dropout is off at inference."""
        x = np.atleast_2d(np.asarray(x, dtype=np.float32))
        if x.shape[1] != self.w1.shape[1]:
            raise ValueError(f"mapper {self.src}->{self.dst} takes {self.w1.shape[1]}-d vectors, got {x.shape[1]}-d")
        h = np.maximum(x @ self.w1.T + self.b1, 0.0)
        return (h @ self.w2.T + self.b2).astype(np.float32)


def train_mapper(x_src: np.ndarray, y_dst: np.ndarray, config: MapperConfig | None = None, *,
                 src: str = "", dst: str = "", log: Any = None) -> Mapper:
    """Fit m_{src→dst} on paired public-corpus vectors (rows of x_src and y_dst are the same documents)."""
    import torch

    config = config or MapperConfig()
    config.validate()
    x = torch.as_tensor(np.asarray(x_src, dtype=np.float32))
    y = torch.as_tensor(np.asarray(y_dst, dtype=np.float32))
    if x.ndim != 2 or y.ndim != 2 or len(x) != len(y) or len(x) == 0:
        raise ValueError(f"mapper {src}->{dst}: need paired non-empty (n, d) arrays, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    gen = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    model = build_mapper(x.shape[1], y.shape[1], config.hidden, config.dropout)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    history: list[float] = []
    batch = min(config.batch_size, len(x))  # |D_p| < batch -> a single batch
    for epoch in range(config.epochs):
        model.train()
        order = torch.randperm(len(x), generator=gen)
        total = 0.0
        for s in range(0, len(x), batch):
            idx = order[s:s + batch]
            opt.zero_grad()
            loss = cosine_loss(model(x[idx]), y[idx])
            if not torch.isfinite(loss):
                raise ValueError(f"mapper {src}->{dst}: the loss became {float(loss.detach())} in epoch {epoch}; "
                                 f"check the public-corpus vectors for NaN/Inf or lower the learning rate")
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        history.append(total / len(x))
        if log is not None:
            log(f"mapper {src}->{dst} epoch {epoch + 1}/{config.epochs}: cosine loss {history[-1]:.4f}")
    lin1, lin2 = model[0], model[3]
    return Mapper(src, dst, lin1.weight.detach().numpy().copy(), lin1.bias.detach().numpy().copy(),
                  lin2.weight.detach().numpy().copy(), lin2.bias.detach().numpy().copy(), history, config)


def mean_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean cosine similarity of matching rows: how close the mapped vectors land to their targets."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    num = (a * b).sum(1)
    den = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return float((num / den).mean())


def mapper_path(folder: str | Path, src: str, dst: str) -> Path:
    """Where the mapper from site `src`'s space to site `dst`'s is stored in `folder`."""
    return Path(folder) / f"mapper_site{src}_to_site{dst}.h5"


def save_mapper(path: str | Path, mapper: Mapper) -> Path:
    """Write a trained mapper (weights, loss history, settings) to HDF5 atomically."""
    attrs: dict[str, AttrValue] = {"src": mapper.src, "dst": mapper.dst}
    attrs.update({f"config.{key}": value for key, value in asdict(mapper.config).items()})
    arrays = {name: getattr(mapper, name) for name in WEIGHTS}
    arrays["loss_history"] = np.asarray(mapper.history, dtype=np.float64)
    return write_model_file(path, MAPPER_FORMAT, attrs, arrays)


def load_mapper(path: str | Path) -> Mapper:
    """Read a mapper written by `save_mapper`, bounded; raises ValueError naming the file."""
    stored = read_model_file(path, MAPPER_FORMAT, what="mapper file", required=(*WEIGHTS, "loss_history"),
                             missing_hint="train it with `hpcfed search train-mappers`")
    values = {k.split(".", 1)[1]: v for k, v in stored.attrs.items() if k.startswith("config.")}
    cfg = build(MapperConfig, values, where=str(path), prefix="config.")  # names a bad key
    if "src" not in stored.attrs or "dst" not in stored.attrs:
        raise ValueError(f"{path}: attributes src and dst are missing; retrain the mapper")
    src, dst = str(stored.attrs["src"]), str(stored.attrs["dst"])
    arrays = {n: np.asarray(stored.arrays[n], dtype=np.float32) for n in WEIGHTS}
    history = [float(v) for v in np.asarray(stored.arrays["loss_history"]).reshape(-1)]
    if arrays["w1"].shape[0] != arrays["w2"].shape[1] or not all(np.isfinite(a).all() for a in arrays.values()):
        raise ValueError(f"{path}: mapper weights are inconsistent or not finite; retrain it")
    return Mapper(src, dst, history=history, config=cfg, **arrays)
