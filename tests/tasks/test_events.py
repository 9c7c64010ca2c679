"""The events task and the SEGA strategy in-process (no MPI), on synthetic messages with planted events."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcfed.config import Config, ConfigError, from_mapping
from hpcfed.params import ParamLayout
from hpcfed.registry import resolve
from hpcfed.schema import build
from hpcfed.strategies.base import StrategyContext, Update
from hpcfed.strategies.sega import Sega
from hpcfed.tasks.base import Site
from hpcfed.tasks.events import EventsTask

SMALL = dict(sites=["synthetic:0", "synthetic:2", "synthetic:4"], text_model="hashing:32", text_dim=32, hidden=8,
             heads=2, out_dim=8, fanouts=[5, 10], batch_size=100, bola_calls=4, bola_init=2, feature_cache=False)


def make_task(tmp_path: Path, cid: int = 0, attack: str | None = None, **extra) -> EventsTask:
    """An EventsTask for client `cid` of four on the small synthetic sites."""
    cfg = build(EventsTask.Config, {**SMALL, **extra}, prefix="task.")
    site = Site(client_id=cid, num_clients=4, seed=0, out_dir=tmp_path, attack=attack)
    return EventsTask(cfg, site)


def test_round_trip_with_bola_glecc_and_final_evaluation(tmp_path):
    task = make_task(tmp_path)
    start = task.get_parameters()
    task.set_parameters(start)
    r0 = task.fit(0)
    assert r0.num_examples == len(task.train_idx) and np.isfinite(r0.metrics["train_loss"])
    assert r0.metrics["bola_lambda"] == 0.0  # round 0: local := global
    other = {k: v + np.float32(0.01) for k, v in task.get_parameters().items()}
    task.set_parameters(other)
    r1 = task.fit(1)
    assert 0.6 <= r1.metrics["bola_lambda"] <= 1.0
    assert r1.metrics["train_alpha"] > 0  # GLECC active from round 1
    val = task.evaluate(1)
    assert set(val) == {"val_nmi", "val_ami", "val_ari"}
    state = task.state_dict()
    task.set_parameters(other)
    final = task.evaluate(1, final=True)
    assert {"nmi", "ami", "ari"} <= set(final) and 0.0 <= final["nmi"] <= 1.0
    assert final["num_events"] == len(np.unique(task.labels[task.test_idx]))
    again = make_task(tmp_path)
    again.load_state_dict(state)
    assert np.array_equal(again.local_flat, state[1]["local"])
    path = task.export_embeddings(tmp_path)
    from hpcfed.store.embeddings import read_export

    exported = read_export(path)
    assert exported.vectors.shape == (len(task.ids), 8)
    # the messages' times and texts, for `hpcfed search --where time=...` and the search page
    assert list(exported.columns["time"]) == list(task.messages.times.astype("datetime64[s]").astype(np.int64))
    assert [t.decode() if isinstance(t, bytes) else t for t in exported.columns["text"]] == list(task.messages.texts)


def test_glecc_own_model_switch_skips_glecc_only_when_the_server_sends_the_own_model(tmp_path):
    for own, expect_glecc in ((True, True), (False, False)):
        task = make_task(tmp_path, glecc_own_model=own)
        task.set_parameters(task.get_parameters())
        task.fit(0)
        task.set_parameters(task.get_parameters())  # a singleton SEGA cluster: θ^g = the client's own upload
        r1 = task.fit(1)
        assert r1.metrics["bola_lambda"] == 1.0  # every λ gives the same model
        assert (r1.metrics["train_alpha"] > 0) is expect_glecc
        assert (r1.metrics["train_glecc"] > 0) is expect_glecc
        task.set_parameters({k: v + np.float32(0.01) for k, v in task.get_parameters().items()})  # other clients' mix
        assert task.fit(2).metrics["train_alpha"] > 0  # GLECC stays on when θ^g carries other clients' knowledge


def test_attacks_change_uploads_or_labels(tmp_path):
    honest = make_task(tmp_path, cid=3, attack=None, sites=SMALL["sites"] + ["synthetic:0"])
    poisoned = make_task(tmp_path, cid=3, attack="model", sites=SMALL["sites"] + ["synthetic:0"])
    h = ParamLayout.of(honest.get_parameters())
    a = h.flatten(honest.get_parameters())
    b = h.flatten(poisoned.get_parameters())
    assert not np.allclose(a, b) and np.isfinite(b).all()
    flipped = make_task(tmp_path, cid=3, attack="data", attack_site="synthetic:0")
    assert (flipped.train_labels != flipped.labels).mean() > 0.5
    with pytest.raises(ValueError, match="has no dataset"):
        make_task(tmp_path, cid=3)


def test_method_presets_map_to_strategy_and_switches():
    def resolved(method: str) -> Config:
        cfg = from_mapping({"strategy": {"name": "sega", "probe_nodes": 50}, "task": {"name": "events"},
                            "method": method})
        resolve(cfg)
        return cfg

    cfg = resolved("dame-no-bola")
    assert cfg.strategy.name == "sega" and cfg.strategy.options == {"probe_nodes": 50}
    assert cfg.task.options["bola"] is False and cfg.task.options["glecc"] is True
    cfg = resolved("fedprox")
    assert cfg.strategy.name == "fedavg" and cfg.strategy.options == {} and cfg.task.options["prox_mu"] > 0
    cfg = resolved("local")
    assert cfg.strategy.name == "local" and not cfg.task.options["bola"] and not cfg.task.options["glecc"]
    assert resolved("dame").task.options["safe"] is True  # issue 26: the default DAMe is the safe one
    assert resolved("dame").task.options["cluster_track"] is True
    own = from_mapping({"task": {"name": "events", "cluster_track": False}, "method": "dame"})
    resolve(own)
    assert own.task.options["cluster_track"] is False  # a user can turn the cluster model off
    paper = resolved("dame-paper").task.options
    assert paper["safe"] is False and paper["bola_alpha"] == 0.6 and paper["glecc_own_model"] is True
    with pytest.raises(ConfigError, match="choose one of"):
        resolved("fedsgd")


def test_sega_groups_similar_clients_and_checkpoints(tmp_path):
    cfg = build(EventsTask.Config, SMALL, prefix="task.")
    logs: list[str] = []
    sega = Sega(build(Sega.Config, {"probe_nodes": 60, "probe_edge_prob": 0.1}),
                StrategyContext(num_clients=4, seed=0, task_cls=EventsTask, task_config=cfg, log=logs.append))
    import torch

    torch.manual_seed(0)
    m = EventsTask.build_model(cfg)
    from hpcfed.tasks import torch_state

    init = torch_state.module_parameters(m)
    sega.initialize(init)
    layout = ParamLayout.of(init)
    base = layout.flatten(init)
    rng = np.random.default_rng(0)
    near = base + rng.normal(0, 1e-3, base.shape).astype(np.float32)
    far = -base  # output negated -> cosine -1 with the others: no edge
    bad = base.copy()
    bad[0] = np.nan
    updates = [Update(0, base.copy(), 10), Update(1, near, 10), Update(2, far, 10), Update(3, bad, 10)]
    sega.aggregate(0, updates)
    assert [0, 1] in sega.partition and [2] in sega.partition and [3] in sega.partition
    assert np.allclose(sega.model_for(2), far)  # alone: its own model back
    assert np.isnan(sega.model_for(3)[0])  # non-finite upload: left out, gets its own upload back
    # θ_0^g = α00·θ_0 + α01·θ_1 with α00 = e/(e + e^sim01) ≥ 1/2 (eq. 12-13)
    diff = (near - base).astype(np.float64)
    t = float((sega.model_for(0) - base) @ diff / (diff @ diff))
    assert 0.45 < t <= 0.5 and np.allclose(sega.model_for(0), base + t * diff, atol=1e-5)
    assert any("non-finite" in line for line in logs)
    state = sega.state_dict()
    other = Sega(build(Sega.Config, {}), StrategyContext(num_clients=4, seed=0, task_cls=EventsTask, task_config=cfg))
    other.initialize(init)
    other.load_state_dict(state)
    assert np.array_equal(other.model_for(1), sega.model_for(1), equal_nan=True)
    assert other.partition == sega.partition
    assert sega.metrics()["sega_clusters"] == 3.0
    assert [sega.metrics()[f"sega_cluster_{k}"] for k in range(4)] == [0.0, 0.0, 1.0, 2.0]  # {0,1}, {2}, {3}


def test_a_site_draws_the_same_split_at_any_client_position(tmp_path):
    first = make_task(tmp_path, cid=0)  # synthetic:0 at client 0
    moved = make_task(tmp_path, cid=1, sites=["synthetic:2", "synthetic:0", "synthetic:4"])  # ... at client 1
    assert len(first.ids) == len(moved.ids)
    assert np.array_equal(first.test_idx, moved.test_idx)  # the split is keyed by the site's name
    from hpcfed.tasks.event_training import site_key as _site_key

    assert _site_key("synthetic:0") != _site_key("synthetic:2")
    assert _site_key("crisislext26", 3) != _site_key("crisislext26")  # an attacker with the same data draws its own
