"""Name -> class resolution for tasks and strategies: built-ins, installed plugins, import paths.

`task.name` / `strategy.name` is one of:

- a built-in name below (``synthetic``, ``fedavg``, ...);
- a name an installed package registers under the entry-point group ``hpcfed.tasks`` or
  ``hpcfed.strategies`` (``[project.entry-points."hpcfed.tasks"] mytask = "mypkg.task:MyTask"``);
- an import path ``package.module:Class``. When the config file's folder holds that module
  (``task.py`` next to ``config.yaml``, as `hpcfed new` writes it), the folder is put on sys.path
  first, so a project runs from anywhere without installing it.

A plugin class must subclass `Task` / `Strategy`; its options are validated through its own nested
``Config`` dataclass exactly like a built-in's. Entries are import paths so that `import hpcfed` and
the CLI's help stay fast (torch, gensim, PyG load only when used).
"""

from __future__ import annotations

import importlib
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

TASKS: dict[str, str] = {
    "synthetic": "hpcfed.tasks.synthetic:SyntheticTask",
    "events": "hpcfed.tasks.events:EventsTask",
    "hin": "hpcfed.tasks.hin:HINTask",
    "doc2vec": "hpcfed.tasks.doc2vec:Doc2VecTask",
    "node2vec": "hpcfed.tasks.node2vec:Node2VecTask",
    "lora_20ng": "hpcfed.tasks.news20_lora:News20LoraTask",
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

TASK_GROUP = "hpcfed.tasks"
STRATEGY_GROUP = "hpcfed.strategies"

_IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def plugin_names(group: str) -> dict[str, str]:
    """Names installed packages register in entry-point `group`, mapped to their import paths."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


def _resolve(table: dict[str, str], group: str, kind: str, name: str, config_path: str | None) -> Any:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name is missing; give a built-in name, an installed plugin name or package.module:Class")
    if ":" in name:
        return _import_class(name, kind, config_path)
    if name in table:
        return _import_class(table[name], kind, None)
    plugins = plugin_names(group)
    if name in plugins:
        return _import_class(plugins[name], kind, None, origin=f"entry point {name!r} in group {group}")
    known = sorted(set(table) | set(plugins))
    raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(known)}, "
                     f"or give an import path package.module:Class")


def _import_class(path: str, kind: str, config_path: str | None, origin: str | None = None) -> Any:
    where = origin or f"import path {path!r}"
    if not _IMPORT_PATH.match(path):
        raise ValueError(f"{where} is malformed; write it as package.module:Class")
    module_name, attr = path.split(":")
    _add_config_folder(module_name, config_path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{where}: cannot import module {module_name!r} ({exc}); put it on PYTHONPATH, "
                         f"next to the config file, or install its package") from None
    except SyntaxError as exc:
        raise ValueError(f"{where}: module {module_name!r} has a syntax error at {exc.filename}:{exc.lineno}") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    _check_kind(obj, kind, where)
    return obj


def _check_kind(obj: Any, kind: str, where: str) -> None:
    import dataclasses

    if kind == "task":
        from hpcfed.tasks.base import Task as base
    else:
        from hpcfed.strategies.base import Strategy as base
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"{where} is {obj!r}, not a subclass of {base.__module__}.{base.__name__}")
    if not dataclasses.is_dataclass(getattr(obj, "Config", None)):
        raise ValueError(f"{where}: {obj.__name__}.Config must be a @dataclass(kw_only=True) of its options")


def _add_config_folder(module_name: str, config_path: str | None) -> None:
    """Put the config file's folder on sys.path when it holds the plugin's top-level module."""
    if not config_path:
        return
    folder = Path(config_path).resolve().parent
    top = module_name.split(".")[0]
    if (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file():
        text = str(folder)
        if text not in sys.path:
            sys.path.insert(0, text)


def task_class(name: str, config_path: str | None = None) -> Any:
    """The Task class `name` stands for; `config_path` is the config file (its folder may hold the module)."""
    return _resolve(TASKS, TASK_GROUP, "task", name, config_path)


def strategy_class(name: str, config_path: str | None = None) -> Any:
    """The Strategy class `name` stands for; see `task_class`."""
    return _resolve(STRATEGIES, STRATEGY_GROUP, "strategy", name, config_path)
