"""Graphs for SEEC node2vec: Planetoid Cora, a planted-community stand-in, and the split across sites.

Cora (``graphs/cora`` under the data root, Planetoid ``ind.cora.*`` format): 2,708 papers, 5,429
undirected citation edges, 7 classes. Only the graph and the labels are read (node2vec uses no
features). Test labels are placed by ``ind.cora.test.index`` (the usual Planetoid fix).

Splitting (paper §V.A.1): nodes are assigned to sites at random; a cross-site edge is either dropped
(no retention) or kept at both sites together with its foreign endpoint (retention).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.data.local_pickle import NUMPY_ARRAYS, load_pickle
from hpcfed.data.root import DataError, dataset_dir


@dataclass
class Graph:
    """An undirected graph with class labels: node count, unique edges (u < v), a label per node."""

    num_nodes: int
    edges: np.ndarray  # (m, 2) int64, undirected, u < v, unique, no self-loops
    labels: np.ndarray  # (num_nodes,) int64, -1 = unknown

    def node_id(self, node: int) -> str:
        """The id `node` is exported under: its index as a string."""
        return str(int(node))


def _clean_edges(pairs: np.ndarray) -> np.ndarray:
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    pairs = np.sort(pairs, axis=1)
    return np.unique(pairs, axis=0)


# The ind.cora.* files are Python-2 pickles (the only form Planetoid ships): a defaultdict of lists
# (the graph) and numpy arrays (the labels); nothing else may be built from them.
_PLANETOID_GLOBALS = NUMPY_ARRAYS | {("collections", "defaultdict"), ("__builtin__", "list"), ("builtins", "list")}


def load_cora(data_root: str | Path | None = None) -> Graph:
    """Cora's citation graph and class labels from the Planetoid files."""
    folder = dataset_dir("graphs/cora", data_root)

    def load(name: str) -> Any:  # a Planetoid object: a dict of lists or an array
        path = folder / f"ind.cora.{name}"
        if not path.is_file():
            raise DataError(f"{path} is missing; the Planetoid Cora folder needs "
                            f"ind.cora.{{graph,ally,ty,test.index}}")
        return load_pickle(path, _PLANETOID_GLOBALS, "a Planetoid Cora file")

    graph, ally, ty = load("graph"), load("ally"), load("ty")
    test_index_path = folder / "ind.cora.test.index"
    if not test_index_path.is_file():
        raise DataError(f"{test_index_path} is missing")
    test_index = np.loadtxt(test_index_path, dtype=np.int64).reshape(-1)
    num_nodes = max(max(graph) + 1, int(test_index.max()) + 1)
    labels = np.full(num_nodes, -1, dtype=np.int64)
    ally, ty = np.asarray(ally), np.asarray(ty)
    labels[: len(ally)] = ally.argmax(1)
    labels[test_index] = ty.argmax(1)
    pairs = [(u, v) for u, nbrs in graph.items() for v in nbrs]
    return Graph(num_nodes, _clean_edges(np.array(pairs)), labels)


def planted_graph(num_nodes: int = 120, num_classes: int = 4, p_in: float = 0.15, p_out: float = 0.005,
                  seed: int = 0) -> Graph:
    """A stochastic block model with `num_classes` communities: a Cora-shaped graph for tests."""
    rng = np.random.default_rng(seed)
    labels = np.arange(num_nodes) % num_classes
    same = labels[:, None] == labels[None, :]
    draw = rng.random((num_nodes, num_nodes)) < np.where(same, p_in, p_out)
    u, v = np.nonzero(np.triu(draw, 1))
    return Graph(num_nodes, _clean_edges(np.stack([u, v], 1)), labels.astype(np.int64))


@dataclass
class SiteGraph:
    """One site's share of a split graph: its own nodes, and the nodes and edges of its local graph."""

    own: np.ndarray  # this site's nodes (sorted)
    nodes: np.ndarray  # nodes of the local graph (own + retained foreign endpoints)
    edges: np.ndarray  # local edges (global node indices)


def split_graph(graph: Graph, num_sites: int, site: int, *, retain_cross_site: bool, seed: int = 0) -> SiteGraph:
    """Random assignment of nodes to sites (equal shares), and this site's local graph."""
    if not 0 <= site < num_sites:
        raise ValueError(f"site {site} out of range for {num_sites} sites")
    owner = np.empty(graph.num_nodes, dtype=np.int64)
    owner[np.random.default_rng(seed).permutation(graph.num_nodes)] = np.arange(graph.num_nodes) % num_sites
    own = np.flatnonzero(owner == site)
    a, b = owner[graph.edges[:, 0]] == site, owner[graph.edges[:, 1]] == site
    keep = (a | b) if retain_cross_site else (a & b)
    edges = graph.edges[keep]
    nodes = np.union1d(own, edges.reshape(-1))
    return SiteGraph(own, nodes, edges)
