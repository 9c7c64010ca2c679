"""The `hpcfed` command line as a whole: every command listed with what it does, a paste-ready
`hpcfed keygen --rank N`, and no library module that imports the CLI."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from hpcfed.cli.commands import COMMANDS
from hpcfed.cli.commands import main as cli_main
from hpcfed.comm import crypto
from hpcfed.comm.keys import load_authorized_keys, load_identity

PACKAGE = Path(__file__).resolve().parents[1] / "hpcfed"


def test_help_lists_every_command_with_one_line_saying_what_it_does():
    env = {**os.environ, "COLUMNS": "80"}  # a terminal of 80 columns
    proc = subprocess.run([sys.executable, "-m", "hpcfed", "--help"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    modules = {p.stem for p in (PACKAGE / "cli").glob("*.py")} - {"__init__", "commands"}
    assert set(COMMANDS) == modules  # one module per command, each reachable
    for name in COMMANDS:
        found = re.search(rf"^\s+{re.escape(name)}\s+(\S.*)$", proc.stdout, re.MULTILINE)
        assert found, f"`hpcfed --help` does not list {name}:\n{proc.stdout}"
        assert "--help" not in found.group(1) and len(found.group(1)) > 20, found.group(0)
    listing = proc.stdout.split("  COMMAND\n", 1)[1].split("\n\n")[0].splitlines()
    assert len(listing) == len(COMMANDS), f"a description takes more than one line:\n{proc.stdout}"


def test_keygen_with_rank_prints_a_line_the_server_accepts_as_is(tmp_path, capsys):
    assert cli_main(["keygen", str(tmp_path / "site3"), "--rank", "3", "--comment", "carol@site3"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(crypto.KEY_TYPE) and line.endswith(" rank=3 carol@site3")
    (tmp_path / "authorized_keys").write_text(line + "\n")
    bound = load_authorized_keys(tmp_path / "authorized_keys")  # how the server reads the file
    assert list(bound) == [3]
    assert crypto.public_raw(bound[3]) == crypto.public_raw(load_identity(tmp_path / "site3").public_key())


def test_keygen_without_rank_says_how_to_bind_the_key(tmp_path, capsys):
    assert cli_main(["keygen", str(tmp_path / "site"), "--comment", "x"]) == 0
    out = capsys.readouterr().out
    assert "--rank N" in out and out.strip().splitlines()[-1].endswith(" rank=N x")


def test_keygen_refuses_the_server_rank(tmp_path, capsys):
    assert cli_main(["keygen", str(tmp_path / "server"), "--rank", "0"]) == 2
    assert "rank 1..K" in capsys.readouterr().err
    assert not (tmp_path / "server").exists()


def test_no_library_module_imports_the_cli():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "cli") or path == PACKAGE / "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "hpcfed.cli" or n.startswith("hpcfed.cli.") for n in names):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not offenders, f"library modules import the CLI: {offenders}"
