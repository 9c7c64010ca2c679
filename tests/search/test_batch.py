"""Batch queries through the CLI: `search index`, then `search query --ids-file/--texts-file [--jsonl]`
against exact search and against one query per call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from search_data import write_doc2vec_models, write_sites

from hpcfed.search.batch import read_lines
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("own_keys")  # index keys in a temporary folder


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("batch")
    write_sites(out, [400, 300, 350])
    write_doc2vec_models(out, 3)
    return out


def _query(args: list[str]) -> list[dict]:
    return json.loads(run_cli(["search", "query", *args, "--compact"]).stdout)["queries"]


def test_index_cli_builds_then_reports_up_to_date(run: Path) -> None:
    first = json.loads(run_cli(["search", "index", str(run), "--kind", "flat", "--quiet"]).stdout)["indexes"]
    assert [r["status"] for r in first] == ["built"] * 3 and first[0]["factory"] == "Flat"
    again = json.loads(run_cli(["search", "index", str(run), "--kind", "flat", "--site", "1"]).stdout)["indexes"]
    assert again == [{"site": "1", "export": str(run / "embeddings" / "site1.h5"), "status": "up to date"}]
    bad = run_cli(["search", "index", str(run), "--site", "7"], check=False)
    assert bad.returncode == 2 and "--site 7: no such site" in bad.stderr


def test_ids_file_answers_like_single_queries_and_exact(run: Path, tmp_path: Path) -> None:
    run_cli(["search", "index", str(run), "--kind", "flat", "--quiet"])
    ids = ["s2-5", "s0-1", "s1-299", "s0-1"]
    (tmp_path / "ids.txt").write_text("\n".join(ids) + "\n\n")
    for merge in ("score", "interleave", "zscore"):
        batch = _query([str(run), "--ids-file", str(tmp_path / "ids.txt"), "--k", "6", "--merge", merge])
        exact = _query([str(run), "--ids-file", str(tmp_path / "ids.txt"), "--k", "6", "--merge", merge, "--exact"])
        assert [q["query"]["id"] for q in batch] == ids and [q["home"] for q in batch] == ["2", "0", "1", "0"]
        assert [[r["id"] for r in q["results"]] for q in batch] == [[r["id"] for r in q["results"]] for q in exact]
    one = _query([str(run), "--id", "s1-299", "--k", "6", "--merge", "zscore"])
    assert [r["id"] for r in one[0]["results"]] == [r["id"] for r in batch[2]["results"]]


def test_texts_file_and_jsonl(run: Path, tmp_path: Path) -> None:
    texts = ["flood in the city", "fire near the bridge", "rescue shelter"]
    (tmp_path / "texts.txt").write_text("\n".join(texts))
    (tmp_path / "ids.txt").write_text("s0-3\n")
    proc = run_cli(["search", "query", str(run), "--texts-file", str(tmp_path / "texts.txt"), "--home", "1",
                    "--ids-file", str(tmp_path / "ids.txt"), "--k", "3", "--jsonl"])
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [q["query"] for q in lines] == [{"id": "s0-3"}] + [{"text": t, "home": "1"} for t in texts]
    single = _query([str(run), "--text", texts[1], "--home", "1", "--k", "3"])
    assert single[0]["results"] == lines[2]["results"]


def test_unknown_id_in_a_file_is_a_clear_error(run: Path, tmp_path: Path) -> None:
    (tmp_path / "ids.txt").write_text("s0-1\nnope\nnada\n")
    bad = run_cli(["search", "query", str(run), "--ids-file", str(tmp_path / "ids.txt")], check=False)
    assert bad.returncode == 2 and "id 'nope' and 1 more is in none of the sites" in bad.stderr
    missing = run_cli(["search", "query", str(run), "--ids-file", str(tmp_path / "none.txt")], check=False)
    assert missing.returncode == 2 and "cannot read the ids file" in missing.stderr


def test_read_lines_bounds_and_encoding(tmp_path: Path) -> None:
    (tmp_path / "bin.txt").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_lines(tmp_path / "bin.txt", "id")
    (tmp_path / "long.txt").write_text("x" * 100_001)
    with pytest.raises(ValueError, match="longer than"):
        read_lines(tmp_path / "long.txt", "text")
    (tmp_path / "ok.txt").write_text(" a \n\nb\n")
    assert read_lines(tmp_path / "ok.txt", "id") == ["a", "b"]
