"""A newcomer's first hour (issue 17): no tracebacks, no silently overwritten run, and a last line
that names the rank that really failed. Every case runs the real CLI in a subprocess."""

from __future__ import annotations

import hashlib
import json
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


def _earlier_run(out: Path) -> None:
    """What an earlier run leaves in OUT (its results, a checkpoint of round 5), beside a user's file."""
    (out / "checkpoints").mkdir(parents=True)
    (out / "embeddings").mkdir()
    (out / "summary.json").write_text('{"accuracy": 0.5}')
    (out / "metrics.jsonl").write_text('{"round": 5, "client": 0, "name": "loss", "value": 1.0, "time": 0.1}\n')
    (out / "checkpoints" / "ckpt-000005.h5").write_bytes(b"an earlier run's checkpoint")
    (out / "embeddings" / "site0.h5").write_bytes(b"an earlier run's export")
    (out / "notes.txt").write_text("mine")  # not hpcfed's: --force leaves it alone


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One finished quickstart run (2 rounds, a checkpoint after each), shared by the tests below. It
    was started with --force over an earlier run's results (test_force_overwrites_deliberately)."""
    out = tmp_path_factory.mktemp("newcomer") / "run"
    _earlier_run(out)
    proc = run_cli(["run", QUICKSTART, *SMALL, "--np", "3", "--out", str(out), "--force"], timeout=240)
    assert (out / "summary.json").is_file() and len(list((out / "checkpoints").glob("ckpt-*.h5"))) == 2
    (out.parent / "console.txt").write_text(proc.stdout + proc.stderr)
    return out


@pytest.mark.mpi
def test_console_numbers_rounds_like_the_files_and_ends_with_figures_and_where_results_are(finished):
    console = (finished.parent / "console.txt").read_text()
    lines = [line.split("] INFO ", 1)[1] for line in console.splitlines() if "] INFO " in line]
    rounds = [line for line in lines if line.startswith("round ")]
    # rounds from 0, like metrics.jsonl and ckpt-00000R.h5; progress counts rounds done out of the total
    assert rounds[0].startswith("round 0 of 0..1 done in ") and "saved ckpt-000000.h5 [1/2 rounds, ETA " in rounds[0]
    assert rounds[1].startswith("round 1 of 0..1 done in ") and rounds[1].endswith("saved ckpt-000001.h5 [2/2 rounds]")
    ckpt_rounds = [e["round"] for e in map(json.loads, (finished / "metrics.jsonl").read_text().splitlines())
                   if e["name"] == "checkpoint"]
    assert ckpt_rounds == [0, 1]
    done, note, results = lines[-3:]
    assert done.startswith("done: final test metrics, mean over 2 sites: accuracy=")
    assert "(on each site's test split)" in done
    accuracy = json.loads((finished / "summary.json").read_text())["mean"]["accuracy"]
    assert f"accuracy={accuracy:.4f}" in done
    assert note.startswith("note: val_accuracy is on each site's validation split, label-skewed like its training data")
    assert results == (f"results: {finished}/summary.json (final metrics per site), "
                       f"{finished}/metrics.jsonl (per round), "
                       f"{finished}/embeddings/ (2 site exports), {finished}/checkpoints/ckpt-000001.h5 (newest "
                       f"checkpoint); plots: hpcfed report {finished}")


@pytest.mark.mpi
def test_rerun_into_a_finished_run_is_refused_and_changes_nothing(finished):
    before = _fingerprint(finished)
    proc = run_cli(["run", QUICKSTART, *SMALL, "--np", "3", "--out", str(finished)], check=False, timeout=120)
    _one_line_error(proc, f"--out {finished} already holds a run (summary.json, metrics.jsonl, checkpoints/, "
                          f"embeddings/); continue it with --resume, overwrite it with --force, "
                          f"or choose another --out")
    both = run_cli(["run", QUICKSTART, "--np", "3", "--out", str(finished), "--resume", "--force"],
                   check=False, timeout=120)
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
def test_force_overwrites_deliberately(finished):
    console = (finished.parent / "console.txt").read_text()
    assert "--force: removed the earlier run's summary.json, metrics.jsonl, checkpoints/, embeddings/" in console
    # the earlier run's round-5 checkpoint is gone: only this run's two are left
    assert sorted(p.name for p in (finished / "checkpoints").iterdir()) == ["ckpt-000000.h5", "ckpt-000001.h5"]
    assert json.loads((finished / "summary.json").read_text())["config"]["rounds"] == 2
    assert (finished / "notes.txt").read_text() == "mine"


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
    negative = run_cli(["run", QUICKSTART, "rounds=-3", "--np", "3", "--out", str(tmp_path / "o")],
                       check=False, timeout=120)
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


def test_data_verify_says_where_it_looked_and_fails_on_missing_or_bad_data(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = run_cli(["data", "verify"], check=False, timeout=120, env={"HPCFED_DATA": str(empty)})
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stdout.splitlines()[0] == f"data root: {empty} (from $HPCFED_DATA)"
    assert "acm              missing" in missing.stdout
    assert f"7 of 7 datasets missing under {empty}: set HPCFED_DATA" in missing.stderr
    allowed = run_cli(["data", "verify", "--allow-missing", "--root", str(empty)], check=False, timeout=120)
    assert allowed.returncode == 0 and allowed.stdout.splitlines()[0] == f"data root: {empty} (--root)"
    (empty / "hin" / "acm").mkdir(parents=True)
    (empty / "hin" / "acm" / "labels.npy").write_bytes(b"not the real file")
    bad = run_cli(["data", "verify", "acm", "--allow-missing", "--root", str(empty)], check=False, timeout=120)
    assert bad.returncode == 1 and "acm              MISMATCH (1 files" in bad.stdout
    assert "1 dataset(s) do not match data_manifest.yaml (acm)" in bad.stderr


def test_exports_read_as_pandas_frames(tmp_path):
    import numpy as np

    from hpcfed.store.embeddings import read_frame, write_export

    path = write_export(tmp_path / "site0.h5", np.arange(6, dtype=np.float32).reshape(3, 2), ["a", "b", "c"],
                        np.array([1, 0, 1]), entity="node", model="mlp", site=0)
    frame = read_frame(path, "node")
    assert list(frame.index) == ["a", "b", "c"] and frame.index.name == "id"
    assert list(frame.columns) == ["label", "dim_0", "dim_1"] and frame.loc["b", "dim_1"] == 3.0
    assert frame["dim_0"].dtype == np.float32 and list(frame["label"]) == [1, 0, 1]
    assert frame.attrs["entity"] == "node" and frame.attrs["model"] == "mlp"


def _torch_install(env: dict) -> tuple[str, str]:
    import os
    import subprocess

    proc = subprocess.run(["bash", str(REPO / "tools" / "setup.sh"), "--print-torch-install"], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr.strip()


def test_setup_picks_the_cpu_wheel_index_without_a_gpu(tmp_path):
    """tools/setup.sh's choice of where torch comes from, against a local index (no network)."""
    import functools
    import http.server
    import os
    import threading

    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<a href='torch-2.13.0+cpu.whl'>torch</a>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    index = f"http://127.0.0.1:{server.server_address[1]}/"
    no_gpu = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    (tmp_path / "bin").mkdir()
    try:
        cmd, _ = _torch_install({**no_gpu, "TORCH_INDEX": index})
        assert cmd.endswith(f"-m pip install -q --index-url {index} torch==2.13.0"), cmd
        cmd, _ = _torch_install({**no_gpu, "TORCH_INDEX": index, "TORCH_SPEC": "torch>=2.4"})
        assert cmd.endswith(f"--index-url {index} torch>=2.4"), cmd
        # unreachable CPU index (this machine: only a mirror of PyPI): the plain spec, with one line why
        cmd, why = _torch_install({**no_gpu, "TORCH_INDEX": "http://127.0.0.1:9/whl/cpu"})
        assert cmd.endswith("-m pip install -q torch==2.13.0") and "unreachable" in why, (cmd, why)
        cmd, why = _torch_install({**no_gpu, "TORCH_INDEX": ""})
        assert cmd.endswith("-m pip install -q torch==2.13.0") and why == "", (cmd, why)
        # a GPU node: the ordinary index, whose wheel brings CUDA
        fake = tmp_path / "bin" / "nvidia-smi"
        fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n")
        fake.chmod(0o755)
        cmd, _ = _torch_install({**no_gpu, "TORCH_INDEX": index})
        assert cmd.endswith("-m pip install -q torch==2.13.0"), cmd
    finally:
        server.shutdown()
        server.server_close()
