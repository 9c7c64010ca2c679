"""Search indexes: recall against exact search, the same answers in every mode and merge, and refusal
of indexes that are forged, truncated, from another export or from another key."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from search_data import write_sites

from hpcfed.models.mapper import Mapper, MapperConfig, mapper_path, save_mapper
from hpcfed.search.ann import AnnIndex, SearchIndexError, index_path, open_site
from hpcfed.search.ann_build import IndexSpec, build_index, index_is_current
from hpcfed.search.global_search import GlobalSearch
from hpcfed.search.index import SiteIndex
from hpcfed.store import sealed
from hpcfed.store.embeddings import export_path, write_export

pytestmark = pytest.mark.usefixtures("own_keys")  # index keys in a temporary folder


def _recall(ann: AnnIndex, exact: SiteIndex, queries: np.ndarray, k: int = 10) -> float:
    got = ann.hits(queries, k)
    want = exact.hits(queries, k)
    return float(np.mean([len({h.id for h in g} & {h.id for h in w}) / k for g, w in zip(got, want)]))


@pytest.mark.parametrize(("spec", "floor"), [
    (IndexSpec(kind="ivf"), 0.95),
    (IndexSpec(kind="hnsw", hnsw_m=16), 0.95),
    (IndexSpec(kind="ivf", compress="int8"), 0.9),
    (IndexSpec(kind="ivf", compress="pq"), 0.3),
])
def test_index_recall_against_exact_search(tmp_path: Path, spec: IndexSpec, floor: float) -> None:
    vectors = write_sites(tmp_path, [3000])["0"]
    report = build_index(export_path(tmp_path, 0), spec=spec, progress=False)
    ann = AnnIndex.load(export_path(tmp_path, 0))
    exact = SiteIndex.from_export(export_path(tmp_path, 0))
    queries = vectors[::30] + 0.05 * np.random.default_rng(9).normal(size=vectors[::30].shape).astype(np.float32)
    assert report["num_rows"] == 3000 and ann.kind == report["factory"]
    assert _recall(ann, exact, queries) >= floor
    if spec.compress == "none":  # uncompressed: the scores are the exact cosines
        best = ann.hits(queries[:5], 1)
        assert [h[0].score for h in best] == pytest.approx([h[0].score for h in exact.hits(queries[:5], 1)], abs=1e-5)
    if spec.compress == "pq":  # IVF-PQ: d/8 bytes per vector, far below the float32 vectors
        assert report["faiss_bytes"] < 3000 * 32 * 4 / 4


def test_flat_index_answers_like_exact_search_in_every_mode_and_merge(tmp_path: Path) -> None:
    """kind=flat is exact: every mode (with mappers) and merge gives the brute-force answers."""
    write_sites(tmp_path, [300, 200, 250], d=8)
    rng = np.random.default_rng(0)
    eye = np.eye(8, dtype=np.float32)
    for src in "012":
        for dst in "012":
            if src != dst:  # linear mappers as MLPs: relu(x) - relu(-x) = x, through a random rotation
                r = np.linalg.qr(rng.normal(size=(8, 8)))[0].astype(np.float32)
                m = Mapper(src, dst, np.vstack([eye, -eye]), np.zeros(16, np.float32), np.hstack([r, -r]),
                           np.zeros(8, np.float32), [1.0], MapperConfig(hidden=16))
                save_mapper(mapper_path(tmp_path / "mappers", src, dst), m)
    for site in range(3):
        build_index(export_path(tmp_path, site), spec=IndexSpec(kind="flat"), progress=False)
    for mode in ("joint", "mapping", "nomapping"):
        for merge in ("score", "interleave", "zscore"):
            fast = GlobalSearch.from_folder(tmp_path, mode=mode, merge=merge)
            slow = GlobalSearch.from_folder(tmp_path, mode=mode, merge=merge, exact=True)
            assert isinstance(fast.indexes["1"], AnnIndex) and isinstance(slow.indexes["1"], SiteIndex)
            for doc_id in ("s0-3", "s1-17", "s2-249"):
                got, want = fast.search_id(doc_id, 7), slow.search_id(doc_id, 7)
                assert [(h.site, h.id) for h in got] == [(h.site, h.id) for h in want], (mode, merge, doc_id)
                assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-4)
                assert doc_id not in [h.id for h in got]


@pytest.mark.parametrize(("compress", "tolerance"), [("none", 1e-5), ("int8", 0.03)])
def test_index_gives_back_the_exported_vector_and_labels(tmp_path: Path, compress: str, tolerance: float) -> None:
    vectors = write_sites(tmp_path, [500])["0"]
    build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="ivf", compress=compress), progress=False)
    ann = AnnIndex.load(export_path(tmp_path, 0))
    assert ann.vector_of("s0-42") == pytest.approx(vectors[42], rel=tolerance, abs=tolerance)
    assert {h.label for h in ann.hits(vectors[:1], 20)[0]} <= {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="not in site 0"):
        ann.vector_of("s9-1")


def test_refresh_rebuilds_only_what_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_sites(tmp_path, [400])
    export = export_path(tmp_path, 0)
    spec = IndexSpec(kind="ivf")
    assert not index_is_current(export, None, spec)
    build_index(export, spec=spec, progress=False)
    assert index_is_current(export, None, spec)
    assert not index_is_current(export, None, IndexSpec(kind="flat"))  # another kind asked: rebuild
    monkeypatch.setenv("HPCFED_STATE_KEY", "ef" * 32)
    assert not index_is_current(export, None, spec)  # tagged with another key: rebuild
    monkeypatch.delenv("HPCFED_STATE_KEY")
    write_sites(tmp_path, [401])
    assert not index_is_current(export, None, spec)


def test_build_shows_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_sites(tmp_path, [2000])
    build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="ivf"), progress=True, block_bytes=32 * 4 * 256)
    err = capsys.readouterr().err
    assert "site0 IVF" in err and "vec" in err


def test_index_from_another_export_is_refused(tmp_path: Path) -> None:
    write_sites(tmp_path, [500, 500])
    for site in (0, 1):
        build_index(export_path(tmp_path, site), spec=IndexSpec(kind="flat"), progress=False)
    shutil.copyfile(index_path(export_path(tmp_path, 1), "doc"), index_path(export_path(tmp_path, 0), "doc"))
    with pytest.raises(SearchIndexError, match="built from another export"):
        AnnIndex.load(export_path(tmp_path, 0))
    # an export rewritten after its index was built (same size): the index no longer describes it
    build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="flat"), progress=False)
    write_sites(tmp_path, [500])
    with pytest.raises(SearchIndexError, match="built from another export"):
        GlobalSearch.from_folder(tmp_path)
    assert GlobalSearch.from_folder(tmp_path, exact=True).search_id("s0-1", 3)  # --exact still answers
    write_sites(tmp_path, [499])
    with pytest.raises(SearchIndexError, match=r"holds 500 but the export site0\.h5 has 499"):
        AnnIndex.load(export_path(tmp_path, 0))
    write_sites(tmp_path, [500], d=16)
    with pytest.raises(SearchIndexError, match=r"has dimension 32 but the export site0\.h5 has 16"):
        AnnIndex.load(export_path(tmp_path, 0))


def test_forged_index_is_refused(tmp_path: Path) -> None:
    write_sites(tmp_path, [800])
    build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="ivf"), progress=False)
    path = index_path(export_path(tmp_path, 0), "doc")
    with h5py.File(path, "r+") as f:  # swap two ids, then recompute the digest with a key of our own
        blob = f["ids/utf8"][:]
        blob[:4], blob[4:8] = blob[4:8].copy(), blob[:4].copy()  # "s0-0" <-> "s0-1"
        f["ids/utf8"][:] = blob
    sealed.seal(path, sealed.FileAuth.from_psk(b"x" * 32, "search-index"))
    with pytest.raises(SearchIndexError, match="authentication failed"):
        AnnIndex.load(export_path(tmp_path, 0))
    with h5py.File(path, "r+") as f:  # edited without touching the tag: the digest no longer matches
        f["norms"][0] = 7.0
    with pytest.raises(SearchIndexError, match="checksum mismatch"):
        AnnIndex.load(export_path(tmp_path, 0))
    with h5py.File(path, "r+") as f:  # no tag at all
        del f.attrs["auth"]
    with pytest.raises(SearchIndexError, match="not authenticated"):
        AnnIndex.load(export_path(tmp_path, 0))


def test_truncated_index_is_refused(tmp_path: Path) -> None:
    write_sites(tmp_path, [800])
    build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="ivf"), progress=False)
    path = index_path(export_path(tmp_path, 0), "doc")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SearchIndexError, match="not a readable HDF5 file"):
        open_site(export_path(tmp_path, 0), None, "0")


def test_index_is_tagged_with_the_job_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With $HPCFED_STATE_KEY the export's tag is checked and the index is tagged with that job's key:
    a reader holding another job's key refuses it."""
    from hpcfed.store.embeddings import seal_export

    write_sites(tmp_path, [300])
    seal_export(export_path(tmp_path, 0), sealed.FileAuth.from_psk(bytes.fromhex("ab" * 32), "embeddings"))
    monkeypatch.setenv("HPCFED_STATE_KEY", "ab" * 32)
    report = build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="flat"), progress=False)
    assert report["export_verified"] is True
    assert len(AnnIndex.load(export_path(tmp_path, 0)).ids) == 300
    monkeypatch.setenv("HPCFED_STATE_KEY", "cd" * 32)
    with pytest.raises(SearchIndexError, match="authentication failed"):
        AnnIndex.load(export_path(tmp_path, 0))
    from hpcfed.store.embeddings import ExportError

    with pytest.raises(ExportError, match="authentication failed"):  # nor is the export indexed with it
        build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="flat"), progress=False)


def test_index_per_entity(tmp_path: Path) -> None:
    write_sites(tmp_path, [300])
    write_export(export_path(tmp_path, 0), np.ones((40, 32), np.float32), [f"p{i}" for i in range(40)],
                 entity="public", model="test", site=0, append=True)
    build_index(export_path(tmp_path, 0), entity="public", spec=IndexSpec(kind="flat"), progress=False)
    assert index_path(export_path(tmp_path, 0), "public").is_file()
    assert isinstance(open_site(export_path(tmp_path, 0), "public", "0"), AnnIndex)
    assert isinstance(open_site(export_path(tmp_path, 0), "doc", "0"), SiteIndex)  # no doc index: exact


def test_ids_of_any_script_survive_the_index(tmp_path: Path) -> None:
    ids = ["café", "東京-1", "a", "", "naïve résumé", "x" * 300]
    vectors = np.random.default_rng(0).normal(size=(len(ids), 8)).astype(np.float32)
    write_export(export_path(tmp_path, 0), vectors, ids, entity="doc", model="test", site=0)
    build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="flat"), progress=False)
    ann = AnnIndex.load(export_path(tmp_path, 0))
    assert ann.ids == ids and ann.hits(vectors[1:2], 1)[0][0].id == "東京-1"


def test_big_exports_get_an_int8_ivf_index_by_default() -> None:
    assert IndexSpec().factory(20_000, 384) == ("Flat", {})  # small: exact
    factory, params = IndexSpec().factory(250_000, 384)
    assert factory == "IVF1024,SQ8" and params["nprobe"] >= 64
    assert IndexSpec(compress="none").factory(250_000, 384)[0] == "IVF1024,Flat"
    assert IndexSpec(kind="hnsw").factory(250_000, 384)[0] == "HNSW32,SQ8"
    with pytest.raises(ValueError, match="HNSW takes none or int8"):
        IndexSpec(kind="hnsw", compress="pq").factory(250_000, 384)


def test_index_of_an_older_format_is_refused_with_the_rebuild_command(tmp_path: Path) -> None:
    """An index written by an older hpcfed (FAISS parts, format 1) is refused before FAISS reads it,
    even with a valid tag, and `hpcfed search index` rebuilds it."""
    from hpcfed.search.ann import index_auth

    write_sites(tmp_path, [300])
    build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="flat"), progress=False)
    path = index_path(export_path(tmp_path, 0), "doc")
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 1
    sealed.seal(path, index_auth())
    with pytest.raises(SearchIndexError, match=r"index format version 1, this hpcfed reads 3; rebuild it with "
                                               r"`hpcfed search index"):
        AnnIndex.load(export_path(tmp_path, 0))
    assert not index_is_current(export_path(tmp_path, 0), None, IndexSpec(kind="flat"))


def test_nprobe_is_raised_at_build_until_the_index_finds_its_own_neighbours(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Diffuse vectors (no clusters): the size rule's nprobe (8 of 64 cells, forced low) misses
    neighbours, so the build measures recall on a sample of its own vectors and probes more cells."""
    from hpcfed.search.calibrate import TARGET

    rng = np.random.default_rng(4)
    vectors = rng.normal(size=(8000, 24)).astype(np.float32)
    write_export(export_path(tmp_path, 0), vectors, [f"d{i}" for i in range(8000)], entity="doc", model="test", site=0)
    low = IndexSpec(kind="ivf", nlist=64)
    monkeypatch.setattr("hpcfed.search.ann_build.auto_nprobe", lambda nlist, n: 8)  # a rule far too low here
    report = build_index(export_path(tmp_path, 0), spec=low, progress=False)
    assert report["nprobe"] > 8 and report["calibrated_recall"] >= TARGET
    ann = AnnIndex.load(export_path(tmp_path, 0))
    assert ann.index.nprobe == report["nprobe"]  # stored in the index: a load searches with it
    exact = SiteIndex.from_export(export_path(tmp_path, 0))
    queries = vectors[::80]
    ids = [f"d{i}" for i in range(0, 8000, 80)]
    got, want = ann.hits(queries, 10, ids), exact.hits(queries, 10, ids)
    assert np.mean([len({h.id for h in g} & {h.id for h in w}) / 10 for g, w in zip(got, want)]) >= 0.95
    fixed = build_index(export_path(tmp_path, 0), spec=IndexSpec(kind="ivf", nlist=64, nprobe=8), progress=False)
    assert fixed["nprobe"] == 8 and "calibrated_recall" not in fixed  # a fixed --nprobe is kept as given
