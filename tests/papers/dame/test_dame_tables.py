"""tools/dame_tables.py: tables from finished runs (--tables-only reads summary.json files, runs nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _tool():
    spec = importlib.util.spec_from_file_location("dame_tables", REPO / "tools" / "dame_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(out: Path, nmis: list[float], wall: float) -> None:
    out.mkdir(parents=True)
    clients = {str(c): {"nmi": v, "ami": v - 0.1, "ari": v - 0.2} for c, v in enumerate(nmis)}
    (out / "summary.json").write_text(json.dumps({"clients": clients, "wall_time_s": wall}))


def test_tables_gain_over_local_attacks_and_wall_times(tmp_path, capsys):
    root = tmp_path / "tables"
    for seed, shift in ((0, 0.0), (1, 0.02)):
        _summary(root / "local" / f"seed{seed}", [0.5 + shift, 0.6, 0.7], 10.0 + 2 * seed)
        _summary(root / "dame" / f"seed{seed}", [0.6 + shift, 0.7, 0.8], 50.0)
        _summary(root / "dame-attack-model" / f"seed{seed}", [0.6 + shift, 0.7, 0.8, 0.0], 60.0)
    code = _tool().main(["--out", str(root), "--seeds", "0", "1", "--methods", "local", "dame",
                         "--attacks", "model", "--attack-methods", "dame", "--sites", "A", "B", "C", "--tables-only"])
    assert code == 0
    text = (root / "tables.md").read_text()
    assert text.strip() == capsys.readouterr().out.strip()  # printed too
    dame_row = next(line for line in text.splitlines() if line.startswith("| dame (n=2)"))
    cells = [c.strip() for c in dame_row.strip("|").split("|")]
    assert cells[1] == "0.610 ± 0.010"  # site A NMI over the two seeds
    assert cells[-3:] == ["+0.100", "+0.100", "+0.100"]  # gain over Local
    assert "| dame | average | 0.703 ± 0.003 | 0.703 ± 0.003 | – |" in text  # the malicious 4th site is left out
    assert "| dame | +0.000 | – |" in text
    assert "| local | 11 ± 1 |" in text
    # the paper's layout: "NMI / AMI / ARI" per site (means), average, gain over Local
    assert "| dame | .610 / .510 / .410 | .700 / .600 / .500 | .800 / .700 / .600 | .703 / .603 / .503 | " \
           "+0.100 / +0.100 / +0.100 |" in text
    assert "| local | +0.100 | +0.100 | +0.100 | +0.100 | 3 of 3 |" in text  # DAMe − Local per site
    assert "| dame attack=model | 60 ± 0 |" in text


def _sized(out: Path, nmis: list[float], num_test: int, wall: float = 5.0) -> None:
    out.mkdir(parents=True)
    clients = {str(c): {"nmi": v, "ami": v - 0.1, "ari": v - 0.2, "num_test": float(num_test), "num_events": 7.0}
               for c, v in enumerate(nmis)}
    (out / "summary.json").write_text(json.dumps({"clients": clients, "wall_time_s": wall}))


def test_sweep_tables_levels_test_sizes_and_paired_gains(tmp_path, capsys):
    root = tmp_path / "sweep"
    for level, n_test in (("200", 40), ("1000", 200)):
        for seed, shift in ((0, 0.0), (1, 0.02)):
            d = root / f"max_messages_per_site={level}"
            _sized(d / "local" / f"seed{seed}", [0.5 + shift, 0.6], n_test)
            _sized(d / "fedavg" / f"seed{seed}", [0.4, 0.5], n_test)
            _sized(d / "dame" / f"seed{seed}", [0.6 + 2 * shift, 0.55], n_test)
    code = _tool().main(["--out", str(root), "--seeds", "0", "1", "--methods", "local", "fedavg", "dame",
                         "--sites", "A", "B", "--sweep", "task.max_messages_per_site=200,1000", "--tables-only"])
    assert code == 0
    text = (root / "tables.md").read_text()
    assert text.strip() == capsys.readouterr().out.strip()
    assert "| 200 | 40 / 7 | 40 / 7 |" in text and "| 1000 | 200 / 7 | 200 / 7 |" in text
    # NMI table: site A of DAMe over seeds 0.60, 0.64 -> mean .620, sample sd .028; avg gain over Local
    assert "| 200 | dame (n=2) | 0.620 ± 0.028 | 0.550 ± 0.000 | 0.585 ± 0.014 | +0.030 |" in text
    # paired DAMe − Local: site A +0.10, +0.12; site B −0.05 twice; avg +0.025, +0.035
    assert ("| 1000 | local | +0.110 ± 0.014 (2/2) | -0.050 ± 0.000 (0/2) | +0.030 ± 0.007 (2/2) "
            "| +0.025, +0.035 | 1 of 2 |") in text
    assert "| 200 | fedavg | " in text and "2 of 2 |" in text
    assert "-attack-" not in "".join(p.name for p in root.rglob("*"))  # a sweep runs no attacks


def _safe_run(out: Path, nmis: list[float], extra: dict | None = None, rounds: dict | None = None) -> None:
    out.mkdir(parents=True)
    clients = {str(c): {"nmi": v, **(extra or {})} for c, v in enumerate(nmis)}
    (out / "summary.json").write_text(json.dumps({"clients": clients}))
    lines = [json.dumps({"round": r, "client": c, "name": name, "value": v})
             for name, per in (rounds or {}).items() for c in range(len(nmis)) for r, v in enumerate(per)]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_safe_tables_goals_kept_models_and_round_means(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("dame_safe_tables", REPO / "tools" / "dame_safe_tables.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    root = tmp_path / "split"
    for seed, shift in ((0, 0.0), (1, 0.02)):
        _safe_run(root / "local" / f"seed{seed}", [0.80 + shift, 0.70, 0.90])
        _safe_run(root / "fedavg" / f"seed{seed}", [0.60, 0.60, 0.60])
        _safe_run(root / "dame-paper" / f"seed{seed}", [0.70, 0.75, 0.90],
                  rounds={"train_alpha": [0.0, 0.9, 1.0], "bola_lambda": [0.0, 0.6, 0.8], "val_nmi": [0.5, 0.6, 0.7]})
        _safe_run(root / "dame" / f"seed{seed}", [0.80 + shift, 0.72, 0.885],
                  {"kept_personal": float(seed), "kept_cluster": float(seed), "vs_local_nmi": -0.02,
                   "local_nmi": 0.80, "personal_nmi": 0.78, "cluster_nmi": 0.83}, rounds={"glecc_on": [0.0, 1.0, 0.0]})
    assert tool.main(["--config", "c.yaml", "--out", str(root), "--sites", "A", "B", "C", "--shared", "0", "1",
                      "--seeds", "0", "1", "--tables-only", "--figure", str(tmp_path / "f.png")]) == 0
    text = (root / "safe.md").read_text()
    assert text.strip() == capsys.readouterr().out.strip()
    assert "| dame − local | +0.000 (+0.000) | +0.020 (+0.020) | -0.015 (-0.015) | +0.002 (+0.002) |" in text
    assert "| dame-paper − local | -0.110 (-0.120) |" in text
    assert "DAMe ≥ Local − 0.01 on every site and seed (6 site-seeds): NOT met (2 below) " \
           "(worst site-seed -0.0150: C, seed 0)" in text
    assert "DAMe ahead of FedAvg on the mean: met (+0.205)" in text
    assert "DAMe above Local on the sites that share events (A, B), mean over seeds: NOT met (+0.000, +0.020; " \
           "above in 2 of 4 site-seeds)" in text
    assert "| kept a model other than Local | 1 of 2 | 1 of 2 | 1 of 2 |" in text
    assert "| of which the cluster model | 1 | 1 | 1 |" in text
    assert "| personalised − Local, test | -0.020 | -0.020 | -0.020 |" in text
    assert "| cluster model − Local, test | +0.030 | +0.030 | +0.030 |" in text
    assert "| dame-paper | A | 0.950 | – | 0.700 | – | 0.700 |" in text  # rounds ≥ 1; last val NMI
    assert "| dame | A | – | – | – | 0.500 | – |" in text
    assert (tmp_path / "f.png").stat().st_size > 0


def test_safe_tables_shadow_local_checks_every_site_seed(tmp_path, capsys):
    """--shadow-local: Local of a seed without a method=local run is the DAMe run's shadow Local model;
    a method=local run found is checked against it; the goal names the worst site-seed of all."""
    spec = importlib.util.spec_from_file_location("dame_safe_tables", REPO / "tools" / "dame_safe_tables.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    root = tmp_path / "split"
    shadows = {0: [0.80, 0.70, 0.90], 1: [0.82, 0.71, 0.88]}
    delivered = {0: [0.80, 0.72, 0.90], 1: [0.82, 0.695, 0.88]}  # seed 1, site B: -0.015
    for seed in (0, 1):
        out = root / "dame" / f"seed{seed}"
        out.mkdir(parents=True)
        clients = {str(c): {"nmi": v, "local_nmi": shadows[seed][c]} for c, v in enumerate(delivered[seed])}
        clients["1"].update({"kept_personal": float(seed), "val_local_nmi": 0.60, "val_personal_nmi": 0.61,
                             "val_cluster_nmi": 0.58, **({"val_gain_lower": 0.002} if seed else {})})
        (out / "summary.json").write_text(json.dumps({"clients": clients}))
    _safe_run(root / "local" / "seed0", [0.80, 0.70, 0.9005])  # a method=local run, 0.0005 off the shadow
    assert tool.main(["--config", "c.yaml", "--out", str(root), "--sites", "A", "B", "C", "--seeds", "0", "1",
                      "--methods", "local", "dame", "--shadow-local"]) == 0  # runs nothing: all found
    text = (root / "safe.md").read_text()
    capsys.readouterr()
    assert "Local of seeds [1]: the safe DAMe run's shadow Local model" in text
    assert "Checked against a method=local run, seed 0: largest difference over sites 0.000500." in text
    # C, seed 0: against the method=local run (0.9005), the run a user made wins over the shadow
    assert "| dame − local | +0.000 (+0.000) | +0.003 (-0.015) | -0.000 (-0.000) | +0.001 (-0.005) |" in text
    assert "DAMe ≥ Local − 0.01 on every site and seed (6 site-seeds): NOT met (1 below) " \
           "(worst site-seed -0.0150: B, seed 1)" in text
    # every site-seed on a row of its own: delivered, Local, the difference, what was kept and why
    assert "| 1 | B | 0.6950 | 0.7100 | -0.0150 | personalised | +0.0100 | +0.0020 |" in text
    assert "| 0 | B | 0.7200 | 0.7000 | +0.0200 | Local | +0.0100 | – |" in text
    assert "| 0 | C | 0.9000 | 0.9005 | -0.0005 | Local | – | – |" in text  # Local from the method=local run
    assert sum(line.startswith("  | 0 |") or line.startswith("  | 1 |") for line in text.splitlines()) == 6
