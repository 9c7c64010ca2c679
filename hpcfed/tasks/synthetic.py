"""The built-in quickstart task: classification + embeddings on data with planted structure.

Every site draws from the same world (class prototypes fixed by the run seed) but with its own
label skew (Dirichlet(`label_skew`) over classes), so a site alone sees few examples of most classes
and the federation beats local training. Each class is a mixture of `modes_per_class` Gaussian
blobs, which a linear model cannot separate; the model is an MLP encoder (-> `embed_dim`) plus a
linear head. The encoder output is what the site exports as its embeddings.

Needs no download; a 3-rank federation of 5 rounds runs in seconds on a laptop core.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hpcfed.params import Params
from hpcfed.store.embeddings import export_path, write_export
from hpcfed.tasks import data_parallel, torch_state
from hpcfed.tasks.adam import Adam
from hpcfed.tasks.base import Bundle, FitResult, Site, Task
from hpcfed.tasks.private_training import RecordDPTraining, steps_per_round
from hpcfed.tasks.sgd import SGD


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([abs(int(k)) for k in keys]))


def make_site_data(seed: int, client_id: int, *, num_classes: int, dim: int, modes_per_class: int,
                   samples: int, label_skew: float, noise: float) -> dict[str, np.ndarray]:
    """Train/val/test arrays for one site. Test labels are balanced; train labels are skewed."""
    world = _rng(seed, 7919)
    centres = world.normal(0.0, 1.0, size=(num_classes, modes_per_class, dim)).astype(np.float32) * 2.0
    site = _rng(seed, 104729, client_id)
    uniform = np.full(num_classes, 1 / num_classes)
    probs = site.dirichlet(np.full(num_classes, label_skew)) if label_skew > 0 else uniform

    def draw(n: int, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        y = site.choice(num_classes, size=n, p=p)
        m = site.integers(0, modes_per_class, size=n)
        x = centres[y, m] + site.normal(0.0, noise, size=(n, dim)).astype(np.float32)
        return x.astype(np.float32), y.astype(np.int64)

    x_tr, y_tr = draw(samples, probs)
    x_va, y_va = draw(max(50, samples // 5), probs)
    uniform = np.full(num_classes, 1.0 / num_classes)
    x_te, y_te = draw(max(100, samples // 2), uniform)
    return {"x_train": x_tr, "y_train": y_tr, "x_val": x_va, "y_val": y_va, "x_test": x_te, "y_test": y_te}


def macro_f1(y: np.ndarray, pred: np.ndarray, num_classes: int) -> float:
    """Unweighted mean of per-class F1 over the classes present in `y` or `pred` (sklearn's convention)."""
    scores = []
    for c in range(num_classes):
        tp = int(((pred == c) & (y == c)).sum())
        fp = int(((pred == c) & (y != c)).sum())
        fn = int(((pred != c) & (y == c)).sum())
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else 0.0


# printed under the run's final figures (see hpcfed.launch.rank.closing_lines)
EVALUATION_NOTE = ("val_accuracy is on each site's validation split, label-skewed like its training data; "
                   "the final test split is balanced over the classes (every class counts equally)")


@dataclass(kw_only=True)
class BlobsConfig:
    """The quickstart's data and network shape and training, shared by its torch task and its NumPy twin
    (`hpcfed.tasks.synthetic_numpy`)."""

    num_classes: int = 8
    dim: int = 16
    modes_per_class: int = 3
    samples_per_site: int = 500
    label_skew: float = 0.5  # Dirichlet concentration; smaller = more skewed; 0 = IID
    noise: float = 1.5
    hidden: int = 64
    embed_dim: int = 16
    lr: float = 0.005
    local_epochs: int = 1
    batch_size: int = 32
    # A parameter tensor of this many values that the model carries but never uses: sizes the
    # model for the comm/scale benchmarks (tools/bench_scale.py) without adding compute.
    ballast: int = 0

    def validate(self) -> None:
        for key in ("num_classes", "dim", "samples_per_site", "hidden", "embed_dim", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_classes < 2:
            raise ValueError("num_classes must be >= 2")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.local_epochs < 0 or self.ballast < 0:
            raise ValueError("local_epochs and ballast must be >= 0")


class SyntheticTask(Task):
    """The quickstart's task: an MLP on label-skewed blobs with planted structure; needs no download."""

    name = "synthetic"
    record_dp_refusal = ""  # each training example is one independent record
    site_parallel = True  # a site of many ranks shares each batch (tasks/data_parallel.py)
    evaluation_note = EVALUATION_NOTE

    @dataclass(kw_only=True)
    class Config(BlobsConfig):
        # adam | sgd (with `momentum`): under privacy.record_dp, SGD steps by the noisy gradient itself where
        # Adam moves every coordinate about lr a step, noise or not (docs/guides/privacy.md, record DP)
        optimizer: Literal["adam", "sgd"] = "adam"
        momentum: float = 0.0  # sgd only
        dtype: str = "float32"  # float32 | float16 | bfloat16: the model's dtype, kept on the wire

        def validate(self) -> None:
            super().validate()
            if self.dtype not in ("float32", "float16", "bfloat16"):
                raise ValueError(f"dtype={self.dtype!r}; choose float32, float16 or bfloat16")
            if self.optimizer not in ("adam", "sgd"):
                raise ValueError(f"optimizer={self.optimizer!r}; choose adam or sgd")
            if not 0.0 <= self.momentum < 1.0 or (self.momentum and self.optimizer != "sgd"):
                raise ValueError(f"momentum must be in [0, 1) and is for optimizer sgd only, got {self.momentum} "
                                 f"with optimizer {self.optimizer}")

    def __init__(self, config: Config, site: Site) -> None:
        super().__init__(config, site)
        import torch
        from torch import nn

        c = config
        self.data = {k: torch.as_tensor(v) for k, v in make_site_data(
            site.seed, site.client_id, num_classes=c.num_classes, dim=c.dim, modes_per_class=c.modes_per_class,
            samples=c.samples_per_site, label_skew=c.label_skew, noise=c.noise).items()}
        torch.manual_seed(site.seed)  # identical initial model on every site
        self.encoder = nn.Sequential(nn.Linear(c.dim, c.hidden), nn.ReLU(), nn.Linear(c.hidden, c.embed_dim))
        self.head = nn.Linear(c.embed_dim, c.num_classes)
        self.model = nn.Sequential(self.encoder, nn.ReLU(), self.head)
        if c.ballast:
            self.model.ballast = nn.Parameter(torch.zeros(c.ballast), requires_grad=False)
        dtype = getattr(torch, c.dtype)
        if dtype != torch.float32:
            self.model.to(dtype)
            for key in ("x_train", "x_val", "x_test"):
                self.data[key] = self.data[key].to(dtype)
        # torch.optim.Adam's / SGD's steps, started faster (no compiler import)
        self.optimizer: Adam | SGD = (SGD(self.model.parameters(), lr=c.lr, momentum=c.momentum) if c.optimizer == "sgd"
                                      else Adam(self.model.parameters(), lr=c.lr))
        self.loss_fn = nn.CrossEntropyLoss()
        self.private: RecordDPTraining | None = None
        self._parallel_model: Any = None  # the DDP wrapper, built at the first fit (a collective)
        if site.record_dp is not None:
            records = len(self.data["x_train"])
            self.private = RecordDPTraining(
                site.record_dp, site.client_id, model=self.model, loss=lambda x, y: self.loss_fn(self.model(x), y),
                records=records, batch_size=c.batch_size,
                steps_per_round=steps_per_round(records, c.batch_size, c.local_epochs), ranks=site.ranks)

    # -- parameters ---------------------------------------------------------------------------
    def get_parameters(self) -> Params:
        return torch_state.module_parameters(self.model)

    def set_parameters(self, params: Params) -> None:
        torch_state.load_module_parameters(self.model, params)

    # -- learning -----------------------------------------------------------------------------
    def fit(self, round: int) -> FitResult:
        import torch

        c = self.config
        x, y = self.data["x_train"], self.data["y_train"]
        if self.private is not None:
            self.model.train()
            return self.private.fit(round, self.optimizer, lambda idx: (x[idx], y[idx]))
        gen = torch.Generator().manual_seed(int(_rng(self.site.seed, self.site.client_id, round).integers(2**62)))
        ranks = self.site.ranks if data_parallel.parallel(self.site.ranks) else None
        if ranks is not None and self._parallel_model is None:
            self._parallel_model = data_parallel.wrap(self.model, ranks, torch.device("cpu"))
        model = self._parallel_model if ranks is not None else self.model
        self.model.train()
        total, count = 0.0, 0
        for _ in range(c.local_epochs):
            order = torch.randperm(len(x), generator=gen)
            for start in range(0, len(x), c.batch_size):
                idx = order[start : start + c.batch_size]
                part = idx if ranks is None else idx[ranks.shard(len(idx))]
                self.optimizer.zero_grad()
                loss = self.loss_fn(model(x[part]), y[part]) if len(part) else model(x[part]).sum()
                (loss if ranks is None else loss * ranks.scale(len(part), len(idx))).backward()
                self.optimizer.step()
                total += float(loss.detach()) * len(part)
                count += len(part)
        if ranks is not None:  # the site's loss over the whole batch, on every rank
            total, examples = ranks.sum(total, count)
            count = int(examples)
        return FitResult(num_examples=len(x), metrics={"train_loss": total / max(count, 1)})

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        import torch

        split = "test" if final else "val"
        x, y = self.data[f"x_{split}"], self.data[f"y_{split}"]
        self.model.eval()
        with torch.no_grad():
            logits = self.model(x)
            loss = float(self.loss_fn(logits, y))
        pred = logits.argmax(1).numpy()
        acc = float((pred == y.numpy()).mean())
        if not final:
            return {"val_loss": loss, "val_accuracy": acc}
        private = self.private.final_metrics() if self.private is not None else {}
        f1 = macro_f1(y.numpy(), pred, self.config.num_classes)
        return {"loss": loss, "accuracy": acc, "macro_f1": f1, **private}

    def export_embeddings(self, out_dir: Path) -> Path:
        import torch

        self.model.eval()
        with torch.no_grad():
            vectors = self.encoder(self.data["x_test"]).float().numpy()
        ids = [f"site{self.site.client_id}-test{i}" for i in range(len(vectors))]
        return write_export(export_path(out_dir, self.site.client_id), vectors, ids, self.data["y_test"].numpy(),
                            entity="node", model="synthetic-mlp", site=self.site.client_id,
                            config_hash=self.site.config_hash, version=0)

    # -- resumable state ------------------------------------------------------------------------
    def state_dict(self) -> Bundle:
        state = torch_state.training_state(self.optimizer)
        return self.private.save(state) if self.private is not None else state

    def load_state_dict(self, state: Bundle) -> None:
        if self.private is not None:
            state = self.private.load(state)
        torch_state.load_training_state(self.optimizer, *state)
