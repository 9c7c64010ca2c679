"""Name -> class registries for tasks and strategies.

Adding a task or strategy is one file plus one line here. Entries are import paths so that
`import hpcfed` and the CLI's help stay fast (torch, gensim, PyG load only when used).
"""

from __future__ import annotations

import importlib
from typing import Any

TASKS: dict[str, str] = {
    "synthetic": "hpcfed.tasks.synthetic:SyntheticTask",
    "events": "hpcfed.tasks.events:EventsTask",
    "hin": "hpcfed.tasks.hin:HINTask",
    "doc2vec": "hpcfed.tasks.doc2vec:Doc2VecTask",
    "node2vec": "hpcfed.tasks.node2vec:Node2VecTask",
}

STRATEGIES: dict[str, str] = {
    "fedavg": "hpcfed.strategies.fedavg:FedAvg",
    "sega": "hpcfed.strategies.sega:Sega",
    "median": "hpcfed.strategies.robust:Median",
    "trimmed_mean": "hpcfed.strategies.robust:TrimmedMean",
    "krum": "hpcfed.strategies.robust:Krum",
    "feddwa": "hpcfed.strategies.feddwa:FedDWA",
    "fedasync": "hpcfed.strategies.fedasync:FedAsync",
    "afed": "hpcfed.strategies.fedasync:FedAsync",
    "local": "hpcfed.strategies.local:Local",
}


def _resolve(table: dict[str, str], kind: str, name: str) -> Any:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(table))}")
    module, attr = table[name].split(":")
    return getattr(importlib.import_module(module), attr)


def task_class(name: str) -> Any:
    return _resolve(TASKS, "task", name)


def strategy_class(name: str) -> Any:
    return _resolve(STRATEGIES, "strategy", name)
