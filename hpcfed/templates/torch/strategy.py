"""A plugin aggregation rule: FedAvg with server momentum (FedAvgM, Hsu et al. 2019).

A strategy keeps the global model as one flat float32 vector (`self.global_flat`) and folds each
round's client updates into it. Whatever it needs to resume exactly goes into `state_dict`.
"""

from dataclasses import dataclass

import numpy as np

from hpcfed.strategies.aggregate import weighted_mean
from hpcfed.strategies.base import SyncStrategy


class FedAvgM(SyncStrategy):
    @dataclass(kw_only=True)
    class Config:  # set under `strategy:` in config.yaml
        server_lr: float = 1.0
        momentum: float = 0.9

        def validate(self):
            if not 0.0 <= self.momentum < 1.0:
                raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")

    def initialize(self, initial):
        super().initialize(initial)
        self.velocity = np.zeros_like(self.global_flat)

    def aggregate(self, round, updates):
        if not updates:
            return
        mean = weighted_mean([u.flat for u in updates], [u.num_examples for u in updates])
        self.velocity = self.config.momentum * self.velocity + (self.global_flat - mean)
        self.global_flat -= self.config.server_lr * self.velocity

    def state_dict(self):
        header, arrays = super().state_dict()
        return header, {**arrays, "velocity": self.velocity}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.velocity = np.array(state[1]["velocity"], dtype=np.float32)
