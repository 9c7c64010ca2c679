"""A newcomer's first hour (issue 17): no tracebacks, no silently overwritten run, and a last line
that names the rank that really failed. Every case runs the real CLI in a subprocess."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import h5py
import pytest

from conftest import REPO, run_cli

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
SMALL = ["rounds=2", "checkpoint_every=1"]


def _fingerprint(folder: Path) -> dict[str, str]:
    """Content hash of every file of a run except the logs (which a refused launch may touch)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "logs" not in p.parts}


def _one_line_error(proc, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpcfed: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One finished quickstart run (2 rounds, a checkpoint after each), shared by the tests below."""
    out = tmp_path_factory.mktemp("newcomer") / "run"
    run_cli(["run", QUICKSTART, *SMALL, "--np", "3", "--out", str(out)], timeout=240)
    assert (out / "summary.json").is_file() and len(list((out / "checkpoints").glob("ckpt-*.h5"))) == 2
    return out


@pytest.mark.mpi
def test_rerun_into_a_finished_run_is_refused_and_changes_nothing(finished):
    before = _fingerprint(finished)
    proc = run_cli(["run", QUICKSTART, *SMALL, "--np", "3", "--out", str(finished)], check=False, timeout=120)
    _one_line_error(proc, f"--out {finished} already holds a run (summary.json, metrics.jsonl, checkpoints/, "
                          f"embeddings/); continue it with --resume, overwrite it with --force, or choose another --out")
    both = run_cli(["run", QUICKSTART, "--np", "3", "--out", str(finished), "--resume", "--force"], check=False, timeout=120)
    _one_line_error(both, "--resume continues the run in --out and --force overwrites it: choose one")
    assert _fingerprint(finished) == before


@pytest.mark.mpi
def test_resume_with_another_config_names_what_differs_and_changes_nothing(finished):
    before = _fingerprint(finished)
    for overrides, needle in ((["seed=7"], "(seed: 0 in the checkpoint, 7 now)"),
                              (["task.lr=0.1"], "(task.lr: 0.005 in the checkpoint, 0.1 now)")):
        proc = run_cli(["run", QUICKSTART, *SMALL, *overrides, "--np", "3", "--out", str(finished), "--resume"],
                       check=False, timeout=120)
        _one_line_error(proc, "--resume: ", "ckpt-000001.h5 was written by a different run configuration", needle)
    assert _fingerprint(finished) == before


@pytest.mark.mpi
def test_resume_when_every_checkpoint_is_invalid_stops_instead_of_starting_over(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    for path in (copy / "checkpoints").glob("ckpt-*.h5"):
        with h5py.File(path, "r+") as f:
            data = f["strategy/global"][()]
            data[0] += 1.0
            f["strategy/global"][...] = data
    before = _fingerprint(copy)
    proc = run_cli(["run", QUICKSTART, *SMALL, "rounds=3", "--np", "3", "--out", str(copy), "--resume"],
                   check=False, timeout=180)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hpcfed: the federation failed") and "rank 0 (the server) failed: --resume: none of the 2 " \
        "checkpoints in" in last and "verifies" in last and "--force" in last, proc.stderr[-3000:]
    assert _fingerprint(copy) == before


@pytest.mark.mpi
def test_force_overwrites_deliberately(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    (copy / "notes.txt").write_text("mine")  # not hpcfed's: --force leaves it alone
    proc = run_cli(["run", QUICKSTART, "rounds=1", "checkpoint_every=1", "--np", "3", "--out", str(copy), "--force"],
                   timeout=240)
    assert "--force: removed the earlier run's summary.json, metrics.jsonl, checkpoints/, embeddings/" in proc.stderr
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["ckpt-000000.h5"]
    assert (copy / "notes.txt").read_text() == "mine"


def test_out_naming_a_file_and_bare_overrides_are_one_line_errors(tmp_path):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    proc = run_cli(["run", QUICKSTART, "--np", "3", "--out", str(target)], check=False, timeout=120)
    _one_line_error(proc, f"--out {target} is a file, not a folder")
    assert target.read_text() == "keep me"
    bare = run_cli(["run", QUICKSTART, "rounds", "--np", "3", "--out", str(tmp_path / "o")], check=False, timeout=120)
    _one_line_error(bare, "override 'rounds' must look like key=value")
    after = run_cli(["run", QUICKSTART, "--np", "3", "rounds", "--out", str(tmp_path / "o")], check=False, timeout=120)
    _one_line_error(after, "override 'rounds' must look like key=value")
    negative = run_cli(["run", QUICKSTART, "rounds=-3", "--np", "3", "--out", str(tmp_path / "o")], check=False, timeout=120)
    _one_line_error(negative, "command line (rounds=-3): rounds must be >= 1, got -3")
    tag = run_cli(["run", QUICKSTART, "x=!!python/object/apply:os.system ['touch pwned']", "--np", "3",
                   "--out", str(tmp_path / "o")], check=False, timeout=120)
    _one_line_error(tag, "not valid YAML")
    assert not (tmp_path / "o").exists() and not (REPO / "pwned").exists()


@pytest.mark.mpi
def test_a_clients_data_error_is_the_last_line_and_names_the_client(tmp_path):
    """Every client fails to find its dataset and MPI_Abort takes the server down: the last line
    names a client and its error, after everything mpiexec printed."""
    proc = run_cli(["run", "configs/fedahe_acm.yaml", "rounds=1", "--np", "3", "--out", str(tmp_path / "o")],
                   check=False, timeout=240, env={"HPCFED_DATA": str(tmp_path / "no-data")})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hpcfed: the federation failed (exit 1): rank ") and "(client " in last, proc.stderr[-3000:]
    assert "failed: dataset 'hin/acm' not found at " in last and "set HPCFED_DATA" in last, last
    assert "rank 0 (the server)" not in last.split("failed:")[1].split(";")[0]
