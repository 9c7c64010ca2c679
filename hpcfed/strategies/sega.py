"""SEGA: personalised global aggregation by 2D structural entropy (DAMe paper §4.3, eq. 9–13; spec 1.4).

Each round the server

1. runs every uploaded client model on one shared random probe graph (the same sampled nodes and
   neighbourhoods for all clients) and gets outputs ``H_k`` of shape (N, d);
2. builds the client graph with edge weights = similarity (eq. 9) and keeps an edge only if
   ``sim > 0`` (NaN never makes an edge)::

       sim_mode="node_mean" (reference code, default): sim(u,v) = (1/N) Σ_n cos(H_u[n], H_v[n])
       sim_mode="pooled"    (paper eq. 9):            sim(u,v) = cos(mean_n H_u[n], mean_n H_v[n])

3. partitions it by greedy 2DSE minimisation (`hpcfed.strategies.entropy`, eq. 10–11);
4. gives each client u in cluster C the softmax-weighted model (eq. 12–13)::

       s_uv = 1 if v == u else max(sim(u,v), 0),   α_uv = exp(s_uv) / Σ_{v'∈C} exp(s_uv'),
       θ_u^g = Σ_{v∈C} α_uv θ_v^l

Everything is indexed by client id (the reference mixes list positions and client ids, spec 1.4
[QUIRK]). A client whose upload is not finite is left out of every cluster and gets its own model.
With K = 2 the greedy rule never merges (ΔSE = 0, spec 1.9), so DAMe with two clients is local
training plus BOLA/GLECC; a warning says so.

The probe graph is Erdős–Rényi G(n, p) with N(0, 1) node features, as the reference code (the paper
says SBM + SAGPool, which the code does not have); ``probe_nodes`` and ``probe_edge_prob`` default to
a small graph for CPU runs (the reference uses 5000 nodes, p = 0.6). The task class supplies the model
code through two classmethods: ``input_dim(task_config)`` and
``probe_outputs(task_config, params_list, x, edge_index, seeds, sample_seed) -> list of (N, d)``.

Memory on rank 0: SEGA's similarity needs every upload of the round at once (no streaming), and it
keeps one personalised model per client: about (2K + 1) x the model's float32 bytes, plus the
probe outputs (K x N x d floats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcfed.params import Params
from hpcfed.strategies.base import SyncStrategy, Update
from hpcfed.strategies.entropy import minimize_2dse


def client_similarity(outputs: Sequence[np.ndarray], mode: str = "node_mean") -> np.ndarray:
    """(K, K) similarity of client outputs (eq. 9); the diagonal is 1, NaN where a cosine is undefined."""
    k = len(outputs)
    sim = np.full((k, k), np.nan)
    if mode == "node_mean":
        unit = []
        for h in outputs:
            h = np.asarray(h, dtype=np.float64)
            with np.errstate(invalid="ignore", divide="ignore"):
                unit.append(h / np.linalg.norm(h, axis=1, keepdims=True))
        for u in range(k):
            for v in range(u + 1, k):
                with np.errstate(invalid="ignore"):
                    sim[u, v] = sim[v, u] = float(np.mean(np.sum(unit[u] * unit[v], axis=1)))
    elif mode == "pooled":
        pooled = [np.asarray(h, dtype=np.float64).mean(axis=0) for h in outputs]
        for u in range(k):
            for v in range(u + 1, k):
                with np.errstate(invalid="ignore", divide="ignore"):
                    norms = np.linalg.norm(pooled[u]) * np.linalg.norm(pooled[v])
                    sim[u, v] = sim[v, u] = float(pooled[u] @ pooled[v] / norms)
    else:
        raise ValueError(f"sim_mode={mode!r}; choose node_mean or pooled")
    np.fill_diagonal(sim, 1.0)
    return sim


def similarity_graph(sim: np.ndarray) -> np.ndarray:
    """Edge weights of the client graph: sim where sim > 0 (NaN compares false), zero diagonal."""
    w = np.where(np.isfinite(sim) & (sim > 0), sim, 0.0)
    np.fill_diagonal(w, 0.0)
    return w


def dispatch_weights(sim: np.ndarray, cluster: Sequence[int], client: int) -> dict[int, float]:
    """Softmax weights α_uv (eq. 12–13) of `client` over the members of its `cluster`."""
    def score(v: int) -> float:
        if v == client:
            return 1.0
        return float(sim[client, v]) if np.isfinite(sim[client, v]) and sim[client, v] > 0 else 0.0

    s = np.array([score(v) for v in cluster])
    e = np.exp(s - s.max())
    return {int(v): float(a) for v, a in zip(cluster, e / e.sum())}


def erdos_renyi(num_nodes: int, edge_prob: float, seed: int) -> np.ndarray:
    """Undirected G(n, p) as a (2, E) edge index with both directions, no self-loops."""
    rng = np.random.default_rng(seed)
    iu, ju = np.triu_indices(num_nodes, k=1)
    keep = rng.random(iu.size) < edge_prob
    src, dst = iu[keep], ju[keep]
    return np.stack([np.concatenate([src, dst]), np.concatenate([dst, src])]).astype(np.int64)


class Sega(SyncStrategy):
    """SEGA (DAMe §4.3): each site gets back a softmax-weighted mix of the uploads in its
    structural-entropy cluster, weighted by how alike the models answer on a shared probe graph."""

    name = "sega"

    @dataclass(kw_only=True)
    class Config:
        probe_nodes: int = 300  # reference: 5000
        probe_edge_prob: float = 0.05  # reference: 0.6
        probe_sample: float = 0.5  # fraction of probe nodes embedded each round (reference 0.5)
        probe_seed: int = 0
        sim_mode: str = "node_mean"  # node_mean (reference code) | pooled (paper eq. 9)

        def validate(self) -> None:
            if self.probe_nodes < 2:
                raise ValueError(f"probe_nodes must be >= 2, got {self.probe_nodes}")
            if not 0.0 < self.probe_edge_prob <= 1.0:
                raise ValueError(f"probe_edge_prob must be in (0, 1], got {self.probe_edge_prob}")
            if not 0.0 < self.probe_sample <= 1.0:
                raise ValueError(f"probe_sample must be in (0, 1], got {self.probe_sample}")
            if self.sim_mode not in ("node_mean", "pooled"):
                raise ValueError(f"sim_mode={self.sim_mode!r}; choose node_mean or pooled")

    def __init__(self, config: Config, context: Any) -> None:
        super().__init__(config, context)
        task_cls = context.task_cls
        if task_cls is None or not hasattr(task_cls, "probe_outputs") or not hasattr(task_cls, "input_dim"):
            raise ValueError("strategy sega needs a task that can run its model on a probe graph "
                             "(classmethods input_dim and probe_outputs, e.g. task: events)")
        if context.num_clients == 2:
            context.log("sega: with 2 clients 2DSE never merges (ΔSE = 0, spec 1.9): every client gets its own "
                        "model back, so DAMe reduces to local training + BOLA/GLECC")
        self.service: np.ndarray  # (K, P) personalised models, by client id; set by `initialize`
        self.partition: list[list[int]] = [[k] for k in range(context.num_clients)]
        self._probe: tuple[np.ndarray, np.ndarray] | None = None

    def initialize(self, initial: Params) -> None:
        super().initialize(initial)
        self.service = np.tile(self.global_flat, (self.context.num_clients, 1))

    def _probe_graph(self) -> tuple[np.ndarray, np.ndarray]:
        if self._probe is None:  # built once per server, as the reference
            c = self.config
            rng = np.random.default_rng(c.probe_seed)
            dim = int(self.context.task_cls.input_dim(self.context.task_config))
            x = rng.standard_normal((c.probe_nodes, dim)).astype(np.float32)
            self._probe = (x, erdos_renyi(c.probe_nodes, c.probe_edge_prob, c.probe_seed))
        return self._probe

    def probe_outputs(self, round: int, flats: Sequence[np.ndarray]) -> list[np.ndarray]:
        x, edge_index = self._probe_graph()
        rng = np.random.default_rng([self.context.seed, 7477, round])
        n = x.shape[0]
        seeds = np.sort(rng.choice(n, size=max(1, int(self.config.probe_sample * n)), replace=False))
        params = [self.layout.unflatten(np.asarray(f, dtype=np.float32)) for f in flats]
        outputs: list[np.ndarray] = self.context.task_cls.probe_outputs(
            self.context.task_config, params, x, edge_index, seeds, int(rng.integers(2**31)))
        return outputs

    def aggregate(self, round: int, updates: list[Update]) -> None:
        if not updates:
            return
        good = [u for u in updates if np.isfinite(u.vector).all()]
        good_ids = {u.client_id for u in good}
        for u in updates:
            if u.client_id not in good_ids:
                self.context.log(f"sega: client {u.client_id} uploaded non-finite parameters; it keeps its own model")
                self.service[u.client_id] = u.vector
        if not good:
            return
        outputs = self.probe_outputs(round, [u.vector for u in good])
        sim = client_similarity(outputs, self.config.sim_mode)
        parts = minimize_2dse(similarity_graph(sim))
        ids = [u.client_id for u in good]
        stacked = np.stack([u.vector for u in good])
        for part in parts:
            for pos in part:
                alpha = dispatch_weights(sim, part, pos)
                w = np.array([alpha[v] for v in part], dtype=np.float32)
                self.service[ids[pos]] = w @ stacked[part]
        alone = [[u.client_id] for u in updates if u.client_id not in good_ids]
        self.partition = [[ids[p] for p in part] for part in parts] + alone
        self.similarity = {f"{ids[a]}-{ids[b]}": float(sim[a, b])
                           for a in range(len(ids)) for b in range(a + 1, len(ids))}
        self.global_flat[:] = stacked.mean(axis=0)  # informational only; clients get `service`
        self.version += 1

    def model_for(self, client_id: int) -> np.ndarray:
        personal: np.ndarray = self.service[client_id]
        return personal

    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        header, arrays = super().state_dict()
        header["partition"] = self.partition
        return header, {**arrays, "service": self.service}

    def load_state_dict(self, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        super().load_state_dict(state)
        header, arrays = state
        self.service = np.array(arrays["service"], dtype=np.float32)
        self.partition = [list(map(int, p)) for p in header.get("partition", self.partition)]

    def metrics(self) -> dict[str, float]:
        out = {"sega_clusters": float(len(self.partition))}
        for index, part in enumerate(sorted(self.partition)):  # who shares a cluster with whom
            for cid in part:
                out[f"sega_cluster_{cid}"] = float(index)
        for key, value in getattr(self, "similarity", {}).items():
            out[f"sega_sim_{key}"] = value
        return out
