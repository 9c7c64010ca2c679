"""SEEC joint learning: vocabulary aggregation (spec 4.5 test 1) and FedAvg of gensim arrays (test 2, 3)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from hpcfed.models import doc2vec as g
from hpcfed.params import ParamLayout
from hpcfed.strategies.base import StrategyContext, Update
from hpcfed.strategies.fedavg import FedAvg
from hpcfed.tasks.base import Site
from hpcfed.tasks.doc2vec import Doc2VecTask, bundle_counts, counts_bundle

A = {"cat": 2, "dog": 1}
B = {"dog": 3, "eel": 1}


def test_vocabulary_sum_and_order() -> None:
    merged = g.merge_counts({0: A, 1: B})
    assert merged == {"dog": 4, "cat": 2, "eel": 1}
    assert [w for w, _ in g.order_vocab(merged, min_count=2)] == ["dog", "cat"]


def test_vocabulary_reference_compat_last_writer_wins() -> None:
    assert g.merge_counts({0: A, 1: B}, "reference_compat") == {"cat": 2, "dog": 3, "eel": 1}


def test_vocabulary_is_independent_of_arrival_order() -> None:
    sites = {0: A, 1: B, 2: {"eel": 5, "fox": 2, "ant": 2}}
    expected = g.order_vocab(g.merge_counts(sites), 2)
    for perm in itertools.permutations(sites):
        shuffled = {cid: sites[cid] for cid in perm}  # dict order = the order the server heard them
        assert g.order_vocab(g.merge_counts(shuffled), 2) == expected
        assert g.merge_counts(shuffled, "reference_compat") == g.merge_counts(sites, "reference_compat")
    # ties broken by the word: ant before fox (both 2)
    assert [w for w, _ in expected] == ["eel", "dog", "ant", "cat", "fox"]


def test_empty_vocabulary_is_an_error() -> None:
    with pytest.raises(ValueError, match="min_count=5"):
        g.order_vocab({"a": 1, "b": 2}, 5)


def test_counts_travel_as_tensors() -> None:
    counts = {"über": 3, "cat": 1}
    assert bundle_counts(counts_bundle(counts), "test") == counts


def test_both_sites_build_identical_vocabularies() -> None:
    from gensim.models.doc2vec import TaggedDocument

    settings = g.GensimSettings(vector_size=8, sample=0)
    docs_a = [TaggedDocument(["cat", "cat", "dog"], ["a0"])]
    docs_b = [TaggedDocument(["dog", "dog", "dog", "eel"], ["b0"]), TaggedDocument(["dog"], ["b1"])]
    vocab = g.order_vocab(g.merge_counts({0: Counter(A), 1: Counter(B)}), 2)
    ma, mb = g.site_model(vocab, settings, 0, docs_a), g.site_model(vocab, settings, 0, docs_b)
    assert ma.wv.index_to_key == mb.wv.index_to_key == ["dog", "cat"]
    assert ma.dv.vectors.shape == (1, 8) and mb.dv.vectors.shape == (2, 8)


def test_average_arrays_hand_values() -> None:
    a, b = {"syn1neg": np.array([[1.0, 2.0]])}, {"syn1neg": np.array([[3.0, 6.0]])}
    np.testing.assert_allclose(g.average_arrays([a, b])["syn1neg"], [[2.0, 4.0]])
    np.testing.assert_allclose(g.average_arrays([a, b], weights=[1, 3])["syn1neg"], [[2.5, 5.0]])


def test_fedavg_strategy_on_gensim_arrays_hand_values() -> None:
    params = [{"syn1neg": np.array([[1.0, 2.0]], np.float32)}, {"syn1neg": np.array([[3.0, 6.0]], np.float32)}]
    layout = ParamLayout.of(params[0])
    for weighting, n_docs, expected in (("uniform", (1, 3), [[2.0, 4.0]]), ("num_examples", (1, 3), [[2.5, 5.0]])):
        s = FedAvg(FedAvg.Config(weighting=weighting), StrategyContext(num_clients=2, seed=0))
        s.initialize(params[0])
        s.aggregate(0, [Update(client_id=i, flat=layout.flatten(p), num_examples=n)
                        for i, (p, n) in enumerate(zip(params, n_docs))])
        np.testing.assert_allclose(layout.unflatten(s.global_flat)["syn1neg"], expected)


def _joint_sites(num_docs: int = 5, **options) -> tuple[list[Doc2VecTask], dict]:
    cfg = Doc2VecTask.Config(dataset="gensim", max_docs=num_docs, vector_size=8, sample=0, min_count=1,
                             total_epochs=2, **options)
    tasks = [Doc2VecTask(cfg, Site(client_id=c, num_clients=2, seed=0, out_dir=None)) for c in range(2)]  # type: ignore[arg-type]
    replies, init = Doc2VecTask.server_setup(cfg, {c: t.setup() for c, t in enumerate(tasks)})
    for c, t in enumerate(tasks):
        t.on_setup(replies[c])
        t.set_parameters(init)
    return tasks, init


def test_joint_round_changes_shared_arrays_and_keeps_doc_vectors_private() -> None:
    tasks, init = _joint_sites()
    assert [t.model.dv.vectors.shape for t in tasks] == [(3, 8), (2, 8)]  # 5 documents dealt over 2 sites
    assert tasks[0].model.wv.index_to_key == tasks[1].model.wv.index_to_key
    for t in tasks:
        t.fit(0)
    arrays = [t.get_parameters() for t in tasks]
    assert set(arrays[0]) == {"syn1neg", "wv"}  # dv is never a federated array
    for name in ("syn1neg", "wv"):
        assert not np.allclose(arrays[0][name], init[name])
    avg = g.average_arrays(arrays)
    for t in tasks:
        t.set_parameters(avg)
    np.testing.assert_array_equal(tasks[0].model.syn1neg, tasks[1].model.syn1neg)
    assert [t.model.dv.vectors.shape for t in tasks] == [(3, 8), (2, 8)]


def test_fit_is_reproducible_per_round() -> None:
    runs = []
    for _ in range(2):
        tasks, _ = _joint_sites()
        tasks[0].fit(0)
        runs.append(tasks[0].get_parameters()["syn1neg"].copy())
    np.testing.assert_array_equal(runs[0], runs[1])


def test_reference_mode_federates_only_syn1neg() -> None:
    tasks, init = _joint_sites(federated_arrays=["syn1neg"])
    assert set(init) == {"syn1neg"} and set(tasks[0].get_parameters()) == {"syn1neg"}
    assert "wv" in tasks[0].state_dict()[1]  # the local word vectors are private state then


def test_learning_rate_decays_across_rounds() -> None:
    s = g.GensimSettings(alpha=0.025, min_alpha=0.0001)
    assert g.epoch_alpha(s, 0, 40) == pytest.approx(0.025)
    assert g.epoch_alpha(s, 39, 40) == pytest.approx(0.0001)
    assert g.epoch_alpha(s, 20, 40) == pytest.approx(0.025 - 20 * (0.025 - 0.0001) / 39)


def test_a_site_without_documents_takes_part(tmp_path) -> None:
    cfg = Doc2VecTask.Config(dataset="gensim", max_docs=2, vector_size=8, sample=0, min_count=1, total_epochs=1)
    tasks = [Doc2VecTask(cfg, Site(client_id=c, num_clients=3, seed=0, out_dir=tmp_path)) for c in range(3)]
    payloads = {c: t.setup() for c, t in enumerate(tasks)}
    empty = [c for c, t in enumerate(tasks) if not t.docs]
    assert len(empty) == 1 and payloads[empty[0]][1]["words"].size == 0  # an empty Counter
    replies, init = Doc2VecTask.server_setup(cfg, payloads)
    t = tasks[empty[0]]
    t.on_setup(replies[empty[0]])
    t.set_parameters(init)
    assert t.fit(0).num_examples == 0
    np.testing.assert_array_equal(t.get_parameters()["wv"], init["wv"])  # skipped in training
    assert t.export_embeddings(tmp_path).is_file()


def test_scale_update_hand_values() -> None:
    start = {"wv": np.array([[1.0, 1.0]], np.float32)}
    trained = {"wv": np.array([[2.0, 0.0]], np.float32)}
    np.testing.assert_allclose(g.scale_update(start, trained, 2.0)["wv"], [[3.0, -1.0]])
    with pytest.raises(ValueError, match="no matching start"):
        g.scale_update({}, trained, 2.0)


def test_sum_update_makes_the_mean_the_sum_of_the_sites_steps() -> None:
    tasks, init = _joint_sites(update="sum")
    plain, _ = _joint_sites()
    for t in tasks + plain:
        t.fit(0)
    mean_of_uploads = g.average_arrays([t.get_parameters() for t in tasks])
    steps = [p.get_parameters() for p in plain]  # same seeds: the same local epochs, uploaded unscaled
    for name in ("wv", "syn1neg"):
        want = init[name] + sum(s[name] - init[name] for s in steps)
        np.testing.assert_allclose(mean_of_uploads[name], want, atol=1e-6)


def test_rounds_per_epoch_trains_one_slice_of_the_epoch_per_round() -> None:
    tasks, _ = _joint_sites(num_docs=12, rounds_per_epoch=3)
    site = tasks[0]  # 6 documents: rounds 0, 1, 2 train documents 0 and 3, 1 and 4, 2 and 5
    first = [site.fit(r) for r in range(3)]
    assert [f.num_examples for f in first] == [2, 2, 2]
    assert [f.metrics["alpha"] for f in first] == pytest.approx([0.025] * 3)  # all of epoch 0
    assert site.fit(3).metrics["alpha"] == pytest.approx(0.0001)  # round 3 starts epoch 1 (of 2)
    with pytest.raises(ValueError, match="set local_epochs=1"):
        Doc2VecTask.Config(dataset="gensim", rounds_per_epoch=2, local_epochs=2).validate()


def test_inferred_doc_vectors_are_what_a_text_query_of_the_same_words_gives(tmp_path) -> None:
    from hpcfed.data.corpus import tokenize
    from hpcfed.store.embeddings import read_export

    tasks, _ = _joint_sites(num_docs=6, doc_vectors="inferred", infer_epochs=3)
    t = tasks[1]
    t.site.out_dir = tmp_path
    t.fit(0)
    trained = np.stack([t.model.dv[d.id] for d in t.docs])
    path = t.export_embeddings(tmp_path)
    exported = read_export(path, "doc").vectors
    assert not np.allclose(exported, trained)  # re-vectorised, not gensim's training-time vectors
    model, settings = g.load_model(tmp_path / "models" / "site1.h5")
    np.testing.assert_allclose(exported[0], g.infer(model, tokenize(t.docs[0].text), settings), atol=1e-6)
    t.fit(1)  # a new model: the cached vectors are dropped
    assert not np.allclose(t.doc_vectors(), exported)


def test_class_names_reach_the_export_and_public_corpus_errors_name_the_key(tmp_path) -> None:
    import json

    from hpcfed.data.root import DataError
    from hpcfed.store.embeddings import read_export

    corpus = tmp_path / "news.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"n{i}", "text": f"{w} prices rose again today", "label": w}) + "\n"
                              for i, w in enumerate(["grain", "earn", "trade", "earn"])))
    cfg = Doc2VecTask.Config(dataset="file", path=str(corpus), vector_size=8, sample=0, min_count=1, total_epochs=1)
    task = Doc2VecTask(cfg, Site(client_id=0, num_clients=1, seed=0, out_dir=tmp_path))
    replies, init = Doc2VecTask.server_setup(cfg, {0: task.setup()})
    task.on_setup(replies[0])
    task.set_parameters(init)
    export = read_export(task.export_embeddings(tmp_path), "doc")
    assert json.loads(export.attrs["label_names"]) == ["earn", "grain", "trade"]
    assert export.labels.tolist() == [1, 0, 2, 0]
    assert Doc2VecTask.final_figures_on.startswith("each site's own documents, as doc2vec has no test split")
    missing = Doc2VecTask.Config(dataset="file", path=str(corpus), mode="nomapping",
                                 public_corpus=f"file:{tmp_path / 'nope.jsonl'}")
    with pytest.raises(DataError, match=r"task.public_corpus='file:.*nope.jsonl' .* or none with method=nomapping"):
        Doc2VecTask(missing, Site(client_id=0, num_clients=1, seed=0, out_dir=tmp_path))
    alone = Doc2VecTask(Doc2VecTask.Config(dataset="file", path=str(corpus), mode="nomapping", public_corpus="none"),
                        Site(client_id=0, num_clients=1, seed=0, out_dir=tmp_path))
    assert alone.public == []
    with pytest.raises(ValueError, match="method=mapping fits its mappers on a public corpus"):
        Doc2VecTask.Config(dataset="file", path=str(corpus), mode="mapping", public_corpus="none").validate()
