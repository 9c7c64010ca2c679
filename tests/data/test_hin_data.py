"""HIN data: meta-paths, the project file format, the CSV importer, partitioning into sites."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from hpcfed.cli.commands import main as cli_main
from hpcfed.data.hin import (
    load_hin_file,
    metapath_adjacency,
    metapath_instances,
    row_normalize,
    save_hin,
    synthetic_hin,
)
from hpcfed.data.hin_import import read_hin_folder
from hpcfed.data.partition import Partition, assign_owners, make_partition, report, site_view
from hpcfed.data.root import DataError

GRAPH = {
    "nodes_P.csv": "id,institution\np0,mit\np1,mit\np2,eth\np3,eth\np4,ucl\n",
    "nodes_A.csv": "id\nalice\nbob\ncarol\n",
    "nodes_S.csv": "id\ndb\nml\n",
    "edges_PA.csv": "src,dst\np0,alice\np1,alice\np1,bob\np2,bob\np3,carol\np4,carol\n",
    "edges_PS.csv": "src,dst\np0,db\np1,db\np2,ml\np3,ml\np4,ml\n",
    "labels.csv": "id,label\np0,databases\np1,databases\np2,learning\np3,learning\np4,learning\n",
    "features.csv": "id,f0,f1\np0,1,0\np1,1,0.5\np2,0,1\np3,0,1\np4,0.2,1\n",
    "splits.csv": "id,split\np0,train\np2,train\np1,val\np3,test\np4,test\n",
}


def _write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_metapath_adjacency_is_binary_symmetric_with_self_loops(tmp_path: Path) -> None:
    hin = read_hin_folder(_write(tmp_path / "g", GRAPH))
    pap = metapath_adjacency(hin, "PAP").toarray()
    expected = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(pap, expected)
    assert metapath_instances(hin, "PAP") == 6  # ordered pairs i != j
    norm = row_normalize(sp.csr_matrix(pap))
    assert np.linalg.norm(norm.toarray(), axis=1) == pytest.approx(np.ones(5))
    with pytest.raises(ValueError, match="no relation between types A and S"):
        metapath_adjacency(hin, "PASAP")


def test_import_round_trip_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _write(tmp_path / "g", GRAPH)
    out = tmp_path / "g.npz"
    assert cli_main(["data", "import-hin", str(folder), "--out", str(out)]) == 0
    assert "meta-path instances PAP=6, PSP=8" in capsys.readouterr().out
    hin = load_hin_file(out)
    assert hin.target == "P" and hin.counts == {"P": 5, "A": 3, "S": 2}
    assert hin.metapaths == ["PAP", "PSP"]
    assert list(hin.label_names) == ["databases", "learning"] and list(hin.labels) == [0, 0, 1, 1, 1]
    assert list(hin.ids["A"]) == ["alice", "bob", "carol"]
    assert {k: list(v) for k, v in hin.splits.items()} == {"train": [0, 2], "val": [1], "test": [3, 4]}
    assert hin.features.shape == (5, 2) and hin.features[1, 1] == pytest.approx(0.5)
    assert list(hin.attributes["institution"]) == ["mit", "mit", "eth", "eth", "ucl"]
    again = tmp_path / "again.npz"
    save_hin(hin, again)
    back = load_hin_file(again)
    for key in hin.relations:
        np.testing.assert_array_equal(back.relations[key], hin.relations[key])
    assert (metapath_adjacency(back, "PSP") != metapath_adjacency(hin, "PSP")).nnz == 0


@pytest.mark.parametrize("change, message", [
    ({"edges_PA.csv": "src,dst\np0,alice\np9,bob\n"}, r"edges_PA.csv: line 3: src 'p9' is not an id in nodes_P.csv"),
    ({"edges_PA.csv": "src,dst\np0,alice\np1,bob\np0,alice\n"},
     r"edges_PA.csv: line 4: duplicate edge 'p0' -> 'alice' \(first at line 2\)"),
    ({"labels.csv": None}, r"labels.csv: missing; every HIN needs labels.csv"),
    ({"labels.csv": "id,label\np0,db\np0,ml\n"}, r"labels.csv: line 3: 'p0' is labelled twice"),
    ({"nodes_A.csv": "id\nalice\nbob\nalice\n"}, r"nodes_A.csv: line 4: duplicate id 'alice' \(first at line 2\)"),
    ({"edges_PS.csv": "source,dst\np0,db\n"}, r"edges_PS.csv: line 1: missing column\(s\) src"),
    ({"features.csv": "id,f0\np0,abc\n"}, r"features.csv: line 2: column 'f0' = 'abc' is not a number"),
    ({"edges_PX.csv": "src,dst\np0,x\n"}, r"edges_PX.csv: relation 'PX' must be two node-type letters"),
])
def test_import_rejects_malformed_input_naming_file_and_line(tmp_path: Path, change: dict, message: str) -> None:
    files = {**GRAPH, **change}
    folder = _write(tmp_path / "g", {k: v for k, v in files.items() if v is not None})
    with pytest.raises(DataError, match=message):
        read_hin_folder(folder)


def test_cli_reports_import_errors_as_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _write(tmp_path / "g", {k: v for k, v in GRAPH.items() if k != "labels.csv"})
    assert cli_main(["data", "import-hin", str(folder), "--out", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err
    assert "labels.csv: missing" in err and "Traceback" not in err


def test_import_without_splits_draws_a_stratified_split(tmp_path: Path) -> None:
    folder = _write(tmp_path / "g", {k: v for k, v in GRAPH.items() if k != "splits.csv"})
    hin = read_hin_folder(folder, train_fraction=0.4, val_fraction=0.2)
    together = np.concatenate([hin.splits["train"], hin.splits["val"], hin.splits["test"]])
    assert sorted(together.tolist()) == [0, 1, 2, 3, 4]
    assert set(hin.labels[hin.splits["train"]]) == {0, 1}  # every class is in train


def test_partitions_keep_only_own_relation_instances() -> None:
    hin = synthetic_hin(papers_per_class=30, seed=3)
    owners = assign_owners(hin, 3, "random", seed=0)
    assert np.bincount(owners).tolist() == [30, 30, 30]
    views = [site_view(hin, owners, s) for s in range(3)]
    for s, view in enumerate(views):
        assert (owners[view.relations["PA"][:, 0]] == s).all()
        assert view.counts == hin.counts  # the node index is shared
    assert sum(len(v.relations["PA"]) for v in views) == len(hin.relations["PA"])
    rep = report(hin, owners, 3, hin.splits["train"])
    assert sum(rep.train) == len(hin.splits["train"])
    for mp in hin.metapaths:  # a site only keeps pairs whose both papers it owns
        assert 0 < sum(rep.instances[mp]) < rep.total_instances[mp]
    assert "meta-path instances kept: PAP" in rep.lines()[0]


def test_attribute_and_dirichlet_partitions() -> None:
    hin = synthetic_hin(papers_per_class=30, num_institutions=5, seed=3)
    owners = assign_owners(hin, 3, "attribute", seed=0, attribute="institution")
    inst = hin.attributes["institution"]
    for value in np.unique(inst):  # a whole institution lives on one site
        assert len(set(owners[inst == value])) == 1
    by_subject = assign_owners(hin, 3, "attribute", seed=0, attribute="S")
    subject = dict(hin.relations["PS"].tolist())
    for s in set(subject.values()):
        assert len({int(by_subject[p]) for p, q in subject.items() if q == s}) == 1
    skewed = assign_owners(hin, 3, "dirichlet", seed=0, alpha=0.1)
    shares = np.array([[np.mean(skewed[hin.labels == c] == s) for s in range(3)] for c in range(3)])
    assert shares.max() > 0.6  # strong label skew at alpha = 0.1
    with pytest.raises(ValueError, match="fewer than the 3 sites"):
        assign_owners(synthetic_hin(num_institutions=2, seed=0), 3, "attribute", seed=0, attribute="institution")
    with pytest.raises(ValueError, match="neither a node attribute"):
        assign_owners(hin, 3, "attribute", seed=0, attribute="nonexistent")
    assert (assign_owners(hin, 3, "none", seed=0) == 0).all()


def test_by_type_partition_holds_the_papers_of_each_sites_authors(tmp_path: Path) -> None:
    # GRAPH: alice wrote p0, p1; bob p1, p2; carol p3, p4. Three authors over three balanced sites
    # -> one author per site, so the holdings are known whichever site each author lands on.
    hin = read_hin_folder(_write(tmp_path / "g", GRAPH))
    part = make_partition(hin, 3, "by_type", seed=0, owner_type="A")
    held = sorted(tuple(np.flatnonzero(part.holds[s]).tolist()) for s in range(3))
    assert held == [(0, 1), (1, 2), (3, 4)]  # p1 (alice and bob) is held by two sites
    site_of = {p: int(np.flatnonzero(part.holds[:, p])[0]) for p in (0, 2, 3)}  # alice's, bob's, carol's site
    # p1's home is its first listed author, alice
    assert part.home.tolist() == [site_of[0], site_of[0], site_of[2], site_of[3], site_of[3]]
    alice = site_of[0]
    view = site_view(hin, part, alice)
    assert sorted(map(tuple, view.relations["PA"].tolist())) == [(0, 0), (1, 0), (1, 1)]  # p1's full author list
    rep = report(hin, part, 3)
    # PAP pairs i != j: alice's site (0,1),(1,0); bob's (1,2),(2,1); carol's (3,4),(4,3) -> all 6 held
    assert rep.instances["PAP"][alice] == 2 and sum(rep.instances["PAP"]) == 6 and rep.covered["PAP"] == 6
    # PSP: db = {p0, p1} (2 pairs, alice's site), ml = {p2, p3, p4} (6 pairs; carol's site holds p3-p4)
    assert sorted(rep.instances["PSP"]) == [0, 2, 2] and rep.covered["PSP"] == 4 and rep.total_instances["PSP"] == 8
    assert "held by some site: PAP 6/6 (100.0%)" in rep.lines()[-1]
    with pytest.raises(ValueError, match="partition_type: a node type other than the target 'P'"):
        make_partition(hin, 3, "by_type", seed=0, owner_type="P")
    with pytest.raises(ValueError, match="build it with make_partition"):
        assign_owners(hin, 3, "by_type", seed=0)


def test_owner_partitions_hold_each_node_once() -> None:
    hin = synthetic_hin(papers_per_class=30, seed=3)
    owners = assign_owners(hin, 3, "random", seed=0)
    part = make_partition(hin, 3, "random", seed=0)
    assert isinstance(part, Partition) and (part.home == owners).all() and (part.holds.sum(axis=0) == 1).all()
    by_type = make_partition(hin, 3, "by_type", seed=0, owner_type="A")
    assert (by_type.holds.sum(axis=0) >= 1).all() and by_type.holds.sum() > hin.num_targets
    assert by_type.holds[by_type.home, np.arange(hin.num_targets)].all()  # a node's home site holds it


def test_heco_loader_matches_the_released_metapath_matrices(shared_data: Path) -> None:
    from hpcfed.data.heco import load_heco

    hin = load_heco("hin/aminer", shared_data)
    assert hin.counts["P"] == 6564 and hin.metapaths == ["PAP", "PRP"]
    assert len(hin.splits["test_20"]) == 1000
    for mp, fname in (("PAP", "pap.npz"), ("PRP", "prp.npz")):
        ours = metapath_adjacency(hin, mp)
        ref = sp.load_npz(shared_data / "hin" / "aminer" / fname).astype(np.float32)
        assert (ours != ref).nnz == 0


def test_partition_report_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from hpcfed.data.partition import main

    assert main(["synthetic", "--scheme", "by_type", "--type", "A", "--train-split", "train"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("site 0: ") and "train labels; meta-path instances kept: PAP" in out[0]
    assert out[3].startswith("held by some site: PAP ") and "(100.0%)" in out[3]  # each instance at its author's site
    assert out[4].startswith("sites holding a target node, mean: ")


def test_import_tsv_tables_with_mapped_column_names(tmp_path: Path) -> None:
    renamed = {"id": "node", "src": "from", "dst": "to", "label": "class"}
    files = {}
    for name, text in GRAPH.items():
        if name == "splits.csv":
            continue
        header, _, body = text.partition("\n")
        header = ",".join(renamed.get(h, h) for h in header.split(","))
        files[name.replace(".csv", ".tsv")] = (header + "\n" + body).replace(",", "\t")
    folder = _write(tmp_path / "g", files)
    hin = read_hin_folder(folder, columns=renamed)
    assert hin.counts == {"P": 5, "A": 3, "S": 2} and len(hin.relations["PA"]) == 6
    assert list(hin.label_names) == ["databases", "learning"] and hin.features.shape == (5, 2)
    with pytest.raises(DataError, match=r"edges_PA.tsv: line 1: --columns src=source: no such column "
                                        r"\(found: from, to\)"):
        read_hin_folder(folder, columns={**renamed, "src": "source"})
    assert cli_main(["data", "import-hin", str(folder), "--columns", "id=node,bad", "--out",
                     str(tmp_path / "x.npz")]) == 2
