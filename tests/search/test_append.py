"""`hpcfed search index --append`: a later export's vectors join the index without a rebuild, answer
like a fresh build, keep the tag checks, and an append from another run, model or dimension is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from search_data import clustered, write_message_sites

from hpcfed.search.ann import AnnIndex, SearchIndexError
from hpcfed.search.ann_build import IndexSpec, build_index
from hpcfed.search.append import append_export
from hpcfed.search.global_search import GlobalSearch
from hpcfed.search.index import SiteIndex
from hpcfed.store.embeddings import export_path, seal_export, write_export
from hpcfed.store.sealed import FileAuth
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("own_keys")  # index keys in a temporary folder


def _export(path: Path, vectors: np.ndarray, first: int, **attrs: object) -> None:
    n = len(vectors)
    write_export(path, vectors, [f"d{first + i}" for i in range(n)], (first + np.arange(n)) % 7, entity="doc",
                 model=str(attrs.pop("model", "test")), site=0, extra=dict(attrs),
                 columns={"time": 1_000 + first + np.arange(n)})


def test_appended_vectors_are_found_like_a_fresh_build_and_drift_is_measured(tmp_path: Path) -> None:
    vectors = clustered(6000, 32, seed=1)
    _export(export_path(tmp_path / "run", 0), vectors[:5000], 0)
    _export(export_path(tmp_path / "new", 0), vectors[5000:], 5000)
    build_index(export_path(tmp_path / "run", 0), spec=IndexSpec(kind="ivf", nlist=64), progress=False)
    report = append_export(export_path(tmp_path / "run", 0), export_path(tmp_path / "new", 0))
    assert report["rows"] == 1000 and report["total_rows"] == 6000 and report["rebuild_due"] is False
    assert 0.8 < report["drift"] < 1.25  # the same distribution: as close to the cells as the trained vectors
    ann = AnnIndex.load(export_path(tmp_path / "run", 0))
    assert len(ann.ids) == 6000 and ann.ids[5000] == "d5000" and list(ann.columns["time"][4999:5001]) == [5999, 6000]
    exact = SiteIndex("0", [f"d{i}" for i in range(6000)], vectors, np.arange(6000) % 7)
    queries = vectors[5000::20]
    got, want = ann.hits(queries, 10), exact.hits(queries, 10)
    recall = np.mean([len({h.id for h in g} & {h.id for h in w}) / 10 for g, w in zip(got, want)])
    assert recall >= 0.95 and np.allclose(ann.vector_of("d5500"), vectors[5500], atol=0.05)
    search = GlobalSearch.from_folder(tmp_path / "run")
    in_window = search.search_id("d5001", 3, search.where(["time=6000..6010"]))  # rows 5000..5009
    assert len(in_window) == 3 and {h.id for h in in_window} <= {f"d{i}" for i in range(5000, 5010)}
    # a shifted distribution is far from the trained cells: the append says a rebuild is due
    shifted = clustered(500, 32, seed=2) + 6.0 * np.random.default_rng(3).normal(size=(1, 32)).astype(np.float32)
    _export(export_path(tmp_path / "shifted", 0), shifted, 9000)
    again = append_export(export_path(tmp_path / "run", 0), export_path(tmp_path / "shifted", 0))
    assert again["rebuild_due"] is True and again["drift"] > 1.25 and "IVF cells" in again["why"]


def test_an_append_that_changed_or_vanished_makes_the_index_refused(tmp_path: Path) -> None:
    vectors = clustered(600, 16, seed=1)
    _export(export_path(tmp_path / "run", 0), vectors[:500], 0)
    _export(export_path(tmp_path / "new", 0), vectors[500:], 500)
    build_index(export_path(tmp_path / "run", 0), spec=IndexSpec(kind="flat"), progress=False)
    append_export(export_path(tmp_path / "run", 0), export_path(tmp_path / "new", 0))
    _export(export_path(tmp_path / "new", 0), vectors[500:] * 2, 500)  # rewritten after the append
    with pytest.raises(SearchIndexError, match=r"new/embeddings/site0.h5 changed since it was appended"):
        AnnIndex.load(export_path(tmp_path / "run", 0))
    shutil.rmtree(tmp_path / "new")
    with pytest.raises(SearchIndexError, match=r"which is gone or unreadable"):
        AnnIndex.load(export_path(tmp_path / "run", 0))


@pytest.mark.parametrize(("make", "named"), [
    (lambda p, v: _export(p, clustered(50, 8, seed=5), 700), "vectors of dimension 8, the index of site0.h5 holds 16"),
    (lambda p, v: _export(p, v, 700, model="other"), "model 'other', the index's export site0.h5 has 'test'"),
    (lambda p, v: _export(p, v, 10), "id 'd10' is already in site0.h5's index"),
])
def test_appends_of_another_model_dimension_or_the_same_documents_are_refused(tmp_path: Path, make, named) -> None:
    vectors = clustered(600, 16, seed=1)
    _export(export_path(tmp_path / "run", 0), vectors[:500], 0)
    build_index(export_path(tmp_path / "run", 0), spec=IndexSpec(kind="flat"), progress=False)
    make(export_path(tmp_path / "new", 0), vectors[500:])
    proc = run_cli(["search", "index", str(tmp_path / "run"), "--append", str(tmp_path / "new")], check=False)
    assert proc.returncode == 2 and "new/embeddings/site0.h5" in proc.stderr and named in proc.stderr
    assert len(AnnIndex.load(export_path(tmp_path / "run", 0)).ids) == 500  # the index is as it was


def test_an_export_of_another_job_key_is_refused_and_a_new_site_is_pointed_to_its_own_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key, other = "11" * 32, "22" * 32
    monkeypatch.setenv("HPCFED_STATE_KEY", key)
    write_message_sites(tmp_path / "run", [300])
    write_message_sites(tmp_path / "new", [300, 100])
    shutil.move(tmp_path / "new" / "embeddings" / "site1.h5", tmp_path / "site1.h5")
    seal_export(export_path(tmp_path / "run", 0), FileAuth.from_psk(bytes.fromhex(key), "embeddings"))
    build_index(export_path(tmp_path / "run", 0), spec=IndexSpec(kind="flat"), progress=False)
    seal_export(export_path(tmp_path / "new", 0), FileAuth.from_psk(bytes.fromhex(other), "embeddings"))
    env = {"HPCFED_STATE_KEY": key}
    proc = run_cli(["search", "index", str(tmp_path / "run"), "--append", str(tmp_path / "new")], check=False, env=env)
    assert proc.returncode == 2 and "new/embeddings/site0.h5" in proc.stderr, proc.stderr
    shutil.rmtree(tmp_path / "new" / "embeddings")
    (tmp_path / "new" / "embeddings").mkdir()
    shutil.move(tmp_path / "site1.h5", tmp_path / "new" / "embeddings" / "site1.h5")
    proc = run_cli(["search", "index", str(tmp_path / "run"), "--append", str(tmp_path / "new")], check=False, env=env)
    assert proc.returncode == 2 and "site 1 has no export in" in proc.stderr
    assert "gets an index of its own" in proc.stderr
    report = json.loads(run_cli(["search", "index", str(tmp_path / "run"), "--quiet"], env=env).stdout)
    assert report["indexes"][0]["status"] == "up to date"
