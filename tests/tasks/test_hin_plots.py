"""Convergence curves read from metrics.jsonl, and the two PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpcfed.store.embeddings import export_path, write_export
from hpcfed.tasks.hin_plots import convergence_curves, plot_convergence, plot_tsne, time_to_reach


def _metrics(run: Path, events: list[tuple]) -> None:
    run.mkdir(parents=True)
    lines = [json.dumps({"round": r, "client": c, "name": n, "value": v, "time": t}) for r, c, n, v, t in events]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_curve_is_the_mean_of_each_clients_latest_value(tmp_path: Path) -> None:
    _metrics(tmp_path / "a", [
        (1, 0, "train_loss", 1.0, 1.0), (1, 0, "val_micro_f1", 0.4, 1.0),
        (2, 1, "train_loss", 0.9, 2.0), (2, 1, "val_micro_f1", 0.6, 2.0),
        (3, None, "broadcast", 1, 2.5),
        (4, 0, "train_loss", 0.5, 3.0), (4, 0, "val_micro_f1", 0.8, 3.0),
    ])
    c = convergence_curves(tmp_path / "a" / "metrics.jsonl", "val_micro_f1")
    assert c["value"] == pytest.approx([0.4, 0.5, 0.7])
    assert list(c["updates"]) == [1, 2, 3] and list(c["time"]) == [1.0, 2.0, 3.0]
    assert time_to_reach(c, 0.5) == 2.0 and time_to_reach(c, 0.9) is None
    out = plot_convergence({"a": tmp_path / "a", "b": tmp_path / "a"}, tmp_path / "conv.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_target_counts_only_once_every_client_has_reported(tmp_path: Path) -> None:
    # a 3-client run whose straggler (client 2) reports late: the mean of the two fast sites alone
    # reaches 0.8 at t=2, but the federation's mean only at t=5
    _metrics(tmp_path / "a", [
        (None, None, "num_clients", 3, 0.0),
        (1, 0, "val_micro_f1", 0.8, 1.0), (2, 1, "val_micro_f1", 0.8, 2.0),
        (3, 2, "val_micro_f1", 0.5, 4.0), (4, 2, "val_micro_f1", 0.8, 5.0),
    ])
    c = convergence_curves(tmp_path / "a" / "metrics.jsonl", "val_micro_f1")
    assert list(c["reporting"]) == [1, 2, 3, 3] and c["num_clients"] == 3
    assert time_to_reach(c, 0.8) == 5.0 and time_to_reach(c, 0.7) == 4.0


def test_tsne_png_from_exports(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for k in range(2):
        labels = np.repeat([0, 1], 15)
        vectors = (rng.normal(size=(30, 8)) + 4 * labels[:, None]).astype(np.float32)
        write_export(export_path(tmp_path, k), vectors, [f"n{i}" for i in range(30)], labels,
                     model="fedahe", site=k)
    out = plot_tsne(tmp_path, tmp_path / "tsne.png")
    assert out.stat().st_size > 1000
    with pytest.raises(ValueError, match="no site"):
        plot_tsne(tmp_path / "empty", tmp_path / "x.png")


def test_results_table_gives_mean_and_sd_over_seeds(tmp_path: Path) -> None:
    from hpcfed.tasks.hin_plots import results_table

    dirs = []
    for seed, micro, method in ((0, 0.9, "feddwa"), (1, 0.8, "feddwa"), (0, 0.7, "local")):
        run = tmp_path / f"{method}{seed}"
        run.mkdir()
        cfg = {"method": method if seed == 0 else None, "seed": seed, "strategy": {"name": method},
               "task": {"options": {"dataset": "hin/acm", "split": "frac:0.3", "partition": "by_type",
                                    "partition_type": "A"}}}  # seed 1: started without method= (issue 40)
        (run / "summary.json").write_text(json.dumps({"micro_f1": micro, "macro_f1": 0.5, "config": cfg}))
        dirs.append(run)
    lines = results_table(dirs).splitlines()
    assert lines[2].startswith("| hin/acm | frac:0.3 | by_type A | feddwa | 0,1 | 0.850 ± 0.071 | 0.500 ± 0.000 |")
    assert lines[3].startswith("| hin/acm | frac:0.3 | by_type A | local | 0 | 0.700 | 0.500 |")
    with pytest.raises(ValueError, match=r"summary\.json does not exist"):
        results_table([tmp_path / "nope"])


def test_a_bad_path_is_one_line_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpcfed.tasks.hin_plots import main

    assert main(["table", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hin_plots table: ") and "summary.json does not exist" in err and len(err.splitlines()) == 1
