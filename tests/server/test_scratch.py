"""Rank 0's scratch disk (parked uploads, the models async sites were sent): read back exactly,
a block at a time, and a disk fault ends the run with the folder and the fix named."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.errors import FederationError
from hpcfed.server.scratch import Parking, Scratch


def test_arrays_come_back_exactly_whole_or_a_block_at_a_time(tmp_path):
    sent = Scratch(tmp_path / "scratch" / "sent", "last model", "set influence.enabled=false")
    first, second = np.arange(10, dtype=np.float32), np.arange(10, 20, dtype=np.float32)
    sent.put(3, first)
    sent.put(3, second)  # an answer replaces the last one
    view = sent.view(3)
    np.testing.assert_array_equal(view[2:5], second[2:5])
    np.testing.assert_array_equal(view[8:100], second[8:])  # a block past the end is cut, as numpy's
    assert sent.view(4) is None and sent.clients() == [3]
    assert (tmp_path / "scratch" / "sent").stat().st_mode & 0o077 == 0  # no other user may rewrite a reference
    parked = Parking(tmp_path / "scratch" / "parked")
    parked.park(1, first, 2.5)
    flat, distance = parked.take_measured(1)
    np.testing.assert_array_equal(flat, first)
    assert distance == 2.5 and not list((tmp_path / "scratch" / "parked").iterdir())
    parked.close()
    assert (tmp_path / "scratch").exists()  # the sent models are still kept there
    sent.close()
    assert not (tmp_path / "scratch").exists()


def test_a_crashed_runs_leftovers_are_cleared_on_opening(tmp_path):
    folder = tmp_path / "scratch" / "parked"
    folder.mkdir(parents=True)
    (folder / "client0.bin").write_bytes(b"left by a crash")
    Parking(folder)
    assert not list(folder.iterdir())


def test_a_disk_fault_ends_the_run_naming_the_folder_and_the_fix(tmp_path):
    sent = Scratch(tmp_path / "sent", "last model", "set influence.enabled=false")
    sent.folder.rmdir()
    sent.folder.write_text("")  # the folder gone, a file in its place: writes fail even for root
    with pytest.raises(FederationError,
                       match=r"cannot keep client 2's last model in .*sent.*set influence.enabled=false"):
        sent.put(2, np.zeros(4, dtype=np.float32))
    parked = Parking(tmp_path / "parked")
    parked.folder.rmdir()
    parked.folder.write_text("")
    with pytest.raises(FederationError, match=r"upload \(parked .*set influence.calibrate_first_round=false"):
        parked.park(0, np.zeros(4, dtype=np.float32), 1.0)


def test_a_file_cut_short_under_the_server_is_named_not_misread(tmp_path):
    sent = Scratch(tmp_path / "sent", "last model", "set influence.enabled=false")
    sent.put(0, np.ones(8, dtype=np.float32))
    path = tmp_path / "sent" / "client0.bin"
    path.write_bytes(path.read_bytes()[:12])  # something else wrote to the folder
    with pytest.raises(FederationError, match=r"client0.bin is shorter than the 8 values written"):
        sent.view(0)[0:8]
    path.unlink()
    with pytest.raises(FederationError, match=r"cannot read .*client0.bin"):
        sent.view(0)[0:8]
