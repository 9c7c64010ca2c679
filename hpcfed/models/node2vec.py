"""node2vec biased random walks (Grover & Leskovec 2016), the corpus of SEEC's graph variant.

A walk at node v, having come from t, moves to a neighbour x of v with unnormalised probability

    α_pq(t, x) = 1/p  if x = t          (return)
                 1    if d(t, x) = 1    (stay near t)
                 1/q  if d(t, x) = 2    (move outward)

SEEC uses p = 0.6, q = 0.1, walk length 20, 20 walks per node (paper §V.A.2). The walks become
sentences of node-id tokens for a skip-gram Word2Vec (124 dims), federated like doc2vec
(`hpcfed.models.doc2vec`). Sampling is vectorised over all walks with rejection sampling
(accept x with probability α/max α, as in torch_cluster), so no per-node transition tables.
"""

from __future__ import annotations

import numpy as np


def csr(num_nodes: int, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Undirected edge list -> (indptr, indices) with sorted neighbour lists."""
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    src = np.concatenate([edges[:, 0], edges[:, 1]])
    dst = np.concatenate([edges[:, 1], edges[:, 0]])
    order = np.lexsort((dst, src))
    src, dst = src[order], dst[order]
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.add.at(indptr, src + 1, 1)
    return np.cumsum(indptr), dst


def biased_walks(num_nodes: int, edges: np.ndarray, starts: np.ndarray, *, walk_length: int = 20,
                 p: float = 0.6, q: float = 0.1, seed: int = 0) -> np.ndarray:
    """One walk per entry of `starts`: (len(starts), walk_length) node indices, -1 after a dead end."""
    if p <= 0 or q <= 0 or walk_length < 1:
        raise ValueError(f"node2vec needs p > 0, q > 0 and walk_length >= 1 (got p={p}, q={q}, length={walk_length})")
    rng = np.random.default_rng(seed)
    indptr, indices = csr(num_nodes, edges)
    degree = np.diff(indptr)
    keys = np.sort(indices + np.repeat(np.arange(num_nodes), degree) * num_nodes)  # edge (u, v) -> u*N + v
    starts = np.asarray(starts, dtype=np.int64)
    walks = np.full((len(starts), walk_length), -1, dtype=np.int64)
    walks[:, 0] = starts
    if walk_length == 1 or len(starts) == 0:
        return walks
    w_return, w_out, w_max = 1.0 / p, 1.0 / q, max(1.0 / p, 1.0, 1.0 / q)

    def uniform_neighbour(cur: np.ndarray) -> np.ndarray:
        return indices[indptr[cur] + (rng.random(len(cur)) * degree[cur]).astype(np.int64)]

    alive = degree[starts] > 0
    walks[alive, 1] = uniform_neighbour(starts[alive])  # first step: no previous node, uniform
    for step in range(2, walk_length):
        rows = np.flatnonzero(alive)
        pending = rows
        while len(pending):
            cur, prev = walks[pending, step - 1], walks[pending, step - 2]
            x = uniform_neighbour(cur)
            key = prev * num_nodes + x
            pos = np.minimum(np.searchsorted(keys, key), len(keys) - 1)
            weight = np.where(x == prev, w_return, np.where(keys[pos] == key, 1.0, w_out))
            ok = rng.random(len(pending)) * w_max < weight
            walks[pending[ok], step] = x[ok]
            pending = pending[~ok]
    return walks


def walk_corpus(num_nodes: int, edges: np.ndarray, nodes: np.ndarray, *, num_walks: int = 20,
                walk_length: int = 20, p: float = 0.6, q: float = 0.1, seed: int = 0,
                node_id=str) -> list[list[str]]:
    """`num_walks` walks from every node of `nodes`, as sentences of node-id strings."""
    starts = np.tile(np.asarray(nodes, dtype=np.int64), num_walks)
    walks = biased_walks(num_nodes, edges, starts, walk_length=walk_length, p=p, q=q, seed=seed)
    return [[node_id(v) for v in w if v >= 0] for w in walks]
