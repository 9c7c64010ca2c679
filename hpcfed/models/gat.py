"""DAMe's backbone (spec 1.2–1.3): a two-layer GAT over sampled message neighbourhoods, and its losses.

Model (PyG `GATConv`, LeakyReLU slope 0.01 as the reference's ``nn.LeakyReLU()``)::

    h1 = ELU( ‖_{k=1..4} GAT_k(x) )          x: (n, in=386) -> (n, 4·48 = 192), residual
    h  = GAT(h1)                              (n, 192) -> (n, 32), one head, residual, no activation

    GAT: e_uv = LeakyReLU(aᵀ[W h_u ‖ W h_v]),  α = softmax over sampled in-neighbours of v,
         h_v' = Σ_u α_uv W h_u  (+ residual)

Neighbour sampling: `sample_subgraph` draws, uniformly without replacement, at most ``fanouts[-1]``
in-neighbours of each seed (for the output layer) and ``fanouts[-2]`` of each of those (first layer),
i.e. the reference ``NeighborSampler([100, 800])``. PyG's `NeighborLoader` would do this, but it needs
pyg-lib or torch-sparse, which have no wheels for the torch this project pins; this vectorised numpy
sampler does the same uniform sampling and runs on a plain ``pip install torch_geometric``.

Losses (paper eq. 14–18, spec 1.3): `triplet_loss` (squared distances, online random-negative mining,
mean over triplets) and `glecc_loss` (mean distance between per-event centroids of the local and the
global model) with its weight ``α = min(exp(L_t^l − L_t^g), 1)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import numpy as np
import torch
from torch import nn


class GAT(nn.Module):
    """Two GATConv layers; input (n, in_dim) + edge_index (2, E) -> (n, out_dim)."""

    def __init__(self, in_dim: int = 386, hidden: int = 48, out_dim: int = 32, heads: int = 4,
                 residual: bool = True) -> None:
        super().__init__()
        from torch_geometric.nn import GATConv

        # add_self_loops=False: the message graph already holds A's self-loops (spec 1.1)
        self.conv1 = GATConv(in_dim, hidden, heads=heads, concat=True, negative_slope=0.01,
                             add_self_loops=False, residual=residual)
        self.conv2 = GATConv(hidden * heads, out_dim, heads=1, concat=False, negative_slope=0.01,
                             add_self_loops=False, residual=residual)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.conv1.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.elu(self.conv1(x, edge_index))
        return self.conv2(h, edge_index)


# ----------------------------------------------------------------------------------------------
# neighbour sampling


def to_csr(edge_index: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(rowptr, col): for target v, its in-neighbours (sources) are ``col[rowptr[v]:rowptr[v+1]]``."""
    src, dst = np.asarray(edge_index[0]), np.asarray(edge_index[1])
    order = np.argsort(dst, kind="stable")
    rowptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_nodes), out=rowptr[1:])
    return rowptr, src[order].astype(np.int64)


def _sample_in_neighbours(rowptr: np.ndarray, col: np.ndarray, targets: np.ndarray, fanout: int,
                          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    start, stop = rowptr[targets], rowptr[targets + 1]
    deg = stop - start
    total = int(deg.sum())
    if total == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    seg = np.repeat(np.arange(len(targets)), deg)
    pos = np.arange(total) - np.repeat(np.cumsum(deg) - deg, deg) + np.repeat(start, deg)
    if fanout >= 0:
        keys = rng.random(total)
        order = np.lexsort((keys, seg))  # random order inside each target's segment
        rank = np.empty(total, np.int64)
        rank[order] = np.arange(total) - np.repeat(np.cumsum(deg) - deg, deg)
        keep = rank < fanout
        seg, pos = seg[keep], pos[keep]
    return col[pos], targets[seg]


def sample_subgraph(rowptr: np.ndarray, col: np.ndarray, seeds: np.ndarray, fanouts: Sequence[int],
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sampled computation graph of `seeds` for a len(fanouts)-layer GNN (fanouts in layer order).

    Returns ``(n_id, edge_index)``: the global ids of the nodes involved, the seeds first in their
    given order, and the sampled edges (2, E) in local ids. A fan-out of -1 takes all neighbours.
    """
    seeds = np.asarray(seeds, dtype=np.int64)
    num_nodes = len(rowptr) - 1
    local = np.full(num_nodes, -1, dtype=np.int64)
    local[seeds] = np.arange(len(seeds))
    n_id = [seeds]
    count = len(seeds)
    frontier = seeds
    edges_src, edges_dst = [], []
    for fanout in reversed(list(fanouts)):  # hop 1 serves the output layer
        src, dst = _sample_in_neighbours(rowptr, col, frontier, int(fanout), rng)
        edges_src.append(src)
        edges_dst.append(dst)
        new = np.unique(src[local[src] < 0])
        local[new] = np.arange(count, count + len(new))
        count += len(new)
        n_id.append(new)
        frontier = new
    src, dst = np.concatenate(edges_src), np.concatenate(edges_dst)
    pairs = np.unique(np.stack([local[src], local[dst]]), axis=1) if len(src) else np.empty((2, 0), np.int64)
    return np.concatenate(n_id), pairs


def embed(model: nn.Module, x: torch.Tensor, rowptr: np.ndarray, col: np.ndarray, nodes: np.ndarray,
          fanouts: Sequence[int], batch_size: int, rng: np.random.Generator) -> torch.Tensor:
    """Embeddings of `nodes` (in their order), computed in mini-batches of sampled subgraphs."""
    outs = []
    for start in range(0, len(nodes), batch_size):
        seeds = nodes[start:start + batch_size]
        n_id, ei = sample_subgraph(rowptr, col, seeds, fanouts, rng)
        h = model(x[torch.from_numpy(n_id)], torch.from_numpy(ei))
        outs.append(h[: len(seeds)])
    return torch.cat(outs) if outs else torch.empty(0, 0)


# ----------------------------------------------------------------------------------------------
# losses


def select_triplets(h: torch.Tensor, labels: torch.Tensor, margin: float, generator: torch.Generator,
                    max_pairs_per_class: int | None = None) -> torch.Tensor:
    """Online random-negative triplet mining (reference `RandomNegativeTripletSelector`), no gradient.

    For every class with ≥ 2 members and every pair (a, p), a < p, pick uniformly at random one
    negative n with ``D2(a,p) − D2(a,n) + margin > 0``; skip the pair when there is none.
    ``max_pairs_per_class`` caps the pairs drawn per class (a CPU budget knob; None = all pairs).
    Returns (T, 3) int64 indices (anchor, positive, negative); T = 0 when nothing qualifies.
    """
    with torch.no_grad():
        d2 = torch.cdist(h.detach().double(), h.detach().double()).pow(2)
        out = []
        labels_np = labels.cpu().numpy()
        for c in np.unique(labels_np):
            members = np.flatnonzero(labels_np == c)
            negatives = np.flatnonzero(labels_np != c)
            if len(members) < 2 or len(negatives) == 0:
                continue
            pairs = np.array(list(combinations(members.tolist(), 2)), dtype=np.int64)
            if max_pairs_per_class is not None and len(pairs) > max_pairs_per_class:
                pick = torch.randperm(len(pairs), generator=generator)[:max_pairs_per_class].numpy()
                pairs = pairs[np.sort(pick)]
            a, p = torch.from_numpy(pairs[:, 0]), torch.from_numpy(pairs[:, 1])
            neg = torch.from_numpy(negatives)
            vals = d2[a, p].unsqueeze(1) - d2[a.unsqueeze(1), neg.unsqueeze(0)] + margin  # (pairs, negatives)
            ok = vals > 0
            keys = torch.rand(vals.shape, generator=generator, dtype=torch.float64)
            keys = torch.where(ok, keys, torch.full_like(keys, -1.0))
            choice = keys.argmax(dim=1)
            has = ok.any(dim=1)
            if has.any():
                out.append(torch.stack([a[has], p[has], neg[choice[has]]], dim=1))
        if not out:
            return torch.empty((0, 3), dtype=torch.int64)
        return torch.cat(out)


def triplet_loss(h: torch.Tensor, triplets: torch.Tensor, margin: float) -> torch.Tensor:
    """``L_t = mean_T relu(D2(a,p) − D2(a,n) + margin)`` with squared Euclidean D2 (eq. 14, spec 1.3).

    No triplet (no class with two members, or a single class) gives 0, still attached to `h`.
    """
    if triplets.numel() == 0:
        return h.sum() * 0.0
    a, p, n = triplets[:, 0], triplets[:, 1], triplets[:, 2]
    ap = (h[a] - h[p]).pow(2).sum(dim=1)
    an = (h[a] - h[n]).pow(2).sum(dim=1)
    return torch.relu(ap - an + margin).mean()


def glecc_loss(h_local: torch.Tensor, h_global: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``L_GLECC = mean_c ||mean(h_l[y=c]) − mean(h_g[y=c])||_2`` over events c in the batch (eq. 15–16)."""
    classes = torch.unique(labels)
    dists = []
    for c in classes:
        mask = labels == c
        dists.append(torch.linalg.vector_norm(h_local[mask].mean(0) - h_global[mask].mean(0)))
    return torch.stack(dists).mean()


def glecc_weight(loss_local: torch.Tensor, loss_global: torch.Tensor, detach: bool = False) -> torch.Tensor:
    """``α = min(exp(L_t^l − L_t^g), 1)`` (eq. 18). The reference does not detach α; `detach` does."""
    gap = loss_local - loss_global
    if detach:
        gap = gap.detach()
    return torch.exp(torch.clamp(gap, max=0.0))
