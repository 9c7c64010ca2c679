"""Corpora: user files (JSONL / plain text), gensim's test corpus, 20 Newsgroups and its site splits."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcfed.data.corpus import (
    NEWSGROUP_FAMILIES,
    Document,
    clean_post,
    gensim_test_corpus,
    label_names,
    load_20newsgroups,
    load_corpus_file,
    sample,
    split_documents,
)
from hpcfed.data.root import DataError


def test_jsonl_and_plain_text(tmp_path: Path) -> None:
    p = tmp_path / "docs.jsonl"
    p.write_text('{"id": "a", "text": "hello world", "label": 2}\n\n{"id": 7, "text": "more"}\n')
    docs = load_corpus_file(p)
    assert [(d.id, d.label) for d in docs] == [("a", 2), ("7", -1)]
    t = tmp_path / "docs.txt"
    t.write_text("first line\n\nthird\n")
    assert [(d.id, d.text) for d in load_corpus_file(t)] == [("0", "first line"), ("1", ""), ("2", "third")]


@pytest.mark.parametrize("line, message", [
    ("not json", "docs.jsonl:2: not valid JSON"),
    ('{"text": "x"}', "docs.jsonl:2: field 'id'"),
    ('{"id": "b", "text": 3}', "docs.jsonl:2: field 'text'"),
    ('{"id": "b", "text": "x", "label": 1.5}', "docs.jsonl:2: field 'label' must be a class name or an integer"),
    ('{"id": "b", "text": "x", "label": ""}', "docs.jsonl:2: field 'label'"),
    ('{"id": "b", "text": "x", "label": ["a"]}', "docs.jsonl:2: field 'label'"),
    ('{"id": "a", "text": "x"}', "docs.jsonl:2: duplicate id"),
])
def test_jsonl_errors_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    p = tmp_path / "docs.jsonl"
    p.write_text('{"id": "a", "text": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        load_corpus_file(p)


def test_class_names_are_numbered_in_sorted_order_and_kept(tmp_path: Path) -> None:
    p = tmp_path / "reuters.jsonl"
    p.write_text('{"id": "a", "text": "x", "label": "trade"}\n{"id": "b", "text": "y", "label": "earn"}\n'
                 '{"id": "c", "text": "z"}\n{"id": "d", "text": "w", "label": "trade"}\n')
    docs = load_corpus_file(p)
    assert [(d.label, d.group) for d in docs] == [(1, "trade"), (0, "earn"), (-1, ""), (1, "trade")]
    assert label_names(docs) == ["earn", "trade"]
    p.write_text('{"id": "a", "text": "x", "label": "10"}\n{"id": "b", "text": "y", "label": 9}\n')
    assert [d.label for d in load_corpus_file(p)] == [1, 0]  # names, in numeric order
    p.write_text('{"id": "a", "text": "x", "label": 10}\n{"id": "b", "text": "y", "label": 9}\n')
    assert [d.label for d in load_corpus_file(p)] == [10, 9]  # integers keep their values


def test_max_docs_is_a_seeded_sample_not_the_first_n() -> None:
    docs = gensim_test_corpus()
    picked = sample(docs, 30, seed=0)
    assert len(picked) == 30 and picked == sample(docs, 30, seed=0)
    assert [d.id for d in picked] != [d.id for d in docs[:30]] and max(int(d.id) for d in picked) > 100
    assert [int(d.id) for d in picked] == sorted(int(d.id) for d in picked)  # corpus order kept
    assert sample(docs, None, 0) is docs and sample(docs, 500, 0) is docs


def test_gensim_corpus_and_random_split() -> None:
    docs = gensim_test_corpus()
    assert len(docs) == 300
    parts = split_documents(docs, 3, seed=1)
    assert sorted(d.id for p in parts for d in p) == sorted(d.id for d in docs)
    assert [len(p) for p in parts] == [100, 100, 100]


def test_family_split_keeps_families_whole() -> None:
    groups = sorted(NEWSGROUP_FAMILIES)
    docs = [Document(f"{g}/{i}", "t", groups.index(g), g) for g in groups for i in range(3)]
    parts = split_documents(docs, 2, mode="family")
    fams = [{NEWSGROUP_FAMILIES[d.group] for d in p} for p in parts]
    assert fams[0].isdisjoint(fams[1]) and fams[0] | fams[1] == set(NEWSGROUP_FAMILIES.values())
    with pytest.raises(ValueError, match="families for 9 sites"):
        split_documents(docs, 9, mode="family")


POST = ("From: bob@x.org\nSubject: Re: Orbit question\nLines: 6\n\n"
        "In article <1@x> ann writes:\n> old text\n| more quoted\nnew text here\n\n-- \nBob, Houston\n")


@pytest.mark.parametrize("remove, keep_subject, want", [
    ((), False, POST),
    (("headers",), False, "In article <1@x> ann writes:\n> old text\n| more quoted\n"
                          "new text here\n\n-- \nBob, Houston\n"),
    (("headers",), True, "Re: Orbit question\nIn article <1@x> ann writes:\n> old text\n| more quoted\n"
                         "new text here\n\n-- \nBob, Houston\n"),
    (("headers", "quotes"), False, "new text here\n\n-- \nBob, Houston\n"),
    (("headers", "quotes", "footers"), True, "Re: Orbit question\nnew text here\n"),
])
def test_clean_post_follows_sklearn_rules(remove, keep_subject, want) -> None:
    assert clean_post(POST, remove, keep_subject) == want


def test_clean_post_rejects_unknown_parts() -> None:
    from hpcfed.tasks.doc2vec import Doc2VecTask

    with pytest.raises(ValueError, match=r"task.remove=\['headers', 'signature'\]: unknown part"):
        Doc2VecTask.Config(remove=["headers", "signature"]).validate()


@pytest.mark.realdata
def test_20newsgroups_from_the_tarball(shared_data) -> None:
    # A data folder without the text corpus (some CI mirrors carry only the graphs) skips, not fails.
    if not (shared_data / "text" / "20news-bydate.tar.gz").is_file():
        pytest.skip(f"{shared_data}/text/20news-bydate.tar.gz is absent")
    docs = load_20newsgroups(shared_data, subset="test", max_docs=200)
    assert len(docs) == 200 and all(d.id.startswith("test/") for d in docs)
    assert all(0 <= d.label < 20 and d.group in NEWSGROUP_FAMILIES for d in docs)
    assert not any(d.text.startswith("From:") for d in docs)  # headers are dropped
