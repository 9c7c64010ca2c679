"""Plugin tasks and strategies: import paths, entry points, and their option validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcfed.config import ConfigError
from hpcfed.launch.parent import prepare_config
from hpcfed.registry import plugin_names, strategy_class, task_class
from hpcfed.strategies.base import Strategy
from hpcfed.tasks.base import Task

# The `plugin_root` / `plugin_path` fixtures: pytest loads them from the helper module by name (a
# conftest.py here would displace tests/conftest.py, which test modules import as `conftest`).
pytest_plugins = ["plugin_source"]


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_import_path_resolves_task_and_strategy(plugin_path):
    task = task_class("myplug.task:BlobTask")
    strategy = strategy_class("myplug.strategy:FedAvgM")
    assert issubclass(task, Task) and task.__name__ == "BlobTask"
    assert issubclass(strategy, Strategy) and strategy.__name__ == "FedAvgM"


def test_entry_points_from_an_installed_package(plugin_path):
    assert plugin_names("hpcfed.tasks")["blobs"] == "myplug.task:BlobTask"
    assert task_class("blobs").__name__ == "BlobTask"
    plugin = strategy_class("myfedavgm")
    assert plugin.__name__ == "FedAvgM" and plugin.__module__ == "myplug.strategy"
    with pytest.raises(ValueError, match=r"entry point 'broken'.*cannot import module 'myplug\.nowhere'"):
        task_class("broken")


def test_unknown_name_lists_builtins_and_plugins(plugin_path):
    with pytest.raises(ValueError) as err:
        task_class("nope")
    assert "blobs" in str(err.value) and "synthetic" in str(err.value) and "package.module:Class" in str(err.value)


@pytest.mark.parametrize("name, message", [
    ("myplug.task", "unknown task"),
    ("myplug.task:", "malformed"),
    ("my plug.task:X", "malformed"),
    ("myplug.missing:BlobTask", "cannot import module 'myplug.missing'"),
    ("myplug.task:Missing", "has no attribute 'Missing'"),
    ("myplug.plain:Plain", "not a subclass of hpcfed.tasks.base.Task"),
    ("myplug.strategy:FedAvgM", "not a subclass of hpcfed.tasks.base.Task"),
    ("os:path", "not a subclass"),
])
def test_bad_task_paths_are_one_line_errors(plugin_path, name, message):
    with pytest.raises(ValueError, match=message) as err:
        task_class(name)
    assert "\n" not in str(err.value)


def test_task_as_strategy_is_refused(plugin_path):
    with pytest.raises(ValueError, match=r"not a subclass of hpcfed\.strategies\.base\.Strategy"):
        strategy_class("myplug.task:BlobTask")


def test_plugin_options_validated_like_builtins(plugin_path, tmp_path):
    good = _config(tmp_path, "task: {name: 'myplug.task:BlobTask', classes: 3}\n"
                             "strategy: {name: myfedavgm, momentum: 0.5}\n")
    cfg = prepare_config(good, [])
    assert cfg.task.options == {"classes": 3}
    cases = [
        (["task.colour=3"], "task.colour: unknown key; allowed keys here: batch_size, classes"),
        (["task.classes=many"], "task.classes must be an integer, got 'many'"),
        (["task.classes=1"], "classes must be >= 2"),
        (["task.optimizer=lbfgs"], "task.optimizer = 'lbfgs' is not allowed; choose one of: adam, adamw, sgd"),
        (["strategy.momentum=1.5"], "momentum must be in [0, 1)"),
        (["strategy.nesterov=true"], "strategy.nesterov: unknown key"),
        (["task.name=myplug.plain:Plain"], "task.name: import path 'myplug.plain:Plain' is"),
        (["strategy.name=nowhere.mod:X"], "strategy.name: import path 'nowhere.mod:X': cannot import module"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as err:
            prepare_config(good, overrides)
        assert message in str(err.value), (overrides, str(err.value))
        # every bad value here came from the command line, and the error says so
        assert str(err.value).startswith(f"command line ({overrides[0]}): ") and "\n" not in str(err.value)


def test_module_next_to_the_config_is_found(tmp_path):
    (tmp_path / "sidetask.py").write_text("from hpcfed.tasks.synthetic import SyntheticTask as Side\n")
    path = _config(tmp_path, "task: {name: 'sidetask:Side', num_classes: 3}\n")
    try:
        cfg = prepare_config(path, [])
        assert task_class(cfg.task.name, cfg.source).__name__ == "SyntheticTask"
        with pytest.raises(ConfigError, match=r"task\.nonsense: unknown key"):
            prepare_config(path, ["task.nonsense=1"])
    finally:
        import sys

        sys.modules.pop("sidetask", None)
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))
