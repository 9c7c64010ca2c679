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


def _dame_like(folder: Path) -> Path:
    """Two sites' exports as a DAMe run writes them: personalised spaces, labels named by events."""
    import numpy as np

    from hpcfed.store.embeddings import export_path, write_export

    for site, events in ((0, ["flood", "quake"]), (1, ["fire"])):
        vectors = np.random.default_rng(site).normal(size=(6, 4)).astype(np.float32)
        write_export(export_path(folder, site), vectors, [f"m{site}-{i}" for i in range(6)],
                     np.arange(6) % len(events), entity="message", model="dame-gat", site=site,
                     extra={"events": ",".join(events), "label_names": json.dumps(events), "shared_space": False})
    return folder


def test_dame_runs_refuse_joint_and_text_but_name_their_events(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from hpcfed.cli.commands import main as cli_main

    run = _dame_like(tmp_path / "dame")
    assert cli_main(["search", "query", str(run), "--id", "m0-1", "--mode", "joint"]) == 2
    assert "--mode joint treats the sites' vectors as one space" in capsys.readouterr().err
    assert cli_main(["search", "query", str(run), "--id", "m0-1", "--compact"]) == 0  # auto: each site's own space
    assert json.loads(capsys.readouterr().out)["queries"][0]["mode"] == "nomapping"
    assert cli_main(["search", "query", str(run), "--id", "m0-1", "--mode", "nomapping", "--k", "12",
                     "--compact"]) == 0
    results = json.loads(capsys.readouterr().out)["queries"][0]["results"]
    names = {(r["site"], r["label"]): r["label_name"] for r in results}
    assert names == {("0", 0): "flood", ("0", 1): "quake", ("1", 0): "fire"}
    assert cli_main(["search", "query", str(run), "--id", "m0-1", "--mode", "joint", "--force",
                     "--compact"]) == 0  # joint anyway
    capsys.readouterr()
    assert cli_main(["search", "query", str(run), "--text", "flood", "--mode", "nomapping"]) == 2
    err = capsys.readouterr().err
    assert "text queries are doc2vec-only" in err and "--id" in err and "does not exist" not in err


def test_malformed_label_names_are_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    from hpcfed.cli.commands import main as cli_main
    from hpcfed.store.embeddings import export_path, write_export

    for site, names in ((0, "not json"), (1, json.dumps([1, 2]))):
        write_export(export_path(tmp_path, site), np.eye(3, dtype=np.float32), [f"d{site}{i}" for i in range(3)],
                     np.arange(3), entity="doc", model="doc2vec-pvdm3", site=site, extra={"label_names": names})
    assert cli_main(["search", "query", str(tmp_path), "--id", "d00", "--compact"]) == 0
    results = json.loads(capsys.readouterr().out)["queries"][0]["results"]
    assert results and all("label_name" not in r for r in results)
