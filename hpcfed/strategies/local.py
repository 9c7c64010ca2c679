"""Local-only training: every client keeps its own model; nothing is shared (synchronous).

All clients start from the same initial model; afterwards client k always gets back its own last
upload. It is the lower bound a federation must beat.

Memory on rank 0: one model per client by definition, (K + 1) x the model's float32 bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcfed.params import Params
from hpcfed.strategies.base import SyncStrategy, Update


class Local(SyncStrategy):
    """Every site keeps its own model; the lower bound a federation must beat."""

    name = "local"
    shares_updates = False  # a site's upload is its own next model: nothing to bound

    def initialize(self, initial: Params) -> None:
        super().initialize(initial)
        self.per_client: np.ndarray = np.tile(self.global_flat, (self.context.num_clients, 1))

    def aggregate(self, round: int, updates: list[Update]) -> None:
        for u in updates:
            self.per_client[u.client_id] = u.flat

    def model_for(self, client_id: int) -> np.ndarray:
        mine: np.ndarray = self.per_client[client_id]
        return mine

    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        header, arrays = super().state_dict()
        return header, {**arrays, "per_client": self.per_client}

    def load_state_dict(self, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        super().load_state_dict(state)
        self.per_client = np.array(state[1]["per_client"], dtype=np.float32)
