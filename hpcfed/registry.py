"""Name -> class resolution for tasks and strategies: built-ins, installed plugins, import paths.

`task.name` / `strategy.name` is one of:

- a built-in name below (``synthetic``, ``fedavg``, ...);
- a name an installed package registers under the entry-point group ``hpcfed.tasks`` or
  ``hpcfed.strategies`` (``[project.entry-points."hpcfed.tasks"] mytask = "mypkg.task:MyTask"``);
- an import path ``package.module:Class``. When the config file's folder holds that module
  (``task.py`` next to ``config.yaml``, as `hpcfed new` writes it), the folder is put on sys.path
  first, so a project runs from anywhere without installing it.

A plugin class must subclass `Task` / `SyncStrategy` or `AsyncStrategy`; its options are validated
through its own nested ``Config`` dataclass exactly like a built-in's. Entries are import paths so
that `import hpcfed` and the CLI's help stay fast (torch, gensim, PyG load only when used).

`resolve` makes a loaded config ready to run, the same way on every rank: the task's ``method=``
preset is applied (`apply_method`), the classes are looked up, ``federation.mode`` is derived from
the strategy's base, and both components' options are validated.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from hpcfed.config import ComponentConfig, Config, ConfigError
from hpcfed.schema import build, locate

if TYPE_CHECKING:
    from hpcfed.strategies.base import Strategy
    from hpcfed.tasks.base import Task

TASKS: dict[str, str] = {
    "synthetic": "hpcfed.tasks.synthetic:SyntheticTask",
    "synthetic_numpy": "hpcfed.tasks.synthetic_numpy:SyntheticNumpyTask",
    "events": "hpcfed.tasks.events:EventsTask",
    "hin": "hpcfed.tasks.hin:HINTask",
    "doc2vec": "hpcfed.tasks.doc2vec:Doc2VecTask",
    "node2vec": "hpcfed.tasks.node2vec:Node2VecTask",
    "lora_20ng": "hpcfed.tasks.news20_lora:News20LoraTask",
}

STRATEGIES: dict[str, str] = {
    "fedavg": "hpcfed.strategies.fedavg:FedAvg",
    "fedavgm": "hpcfed.strategies.fedavgm:FedAvgM",
    "sega": "hpcfed.strategies.sega:Sega",
    "median": "hpcfed.strategies.robust:Median",
    "trimmed_mean": "hpcfed.strategies.robust:TrimmedMean",
    "krum": "hpcfed.strategies.robust:Krum",
    "feddwa": "hpcfed.strategies.feddwa:FedDWA",
    "fedasync": "hpcfed.strategies.fedasync:FedAsync",
    "fedbuff": "hpcfed.strategies.fedbuff:FedBuff",
    "afed": "hpcfed.strategies.fedasync:FedAsync",
    "local": "hpcfed.strategies.local:Local",
}

TASK_GROUP = "hpcfed.tasks"
STRATEGY_GROUP = "hpcfed.strategies"

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_IMPORT_PATH = re.compile(rf"^{_DOTTED}:{_DOTTED}$")


def plugin_names(group: str) -> dict[str, str]:
    """Names installed packages register in entry-point `group`, mapped to their import paths."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


def _resolve(table: dict[str, str], group: str, kind: str, name: str, config_path: str | None) -> Any:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name is missing; give a built-in name, an installed plugin name or "
                         f"package.module:Class")
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
    from hpcfed.strategies.base import Strategy, kind_problem
    from hpcfed.tasks.base import Task

    base: type = Task if kind == "task" else Strategy
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"{where} is {obj!r}, not a subclass of {base.__module__}.{base.__name__}")
    problem = kind_problem(obj) if base is Strategy else None
    if problem:
        raise ValueError(f"{where}: {problem}")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise ValueError(f"{where}: {obj.__name__} does not implement {missing}; define it in the class")
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


def task_class(name: str, config_path: str | None = None) -> type[Task]:
    """The Task class `name` stands for; `config_path` is the config file (its folder may hold the module)."""
    cls: type[Task] = _resolve(TASKS, TASK_GROUP, "task", name, config_path)  # checked by _check_kind
    return cls


def uses_torch(cfg: Config) -> bool:
    """Whether the config's task trains with torch (`Task.uses_torch`); its sites import it only then."""
    return task_class(cfg.task.name, cfg.source).uses_torch


def strategy_class(name: str, config_path: str | None = None) -> type[Strategy]:
    """The Strategy class `name` stands for; see `task_class`."""
    cls: type[Strategy] = _resolve(STRATEGIES, STRATEGY_GROUP, "strategy", name, config_path)  # checked by _check_kind
    return cls


class Components(NamedTuple):
    """The classes a resolved config names."""

    task: type[Task]
    strategy: type[Strategy]


def resolve(cfg: Config) -> Components:
    """Make a loaded config ready to run (every rank does the same): apply its ``method=`` preset,
    look up the task and strategy, derive ``federation.mode`` from the strategy, validate both
    components' options, and check the ``privacy`` section against what the strategy declares
    (`hpcfed.privacy.requirements`). Raises a one-line `ConfigError` naming the key and the fix; calling it
    again on the result changes nothing."""
    task_cls = _component(task_class, cfg.task.name, "task.name", cfg.source)
    apply_method(cfg, task_cls)
    strategy_cls = _component(strategy_class, cfg.strategy.name, "strategy.name", cfg.source)
    derive_mode(cfg, strategy_cls)
    build(task_cls.Config, cfg.task.options, where=cfg.source, prefix="task.")
    strategy_config = build(strategy_cls.Config, cfg.strategy.options, where=cfg.source, prefix="strategy.")
    from hpcfed.privacy.requirements import Declared, check_privacy

    declared = strategy_cls.aggregates_with(strategy_config)
    check_privacy(cfg, Declared(cfg.strategy.name, strategy_cls.synchronous, declared,
                                folds_buffers=strategy_cls.folds_buffers, options=cfg.strategy.options))
    if cfg.privacy.record_dp is not None:
        from hpcfed.privacy.record_dp import check_task

        check_task(cfg.task.name, task_cls.record_dp_refusal, cfg.source)
    check_site_parallel(cfg, task_cls)
    return Components(task_cls, strategy_cls)


def check_site_parallel(cfg: Config, task_cls: type[Task]) -> None:
    """``federation.ranks_per_site`` > 1 needs a task whose ranks train one site together (record-level
    DP shards each Poisson batch over them: `hpcfed.tasks.private_training`)."""
    per = cfg.federation.ranks_per_site
    if (per if isinstance(per, int) else max(per, default=1)) <= 1:
        return
    where = f"{locate(cfg.source, 'federation.ranks_per_site')} = {per!r}"
    if not task_cls.site_parallel:
        raise ConfigError(f"{where}: task {cfg.task.name!r} trains on one rank per site (it is not data-parallel); "
                          f"set ranks_per_site=1 or use a TorchTask-based task")


def apply_method(cfg: Config, task_cls: type[Task]) -> None:
    """Apply the task's preset for ``cfg.method`` (`Task.METHODS`) to `cfg`: the one place where a
    method edits the run config, before anything is validated."""
    if not cfg.method:
        return
    where = f"{locate(cfg.source, 'method')} = {cfg.method!r}"
    if not task_cls.METHODS:
        raise ConfigError(f"{where}: task {cfg.task.name!r} defines no methods; remove method={cfg.method}")
    preset = task_cls.METHODS.get(cfg.method)
    if preset is None:
        raise ConfigError(f"{where}: unknown method for task {cfg.task.name!r}; "
                          f"choose one of: {', '.join(task_cls.METHODS)}")
    if cfg.strategy.name != preset.strategy:  # the configured options belong to the other strategy
        cfg.strategy = ComponentConfig(name=preset.strategy, options={})
    # copies: a run's config never shares a value with the table
    for key, value in preset.strategy_defaults.items():
        cfg.strategy.options.setdefault(key, copy.deepcopy(value))
    cfg.task.options.update(copy.deepcopy(dict(preset.task_options)))
    for key, value in preset.task_defaults.items():
        cfg.task.options.setdefault(key, copy.deepcopy(value))
    if preset.num_clients is not None:
        cfg.federation.num_clients = preset.num_clients


def derive_mode(cfg: Config, strategy_cls: type[Strategy]) -> None:
    """Set ``federation.mode`` from the strategy's base; a config that gives another one is refused."""
    mode: Literal["sync", "async"] = "sync" if strategy_cls.synchronous else "async"
    given = cfg.federation.mode
    if given is not None and given != mode:
        kind, other = ("synchronous", "an asynchronous one (fedasync, fedbuff, feddwa)") if mode == "sync" else \
            ("asynchronous", "a synchronous one (fedavg, local, ...)")
        raise ConfigError(f"{locate(cfg.source, 'federation.mode')} = {given!r} disagrees with strategy "
                          f"{cfg.strategy.name!r}, which is {kind}: the mode follows from the strategy; remove "
                          f"federation.mode, or choose {other}")
    cfg.federation.mode = mode


def _component(resolve_name: Any, name: str, key: str, source: str) -> Any:
    try:
        return resolve_name(name, source)
    except ValueError as exc:
        raise ConfigError(f"{locate(source, key)}: {exc}") from None
