"""Source of the temporary plugin package the plugin tests write to disk (`myplug`), and helpers
to write it and a dist-info that registers entry points for it (an "installed" package, no pip)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

TASK_SOURCE = textwrap.dedent('''
    """A user's torch task: an MLP on label-skewed Gaussian blobs; the first layer is frozen."""
    from dataclasses import dataclass

    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from hpcfed.tasks.torch_adapter import TorchTask


    class BlobTask(TorchTask):
        @dataclass(kw_only=True)
        class Config(TorchTask.Config):
            classes: int = 4
            dim: int = 8
            samples: int = 120
            hidden: int = 16
            batch_size: int = 16
            dropout: float = 0.1

            def validate(self):
                super().validate()
                if self.classes < 2:
                    raise ValueError(f"classes must be >= 2, got {self.classes}")

        def _data(self, split):
            c = self.config
            world = np.random.default_rng(self.site.seed)
            centres = world.normal(0, 2.0, size=(c.classes, c.dim))
            skew = np.random.default_rng([self.site.seed, self.site.client_id]).dirichlet(np.full(c.classes, 0.5))
            rng = np.random.default_rng([self.site.seed, self.site.client_id, {"train": 0, "val": 1, "test": 2}[split]])
            probs = skew if split != "test" else np.full(c.classes, 1 / c.classes)
            y = rng.choice(c.classes, size=c.samples, p=probs)
            x = centres[y] + rng.normal(0, 1.0, size=(c.samples, c.dim))
            return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))

        def build_model(self):
            c = self.config
            model = nn.Sequential(nn.Linear(c.dim, c.hidden), nn.ReLU(), nn.Dropout(c.dropout),
                                  nn.Linear(c.hidden, c.hidden), nn.BatchNorm1d(c.hidden), nn.ReLU(),
                                  nn.Linear(c.hidden, c.classes))
            model[0].weight.requires_grad_(False)  # a frozen "backbone" tensor: never travels
            return model

        def train_data(self):
            return DataLoader(self._data("train"), batch_size=self.config.batch_size, shuffle=True)

        def eval_data(self, split):
            return DataLoader(self._data(split), batch_size=64)

        def embed(self, inputs):
            return self.model[:3](inputs)
''')

# The plugin strategy is the one `hpcfed new` writes (FedAvgM), so the template is tested too.
STRATEGY_SOURCE = (Path(__file__).resolve().parents[2] / "hpcfed" / "templates" / "torch" / "strategy.py").read_text()

NOT_A_TASK_SOURCE = "class Plain:\n    pass\n"


def write_package(root: Path, name: str = "myplug") -> Path:
    """`root/name/{__init__,task,strategy,plain}.py`; returns `root`."""
    pkg = root / name
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "task.py").write_text(TASK_SOURCE)
    (pkg / "strategy.py").write_text(STRATEGY_SOURCE)
    (pkg / "plain.py").write_text(NOT_A_TASK_SOURCE)
    return root


def write_dist_info(root: Path, dist: str, tasks: dict[str, str], strategies: dict[str, str]) -> Path:
    """An installed-package record (`dist-info` with entry_points.txt) under `root`, as pip would write it."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = ["[hpcfed.tasks]", *(f"{k} = {v}" for k, v in tasks.items()), "",
             "[hpcfed.strategies]", *(f"{k} = {v}" for k, v in strategies.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    return info


ENTRY_TASKS = {"blobs": "myplug.task:BlobTask", "broken": "myplug.nowhere:Nothing"}
ENTRY_STRATEGIES = {"myfedavgm": "myplug.strategy:FedAvgM"}  # not "fedavgm": a built-in name wins


@pytest.fixture(scope="session")
def plugin_root(tmp_path_factory) -> Path:
    """A folder holding the `myplug` package and a dist-info registering its entry points."""
    root = write_package(tmp_path_factory.mktemp("plugins"))
    write_dist_info(root, "myplug_dist", ENTRY_TASKS, ENTRY_STRATEGIES)
    return root


@pytest.fixture()
def plugin_path(plugin_root, monkeypatch) -> Path:
    """`plugin_root` on sys.path for one test; the modules it imported are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(plugin_root))
    yield plugin_root
    for name in [m for m in sys.modules if m == "myplug" or m.startswith("myplug.")]:
        del sys.modules[name]
