"""The documentation site's promises: its runnable examples run, its generated references cover
every command and every configuration key, and every key the pages name exists.

A shell block is runnable when the line before its fence is ``<!-- runnable -->``; the blocks of one
page run in order in one temporary folder (with ``configs/`` of the repository beside them), so a
later block may use what an earlier one wrote."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import hpcfed_reference as reference  # noqa: E402  (docs/_ext is not a package; its path is set just above)

RUNNABLE = re.compile(r"<!-- runnable -->\n```(?:bash|sh|console)\n(.*?)\n```", re.S)


def runnable_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "<!-- runnable -->" in p.read_text())


def blocks(page: Path) -> list[str]:
    return RUNNABLE.findall(page.read_text())


def test_the_getting_started_page_has_runnable_blocks():
    names = {p.relative_to(DOCS).as_posix() for p in runnable_pages()}
    assert "getting-started.md" in names
    text = "\n".join(blocks(DOCS / "getting-started.md"))
    for command in ("hpcfed run", "hpcfed report", "hpcfed inspect", "hpcfed search query", "hpcfed new"):
        assert command in text, f"getting-started.md has no runnable `{command}`"


@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_runnable_blocks_run(page: Path, tmp_path: Path):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    env = {**os.environ, "HPCFED_KEYS_DIR": str(tmp_path / "keys"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    env.pop("HPCFED_PSK", None)
    for i, block in enumerate(blocks(page)):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (f"{page.name} block {i} exited {proc.returncode}:\n{block}\n--- stdout\n"
                                      f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")


def test_the_cli_reference_lists_every_command():
    markdown = reference.cli_markdown()
    commands = reference.commands()
    assert len(commands) >= 12 and {"run", "search", "status", "keygen"} <= set(commands), commands
    for name in commands:
        assert f"`hpcfed {name}`" in markdown, f"hpcfed {name} is missing from the CLI reference"
        assert reference.help_text([name]).startswith("usage: hpcfed"), name
    for group in ("data", "search"):
        subs = re.search(r"\{([a-z0-9_,-]+)\}", reference.help_text([group])).group(1).split(",")
        for name in subs:
            assert f"`hpcfed {group} {name}`" in markdown


def _all_keys(cls: type, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(cls):
        nested = reference._dataclass_of(f.type if not isinstance(f.type, str) else
                                         __import__("typing").get_type_hints(cls)[f.name])
        if nested is not None and nested.__name__ != "ComponentConfig":
            keys |= _all_keys(nested, f"{prefix}{f.name}.")
        elif f.name != "source":
            keys.add(f"{prefix}{f.name}")
    return keys


def _template_keys() -> set[str]:
    """Options of the `hpcfed new` projects' tasks and strategies (the pages run them too)."""
    from hpcfed.tasks.torch_adapter import TorchTask

    keys = {f"task.{f.name}" for f in dataclasses.fields(TorchTask.Config)}
    for source in (REPO / "hpcfed" / "templates").glob("*/*.py"):
        kind = "strategy" if source.stem == "strategy" else "task"
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "Config":
                keys |= {f"{kind}.{item.target.id}" for item in node.body
                         if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return keys


def known_keys() -> set[str]:
    from hpcfed.config import Config

    keys = {row[0] for row in reference.config_rows(Config)}
    for kind, _, options in reference.components():
        keys |= {row[0] for row in reference.config_rows(options, f"{kind}.")}
    return keys | {"task.name", "strategy.name"}


def test_the_config_reference_lists_every_key():
    from hpcfed.config import Config

    markdown = reference.config_markdown()
    assert _all_keys(Config) <= {row[0] for row in reference.config_rows(Config)}
    for key in known_keys() - {"task.name", "strategy.name"}:
        assert f"`{key}`" in markdown, key


SECTIONS = ("federation", "security", "comm", "influence", "privacy", "task", "strategy")
OVERRIDE = re.compile(rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})(?:\.[a-z_][a-z0-9_]*)+)=")


def test_every_key_the_pages_name_exists():
    """`federation.quorum=0.75` in a page is a key a user will type: a renamed key fails here."""
    keys = known_keys() | _template_keys()
    pages = [*DOCS.rglob("*.md"), REPO / "README.md"]
    unknown = []
    for page in pages:
        for match in OVERRIDE.finditer(page.read_text()):
            key = match.group(1)
            if key not in keys and not any(key.startswith(k + ".") for k in keys if k.endswith("slowdown")):
                unknown.append(f"{page.relative_to(REPO)}: {key}")
    assert not unknown, "keys named in the docs that the configuration does not have:\n" + "\n".join(unknown)


DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def dated_lines(page: Path) -> list[str]:
    """The lines of a page, outside code and link targets, that carry a date."""
    text = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        prose = LINK_TARGET.sub("]()", INLINE_CODE.sub("``", line))
        if DATE.search(prose):
            found.append(f"{page.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    return found


def test_dated_figures_live_only_on_the_benchmarks_pages():
    """A measurement carries its date, machine and command on the benchmarks pages; README, guides,
    references and paper pages state what it shows and link there, so they never go stale."""
    benchmarks = {DOCS / "benchmarks.md", *(DOCS / "benchmarks").rglob("*.md")}
    pages = [REPO / "README.md", *(p for p in sorted(DOCS.rglob("*.md")) if p not in benchmarks)]
    dated = [line for page in pages for line in dated_lines(page)]
    assert not dated, "move these dated figures to docs/benchmarks.md and link to them:\n" + "\n".join(dated)
