"""The FedAHE task without MPI: method mapping, per-site data, fit/evaluate/export, resumable state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from hpcfed.config import ConfigError, from_mapping
from hpcfed.registry import resolve
from hpcfed.schema import build
from hpcfed.store.embeddings import read_export
from hpcfed.tasks.base import Site
from hpcfed.tasks.hin import HINTask

SMALL = {"dataset": "synthetic", "dim": 16, "pref_dim": 4, "lr": 0.01,
         "synthetic": {"papers_per_class": 30, "authors_per_class": 15, "train_per_class": 6, "val_per_class": 6}}


def _task(tmp_path: Path, client_id: int = 0, num_clients: int = 3, **options) -> HINTask:
    cfg = build(HINTask.Config, {**SMALL, **options}, prefix="task.")
    return HINTask(cfg, Site(client_id=client_id, num_clients=num_clients, seed=0, out_dir=tmp_path))


@pytest.mark.parametrize("method, strategy, mode", [
    ("feddwa", "feddwa", "async"), ("afed", "fedasync", "async"), ("fedavg", "fedavg", "sync"),
    ("local", "local", "sync"), ("centralized", "fedavg", "sync")])
def test_method_presets(method: str, strategy: str, mode: str) -> None:
    cfg = from_mapping({"strategy": {"name": "feddwa", "threshold": 5}, "method": method,
                        "task": {"name": "hin", "dataset": "synthetic"}})
    resolve(cfg)
    assert (cfg.strategy.name, cfg.mode) == (strategy, mode)
    assert cfg.strategy.options == ({"threshold": 5} if strategy == "feddwa" else {})
    if method == "centralized":
        assert cfg.task.options["partition"] == "none" and cfg.federation.num_clients == 1
    with pytest.raises(ConfigError, match="choose one of: feddwa, afed, fedavg, local, centralized"):
        resolve(from_mapping({"task": {"name": "hin"}, "method": "fedprox"}))


def test_sites_share_shapes_and_split_the_nodes(tmp_path: Path) -> None:
    tasks = [_task(tmp_path, k) for k in range(3)]
    shapes = [{k: v.shape for k, v in t.get_parameters().items()} for t in tasks]
    assert shapes[0] == shapes[1] == shapes[2]
    for split in ("train", "val", "test"):
        parts = [set(t.nodes[split].tolist()) for t in tasks]
        assert not parts[0] & parts[1] and sum(map(len, parts)) == len(tasks[0].hin.splits[split])
    first = tasks[0].get_parameters()
    assert all(np.array_equal(first["p"], t.get_parameters()["p"]) for t in tasks)  # same initial model


def test_fit_learns_and_evaluate_reports_f1(tmp_path: Path) -> None:
    task = _task(tmp_path, num_clients=1, partition="none", lr=0.03, num_sample=10)
    before = task.evaluate(0)["val_loss"]
    for r in range(12):
        result = task.fit(r)
    assert result.num_examples == len(task.nodes["train"]) == 18
    after = task.evaluate(12)
    assert after["val_loss"] < before and after["val_micro_f1"] > 0.6
    final = task.evaluate(25, final=True)
    assert {"micro_f1", "macro_f1", "lr_micro_f1", "lr_macro_f1"} <= set(final)
    path = task.export_embeddings(tmp_path)
    exp = read_export(path)
    assert exp.vectors.shape == (90, 16) and list(exp.labels[:3]) == [0, 0, 0]


def test_sync_every_batch_does_one_batch_per_call(tmp_path: Path) -> None:
    task = _task(tmp_path, num_clients=1, partition="none", batch_size=5, sync_every="batch")
    sizes = [task.fit(r).num_examples for r in range(5)]
    assert sizes == [5, 5, 5, 3, 5]  # 18 train nodes: batches of 5, 5, 5, 3, then a new epoch


def test_personal_preference_vectors_stay_local(tmp_path: Path) -> None:
    task = _task(tmp_path, personal_params=["p"])
    own_p = task.get_parameters()["p"].copy()
    incoming = {k: np.zeros_like(v) for k, v in task.get_parameters().items()}
    task.set_parameters(incoming)
    params = task.get_parameters()
    assert np.array_equal(params["p"], own_p) and not params["classifier.weight"].any()
    with pytest.raises(ConfigError, match="personal_params"):
        build(HINTask.Config, {"personal_params": ["classifier"]}, prefix="task.")


def test_best_val_selection_evaluates_the_best_received_model(tmp_path: Path) -> None:
    task = _task(tmp_path, num_clients=1, partition="none", lr=0.03, num_sample=10, model_selection="best_val")
    for r in range(8):
        task.fit(r)  # scores the model it starts from (the one received) on val first
    best = {k: v.copy() for k, v in task.best_params.items()}
    expected = _task(tmp_path, num_clients=1, partition="none", num_sample=10)
    expected.set_parameters(best)
    want = expected.evaluate(0, final=True)
    broken = {k: (np.zeros_like(v) if k.startswith("classifier") else v) for k, v in best.items()}
    broken["classifier.bias"][1] = 1.0  # the final model predicts class 1 for every node
    task.set_parameters(broken)
    got = task.evaluate(20, final=True)
    assert got["selected_val_micro_f1"] == pytest.approx(task.best_val) and task.best_val > 0.6
    assert got["micro_f1"] == pytest.approx(want["micro_f1"]) and got["micro_f1"] > 0.5
    last = _task(tmp_path, num_clients=1, partition="none", num_sample=10)  # model_selection: last
    last.set_parameters(broken)
    assert last.evaluate(0, final=True)["micro_f1"] == pytest.approx(1 / 3)  # 18 of the 54 test papers per class


def test_relation_rows_join_the_input_and_by_type_counts_each_test_node_once(tmp_path: Path) -> None:
    tasks = [_task(tmp_path, k, partition="by_type", partition_type="A", input_relations=["A", "S"])
             for k in range(3)]
    hin = tasks[0].hin
    n_p, n_a, n_s = hin.counts["P"], hin.counts["A"], hin.counts["S"]
    assert tasks[0].model.ws[0].weight.shape == (16, n_p + n_a + n_s)
    t = tasks[1]
    paper = int(t.own_nodes[0])
    authors = hin.relations["PA"][hin.relations["PA"][:, 0] == paper, 1]
    row = t.inputs[0].features[paper].toarray().ravel()
    expected = np.zeros(n_a + n_s)
    expected[authors] = 1 / np.sqrt(len(authors))  # the full author list, L2-normalised on its own
    expected[n_a + hin.relations["PS"][hin.relations["PS"][:, 0] == paper, 1]] = 1.0
    np.testing.assert_allclose(row, expected, rtol=1e-6)
    test = hin.splits["test"]
    assert sum(len(x.nodes["home_test"]) for x in tasks) == len(test)  # every test paper once
    assert sum(len(x.nodes["test"]) for x in tasks) > len(test)  # co-authored papers held twice
    final = t.evaluate(0, final=True)
    assert final["home_num_test"] == len(t.nodes["home_test"]) and 0 <= final["home_micro_f1"] <= 1
    with pytest.raises(ConfigError, match="partition_type"):
        build(HINTask.Config, {"partition": "by_type"}, prefix="task.")
    with pytest.raises(ValueError, match="input_relations: 'X' is not a node type related to P"):
        _task(tmp_path, input_relations=["X"])


def test_state_dict_round_trip_repeats_the_next_fit(tmp_path: Path) -> None:
    a = _task(tmp_path, num_clients=1, partition="none")
    a.fit(0)
    params, state = a.get_parameters(), a.state_dict()
    b = _task(tmp_path, num_clients=1, partition="none")
    b.set_parameters(params)
    b.load_state_dict(state)
    a.fit(1)
    b.fit(1)
    for k, v in a.get_parameters().items():
        np.testing.assert_array_equal(v, b.get_parameters()[k])


def test_real_heco_graph_smoke(shared_data: Path, tmp_path: Path) -> None:
    cfg = build(HINTask.Config, {"dataset": "hin/acm", "dim": 16, "pref_dim": 4, "num_sample": 10}, prefix="task.")
    task = HINTask(cfg, Site(client_id=1, num_clients=3, seed=0, out_dir=tmp_path, data_root=shared_data))
    assert task.hin.counts["P"] == 4019 and task.model.ws[0].weight.shape == (16, 4019)
    assert 0 < len(task.nodes["test"]) < 1000
    result = task.fit(0)
    assert result.num_examples == len(task.nodes["train"]) and np.isfinite(result.metrics["train_loss"])
    metrics = task.evaluate(0, final=True)
    assert 0.0 <= metrics["micro_f1"] <= 1.0 and metrics["num_test"] == len(task.nodes["test"])
