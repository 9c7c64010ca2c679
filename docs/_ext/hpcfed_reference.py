"""Reference pages generated from the code at build time, so they cannot drift from it.

- ``{hpcfed-cli}``: every command's ``--help``, as argparse prints it, found by walking the
  subcommands the top-level help lists (the installed ``hpcfed`` entry point, called in-process).
- ``{hpcfed-config}``: every key of the run configuration (``hpcfed.config.Config`` and its nested
  sections) and every built-in task's and strategy's options, with type, default and the comment the
  code gives it.

The same functions (`cli_pages`, `config_rows`) are what tests/docs/test_docs.py checks against:
every command and every key must appear.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import io
import os
import re
import typing
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any

_CHOICES = re.compile(r"^usage: .*?\{([a-z0-9_,-]+)\}", re.S)


def _entry_point() -> Callable[[list[str]], int]:
    (found,) = entry_points(group="console_scripts", name="hpcfed")
    main: Callable[[list[str]], int] = found.load()
    return main


def help_text(argv: list[str]) -> str:
    """What ``hpcfed ARGV --help`` prints, captured in-process (80 columns, so pages are stable)."""
    main = _entry_point()
    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            try:
                main([*argv, "--help"])
            except SystemExit:
                pass
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue().rstrip()


def commands() -> list[str]:
    """The commands ``hpcfed --help`` lists (one per line under COMMAND, with their summary)."""
    text = help_text([])
    section = text.split("COMMAND\n", 2)[-1].split("\n\n", 1)[0]
    return [line.split()[0] for line in section.splitlines() if re.match(r"^    [a-z]", line)]


def cli_pages() -> list[tuple[list[str], str]]:
    """(argv, help text) for ``hpcfed``, every command, and every action a command names in its
    usage line (``hpcfed data {verify,...}``, ``hpcfed search {query,...}``)."""
    pages: list[tuple[list[str], str]] = [([], help_text([]))]
    for name in commands():
        text = help_text([name])
        pages.append(([name], text))
        found = _CHOICES.search(text.split("\n\n", 1)[0])
        for action in found.group(1).split(",") if found else []:
            sub = help_text([name, action])
            if sub and sub != text:  # a positional choice that is no subcommand prints its parent's help
                pages.append(([name, action], sub))
    return pages


def cli_markdown() -> str:
    parts = []
    for argv, text in cli_pages():
        title = " ".join(["hpcfed", *argv])
        level = "#" * (2 + min(len(argv), 1))
        parts.append(f"{level} `{title}`\n\n```text\n{text}\n```\n")
    return "\n".join(parts)


# -- configuration keys --------------------------------------------------------------------------

def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class body (the one on its line and any lines right above it), or in
    the body of the dataclass it inherits the field from."""
    comments: dict[str, str] = {}
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass):
            for name, text in _own_field_comments(klass).items():
                comments.setdefault(name, text)
    return comments


def _own_field_comments(cls: type) -> dict[str, str]:
    """`_field_comments` of the fields written in `cls`'s own body."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        match = re.match(r"^([a-z_][a-z0-9_]*)\s*:", stripped)
        if match and line.startswith(" " * 4) and not line.startswith(" " * 8 + " "):
            inline = stripped.split("  # ", 1)[1].strip() if "  # " in stripped else ""
            comments.setdefault(match.group(1), " ".join([*above, inline]).strip())
        above = []
    return comments


def _type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("NoneType", "None")
    text = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return re.sub(r"hpcfed\.[\w.]+\.", "", text)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "(section)" if dataclasses.is_dataclass(value) else repr(value)
    return "required"


def _dataclass_of(hint: Any) -> type | None:
    for arg in (hint, *typing.get_args(hint)):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def config_rows(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every field of a config dataclass, nested
    sections flattened."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name == "source":
            continue
        key = f"{prefix}{f.name}"
        nested = _dataclass_of(hints[f.name])
        if nested is not None and nested.__name__ != "ComponentConfig":
            yield from config_rows(nested, key + ".")
            continue
        yield key, _type_name(hints[f.name]), _default(f), comments.get(f.name, "")


def components() -> Iterator[tuple[str, str, type]]:
    """("task" or "strategy", name, its options dataclass) for every built-in."""
    from hpcfed import registry

    for kind, table in (("task", registry.TASKS), ("strategy", registry.STRATEGIES)):
        for name, path in sorted(table.items()):
            module, attr = path.split(":")
            options = getattr(getattr(importlib.import_module(module), attr), "Config", None)
            if options is not None and dataclasses.is_dataclass(options):
                yield kind, name, options


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    body = "\n".join(f"| `{k}` | `{cell(t)}` | `{cell(d)}` | {cell(c)} |" for k, t, d, c in rows)
    return "| key | type | default | what it does |\n|---|---|---|---|\n" + body + "\n"


def config_markdown() -> str:
    from hpcfed.config import Config

    parts = ["## The run configuration\n", _table(list(config_rows(Config)))]
    for kind, name, options in components():
        parts.append(f"## `{kind}: {name}`\n\nSet as `{kind}.name: {name}` with these options "
                     f"(`{kind}.KEY=VALUE` on the command line).\n")
        rows = list(config_rows(options, f"{kind}."))
        parts.append(_table(rows) if rows else "No options.\n")
    return "\n".join(parts)


def setup(app: Any) -> dict[str, Any]:
    from docutils.parsers.rst import Directive

    def directive(render: Callable[[], str]) -> type[Directive]:
        class Generated(Directive):
            has_content = False

            def run(self) -> list[Any]:
                from docutils import nodes
                from docutils.statemachine import StringList

                holder = nodes.section()
                self.state.nested_parse(StringList(render().splitlines()), self.content_offset, holder)
                return list(holder.children)

        return Generated

    app.add_directive("hpcfed-cli", directive(cli_markdown))
    app.add_directive("hpcfed-config", directive(config_markdown))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
