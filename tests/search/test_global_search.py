"""Global search: merge order (spec 4.5 test 6), site indexes, offline search over exports, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpcfed.models.mapper import Mapper, MapperConfig, mapper_path, save_mapper
from hpcfed.search.global_search import GlobalSearch
from hpcfed.search.index import Hit, SiteIndex, merge_results
from hpcfed.store.embeddings import export_path, write_export
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("own_keys")  # index keys in a temporary folder


def test_merge_order_hand_case() -> None:
    site0 = [Hit("0", "x", 0.9), Hit("0", "y", 0.5)]
    site1 = [Hit("1", "z", 0.7)]
    assert [h.id for h in merge_results([site0, site1], 2)] == ["x", "z"]
    tie = merge_results([[Hit("0", "b", 0.5)], [Hit("1", "a", 0.5)]], 2)
    assert [h.id for h in tie] == ["a", "b"]  # ties -> doc id


def test_interleave_merge_takes_sites_rank_by_rank_home_first() -> None:
    home = [Hit("1", "h1", 0.4), Hit("1", "h2", 0.3), Hit("1", "h3", 0.2)]
    other = [Hit("0", "o1", 0.9), Hit("0", "o2", 0.8)]
    third = [Hit("2", "t1", 0.95)]
    got = merge_results([other, home, third], 5, "interleave", home="1")
    assert [h.id for h in got] == ["h1", "o1", "t1", "h2", "o2"]
    assert [h.id for h in merge_results([other, home, third], 3)] == ["t1", "o1", "o2"]  # by score, for contrast
    assert [h.id for h in merge_results([[], home], 2, "interleave", home="0")] == ["h1", "h2"]
    with pytest.raises(ValueError, match="merge='best'"):
        merge_results([home], 2, "best")


def _site_with_cosines(site: str, cosines: list[float]) -> SiteIndex:
    """Unit vectors whose cosines with the query (1, 0) are the given values."""
    vectors = np.array([[c, np.sqrt(1 - c * c)] for c in cosines], np.float32)
    return SiteIndex(site, [f"{site}-{i}" for i in range(len(cosines))], vectors)


def test_zscore_merge_compares_sites_by_standardized_scores() -> None:
    query = np.array([[1.0, 0.0]], np.float32)
    home = _site_with_cosines("0", [0.5, 0.3, 0.1])  # mean .3, std .1633
    mapped = _site_with_cosines("1", [0.95, 0.94, 0.81])  # scores run high: mean .9, std .06377
    z_home, z_mapped = home.hits(query, 3, standardize=True)[0], mapped.hits(query, 3, standardize=True)[0]
    assert [h.score for h in z_home] == pytest.approx([1.224745, 0.0, -1.224745], abs=1e-4)
    assert [h.score for h in z_mapped] == pytest.approx([0.784063, 0.627250, -1.411313], abs=1e-4)
    assert [h.id for h in merge_results([z_home, z_mapped], 3, "zscore")] == ["0-0", "1-0", "1-1"]
    raw = [home.hits(query, 3)[0], mapped.hits(query, 3)[0]]
    assert [h.id for h in merge_results(raw, 3, "score")] == ["1-0", "1-1", "1-2"]  # raw cosines: one site only
    # the excluded document (the query itself) is left out of the mean and std: (.3 - .2) / .1 = 1
    assert home.hits(query, 1, exclude=["0-0"], standardize=True)[0][0].score == pytest.approx(1.0, abs=1e-4)
    assert _site_with_cosines("2", [0.4]).hits(query, 1, standardize=True)[0][0].score == 0.0  # one document


def test_site_index_topk_excludes_the_query() -> None:
    idx = SiteIndex("0", ["a", "b", "c"], np.array([[1, 0], [0.9, 0.1], [0, 1]], np.float32), np.array([0, 0, 1]))
    hits = idx.hits(idx.raw[:1], 2, exclude=["a"])[0]
    assert [h.id for h in hits] == ["b", "c"]
    assert hits[0].score == pytest.approx(0.9 / np.hypot(0.9, 0.1), rel=1e-5)
    with pytest.raises(ValueError, match="need a mapper"):
        idx.topk(np.zeros((1, 3)), 1)


def _write_sites(run: Path, *, rotate_site1: bool) -> None:
    """Two sites in a 2-d space; site 1's space optionally rotated by 90 degrees."""
    rot = np.array([[0.0, -1.0], [1.0, 0.0]], np.float32)
    site0 = np.array([[1, 0], [0.7, 0.7]], np.float32)
    site1 = np.array([[0.95, 0.05], [0, 1]], np.float32)
    if rotate_site1:
        site1 = site1 @ rot.T
    write_export(export_path(run, 0), site0, ["q", "a"], np.array([1, 2]), entity="doc", model="t", site=0)
    write_export(export_path(run, 1), site1, ["b", "c"], np.array([1, 3]), entity="doc", model="t", site=1)
    if rotate_site1:  # exact linear mappers as MLPs: relu(x) - relu(-x) = x
        eye = np.eye(2, dtype=np.float32)
        for src, dst, r in (("0", "1", rot), ("1", "0", rot.T)):
            m = Mapper(src, dst, np.vstack([eye, -eye]), np.zeros(4, np.float32), np.hstack([r, -r]),
                       np.zeros(2, np.float32), [1.0], MapperConfig(hidden=4))
            save_mapper(mapper_path(run / "mappers", src, dst), m)


def test_global_search_joint_and_mapping(tmp_path: Path) -> None:
    _write_sites(tmp_path / "joint", rotate_site1=False)
    hits = GlobalSearch.from_folder(tmp_path / "joint").search_id("q", 2)
    assert [(h.site, h.id) for h in hits] == [("1", "b"), ("0", "a")]
    _write_sites(tmp_path / "mapped", rotate_site1=True)
    mapped = GlobalSearch.from_folder(tmp_path / "mapped", mode="mapping").search_id("q", 2)
    assert [(h.site, h.id) for h in mapped] == [("1", "b"), ("0", "a")]
    unmapped = GlobalSearch.from_folder(tmp_path / "mapped", mode="nomapping").search_id("q", 1)
    assert unmapped[0].id != "b"  # without the mapper the rotated space gives the wrong neighbour
    with pytest.raises(ValueError, match="train-mappers"):
        GlobalSearch.from_folder(tmp_path / "joint", mode="mapping")


def test_search_cli_offline_json(tmp_path: Path) -> None:
    _write_sites(tmp_path, rotate_site1=True)
    proc = run_cli(["search", "query", str(tmp_path), "--id", "q", "--mode", "mapping", "--k", "2", "--compact"])
    out = json.loads(proc.stdout)
    results = out["queries"][0]["results"]
    assert [(r["site"], r["id"]) for r in results] == [("1", "b"), ("0", "a")]
    assert results[0]["score"] >= results[1]["score"]
    bad = run_cli(["search", "query", str(tmp_path), "--id", "nope"], check=False)
    assert bad.returncode == 2 and "in none of the sites" in bad.stderr
