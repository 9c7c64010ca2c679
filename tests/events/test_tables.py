"""tools/dame_tables.py: tables from finished runs (--tables-only reads summary.json files, runs nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
