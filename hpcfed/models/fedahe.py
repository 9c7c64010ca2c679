"""FedAHE's local model: node-level and meta-path-level attention over meta-path adjacency rows.

Spec section 2 (paper eqs 1-8; **(R)** = reconstructed, with a knob). For a meta-path π, node i's
input is its L2-normalised adjacency row ``A_i^π`` (length N, self-loop included), optionally
concatenated with side blocks ``x_i``, each L2-normalised on its own: its features
(``use_features``) and its own relation rows as the site holds them (``input_relations``: its
authors, its subject or references)::

    (1)  s_ij^π = cos(W_s^π A_i^π, W_s^π A_j^π)                      W_s^π: Linear(N[+F], d)
    (2)  c_ij^π = exp(s_ij^π) / Σ_{k∈N_i^π} exp(s_ik^π)              over ≤ num_sample neighbours + i
    (3)  e_{N(i)}^π = σ(Σ_{j∈N_i^π} c_ij^π W_s^π A_j^π)              σ = sigmoid
    (4)  e_i^π = W_c^π [e_{N(i)}^π ‖ W_s^π A_i^π] (+ b)              eq4_activation ∈ {none, sigmoid}
    (5R) e_i^π' = W_p e_i^π (+ b);  δ'_i^π = cos(p_i, e_i^π')        eq5_activation ∈ {none, tanh}
    (6R) δ_i^π = softmax_π(δ'_i^π)
    (7)  e_i = Σ_π δ_i^π e_i^π
    (8)  L = CE(W_o dropout(e_i) + b_o, y_i)  over labelled nodes  (dropout only while training)

Shapes: every parameter depends only on (N[+F], d, k, M, C) — never on a site's edges — so sites
with different relation instances have identical state dicts (spec test 3).

The adjacency rows are N-dimensional and sparse: ``W_s^π A^π`` is a sparse-dense product, either
over the rows a batch needs or, when those rows hold more non-zeros than the whole matrix (dense
meta-paths like ACM's PSP), over all N rows at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn
from torch.nn import functional as F

EPS = 1e-8  # as torch.nn.CosineSimilarity: a zero projection gives cos = 0


def node_attention(h_self: torch.Tensor, h_nbr: torch.Tensor, seg: torch.Tensor,
                   num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs 1-3. h_self (B, d), h_nbr (E, d) with seg (E,) naming each row's node in 0..B-1.

    Returns the attention c (E,) and the neighbourhood embedding e_N (B, d).
    """
    s = F.cosine_similarity(h_self[seg], h_nbr, dim=-1, eps=EPS)  # eq 1
    c = segment_softmax(s, seg, num_nodes)  # eq 2
    summed = torch.zeros(num_nodes, h_nbr.shape[1], dtype=h_nbr.dtype).index_add_(0, seg, c.unsqueeze(-1) * h_nbr)
    return c, torch.sigmoid(summed)  # eq 3


def segment_softmax(s: torch.Tensor, seg: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Softmax of `s` within each segment (rows with the same `seg`), stabilised by the segment max.

    The same as ``torch_geometric.utils.softmax``, with torch built-ins only (PyG's import costs
    seconds per process, and every site and test process would pay it).
    """
    peak = torch.full((num_segments,), float("-inf"), dtype=s.dtype).scatter_reduce(0, seg, s, reduce="amax")
    z = torch.exp(s - peak.detach()[seg])
    total = torch.zeros(num_segments, dtype=s.dtype).index_add_(0, seg, z)
    return z / total[seg]


def metapath_attention(e_paths: torch.Tensor, p: torch.Tensor, w_p: nn.Module,
                       activation: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs 5-7. e_paths (B, M, d), p (B, k). Returns δ (B, M) and e (B, d)."""
    proj = w_p(e_paths)  # eq 5: (B, M, k)
    if activation == "tanh":
        proj = torch.tanh(proj)
    delta_raw = F.cosine_similarity(p.unsqueeze(1).expand_as(proj), proj, dim=-1, eps=EPS)  # eq 5
    delta = torch.softmax(delta_raw, dim=1)  # eq 6
    return delta, (delta.unsqueeze(-1) * e_paths).sum(dim=1)  # eq 7


class MetapathInput:
    """One meta-path's input matrix (rows ``[A_i^π ‖ x_i]``) and its neighbour lists, on one site."""

    def __init__(self, adjacency: sp.csr_matrix, side: Sequence[sp.spmatrix] = ()) -> None:
        from hpcfed.data.hin import row_normalize

        adjacency = sp.csr_matrix(adjacency, dtype=np.float32)
        self.indptr = adjacency.indptr.astype(np.int64)
        self.indices = adjacency.indices.astype(np.int64)
        rows = sp.csr_matrix(row_normalize(adjacency), dtype=np.float32)
        # Side blocks are kept apart from the adjacency so that identical adjacency rows stay
        # shareable; W_s^π [A_i ‖ x_i] = W_s^π[:, :N] A_i + W_s^π[:, N:] x_i. Each block is
        # normalised on its own so that a long author list does not drown the word features.
        blocks = [sp.csr_matrix(row_normalize(sp.csr_matrix(b, dtype=np.float32)), dtype=np.float32) for b in side]
        self.features = sp.hstack(blocks, format="csr", dtype=np.float32) if blocks else None
        rows.sort_indices()
        # Identical input rows share one projection: in a meta-path built through a low-degree type
        # (ACM's PSP: one subject per paper) whole blocks of rows are equal, so the N x N product
        # shrinks to (distinct rows) x N.
        keys = [rows.indices[a:b].tobytes() + rows.data[a:b].tobytes()
                for a, b in zip(rows.indptr[:-1], rows.indptr[1:])]
        first: dict[bytes, int] = {}
        self.row_group = np.array([first.setdefault(k, len(first)) for k in keys], dtype=np.int64)
        representative = np.zeros(len(first), dtype=np.int64)
        representative[self.row_group[::-1]] = np.arange(len(keys))[::-1]
        self.rows = rows
        self.unique_rows = rows[representative]
        self._full: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.rows.shape[0]

    @property
    def input_dim(self) -> int:
        return self.rows.shape[1] + (0 if self.features is None else self.features.shape[1])

    def sample(self, nodes: np.ndarray, num_sample: int | None,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """≤ num_sample meta-path neighbours of each node (uniform, without replacement), plus the node.

        Returns (neighbour ids (E,), segment (E,) = position of the node in `nodes`).
        """
        nbrs, segs = [], []
        for pos, i in enumerate(nodes):
            row = self.indices[self.indptr[i]:self.indptr[i + 1]]
            row = row[row != i]
            if num_sample is not None and len(row) > num_sample:
                row = rng.choice(row, size=num_sample, replace=False)
            nbrs.append(np.append(row, i))
            segs.append(np.full(len(row) + 1, pos, dtype=np.int64))
        return np.concatenate(nbrs).astype(np.int64), np.concatenate(segs)

    def project(self, linear: nn.Linear, nodes: np.ndarray) -> torch.Tensor:
        """``W_s^π`` applied to the input rows of `nodes` -> (len(nodes), d)."""
        n = self.rows.shape[1]
        w_adj = linear.weight[:, :n].t()
        groups, inverse = np.unique(self.row_group[nodes], return_inverse=True)
        rows = self.unique_rows
        sub_nnz = int((rows.indptr[groups + 1] - rows.indptr[groups]).sum())
        if sub_nnz >= rows.nnz:
            if self._full is None:
                self._full = _to_torch(rows)
            h = torch.sparse.mm(self._full, w_adj)[torch.as_tensor(groups)]
        else:
            h = torch.sparse.mm(_to_torch(rows[groups]), w_adj)
        h = (h + linear.bias)[torch.as_tensor(inverse)]
        if self.features is not None:
            h = h + torch.sparse.mm(_to_torch(self.features[nodes]), linear.weight[:, n:].t())
        return h


def _to_torch(m: sp.csr_matrix) -> torch.Tensor:
    coo = m.tocoo()
    idx = torch.as_tensor(np.vstack([coo.row, coo.col]).astype(np.int64))
    return torch.sparse_coo_tensor(idx, torch.as_tensor(coo.data, dtype=torch.float32), m.shape,
                                   check_invariants=False).coalesce()


class FedAHE(nn.Module):
    """The whole local model (eqs 1-8). Parameters: ws.m, wc.m (per meta-path), wp, p, classifier."""

    def __init__(self, *, num_nodes: int, input_dim: int, num_metapaths: int, num_classes: int, dim: int = 128,
                 pref_dim: int = 32, eq4_activation: str = "none", eq5_activation: str = "none",
                 dropout: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout = dropout
        if eq4_activation not in ("none", "sigmoid") or eq5_activation not in ("none", "tanh"):
            raise ValueError("eq4_activation must be none|sigmoid and eq5_activation none|tanh")
        self.eq4_activation, self.eq5_activation = eq4_activation, eq5_activation
        self.ws = nn.ModuleList(nn.Linear(input_dim, dim) for _ in range(num_metapaths))
        self.wc = nn.ModuleList(nn.Linear(2 * dim, dim) for _ in range(num_metapaths))
        self.wp = nn.Linear(dim, pref_dim)
        self.p = nn.Parameter(torch.empty(num_nodes, pref_dim))
        self.classifier = nn.Linear(dim, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in [*self.ws, *self.wc, self.wp, self.classifier]:
            layer.reset_parameters()
        nn.init.uniform_(self.p, 0.0, 1.0)  # HAHE out_embedding init

    def embed(self, inputs: Sequence[MetapathInput], nodes: np.ndarray, num_sample: int | None,
              rng: np.random.Generator, return_attention: bool = False):
        """e_i (eq 7) for `nodes` (B,) -> (B, d); with `return_attention` also δ (B, M)."""
        per_path = []
        for m, inp in enumerate(inputs):
            nbr, seg = inp.sample(nodes, num_sample, rng)
            needed, inverse = np.unique(np.concatenate([nodes, nbr]), return_inverse=True)
            linear = self.ws[m]
            assert isinstance(linear, nn.Linear)  # ModuleList indexing is typed as Module
            h = inp.project(linear, needed)
            h_self, h_nbr = h[torch.as_tensor(inverse[:len(nodes)])], h[torch.as_tensor(inverse[len(nodes):])]
            _, e_n = node_attention(h_self, h_nbr, torch.as_tensor(seg), len(nodes))
            e = self.wc[m](torch.cat([e_n, h_self], dim=-1))  # eq 4: [neighbour ‖ self]
            per_path.append(torch.sigmoid(e) if self.eq4_activation == "sigmoid" else e)
        delta, e = metapath_attention(torch.stack(per_path, dim=1), self.p[torch.as_tensor(nodes)], self.wp,
                                      self.eq5_activation)
        return (e, delta) if return_attention else e

    def forward(self, inputs: Sequence[MetapathInput], nodes: np.ndarray, num_sample: int | None,
                rng: np.random.Generator) -> torch.Tensor:
        """Class logits (B, C) = W_o dropout(e_i) + b_o (eq 8's argument)."""
        e = self.embed(inputs, nodes, num_sample, rng)
        return self.classifier(F.dropout(e, self.dropout, self.training))
