"""Bring your own PyTorch model: subclass `TorchTask`, write three methods, get a full `Task`.

    class MyTask(TorchTask):
        @dataclass(kw_only=True)
        class Config(TorchTask.Config):     # your options, validated like a built-in's
            hidden: int = 32

        def build_model(self) -> nn.Module: ...               # the same on every site (seeded)
        def train_data(self) -> Iterable[Any]: ...                  # e.g. a DataLoader of (x, y) or dicts
        def eval_data(self, split: str) -> Iterable[Any]: ...       # split is "val" (per round) or "test" (final)
        # optional: loss(output, target), metrics(outputs, targets), embed(inputs), split_batch(batch)

and run it with ``task: {name: mymodule:MyTask, lr: 0.01}``. The adapter does the rest:

- ``personalize_epochs: N`` fine-tunes the final federated model on the site's own data before the
  final test (FedAvg-FT); the personal model never travels;
- only *shared* tensors travel: by default the parameters with ``requires_grad`` (so a frozen
  backbone with LoRA adapters sends the adapters and the head); ``share: all`` sends every floating
  parameter and buffer, ``share_patterns: ["encoder.*"]`` picks by name (fnmatch);
- the model and every batch go to ``site.device`` (a GPU under ``device: auto|cuda`` when one is
  visible); the optimizer (``adam|adamw|sgd``) keeps its state across rounds;
- each ``fit(round)`` reseeds torch, numpy and `random` from (seed, client_id, round) — the Task
  reproducibility contract — so DataLoader shuffling and dropout repeat exactly on a resumed run;
- ``state_dict`` holds the optimizer state, the RNG state and the tensors that stay on the site
  (trainable but not shared, and buffers), so checkpoint/resume restores the site exactly;
- evaluation reports loss, accuracy and macro-F1 for classification outputs unless `metrics` is
  overridden; `embed` (when defined) turns the test split into an HDF5 embedding export.
"""

from __future__ import annotations

import fnmatch
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hpcfed.params import Params
from hpcfed.store.embeddings import export_path, write_export
from hpcfed.tasks import data_parallel, torch_state
from hpcfed.tasks.base import Bundle, FitResult, Site, Task
from hpcfed.tasks.private_training import RecordDPTraining, refuse_record_mixing, steps_per_round

LOCAL_PREFIX = "local/"  # state_dict arrays: tensors that never leave the site


def round_seed(seed: int, client_id: int, round: int) -> int:
    """The seed of one site's round, derived from (seed, client_id, round) only."""
    seq = np.random.SeedSequence([abs(int(seed)), abs(int(client_id)), abs(int(round)), 0x70C4])
    return int(seq.generate_state(1, dtype=np.uint32)[0])


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and GPUs), numpy's global generator and `random`."""
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def to_device(value: Any, device: Any) -> Any:
    """Move tensors inside nested dicts/lists/tuples to `device`."""
    if hasattr(value, "to") and hasattr(value, "device"):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def _wire_array(tensor: Any) -> np.ndarray:
    """A tensor as a numpy array in the dtype the wire carries it in (bfloat16 stays bfloat16)."""
    return torch_state.to_numpy(tensor)


class TorchTask(Task):
    """A `Task` around a user's torch model; see the module docstring."""

    name = "torch"
    record_dp_refusal = ""  # DP-SGD over train_data()'s dataset, one item one record (tasks/private_training.py)
    site_parallel = True  # a site of many ranks shares each batch (tasks/data_parallel.py)

    @dataclass(kw_only=True)
    class Config:
        lr: float = 1e-3
        optimizer: Literal["adam", "adamw", "sgd"] = "adam"
        weight_decay: float = 0.0
        momentum: float = 0.0  # sgd only
        local_epochs: int = 1
        max_steps: int | None = None  # cap on optimizer steps per round (None: whole epochs)
        grad_clip: float | None = None  # max gradient norm
        share: Literal["trainable", "all"] = "trainable"
        share_patterns: list[str] = field(default_factory=list)  # fnmatch names; overrides `share`
        # Before the final test, fine-tune the federated model on this site's own data for this many
        # epochs (FedAvg-FT): the site's personal model; nothing of it travels.
        personalize_epochs: int = 0

        def validate(self) -> None:
            if self.lr <= 0:
                raise ValueError(f"lr must be > 0, got {self.lr}")
            if self.local_epochs < 1:
                raise ValueError(f"local_epochs must be >= 1, got {self.local_epochs}")
            if self.personalize_epochs < 0:
                raise ValueError(f"personalize_epochs must be >= 0, got {self.personalize_epochs}")
            if self.max_steps is not None and self.max_steps < 1:
                raise ValueError(f"max_steps must be >= 1 or null, got {self.max_steps}")
            if self.grad_clip is not None and self.grad_clip <= 0:
                raise ValueError(f"grad_clip must be > 0 or null, got {self.grad_clip}")
            if self.weight_decay < 0 or self.momentum < 0:
                raise ValueError("weight_decay and momentum must be >= 0")

    # -- what a user writes ---------------------------------------------------------------------
    def build_model(self) -> Any:
        """The model (an ``nn.Module``); called once per site under the run seed."""
        raise NotImplementedError(f"{type(self).__name__} must define build_model(self) -> nn.Module")

    def train_data(self) -> Iterable[Any]:
        """This site's training batches (e.g. a DataLoader); iterated once per local epoch."""
        raise NotImplementedError(f"{type(self).__name__} must define train_data(self) -> DataLoader")

    def eval_data(self, split: str) -> Iterable[Any]:
        """Batches of split ``"val"`` (evaluated each round) or ``"test"`` (final evaluation, export)."""
        raise NotImplementedError(f"{type(self).__name__} must define eval_data(self, split) -> DataLoader")

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, targets) of a batch: ``(x, y)`` pairs, or dicts whose ``labels``/``label``/``y`` is the target."""
        if isinstance(batch, (list, tuple)) and len(batch) == 2:
            return batch[0], batch[1]
        if isinstance(batch, dict):
            for key in ("labels", "label", "y"):
                if key in batch:
                    return {k: v for k, v in batch.items() if k != key}, batch[key]
        raise ValueError(f"{type(self).__name__}: a batch must be (inputs, targets) or a dict with 'labels'; "
                         f"got {type(batch).__name__} (override split_batch for other layouts)")

    def forward(self, inputs: Any) -> Any:
        """Model output for `inputs` (dicts become keyword arguments; a ``.logits`` attribute is unwrapped)."""
        if isinstance(inputs, dict):
            out = self.model(**inputs)
        elif isinstance(inputs, (list, tuple)):
            out = self.model(*inputs)
        else:
            out = self.model(inputs)
        return getattr(out, "logits", out)

    def loss(self, output: Any, target: Any) -> Any:
        """Training/evaluation loss (default: cross-entropy over logits)."""
        import torch.nn.functional as F

        return F.cross_entropy(output, target)

    def metrics(self, outputs: Any, targets: Any) -> dict[str, float]:
        """Metrics over a whole split's concatenated outputs (default: accuracy and macro-F1 of logits)."""
        if outputs.ndim != 2 or targets.ndim != 1:
            return {}
        from hpcfed.tasks.synthetic import macro_f1

        pred = outputs.argmax(1).cpu().numpy()
        y = targets.cpu().numpy()
        return {"accuracy": float((pred == y).mean()) if len(y) else 0.0,
                "macro_f1": macro_f1(y, pred, int(outputs.shape[1]))}

    def embed(self, inputs: Any) -> Any:
        """Embedding vectors of `inputs`; define it to get an HDF5 export of the test split."""
        return None

    # -- the Task protocol ----------------------------------------------------------------------
    def __init__(self, config: Any, site: Site) -> None:
        super().__init__(config, site)
        import torch

        self.device = torch.device(site.device)
        seed_everything(site.seed)  # the same initial model on every site
        self.model = self.build_model().to(self.device)
        self.shared = self.shared_names()
        if not self.shared:
            raise ValueError(f"task {type(self).__name__}: no parameter is shared (share={config.share}, "
                             f"share_patterns={config.share_patterns}); mark some requires_grad or fix the patterns")
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"task {type(self).__name__}: the model has no parameter with requires_grad")
        self.optimizer = self._optimizer(trainable)
        self._train = self.train_data()
        self.private = self._record_dp(site) if site.record_dp is not None else None

    def _record_dp(self, site: Site) -> RecordDPTraining:
        """DP-SGD over train_data()'s dataset: a map-style dataset of independent records, which the
        steps sample by Poisson sampling and batch with the loader's own collate_fn."""
        c, loader = self.config, self._train
        dataset, batch_size = getattr(loader, "dataset", None), getattr(loader, "batch_size", None)
        if _dataset_len(loader) is None or not hasattr(dataset, "__getitem__") or not batch_size:
            raise ValueError(f"task {type(self).__name__}: privacy.record_dp samples records from train_data()'s "
                             f"dataset, so train_data() must return a DataLoader over a map-style dataset with a "
                             f"batch_size (got {type(loader).__name__})")
        if c.personalize_epochs:
            raise ValueError(f"task.personalize_epochs = {c.personalize_epochs} with privacy.record_dp: the personal "
                             f"model would train on the records outside the accountant; set it to 0")
        refuse_record_mixing(self.model, self.shared, type(self).__name__)
        records = len(dataset)  # type: ignore[arg-type]  # _dataset_len checked it has one
        return RecordDPTraining(site.record_dp, site.client_id, model=self.model,  # type: ignore[arg-type]  # set
                                loss=lambda x, y: self.loss(self.forward(x), y), records=records,
                                batch_size=int(batch_size),
                                steps_per_round=steps_per_round(records, int(batch_size), c.local_epochs, c.max_steps),
                                ranks=site.ranks)

    def _gather(self, indices: Any) -> tuple[Any, Any]:
        """The batch of records `indices` of the training dataset, collated as the loader does, on the device."""
        loader = self._train
        batch = loader.collate_fn([loader.dataset[int(i)] for i in indices])  # type: ignore[attr-defined]  # _record_dp checked
        return to_device(self.split_batch(batch), self.device)

    def shared_names(self) -> list[str]:
        """Names (state_dict keys) of the tensors that travel, in the model's order."""
        c = self.config
        state = self.model.state_dict(keep_vars=True)
        floating = [n for n, t in state.items() if t.is_floating_point()]
        if c.share_patterns:
            return [n for n in floating if any(fnmatch.fnmatchcase(n, p) for p in c.share_patterns)]
        if c.share == "all":
            return floating
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return [n for n in floating if n in trainable]

    def _optimizer(self, params: list[Any]) -> Any:
        import torch

        c = self.config
        if c.optimizer == "sgd":
            return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)
        cls = torch.optim.AdamW if c.optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=c.lr, weight_decay=c.weight_decay)

    def get_parameters(self) -> Params:
        state = self.model.state_dict()
        return {n: _wire_array(state[n]) for n in self.shared}

    def set_parameters(self, params: Params) -> None:
        import torch

        if list(params) != self.shared:
            missing = [n for n in self.shared if n not in params]
            unknown = [n for n in params if n not in set(self.shared)]
            raise ValueError(f"shared parameters differ from the model's: missing {missing[:3]}, unknown {unknown[:3]}")
        state = self.model.state_dict()
        with torch.no_grad():
            for name, value in params.items():
                tensor = state[name]
                tensor.copy_(torch_state.to_torch(value).to(tensor.dtype).reshape(tensor.shape))

    def fit(self, round: int) -> FitResult:
        seed_everything(round_seed(self.site.seed, self.site.client_id, round))
        if self.private is not None:
            self.model.train()
            return self.private.fit(round, self.optimizer, self._gather)
        with data_parallel.training(self) as ranks:
            total, seen = self._train_epochs(self.config.local_epochs, ranks)
        if ranks is not None:  # the site's loss and examples, on every rank
            total, examples = ranks.sum(total, seen)
            seen = int(examples)
        size = _dataset_len(self._train)
        return FitResult(num_examples=size if size is not None else seen,
                         metrics={"train_loss": total / max(seen, 1)})

    def _train_epochs(self, epochs: int, ranks: data_parallel.SiteRanks | None = None) -> tuple[float, int]:
        """Train on this site's data (this rank's rows of each batch, under `ranks`); (summed loss, examples seen)."""
        c = self.config
        self.model.train()
        total, seen, steps = 0.0, 0, 0
        for _ in range(epochs):
            for batch in self._train:
                inputs, target = to_device(self.split_batch(batch), self.device)
                rows = _batch_len(target)
                if ranks is not None:
                    part = ranks.shard(rows)
                    inputs, target = data_parallel.shard_rows(inputs, part), data_parallel.shard_rows(target, part)
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.loss(self.forward(inputs), target)
                (loss if ranks is None else loss * ranks.scale(_batch_len(target), rows)).backward()
                if c.grad_clip is not None:
                    import torch

                    torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], c.grad_clip)
                self.optimizer.step()
                n = _batch_len(target)
                total += float(loss.detach()) * n
                seen += n
                steps += 1
                if c.max_steps is not None and steps >= c.max_steps:
                    break
            if c.max_steps is not None and steps >= c.max_steps:
                break
        return total, seen

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        if final and self.config.personalize_epochs:
            self.personalize(round)
        result = self.evaluate_on(self.eval_data("test" if final else "val"))
        if final and self.private is not None:
            result.update(self.private.final_metrics())
        return result if final else {f"val_{k}": v for k, v in result.items()}

    def personalize(self, round: int) -> None:
        """Fine-tune the final federated model on this site's data (`personalize_epochs`): the
        final test and the embedding export then use the site's personal model."""
        seed_everything(round_seed(self.site.seed, self.site.client_id, round + 1))
        self._train_epochs(self.config.personalize_epochs)

    def evaluate_on(self, batches: Iterable[Any]) -> dict[str, float]:
        """Loss and `metrics` of the current model over `batches` (empty dict for no batches)."""
        import torch

        outputs, targets, total, seen = [], [], 0.0, 0
        self.model.eval()
        with torch.no_grad():
            for batch in batches:
                inputs, target = to_device(self.split_batch(batch), self.device)
                out = self.forward(inputs)
                n = _batch_len(target)
                total += float(self.loss(out, target)) * n
                seen += n
                outputs.append(out.detach().float().cpu())
                targets.append(target.detach().cpu())
        if not outputs:
            return {}
        return {"loss": total / max(seen, 1), **self.metrics(torch.cat(outputs), torch.cat(targets))}

    def export_embeddings(self, out_dir: Path) -> Path | None:
        import torch

        vectors, labels = [], []
        self.model.eval()
        with torch.no_grad():
            for batch in self.eval_data("test"):
                inputs, target = to_device(self.split_batch(batch), self.device)
                emb = self.embed(inputs)
                if emb is None:
                    return None
                vectors.append(emb.detach().float().cpu().numpy())
                labels.append(target.detach().cpu().numpy().reshape(len(emb), -1)[:, 0])
        if not vectors:
            return None
        matrix = np.concatenate(vectors).astype(np.float32)
        ids = [f"site{self.site.client_id}-test{i}" for i in range(len(matrix))]
        return write_export(export_path(out_dir, self.site.client_id), matrix, ids, np.concatenate(labels),
                            entity="item", model=type(self).__name__, site=self.site.client_id,
                            config_hash=self.site.config_hash, version=0)

    # -- resumable state --------------------------------------------------------------------------
    def _local_names(self) -> list[str]:
        """Tensors that stay on the site and change: trainable-but-unshared parameters and all buffers."""
        shared = set(self.shared)
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        buffers = {n for n, _ in self.model.named_buffers()}
        return [n for n in self.model.state_dict() if n not in shared and (n in trainable or n in buffers)]

    def state_dict(self) -> Bundle:
        header, arrays = torch_state.training_state(self.optimizer)
        state = self.model.state_dict()
        local = {LOCAL_PREFIX + n: _wire_array(state[n]) for n in self._local_names()}
        bundle = (header, {**arrays, **local})
        return self.private.save(bundle) if self.private is not None else bundle

    def load_state_dict(self, state: Bundle) -> None:
        import torch

        if self.private is not None:
            state = self.private.load(state)
        header, arrays = state
        torch_state.load_training_state(self.optimizer, header, arrays)
        model_state = self.model.state_dict()
        with torch.no_grad():
            for key, value in arrays.items():
                if not key.startswith(LOCAL_PREFIX):
                    continue
                name = key[len(LOCAL_PREFIX):]
                tensor = model_state.get(name)
                if tensor is None or int(np.size(value)) != tensor.numel():
                    raise ValueError(f"saved site state has tensor {name!r} that the model does not have "
                                     f"(or of another shape); resume with the same task config")
                tensor.copy_(torch.as_tensor(np.asarray(value)).to(tensor.dtype).reshape(tensor.shape))


def _batch_len(target: Any) -> int:
    shape = getattr(target, "shape", None)
    return int(shape[0]) if shape else 1


def _dataset_len(loader: Any) -> int | None:
    dataset = getattr(loader, "dataset", None)
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None
