"""`hpcfed report DIR`: plots and report.md from a metrics.jsonl, malformed lines, TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from hpcfed.report import make_report, read_metrics


def _write_run(run: Path, *, rounds: int = 5, summary: bool = True, cut_last_line: bool = False) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lines = [{"round": None, "client": None, "name": "num_clients", "value": 2, "time": 0.0}]
    t = 0.0
    for r in range(rounds):
        for c in (0, 1):
            t += 0.5
            lines.append({"round": r, "client": c, "name": "loss", "value": 1.0 / (r + 1 + c), "time": t})
            lines.append({"round": r, "client": c, "name": "val_accuracy", "value": 0.5 + 0.1 * r, "time": t})
        lines.append({"round": r, "client": -1, "name": "round_time_s", "value": 0.5, "time": t})
        if r % 2 == 1:
            lines.append({"round": r, "client": None, "name": "checkpoint", "value": f"ckpt-{r:06d}.h5", "time": t})
    lines.append({"round": 1, "client": 1, "name": "straggler", "value": 1, "time": 1.0})
    lines.append({"round": 2, "client": 0, "name": "loss", "value": None, "time": 1.5})  # non-finite -> null
    text = "".join(json.dumps(x) + "\n" for x in lines)
    if cut_last_line:
        text += '{"round": 9, "client": 0, "name": "lo'  # killed mid-write
    (run / "metrics.jsonl").write_text(text)
    if summary:
        (run / "summary.json").write_text(json.dumps({
            "mean": {"accuracy": 0.75}, "clients": {"0": {"accuracy": 0.7}, "1": {"accuracy": 0.8}},
            "rounds": rounds, "updates_accepted": 2 * rounds, "wall_time_s": t,
            "rejected": {"runtime": {}, "channel": {"tag": 3}},
            "config": {"name": "demo", "source": "configs/demo.yaml", "federation": {"mode": "sync"},
                       "strategy": {"name": "fedavg"}, "task": {"name": "synthetic"}}}))


def test_report_writes_plots_and_markdown(tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    result = make_report(run)
    names = sorted(Path(p).name for p in result["plots"])
    # num_clients and straggler have one value per site: listed, not drawn as empty plots
    assert names == ["loss.png", "round_time_s.png", "val_accuracy.png"]
    for p in result["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (run / "report.md").read_text()
    assert "| site | accuracy |" in md and "| site 1 | 0.8 |" in md and "| **mean** | 0.75 |" in md
    assert "| rejected messages | 3 |" in md
    # loss: best is the lowest; site 0's loss at round 4 is 1/5; the null at round 2 is kept as a point.
    assert "| loss | site 0 | 6 | 0.2 | 4 | 0.2 | 4 |" in md
    assert "| val_accuracy | site 1 | 5 | 0.9 | 4 | 0.9 | 4 |" in md
    assert "| round_time_s | server | 5 |" in md
    assert "| checkpoint | ckpt-000003.h5 |" in md and "| site 1 | straggler | 1 |" in md
    assert "![loss](report/loss.png)" in md
    assert "Not plotted (one value per site, see the tables above): `num_clients`, `straggler`." in md


def _x_axis(png: str) -> str:
    from PIL import Image

    with Image.open(png) as img:
        return img.text["Description"]


def test_plots_label_the_x_axis_by_mode(tmp_path):
    """Sync runs are plotted per round, async runs per accepted update (from summary.json's config,
    or, for an unfinished run, from what the server logs in each mode)."""
    sync = tmp_path / "sync"
    _write_run(sync, summary=False)  # round_time_s marks a sync run
    assert _x_axis(make_report(sync)["plots"][0]) == "loss per round (from 0) and per wall time"
    run = tmp_path / "async"
    _write_run(run, summary=False)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [x for x in lines if x["name"] != "round_time_s"]
    lines += [{"round": u, "client": None, "name": "broadcast", "value": u % 2, "time": u} for u in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    plots = make_report(run)["plots"]
    assert all(_x_axis(p).endswith("per accepted updates and per wall time") for p in plots), plots


def test_report_of_a_killed_run_skips_the_cut_line_and_says_so(tmp_path):
    run = tmp_path / "killed"
    _write_run(run, summary=False, cut_last_line=True)
    m = read_metrics(run / "metrics.jsonl")
    assert len(m.skipped) == 1 and m.skipped[0][1].startswith("not JSON")
    text = Path(make_report(run)["report"]).read_text()
    assert "No `summary.json`" in text and f"line {m.skipped[0][0]}: not JSON" in text


def test_report_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_report(tmp_path / "nope")
    (tmp_path / "metrics.jsonl").write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl holds no metric records; "
                                         r"first problem: line 1: no metric name"):
        make_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"round": "x", "client": 0, "name": "loss", "value": 1}\n')
    with pytest.raises(ValueError, match="line 1: key 'round' must be a number"):
        make_report(tmp_path)


def test_cli_report_command(tmp_path):
    run = tmp_path / "cli"
    _write_run(run)
    proc = run_cli(["report", str(run), "--json"], timeout=120)
    result = json.loads(proc.stdout)
    assert Path(result["report"]).is_file() and len(result["plots"]) == 3
    bad = run_cli(["report", str(tmp_path / "missing")], timeout=120, check=False)
    assert bad.returncode == 2 and "missing" in bad.stderr and "Traceback" not in bad.stderr


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is optional (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "tb"
    _write_run(run)
    result = make_report(run, tensorboard=True)
    acc = EventAccumulator(result["tensorboard"])
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/site0", "loss/site1", "val_accuracy/site1", "round_time_s/server"} <= tags
    events = acc.Scalars("val_accuracy/site1")
    assert [e.step for e in events] == [0, 1, 2, 3, 4]
    assert events[-1].value == pytest.approx(0.9)


def test_sites_are_named_and_only_scores_are_ranked(tmp_path):
    run = tmp_path / "dame"
    run.mkdir()
    lines = [{"round": r, "client": c, "name": name, "value": value, "time": float(r)}
             for r in range(3) for c in (0, 1)
             for name, value in (("val_nmi", 0.5 + 0.1 * r - 0.2 * (r == 2)), ("bola_lambda", 0.1 * r),
                                 ("train_loss", 1.0 - 0.1 * r))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "summary.json").write_text(json.dumps({
        "clients": {"0": {"nmi": 0.6}, "1": {"nmi": 0.7}},
        "config": {"task": {"name": "events", "options": {"sites": ["crisislext26:1/2", "arabic"]}}}}))
    text = Path(make_report(run)["report"]).read_text()
    assert "| site 0 (crisislext26:1/2) | 0.6 |" in text and "| site 1 (arabic) | 0.7 |" in text
    assert "| bola_lambda | site 0 (crisislext26:1/2) | 3 | 0.2 | 2 | – | – |" in text  # a weight: not ranked
    assert "| val_nmi | site 1 (arabic) | 3 | 0.5 | 2 | 0.6 | 1 |" in text
    assert "| train_loss | site 0 (crisislext26:1/2) | 3 | 0.8 | 2 | 0.8 | 2 |" in text


def test_site_legends_show_a_files_name_not_its_folders():
    """Issue 40: legends showed full absolute parquet paths as site names."""
    from hpcfed.report import site_names

    sites = ["/home/u/data/c6.parquet:1/3", "./x/tweets.jsonl~flood%1/2", "crisislext26~quake", "/data/my_site"]
    summary = {"config": {"task": {"options": {"sites": sites}}}}
    assert site_names(summary) == {0: "c6.parquet:1/3", 1: "tweets.jsonl~flood%1/2", 2: "crisislext26~quake",
                                   3: "my_site"}
    named = {"config": {"task": {"options": {"site_names": ["/as/the/user/wrote"], "sites": sites}}}}
    assert site_names(named) == {0: "/as/the/user/wrote"}  # names the user gave are kept
