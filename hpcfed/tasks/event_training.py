"""Training and scoring of the DAMe GAT on one site: a round of local training (triplet loss, GLECC,
proximal terms; spec 1.3, 1.6) and the k-means NMI/AMI/ARI of embeddings (spec 1.7).

Kept apart from `hpcfed.tasks.events` so the task can train more than one model per round on the same
batches (Ditto's personal model) or on its own replay of the batches (the safe DAMe's shadow Local
model, `hpcfed.tasks.dame_safe`), each from generators seeded by (seed, client, round).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class TrainData:
    """What a site trains on: features, CSR graph, training nodes and their (possibly poisoned) labels."""

    x: Any  # torch.Tensor (n, d)
    rowptr: np.ndarray
    col: np.ndarray
    train_idx: np.ndarray
    train_labels: np.ndarray


def train_epochs(models: list[tuple[Any, Any, float]], data: TrainData, config: Any, *, global_model: Any,
                 use_glecc: bool, rng: np.random.Generator, gen: Any) -> dict[str, float]:
    """Train `models` [(module, optimizer, proximal μ)] for ``config.local_epochs`` on the same batches.

    The first model gets GLECC towards `global_model` when `use_glecc`; every model with μ > 0 gets
    ``μ/2·||θ − θ^g||²``. Returns the first model's mean loss, triplet loss, GLECC loss and α per step.
    """
    import torch

    from hpcfed.models.gat import glecc_loss, glecc_weight, sample_subgraph, select_triplets, triplet_loss

    c = config
    global_params = [p.detach().clone() for p in global_model.parameters()]
    labels_all = torch.from_numpy(data.train_labels)
    stats = {"loss": 0.0, "triplet": 0.0, "glecc": 0.0, "alpha": 0.0}
    steps = 0
    for _ in range(c.local_epochs):
        order = rng.permutation(data.train_idx)
        for start_i in range(0, len(order), c.batch_size):
            seeds = order[start_i:start_i + c.batch_size]
            n_id, ei = sample_subgraph(data.rowptr, data.col, seeds, c.fanouts, rng)
            xb, eib = data.x[torch.from_numpy(n_id)], torch.from_numpy(ei)
            yb = labels_all[torch.from_numpy(seeds)]
            for idx, (model, optimizer, mu) in enumerate(models):
                model.train()
                optimizer.zero_grad()
                h = model(xb, eib)[: len(seeds)]
                triplets = select_triplets(h, yb, c.margin, gen, c.max_pairs_per_class)
                loss_t = triplet_loss(h, triplets, c.margin)
                loss = loss_t
                if use_glecc and idx == 0 and triplets.numel():
                    with torch.no_grad():
                        h_g = global_model(xb, eib)[: len(seeds)]
                    loss_tg = triplet_loss(h_g, triplets, c.margin)
                    l_glecc = glecc_loss(h, h_g, yb)
                    alpha = glecc_weight(loss_t, loss_tg, c.detach_alpha)
                    loss = loss_t + alpha * l_glecc  # eq. 17
                    stats["glecc"] += float(l_glecc.detach())
                    stats["alpha"] += float(alpha.detach())
                if mu > 0:  # FedProx / Ditto proximal term μ/2·||θ − θ^g||²
                    prox = sum(((p - g) ** 2).sum() for p, g in zip(model.parameters(), global_params))
                    loss = loss + 0.5 * mu * prox
                loss.backward()
                optimizer.step()
                if idx == 0:
                    stats["loss"] += float(loss.detach())
                    stats["triplet"] += float(loss_t.detach())
            steps += 1
    return {k: v / max(steps, 1) for k, v in stats.items()}


def kmeans_metrics(embeddings: np.ndarray, labels: np.ndarray, seed: int = 0) -> dict[str, float]:
    """k-means (k = distinct labels in `labels`) on `embeddings`; NMI, AMI, ARI (spec 1.7)."""
    from sklearn.metrics import adjusted_mutual_info_score, adjusted_rand_score, normalized_mutual_info_score

    k = len(np.unique(labels))
    if len(labels) < 2 or k < 1:
        return {"nmi": 0.0, "ami": 0.0, "ari": 0.0}
    pred = kmeans_predict(embeddings, k, seed)
    return {"nmi": float(normalized_mutual_info_score(labels, pred)),
            "ami": float(adjusted_mutual_info_score(labels, pred, average_method="arithmetic")),
            "ari": float(adjusted_rand_score(labels, pred))}


def kmeans_predict(embeddings: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    """The cluster of each row of `embeddings` by k-means with `k` clusters (fewer if fewer distinct rows)."""
    from sklearn.cluster import KMeans

    x = np.nan_to_num(np.asarray(embeddings, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    pred: np.ndarray = KMeans(n_clusters=min(k, len(np.unique(x, axis=0))) or 1, random_state=seed,
                              n_init=10).fit_predict(x)
    return pred


def seeded_rng(*keys: int) -> np.random.Generator:
    """A generator seeded by (seed, stream, client, round, ...): every draw of a site is reproducible."""
    return np.random.default_rng(np.random.SeedSequence([abs(int(k)) for k in keys]))


def site_key(name: str, attacker_id: int | None = None) -> int:
    """Seed key of a site's subsample and split: its dataset name, so a site draws the same messages and
    test split in every config and at every client position (an attacker with the same data draws its own)."""
    import zlib

    key = zlib.crc32(name.encode("utf-8"))
    return key if attacker_id is None else key + 1 + attacker_id
