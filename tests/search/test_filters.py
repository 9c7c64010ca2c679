"""Filters (``--where``, ``"where"``, `GlobalSearch.where`): applied inside the search, so that a filter
keeping 1 % of a collection still finds its true top-k; every hit matches; bad filters are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from search_data import EVENTS, T0, clustered, write_message_sites

from hpcfed.search import kept
from hpcfed.search.ann import AnnIndex
from hpcfed.search.ann_build import IndexSpec, build_index
from hpcfed.search.filters import FilterError
from hpcfed.search.global_search import GlobalSearch
from hpcfed.search.index import SiteIndex
from hpcfed.store.embeddings import export_path, write_export
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("own_keys")  # index keys in a temporary folder


@pytest.mark.parametrize("exact_rows", [None, 0])
def test_a_filter_keeping_one_percent_finds_the_exact_top_k_inside_an_ivf_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exact_rows: int | None) -> None:
    """100 labels over 20,000 vectors: label=7 keeps 200. Scored exactly over the kept rows' decoded
    vectors (few rows: `kept.EXACT_ROWS`), or (exact_rows=0) through the IVF index with an ID selector
    and its default nprobe scaled by the share kept: about the same top-10 as exact search over them."""
    if exact_rows is not None:
        monkeypatch.setattr(kept, "EXACT_ROWS", exact_rows)
    n = 20_000
    vectors = clustered(n, 32, seed=3)
    write_export(export_path(tmp_path, 0), vectors, [f"d{i}" for i in range(n)], np.arange(n) % 100,
                 entity="doc", model="test", site=0)
    build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="ivf", nlist=256), progress=False)
    ann = AnnIndex.load(export_path(tmp_path, 0))
    exact = SiteIndex.from_export(export_path(tmp_path, 0))
    keep = ann.labels == 7
    queries = vectors[::200] + 0.05 * np.random.default_rng(1).normal(size=(100, 32)).astype(np.float32)
    got, want = ann.hits(queries, 10, allowed=keep), exact.hits(queries, 10, allowed=keep)
    assert all(len(g) == 10 and all(h.label == 7 for h in g) for g in got)
    recall = np.mean([len({h.id for h in g} & {h.id for h in w}) / 10 for g, w in zip(got, want)])
    assert recall >= (0.95 if exact_rows == 0 else 0.98)  # exact over the int8-decoded vectors
    assert ann.kept.get(keep, ann.index) is ann.kept.get(keep, ann.index)  # worked out once per mask
    assert (ann.kept.get(keep, ann.index).vectors is None) == (exact_rows == 0)
    unfiltered = ann.hits(queries, 10)  # without the filter the answers are mostly other labels
    assert np.mean([h.label == 7 for hits in unfiltered for h in hits]) < 0.2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("messages")
    write_message_sites(run, [400, 300])
    return run


@pytest.mark.parametrize("indexed", [False, True])
def test_every_hit_matches_site_label_time_and_attribute_filters(run: Path, indexed: bool,
                                                                  tmp_path: Path) -> None:
    if indexed:
        run = Path(tmp_path / "run")
        write_message_sites(run, [400, 300])
        for site in (0, 1):
            build_index(export_path(run, site), spec=IndexSpec(kind="flat"), progress=False)
    search = GlobalSearch.from_folder(run, exact=not indexed)
    q = search.indexes["0"].vector_of("m0-5")[None]

    def hits(*where: str) -> list:
        return search.search("0", q, 10, ["m0-5"], search.where(list(where)))[0]

    assert {h.site for h in hits("site=1")} == {"1"}
    fire = hits("label=fire")  # by name: label 1 at both sites
    assert len(fire) == 10 and {search.label_name(h.site, h.label) for h in fire} == {"fire"}
    assert {search.label_name(h.site, h.label) for h in hits("label_name=quake")} == {"quake"}
    assert {h.site for h in hits("label=quake")} == {"0"}  # site 1 names no quake
    either = hits("label=flood", "label=storm")
    assert {search.label_name(h.site, h.label) for h in either} <= {"flood", "storm"} and len(either) == 10
    window = hits("time=2012-10-12T05:00..2012-10-12T10:00")  # rows 5..9 of each site, row 5 of site 0 is the query
    assert sorted(h.id for h in window) == sorted([f"m0-{i}" for i in range(6, 10)] + [f"m1-{i}" for i in range(5, 10)])
    assert {h.id for h in hits(f"time={T0 + 3600 * 398}..")} == {"m0-398", "m0-399"}
    lang = hits("lang=2", "site=0")
    assert lang and all(int(h.id.split("-")[1]) % 3 == 2 for h in lang)
    shown = search.shown(window[0])
    assert shown["label_name"] in EVENTS and shown["time"].startswith("2012-10-12T")
    assert shown["text"].startswith("message")


@pytest.mark.parametrize(("where", "named"), [
    (["colour=red"], "'colour': no site's export carries that attribute"),
    (["time=2012-10-13..2012-10-12"], "the range is empty"),
    (["time=2012-10-12..2012-10-12"], "the range is empty"),
    (["time=yesterday..today"], "'yesterday' is neither an ISO 8601"),
    (["label=tsunami"], "label='tsunami': no site names a label so"),
    (["label=99"], "label=99: no site has a document with that label"),
    (["site=5"], "site='5': no such site"),
    (["lang=abc"], "'abc' is not a number"),
    (["site"], "write KEY=VALUE"),
])
def test_bad_filters_are_refused_naming_them(run: Path, where: list[str], named: str) -> None:
    search = GlobalSearch.from_folder(run, exact=True)
    with pytest.raises(FilterError, match=None) as exc:
        search.where(where)
    assert named in str(exc.value)


def test_query_cli_filters_and_names_a_bad_filter_in_one_line(run: Path) -> None:
    out = json.loads(run_cli(["search", "query", str(run), "--exact", "--id", "m1-3", "--k", "5", "--compact",
                              "--where", "site=0", "--where", "label=storm"]).stdout)
    results = out["queries"][0]["results"]
    assert len(results) == 5 and {(r["site"], r["label_name"]) for r in results} == {("0", "storm")}
    assert all("time" in r and "text" in r for r in results)
    bad = run_cli(["search", "query", str(run), "--exact", "--id", "m1-3", "--where", "mood=happy"], check=False)
    assert bad.returncode == 2 and "'mood': no site's export carries that attribute" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_service_filters_by_where_and_refuses_a_bad_one_with_a_400(run: Path) -> None:
    from test_service import Service

    service = Service([str(run), "--exact"])
    try:
        where = {"label": ["fire", "quake"], "time": "2012-10-12..2012-10-20"}
        status, body = service.call("/search", {"id": "m0-7", "k": 4, "where": where})
        assert status == 200
        results = body["queries"][0]["results"]
        assert len(results) == 4 and {r["label_name"] for r in results} <= {"fire", "quake"}
        assert all("2012-10-12" <= r["time"] < "2012-10-20" for r in results)
        for where, named in (({"colour": "red"}, "'colour': no site's export carries"),
                             ({"time": "2012-10-20..2012-10-12"}, "the range is empty"),
                             ({"label": "tsunami"}, "label='tsunami': no site names a label so"),
                             ([1, 2], '"where" must be an object')):
            status, body = service.call("/search", {"id": "m0-7", "where": where})
            assert status == 400 and named in body["error"], body
    finally:
        service.stop()


@pytest.mark.parametrize("queries", [1, kept.SMALL_BATCH, kept.SMALL_BATCH + 1, 40])
def test_kept_top_k_is_the_exact_top_k_in_either_path(queries: int) -> None:
    """A few query rows go through FAISS's scan, more through one matrix product: both give the exact
    top-k, best first, and k as large as the rows kept."""
    rng = np.random.default_rng(4)
    vectors = rng.normal(size=(700, 24)).astype(np.float32)
    q = rng.normal(size=(queries, 24)).astype(np.float32)
    want = q.astype(np.float64) @ vectors.T.astype(np.float64)
    for k in (1, 10, 700):
        scores, rows = kept.top_k(q, vectors, k)
        assert rows.shape == (queries, k) and scores.shape == (queries, k)
        assert np.allclose(scores, np.take_along_axis(want, rows, axis=1), atol=1e-4)
        assert np.allclose(scores, -np.sort(-want, axis=1)[:, :k], atol=1e-4)
        assert all(len(set(r.tolist())) == k for r in rows)


def test_a_narrow_filter_searched_on_the_callers_thread_answers_as_the_pool_does(
        run: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Few kept rows are searched site after site on the calling thread (`INLINE_WORK`); forcing the
    pool (no inline work at all) gives the same answers, for one query and for a batch."""
    import hpcfed.search.global_search as gs

    run = Path(tmp_path / "run")
    write_message_sites(run, [400, 300])
    for site in (0, 1):
        build_index(export_path(run, site), spec=IndexSpec(kind="flat"), progress=False)
    search = GlobalSearch.from_folder(run)
    where = search.where(["label=fire"])
    ids = ["m0-5", "m1-7", "m0-100", "m1-250"]
    vectors = np.stack([search.indexes[i[1]].vector_of(i) for i in ids])
    calls: list[str] = []
    monkeypatch.setattr(gs, "in_turn", lambda fn, items: calls.append("inline") or [fn(x) for x in items])
    inline = [search.search("0", vectors[:1], 10, ids[:1], where), search.search("0", vectors, 10, ids, where)]
    assert calls == ["inline", "inline"]
    monkeypatch.setattr(gs, "INLINE_WORK", 0)
    pooled = [search.search("0", vectors[:1], 10, ids[:1], where), search.search("0", vectors, 10, ids, where)]
    assert calls == ["inline", "inline"]  # the pool this time
    assert inline == pooled and all(len(hits) == 10 for batch in inline for hits in batch)
    assert all(search.label_name(h.site, h.label) == "fire" for batch in inline for hits in batch for h in hits)
