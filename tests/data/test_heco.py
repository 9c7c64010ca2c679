"""HeCo-layout folders read by path (a dblp-like layout written here; acm from the shared data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from hpcfed.cli.commands import main as cli_main
from hpcfed.data.heco import load_heco, read_heco_folder
from hpcfed.data.hin import load_hin_file
from hpcfed.data.hin_dataset import load_dataset
from hpcfed.data.partition import site_view
from hpcfed.data.root import DataError


def _dblp_like(folder: Path) -> Path:
    """Target type a (authors, labelled); papers link authors to conferences and terms, as in dblp."""
    folder.mkdir(parents=True)
    np.savetxt(folder / "pa.txt", [[0, 0], [0, 1], [1, 2], [2, 3], [3, 0]], fmt="%d")
    np.savetxt(folder / "pc.txt", [[0, 0], [1, 1], [2, 1], [3, 0]], fmt="%d")
    np.savetxt(folder / "pt.txt", [[0, 0], [1, 1], [2, 2], [3, 0]], fmt="%d")
    np.save(folder / "labels.npy", np.array([0.0, 0.0, 1.0, 1.0]))
    sp.save_npz(folder / "a_feat.npz", sp.csr_matrix(np.eye(4, dtype=np.float32)))
    np.save(folder / "train_1.npy", np.array([0, 2]))
    return folder


def test_a_dblp_like_folder_by_path(tmp_path: Path) -> None:
    hin = read_heco_folder(_dblp_like(tmp_path / "dblp"))
    assert hin.target == "A" and hin.counts == {"P": 4, "A": 4, "C": 2, "T": 3}
    assert hin.metapaths == ["APA", "APCPA", "APTPA"]
    assert hin.labels.tolist() == [0, 0, 1, 1] and hin.features.shape == (4, 4)
    assert hin.splits["train_1"].tolist() == [0, 2]
    assert load_dataset(str(tmp_path / "dblp")).metapaths == hin.metapaths  # task.dataset: a folder


def test_import_hin_writes_a_heco_folder_as_a_hin_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dblp.npz"
    assert cli_main(["data", "import-hin", str(_dblp_like(tmp_path / "dblp")), "--out", str(out)]) == 0
    assert "meta-path instances APA=" in capsys.readouterr().out
    hin = load_hin_file(out)
    assert hin.target == "A" and set(hin.splits) == {"train_1"}


def test_sites_split_the_links_one_hop_from_the_target(tmp_path: Path) -> None:
    hin = read_heco_folder(_dblp_like(tmp_path / "dblp"))
    view = site_view(hin, np.array([0, 0, 1, 1]), 1)  # site 1 holds authors 2 and 3: papers 1 and 2
    assert sorted(view.relations["PA"][:, 0].tolist()) == [1, 2]
    assert sorted(view.relations["PC"][:, 0].tolist()) == [1, 2]  # not paper 0's or 3's conference
    assert sorted(view.relations["PT"][:, 0].tolist()) == [1, 2]


@pytest.mark.parametrize("breakage, message", [
    (lambda f: np.save(f / "labels.npy", np.array([0.5, 1, 0, 1])), r"labels.npy: labels must be whole numbers"),
    (lambda f: (f / "pc.txt").write_text("0 1 2\n"), r"pc.txt: expected two non-negative integer columns"),
    (lambda f: (f / "pt.txt").write_text("0 x\n"), r"pt.txt: not two integer columns per line"),
    (lambda f: (f / "labels.npy").unlink(), r"labels.npy is missing"),
    (lambda f: (np.save(f / "labels.npy", np.zeros(5)), (f / "a_feat.npz").unlink()),
     r"cannot tell the labelled type from labels.npy \(5 labels; node counts A=4, C=2, P=4, T=3\); pass --target"),
])
def test_malformed_heco_folders_name_the_file(tmp_path: Path, breakage, message: str) -> None:
    folder = _dblp_like(tmp_path / "dblp")
    breakage(folder)
    with pytest.raises(DataError, match=message):
        read_heco_folder(folder)


def test_an_unknown_target_letter(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"--target X: no edge file .* names type x \(types: A, C, P, T\)"):
        read_heco_folder(_dblp_like(tmp_path / "dblp"), target="x")


def test_the_acm_release_by_path_equals_by_name(shared_data: Path) -> None:
    by_name = load_heco("hin/acm", shared_data)
    by_path = read_heco_folder(shared_data / "hin" / "acm")
    assert by_path.target == "P" and by_path.metapaths == ["PAP", "PSP"]
    assert by_path.counts == by_name.counts
    assert (by_path.labels == by_name.labels).all() and by_path.features.shape == (4019, 1902)
