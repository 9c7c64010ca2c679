"""node2vec walks, graph splitting with/without retention, the node2vec task, Cora loading."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from hpcfed.config import ConfigError, from_mapping
from hpcfed.data.cora import load_cora, planted_graph, split_graph
from hpcfed.models.node2vec import biased_walks, csr
from hpcfed.registry import resolve
from hpcfed.tasks.base import Site
from hpcfed.tasks.node2vec import Node2VecTask


def test_walks_follow_edges() -> None:
    g = planted_graph(60, seed=1)
    walks = biased_walks(g.num_nodes, g.edges, np.arange(g.num_nodes), walk_length=12, seed=0)
    edges = {tuple(e) for e in g.edges} | {tuple(e[::-1]) for e in g.edges}
    for w in walks:
        w = w[w >= 0]
        assert all((int(a), int(b)) in edges for a, b in pairwise(w))


def test_small_q_walks_outward_and_isolated_nodes_stop() -> None:
    # path 0-1-2-3 plus a triangle 1-4-0: from (prev=0, cur=1) the options are 0 (return), 4 (near 0), 2 (outward)
    edges = np.array([[0, 1], [1, 2], [2, 3], [1, 4], [0, 4]])
    starts = np.zeros(4000, dtype=np.int64)
    rng_walks = biased_walks(6, edges, starts, walk_length=3, p=0.6, q=0.1, seed=0)
    from_1 = rng_walks[rng_walks[:, 1] == 1][:, 2]
    frac = {v: np.mean(from_1 == v) for v in (0, 2, 4)}
    # weights 1/p = 1.667, 1/q = 10, 1 -> probabilities 0.132, 0.789, 0.079
    assert frac[2] == pytest.approx(10 / 12.667, abs=0.04)
    assert frac[0] == pytest.approx(1.667 / 12.667, abs=0.04)
    lone = biased_walks(6, edges, np.array([5]), walk_length=4)
    assert lone.tolist() == [[5, -1, -1, -1]]
    indptr, indices = csr(6, edges)
    assert indices[indptr[1]:indptr[2]].tolist() == [0, 2, 4]


def test_split_graph_retention() -> None:
    g = planted_graph(80, seed=2)
    parts = [split_graph(g, 2, s, retain_cross_site=False, seed=0) for s in range(2)]
    assert sorted(np.concatenate([p.own for p in parts]).tolist()) == list(range(80))
    for p in parts:
        assert np.isin(p.edges, p.own).all()  # no retention: only edges inside the site
    kept = [split_graph(g, 2, s, retain_cross_site=True, seed=0) for s in range(2)]
    cross = len(g.edges) - sum(len(p.edges) for p in parts)
    assert cross > 0
    assert sum(len(p.edges) for p in kept) == sum(len(p.edges) for p in parts) + 2 * cross
    assert all(len(k.nodes) > len(k.own) for k in kept)  # foreign endpoints are kept


@pytest.mark.parametrize("retain", [False, True])
def test_node2vec_task_joint_round(retain: bool) -> None:
    cfg = Node2VecTask.Config(dataset="planted", planted_nodes=60, vector_size=16, num_walks=4, walk_length=8,
                              total_epochs=2, retain_cross_site=retain)
    tasks = [Node2VecTask(cfg, Site(client_id=c, num_clients=2, seed=0, out_dir=None)) for c in range(2)]  # type: ignore[arg-type]
    replies, init = Node2VecTask.server_setup(cfg, {c: t.setup() for c, t in enumerate(tasks)})
    for c, t in enumerate(tasks):
        t.on_setup(replies[c])
        t.set_parameters(init)
        t.fit(0)
    assert tasks[0].model.wv.index_to_key == tasks[1].model.wv.index_to_key
    assert init["wv"].shape == (len(tasks[0].model.wv), 16)
    ids, vectors, labels = tasks[0].node_vectors()
    assert set(ids) == {str(v) for v in tasks[0].own}  # search only over the site's own nodes
    assert vectors.shape == (len(ids), 16) and labels.min() >= 0
    assert "local_label_precision_at_10" in tasks[0].evaluate(0, final=True)


def test_unknown_method_is_rejected() -> None:
    with pytest.raises(ConfigError, match="joint, centralized"):
        resolve(from_mapping({"task": {"name": "node2vec"}, "method": "mapping"}))


@pytest.mark.realdata
def test_cora_loads(shared_data) -> None:
    g = load_cora(shared_data)
    assert g.num_nodes == 2708 and g.labels.min() == 0 and g.labels.max() == 6
    assert 5000 < len(g.edges) <= 5429 and (g.edges[:, 0] < g.edges[:, 1]).all()


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_a_tampered_cora_file_is_refused_not_run(tmp_path) -> None:
    import pickle
    from collections import defaultdict

    from hpcfed.data.root import DataError

    folder = tmp_path / "graphs" / "cora"
    folder.mkdir(parents=True)
    (folder / "ind.cora.graph").write_bytes(pickle.dumps(defaultdict(list, {0: [1], 1: [0]}), protocol=4))
    (folder / "ind.cora.ally").write_bytes(pickle.dumps(np.eye(2), protocol=4))
    (folder / "ind.cora.ty").write_bytes(pickle.dumps(_RunsCode(), protocol=4))
    (folder / "ind.cora.test.index").write_text("1\n")
    refused = r"ind\.cora\.ty: cannot be read as a Planetoid Cora file \(refusing posix\.system"
    with pytest.raises(DataError, match=refused):
        load_cora(tmp_path)
    (folder / "ind.cora.ty").write_bytes(pickle.dumps(np.eye(2)[1:], protocol=4))
    g = load_cora(tmp_path)  # the same folder with honest files loads
    assert g.num_nodes == 2 and g.labels.tolist() == [0, 1] and g.edges.tolist() == [[0, 1]]
