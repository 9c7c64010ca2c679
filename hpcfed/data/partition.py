"""Splitting one HIN into federated sites.

The realistic setting (spec section 2, [RECON]): every site knows the shared node index (ids are
public), but holds only **its own relation instances**. A site *holds* a set of target nodes and
keeps every relation edge with a held target endpoint (a paper's author list, its subject, its
references). A relation that does not touch the target type is split the same way one hop further:
the site keeps its edges from the nodes its held targets link to (dblp, target author: the
conferences and terms of its authors' papers). Its meta-path instances are the ones between two
held nodes.

Schemes (`make_partition`):
- ``random``: each target node goes to a uniformly random site (balanced by a permutation).
- ``attribute``: nodes are grouped by the value of a target attribute (``attr/NAME`` in the HIN
  file, e.g. institution) or, when the name is a node type letter, by their first neighbour of that
  type (``S``: the paper's subject); whole groups go to the least-loaded site, largest first.
- ``dirichlet``: label skew; for each class a Dirichlet(alpha) draw says what share of that class
  each site receives (smaller alpha = more skewed). Unlabelled nodes are spread uniformly.
- ``by_type``: the sites own the nodes of another type (``partition_type: A``: each institution
  has its authors, assigned uniformly and balanced) and hold every target node linked to one of
  them, i.e. all the papers of their authors, with those papers' full relation rows. A paper with
  authors at several institutions is held by each of them; every meta-path instance p1-a-p2 is
  held at the site of author a. Each held node also has one *home* site (the site of its first
  listed neighbour of that type), so a quantity can be counted once per node.
- ``none``: one site holds everything (centralized training).

In the first three schemes every target node is held by exactly one site, its home.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from hpcfed.data.hin import HIN, metapath_adjacency

SCHEMES = ("random", "attribute", "dirichlet", "by_type", "none")


@dataclass
class Partition:
    """Which site holds which target nodes: ``holds`` (S, N) bool, ``home`` (N,) site ids."""

    holds: np.ndarray
    home: np.ndarray

    @property
    def num_sites(self) -> int:
        """How many sites the partition spreads the target nodes over."""
        return int(self.holds.shape[0])

    @classmethod
    def from_owners(cls, owners: np.ndarray, num_sites: int) -> Partition:
        """One owner per target node (random / attribute / dirichlet / none): holds = home."""
        owners = np.asarray(owners, dtype=np.int64)
        return cls(holds=owners[None, :] == np.arange(num_sites)[:, None], home=owners)


def make_partition(hin: HIN, num_sites: int, scheme: str, seed: int, *, attribute: str | None = None,
                   alpha: float = 0.5, owner_type: str | None = None) -> Partition:
    """The partition of `hin` into `num_sites` sites under `scheme` (module docstring)."""
    if scheme == "by_type" and num_sites > 1:
        return _by_type(hin, num_sites, seed, owner_type)
    return Partition.from_owners(assign_owners(hin, num_sites, scheme, seed, attribute=attribute, alpha=alpha),
                                 max(num_sites, 1))


def _by_type(hin: HIN, num_sites: int, seed: int, owner_type: str | None) -> Partition:
    if owner_type is None or owner_type == hin.target or owner_type not in hin.counts:
        raise ValueError(f"partition=by_type needs partition_type: a node type other than the target "
                         f"{hin.target!r}, one of {', '.join(t for t in sorted(hin.counts) if t != hin.target)}")
    edges, tcol = _target_edges(hin, owner_type)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7727, 2]))
    n_owned = hin.counts[owner_type]
    site_of = (np.arange(n_owned, dtype=np.int64) % num_sites)[rng.permutation(n_owned)]
    targets, owned = edges[:, tcol], edges[:, 1 - tcol]
    holds = np.zeros((num_sites, hin.num_targets), dtype=bool)
    holds[site_of[owned], targets] = True
    # home = the site of the first listed neighbour (file order); nodes with none get a random site
    home = (np.arange(hin.num_targets, dtype=np.int64) % num_sites)[rng.permutation(hin.num_targets)]
    lonely = ~holds.any(axis=0)
    holds[home[lonely], np.flatnonzero(lonely)] = True
    listed, first = np.unique(targets, return_index=True)  # first occurrence = first listed
    home[listed] = site_of[owned[first]]
    return Partition(holds=holds, home=home)


def _target_edges(hin: HIN, other: str) -> tuple[np.ndarray, int]:
    """Edges between the target type and `other` and the column holding the target index."""
    if hin.target + other in hin.relations:
        return hin.relations[hin.target + other], 0
    if other + hin.target in hin.relations:
        return hin.relations[other + hin.target], 1
    raise ValueError(f"no relation between {hin.target} and {other}; relations: {', '.join(sorted(hin.relations))}")


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
    if scheme == "by_type":
        raise ValueError("partition=by_type lets several sites hold a node; build it with make_partition")
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
        raise ValueError("partition=attribute needs partition_attribute "
                         "(an attr/NAME of the HIN or a node type letter)")
    if attribute in hin.attributes:
        return np.asarray(hin.attributes[attribute]).astype(str)
    if attribute in hin.counts and attribute != hin.target:
        try:
            edges, tcol = _target_edges(hin, attribute)
        except ValueError:
            raise ValueError(f"partition attribute {attribute!r}: "
                             f"no relation between {hin.target} and {attribute}") from None
        ocol = 1 - tcol
        first = np.full(hin.num_targets, -1, dtype=np.int64)
        order = np.lexsort((edges[:, ocol], edges[:, tcol]))
        t, o = edges[order, tcol], edges[order, ocol]
        keep = np.r_[True, t[1:] != t[:-1]]
        first[t[keep]] = o[keep]
        return first.astype(str)
    raise ValueError(f"partition attribute {attribute!r} is neither a node attribute "
                     f"({', '.join(sorted(hin.attributes)) or 'none'}) "
                     f"nor a node type ({', '.join(sorted(hin.counts))})")


def site_view(hin: HIN, partition: Partition | np.ndarray, site: int) -> HIN:
    """The HIN as site `site` sees it: the shared node index, only the relation edges of its held nodes.

    `partition` may also be a plain owner array (one site per target node).
    """
    holds = _holds(partition, site)
    relations = {}
    reached: dict[str, np.ndarray] = {}  # per neighbour type: the nodes a held target links to
    for key, edges in hin.relations.items():
        if hin.target in key:
            relations[key] = edges[holds[edges[:, key.index(hin.target)]]]
            for col, t in enumerate(key):
                if t != hin.target:
                    mask = reached.setdefault(t, np.zeros(hin.counts[t], dtype=bool))
                    mask[relations[key][:, col]] = True
    for key, edges in hin.relations.items():
        if hin.target not in key:
            seen = [reached[t][edges[:, col]] for col, t in enumerate(key) if t in reached]
            relations[key] = edges[np.logical_or.reduce(seen)] if seen else edges  # unreachable: public
    return hin.with_relations(relations)


def _holds(partition: Partition | np.ndarray, site: int) -> np.ndarray:
    if isinstance(partition, Partition):
        row: np.ndarray = partition.holds[site]
        return row
    mask: np.ndarray = np.asarray(partition) == site
    return mask


@dataclass
class PartitionReport:
    """Per site: held target nodes, labelled train nodes, meta-path instances kept (and their union)."""

    nodes: list[int]
    train: list[int]
    instances: dict[str, list[int]]
    total_instances: dict[str, int]
    covered: dict[str, int]  # instances held by at least one site

    def lines(self) -> list[str]:
        """The report as printable lines: one per site, then the instances some site holds."""
        out = []
        for s in range(len(self.nodes)):
            kept = ", ".join(f"{mp} {self.instances[mp][s]}/{self.total_instances[mp]} "
                             f"({100.0 * self.instances[mp][s] / max(1, self.total_instances[mp]):.1f}%)"
                             for mp in self.instances)
            labels = "no train split" if self.train[s] < 0 else f"{self.train[s]} train labels"
            out.append(f"site {s}: {self.nodes[s]} target nodes, {labels}; "
                       f"meta-path instances kept: {kept}")
        out.append("held by some site: " + ", ".join(
            f"{mp} {self.covered[mp]}/{self.total_instances[mp]} "
            f"({100.0 * self.covered[mp] / max(1, self.total_instances[mp]):.1f}%)" for mp in self.covered))
        return out


def report(hin: HIN, partition: Partition | np.ndarray, num_sites: int,
           train: np.ndarray | None = None) -> PartitionReport:
    """Count what each site keeps; instances = node pairs i != j joined by the meta-path."""
    def pairs(h: HIN, mp: str) -> sp.csr_matrix:
        adj = metapath_adjacency(h, mp, self_loops=False)
        adj.setdiag(0)
        adj.eliminate_zeros()
        return adj

    instances: dict[str, list[int]] = {}
    covered: dict[str, int] = {}
    for mp in hin.metapaths:
        per_site = [pairs(site_view(hin, partition, s), mp) for s in range(num_sites)]
        instances[mp] = [int(a.nnz) for a in per_site]
        union = sum(per_site[1:], per_site[0])
        covered[mp] = int(union.nnz)
    held = [_holds(partition, s) for s in range(num_sites)]
    train_count = [int(np.sum(h[train])) if train is not None else -1 for h in held]  # -1: no split given
    return PartitionReport(nodes=[int(h.sum()) for h in held], train=train_count, instances=instances,
                           total_instances={mp: int(pairs(hin, mp).nnz) for mp in hin.metapaths}, covered=covered)


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcfed.data.partition hin/acm --sites 3 --scheme by_type --type A``: print the report."""
    import argparse

    from hpcfed.data.hin_dataset import load_dataset

    p = argparse.ArgumentParser(prog="python -m hpcfed.data.partition", description=main.__doc__)
    p.add_argument("dataset", help="hin/acm, hin/aminer, synthetic or a .npz from import-hin")
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--scheme", default="random", choices=SCHEMES)
    p.add_argument("--type", default=None, help="by_type: the node type the sites own (A)")
    p.add_argument("--attribute", default=None, help="attribute: attr/NAME or a node type letter")
    p.add_argument("--alpha", type=float, default=0.5, help="dirichlet alpha")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-split", default=None,
                   help="count the labelled nodes of this split (default: train, else train_20, else a train_*)")
    args = p.parse_args(argv)
    hin = load_dataset(args.dataset)
    part = make_partition(hin, args.sites, args.scheme, args.seed, attribute=args.attribute, alpha=args.alpha,
                          owner_type=args.type)
    split = args.train_split or next((n for n in ("train", "train_20", *sorted(hin.splits))
                                      if n in hin.splits and n.startswith("train")), None)
    if args.train_split and split not in hin.splits:
        raise ValueError(f"--train-split {split}: {hin.name} has the splits {', '.join(sorted(hin.splits)) or 'none'}")
    train = hin.splits.get(split) if split else None
    for line in report(hin, part, args.sites, train).lines():
        print(line)
    print(f"sites holding a target node, mean: {part.holds.sum(axis=0).mean():.2f}"
          + (f"; train labels counted in split {split}" if split else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def label_skew_shares(num_classes: int, num_sites: int, alpha: float, seed: int) -> np.ndarray:
    """(num_classes, num_sites) shares: row c is a Dirichlet(alpha) draw of how class c splits over sites.

    The same shares applied to a train and a test split give every site the same label mix in both.
    """
    if alpha <= 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7741]))
    return rng.dirichlet(np.full(num_sites, alpha), size=num_classes)


def split_by_shares(labels: np.ndarray, shares: np.ndarray, seed: int) -> np.ndarray:
    """Site id of every item: class c's items (in a seeded random order) are cut by ``shares[c]``."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7753]))
    owners = np.zeros(len(labels), dtype=np.int64)
    for c in range(shares.shape[0]):
        members = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(shares[c])[:-1] * len(members)).astype(np.int64)
        for s, part in enumerate(np.split(members, cuts)):
            owners[part] = s
    return owners
