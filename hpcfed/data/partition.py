"""Splitting one HIN into federated sites.

The realistic setting (spec section 2, [RECON]): every site knows the shared node index (ids are
public), but holds only **its own relation instances** — e.g. the papers of its institution, and so
the paper-author / paper-subject edges of those papers and the meta-path instances they form. A site
owns a set of target nodes; it keeps every relation edge with an owned target endpoint, and every
edge of a relation that does not touch the target type (such relations are treated as public).

Owner assignment schemes (`assign_owners`):
- ``random``: each target node goes to a uniformly random site (balanced by a permutation).
- ``attribute``: nodes are grouped by the value of a target attribute (``attr/NAME`` in the HIN
  file, e.g. institution) or, when the name is a node type letter, by their first neighbour of that
  type (``S``: the paper's subject); whole groups go to the least-loaded site, largest first.
- ``dirichlet``: label skew; for each class a Dirichlet(alpha) draw says what share of that class
  each site receives (smaller alpha = more skewed). Unlabelled nodes are spread uniformly.
- ``none``: one site holds everything (centralized training).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcfed.data.hin import HIN, metapath_adjacency

SCHEMES = ("random", "attribute", "dirichlet", "none")


def assign_owners(hin: HIN, num_sites: int, scheme: str, seed: int, *, attribute: str | None = None,
                  alpha: float = 0.5) -> np.ndarray:
    """Site id (0..num_sites-1) of every target node, shape (N,)."""
    n = hin.num_targets
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7727]))
    if scheme == "none" or num_sites == 1:
        return np.zeros(n, dtype=np.int64)
    if scheme == "random":
        owners = np.arange(n, dtype=np.int64) % num_sites
        return owners[rng.permutation(n)]
    if scheme == "attribute":
        groups = _attribute_groups(hin, attribute)
        values, inverse, sizes = np.unique(groups, return_inverse=True, return_counts=True)
        if len(values) < num_sites:
            raise ValueError(f"partition attribute {attribute!r} has {len(values)} distinct values, fewer than "
                             f"the {num_sites} sites; pick another attribute or scheme=random")
        load = np.zeros(num_sites, dtype=np.int64)
        group_site = np.empty(len(values), dtype=np.int64)
        for g in np.argsort(-sizes, kind="stable"):  # greedy balance: biggest group to the lightest site
            s = int(np.argmin(load))
            group_site[g] = s
            load[s] += sizes[g]
        return group_site[inverse]
    if scheme == "dirichlet":
        if alpha <= 0:
            raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
        owners = rng.integers(num_sites, size=n).astype(np.int64)
        for c in range(hin.num_classes):
            members = rng.permutation(np.flatnonzero(hin.labels == c))
            share = rng.dirichlet(np.full(num_sites, alpha))
            cuts = (np.cumsum(share)[:-1] * len(members)).astype(np.int64)
            for s, part in enumerate(np.split(members, cuts)):
                owners[part] = s
        return owners
    raise ValueError(f"unknown partition scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")


def _attribute_groups(hin: HIN, attribute: str | None) -> np.ndarray:
    if attribute is None:
        raise ValueError("partition=attribute needs partition_attribute (an attr/NAME of the HIN or a node type letter)")
    if attribute in hin.attributes:
        return np.asarray(hin.attributes[attribute]).astype(str)
    if attribute in hin.counts and attribute != hin.target:
        key = hin.target + attribute
        if key in hin.relations:
            edges = hin.relations[key]
            tcol, ocol = 0, 1
        elif attribute + hin.target in hin.relations:
            edges = hin.relations[attribute + hin.target]
            tcol, ocol = 1, 0
        else:
            raise ValueError(f"partition attribute {attribute!r}: no relation between {hin.target} and {attribute}")
        first = np.full(hin.num_targets, -1, dtype=np.int64)
        order = np.lexsort((edges[:, ocol], edges[:, tcol]))
        t, o = edges[order, tcol], edges[order, ocol]
        keep = np.r_[True, t[1:] != t[:-1]]
        first[t[keep]] = o[keep]
        return first.astype(str)
    raise ValueError(f"partition attribute {attribute!r} is neither a node attribute "
                     f"({', '.join(sorted(hin.attributes)) or 'none'}) nor a node type ({', '.join(sorted(hin.counts))})")


def site_view(hin: HIN, owners: np.ndarray, site: int) -> HIN:
    """The HIN as site `site` sees it: the shared node index, only its own relation instances."""
    relations = {}
    for key, edges in hin.relations.items():
        if hin.target not in key:
            relations[key] = edges
            continue
        col = key.index(hin.target)
        relations[key] = edges[owners[edges[:, col]] == site]
    return hin.with_relations(relations)


@dataclass
class PartitionReport:
    """Per site: owned target nodes, labelled train nodes, meta-path instances kept."""

    nodes: list[int]
    train: list[int]
    instances: dict[str, list[int]]
    total_instances: dict[str, int]

    def lines(self) -> list[str]:
        out = []
        for s in range(len(self.nodes)):
            kept = ", ".join(f"{mp} {self.instances[mp][s]}/{self.total_instances[mp]} "
                             f"({100.0 * self.instances[mp][s] / max(1, self.total_instances[mp]):.1f}%)"
                             for mp in self.instances)
            out.append(f"site {s}: {self.nodes[s]} target nodes, {self.train[s]} train labels; "
                       f"meta-path instances kept: {kept}")
        return out


def report(hin: HIN, owners: np.ndarray, num_sites: int, train: np.ndarray | None = None) -> PartitionReport:
    """Count what each site keeps; instances = node pairs i != j joined by the meta-path."""
    def pairs(h: HIN, mp: str) -> int:
        adj = metapath_adjacency(h, mp, self_loops=False)
        return int(adj.nnz - np.count_nonzero(adj.diagonal()))

    instances = {mp: [pairs(site_view(hin, owners, s), mp) for s in range(num_sites)] for mp in hin.metapaths}
    train_count = [int(np.sum(owners[train] == s)) if train is not None else 0 for s in range(num_sites)]
    return PartitionReport(nodes=[int(np.sum(owners == s)) for s in range(num_sites)], train=train_count,
                           instances=instances, total_instances={mp: pairs(hin, mp) for mp in hin.metapaths})
