"""{{name}}: the model and each site's data. Replace the data and the model with your own.

`TorchTask` turns these few methods into a federated task: only the tensors with requires_grad
travel, each round is seeded from (seed, site, round), the optimizer state and RNG are checkpointed,
and the model runs on the site's GPU under `device: auto`. Options of the `Config` below are set
in config.yaml under `task:` and validated (an unknown key is an error naming it).
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hpcfed.tasks.torch_adapter import TorchTask


class SiteTask(TorchTask):
    @dataclass(kw_only=True)
    class Config(TorchTask.Config):  # lr, optimizer, local_epochs, share, ... come from TorchTask
        classes: int = 6
        dim: int = 10
        samples: int = 400  # training examples per site
        label_skew: float = 0.5  # Dirichlet concentration; smaller = each site sees fewer classes
        hidden: int = 64
        batch_size: int = 32

        def validate(self):
            super().validate()
            if self.classes < 2 or self.samples < 1 or self.label_skew <= 0:
                raise ValueError("classes >= 2, samples >= 1 and label_skew > 0 are required")

    # -- data: a built-in synthetic set (a mixture of Gaussian blobs per class) ---------------------
    def dataset(self, split):
        c = self.config
        world = np.random.default_rng(self.site.seed)  # the same classes on every site
        centres = world.normal(0.0, 2.0, size=(c.classes, 2, c.dim))
        mix = np.random.default_rng([self.site.seed, self.site.client_id]).dirichlet(np.full(c.classes, c.label_skew))
        probs = mix if split != "test" else np.full(c.classes, 1.0 / c.classes)  # test: every class
        rng = np.random.default_rng([self.site.seed, self.site.client_id, ["train", "val", "test"].index(split)])
        n = c.samples if split == "train" else max(100, c.samples // 4)
        y = rng.choice(c.classes, size=n, p=probs)
        x = centres[y, rng.integers(0, 2, size=n)] + rng.normal(0.0, 1.2, size=(n, c.dim))
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))

    def train_data(self):
        return DataLoader(self.dataset("train"), batch_size=self.config.batch_size, shuffle=True)

    def eval_data(self, split):  # "val" every round, "test" at the end
        return DataLoader(self.dataset(split), batch_size=256)

    # -- model ----------------------------------------------------------------------------------
    def build_model(self):
        c = self.config
        return nn.Sequential(nn.Linear(c.dim, c.hidden), nn.ReLU(), nn.Linear(c.hidden, c.hidden), nn.ReLU(),
                             nn.Linear(c.hidden, c.classes))

    def embed(self, inputs):  # optional: embeddings/site<k>.h5 of the test split
        return self.model[:4](inputs)

    # optional: def loss(self, output, target) / def metrics(self, outputs, targets) -> dict
