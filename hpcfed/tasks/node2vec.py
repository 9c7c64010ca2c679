"""SEEC node2vec task: federated skip-gram over biased random walks of a graph split across sites.

Each site owns a random share of the nodes (paper §V.A.1) and walks its local graph (p = 0.6,
q = 0.1, length 20, 20 walks per node; `hpcfed.models.node2vec`). Cross-site edges are dropped
(``retain_cross_site: false``) or kept at both sites with their foreign endpoint (``true``). The
vocabulary is the set of global node ids; the setup exchange and FedAvg of ``wv``/``syn1neg`` are
doc2vec's (`hpcfed.tasks.doc2vec.GensimJointTask`). Search runs only over each site's own nodes,
so the export holds this site's nodes (entity ``node``: vectors, ids, labels).

Methods: ``joint`` (default) and ``centralized`` (one site, the whole graph; run with ``--np 2``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np

from hpcfed.models import doc2vec as g
from hpcfed.models.node2vec import walk_corpus
from hpcfed.store.embeddings import export_path, write_export
from hpcfed.tasks.base import MethodPreset, Site
from hpcfed.tasks.doc2vec import (
    GensimJointOptions,
    GensimJointTask,
    _rng_seed,
    gensim_method,
    model_path,
    validate_shared,
)


class Node2VecTask(GensimJointTask):
    """SEEC's node2vec task: federated skip-gram over random walks of each site's share of a graph."""

    name = "node2vec"
    METHODS: ClassVar[Mapping[str, MethodPreset]] = {
        method: gensim_method(method) for method in ("joint", "centralized")}
    kind = "word2vec"
    entity = "node"

    @dataclass(kw_only=True)
    class Config(GensimJointOptions):
        mode: Literal["joint", "centralized"] = "joint"
        dataset: Literal["cora", "planted"] = "cora"
        planted_nodes: int = 120  # dataset=planted: a small graph with communities (tests, demos)
        retain_cross_site: bool = False
        p: float = 0.6
        q: float = 0.1
        walk_length: int = 20
        num_walks: int = 20
        # the model's settings and the schedule are doc2vec's (GensimJointOptions), but for these
        vector_size: int = 124
        min_count: int = 1
        dm: int = field(default=1, init=False)  # doc2vec only
        infer_epochs: int = field(default=40, init=False)  # doc2vec only

        def validate(self) -> None:
            validate_shared(self, positive=("walk_length", "num_walks"))
            if self.p <= 0 or self.q <= 0:
                raise ValueError(f"p and q must be > 0, got p={self.p}, q={self.q}")

    def __init__(self, config: Config, site: Site) -> None:
        super().__init__(config, site)
        from hpcfed.data.cora import load_cora, planted_graph, split_graph

        self.graph = load_cora(site.data_root) if config.dataset == "cora" else \
            planted_graph(config.planted_nodes, seed=site.seed)
        if config.mode == "centralized" and site.num_clients != 1:
            raise ValueError(f"method=centralized trains one model on the whole graph: run it with one client "
                             f"(--np 2), not {site.num_clients}")
        part = split_graph(self.graph, site.num_clients, site.client_id,
                           retain_cross_site=config.retain_cross_site, seed=site.seed)
        self.own = part.own
        # Walks are drawn once (seeded by site) and reused every epoch, as the node2vec package does.
        self.corpus = walk_corpus(self.graph.num_nodes, part.edges, part.nodes, num_walks=config.num_walks,
                                  walk_length=config.walk_length, p=config.p, q=config.q,
                                  seed=_rng_seed(site.seed, site.client_id, 7), node_id=self.graph.node_id)

    def _local_counts(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for walk in self.corpus:
            counts.update(walk)
        return counts

    # -- evaluation and export ---------------------------------------------------------------------
    def node_vectors(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        ids = [self.graph.node_id(v) for v in self.own if self.graph.node_id(v) in self.model.wv.key_to_index]
        vectors = np.stack([self.model.wv[i] for i in ids]).astype(np.float32) if ids else \
            np.zeros((0, self.config.vector_size), dtype=np.float32)
        labels = np.array([self.graph.labels[int(i)] for i in ids], dtype=np.int64)
        return ids, vectors, labels

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        from hpcfed.search.index import SiteIndex
        from hpcfed.search.metrics import label_precision_at_k

        k = self.config.eval_k
        ids, vectors, labels = self.node_vectors()
        out = {"num_nodes": float(len(ids)), "vocab_size": float(len(self.model.wv))}
        if len(ids) > 1:
            index = SiteIndex(str(self.site.client_id), ids, vectors, labels)
            hits = index.hits(vectors, k, exclude=ids)
            found = [[h.label for h in r] for r in hits]
            out[f"local_label_precision_at_{k}"] = label_precision_at_k(list(labels), found, k)
        return out

    def export_embeddings(self, out_dir: Path) -> Path:
        cid = self.site.client_id
        ids, vectors, labels = self.node_vectors()
        path = write_export(export_path(out_dir, cid), vectors, ids, labels, entity="node",
                            model=f"node2vec-sg{self.config.vector_size}", site=cid,
                            config_hash=self.site.config_hash,
                            extra={"mode": self.config.mode, "kind": "node2vec",
                                   "retain_cross_site": bool(self.config.retain_cross_site)})
        g.save_model(model_path(out_dir, cid), self.model, self.settings, site=cid)
        return path
