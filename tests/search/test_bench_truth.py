"""`tools/search_truth.py`, the exact answers of `tools/bench_search.py`'s filter and append goals
(computed one site at a time instead of by an ``--exact`` search holding every site's vectors),
agree with the library's exact search: unfiltered, with a label filter, and over an export and
the vectors appended after it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcfed.search.batch import answer_ids
from hpcfed.search.filters import compile_where
from hpcfed.search.global_search import GlobalSearch
from hpcfed.store.embeddings import export_path, read_export, write_export

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import search_truth
from bench_search import write_collection

pytestmark = pytest.mark.usefixtures("own_keys")  # index keys in a temporary folder


def _pairs(answers: list[dict]) -> list[list[tuple[str, str]]]:
    return [[(r["site"], r["id"]) for r in a["results"]] for a in answers]


def _scores(answers: list[dict]) -> np.ndarray:
    return np.array([[r["score"] for r in a["results"]] for a in answers])


@pytest.mark.parametrize("labels", [None, [7]])
def test_the_bench_truth_is_the_exact_search_of_the_library(tmp_path: Path, labels: list[int] | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(search_truth, "BLOCK", 97)  # many blocks, a query's own row in some of them
    ids = write_collection(tmp_path / "run", 3000, 3, 32)
    queries = ids[::150]
    search = GlobalSearch.from_folder(tmp_path / "run", exact=True)
    where = None if labels is None else compile_where({"label": labels}, search.indexes, search.names)
    want = answer_ids(search, queries, 10, where)
    got = search_truth.exact_answers([tmp_path / "run"], 3, queries, 10, labels)
    assert _pairs(got) == _pairs(want)
    assert np.allclose(_scores(got), _scores(want), atol=1e-5)
    assert all(q not in {r["id"] for r in a["results"]} for q, a in zip(queries, got))
    if labels is not None:
        assert all(r["label"] == 7 for a in want for r in a["results"])


def test_the_append_truth_searches_the_export_and_the_appended_vectors_together(tmp_path: Path) -> None:
    write_collection(tmp_path / "run", 2000, 2, 24)
    new = write_collection(tmp_path / "new", 400, 2, 24, prefix="a", seed=1)
    for site in range(2):  # the reference: one export holding both, searched exactly by the library
        old, more = (read_export(export_path(tmp_path / f, site)) for f in ("run", "new"))
        write_export(export_path(tmp_path / "both", site), np.concatenate([old.vectors, more.vectors]),
                     old.ids + more.ids, np.concatenate([old.labels, more.labels]), entity="doc", model="synthetic",
                     site=site)
    queries = new[::40]
    want = answer_ids(GlobalSearch.from_folder(tmp_path / "both", exact=True), queries, 10)
    got = search_truth.exact_answers([tmp_path / "run", tmp_path / "new"], 2, queries, 10)
    assert _pairs(got) == _pairs(want)
    assert any(r["id"].startswith("s") for a in got for r in a["results"])  # both folders answer
    assert any(r["id"].startswith("a") for a in got for r in a["results"])


def test_the_bench_reports_each_command_s_own_peak_memory_not_its_own() -> None:
    """`bench_search.run` measures a command's peak RSS and CPU time: a small command started while the
    bench holds 400 MB reports its own few tens of MB (Linux charges a child started straight from a
    process that process's peak), one that allocates 300 MB reports at least that, and a failure is
    named with the command's exit status and its stderr."""
    from bench_process import run

    held = np.ones(400 * 2**20 // 8)  # the bench's own memory (a whole collection at 1 M: gigabytes)
    small = run([sys.executable, "-c", "pass"], dict(os.environ))
    big = run([sys.executable, "-c", "import numpy; a = numpy.ones(300 * 2**20 // 8); print(a.sum() > 0)"],
              dict(os.environ))
    assert held.sum() > 0
    assert small["peak_rss_mb"] < 150, small
    assert big["peak_rss_mb"] >= 300 and big["stdout"].strip() == "True", big
    assert big["cpu_s"] > 0.0
    with pytest.raises(RuntimeError, match=r"exited 3: .*no way"):
        run([sys.executable, "-c", "import sys; print('no way', file=sys.stderr); sys.exit(3)"], dict(os.environ))
