"""``method=`` presets (`Task.METHODS`, applied by `hpcfed.registry.resolve`) give every run config
exactly what the tasks' old ``apply_method`` code gave it.

method_presets_before.json was written by the old code (each task's ``apply_method`` before the
presets replaced it, at commit 96eac9d): for every task and each of its methods, applied to a bare
config, a config with its own strategy and task options, a SEGA config, a FedDWA config and the
shipped configs/*.yaml of the task, the resulting strategy, strategy and task options, number of
clients and federation mode (the one the old server accepted; the mode now follows from the strategy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpcfed.config import ConfigError, from_mapping, load
from hpcfed.registry import resolve
from hpcfed.tasks.base import MethodPreset

REPO = Path(__file__).resolve().parents[2]
BEFORE = json.loads((Path(__file__).with_name("method_presets_before.json")).read_text())
TASK_METHODS = {
    "hin": ["feddwa", "afed", "fedavg", "local", "centralized"],
    "doc2vec": ["joint", "centralized", "mapping", "nomapping"],
    "node2vec": ["joint", "centralized"],
    "events": ["dame", "local", "fedavg", "fedprox", "ditto", "dame-no-bola", "dame-no-sega", "dame-no-glecc"],
}


# Added since the record: issue 26 made ``method=dame`` the safe DAMe (task.safe) and kept the paper's
# method as ``dame-paper``.
ADDED = {("events", "dame"): {"safe": True, "cluster_track": True}}
NEW_METHODS = {"events": ["dame-paper"]}


def _resolved(row: dict[str, Any]) -> dict[str, Any]:
    source = row["input"]
    if "config" in source:
        cfg = load(REPO / source["config"], [f"method={row['method']}"])
    else:
        cfg = from_mapping({**source["mapping"], "method": row["method"]})
    resolve(cfg)
    return {"strategy": cfg.strategy.name, "strategy_options": cfg.strategy.options,
            "task_options": cfg.task.options, "num_clients": cfg.federation.num_clients, "mode": cfg.mode}


def test_the_record_covers_every_task_and_method():
    seen = {(row["task"], row["method"]) for row in BEFORE}
    assert seen == {(task, method) for task, methods in TASK_METHODS.items() for method in methods}
    assert len(BEFORE) == 104


@pytest.mark.parametrize("row", BEFORE, ids=lambda r: f"{r['task']}-{r['method']}-{json.dumps(r['input'])[:40]}")
def test_preset_gives_what_apply_method_gave(row):
    expected = json.loads(json.dumps(row["expected"]))
    expected["task_options"].update(ADDED.get((row["task"], row["method"]), {}))
    assert _resolved(row) == expected


def test_the_tasks_methods_are_their_tables():
    from hpcfed.registry import task_class

    for task, methods in TASK_METHODS.items():
        table = task_class(task).METHODS
        assert list(table) == methods + NEW_METHODS.get(task, []) and all(
            isinstance(p, MethodPreset) for p in table.values())
    row: Any = task_class("doc2vec").METHODS["joint"].task_options
    with pytest.raises(TypeError):  # a row is read-only: no run can change another's preset
        row["mode"] = "x"


def test_resolve_twice_changes_nothing():
    cfg = load(REPO / "configs" / "fedahe_synthetic.yaml", ["method=afed"])
    resolve(cfg)
    once = cfg.to_dict()
    resolve(cfg)
    assert cfg.to_dict() == once and cfg.mode == "async" and cfg.strategy.name == "fedasync"


@pytest.mark.parametrize("task, method, message", [
    ("hin", "fedprox", "command line (method=fedprox): method = 'fedprox': unknown method for task 'hin'; "
                       "choose one of: feddwa, afed, fedavg, local, centralized"),
    ("node2vec", "mapping", "unknown method for task 'node2vec'; choose one of: joint, centralized"),
    ("synthetic", "fedavg", "method = 'fedavg': task 'synthetic' defines no methods; remove method=fedavg"),
])
def test_unknown_methods_are_one_line_errors(task, method, message):
    cfg = from_mapping({"task": {"name": task}}, [f"method={method}"])
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
