"""YAML that cannot blow up: `load_yaml` is `yaml.safe_load` with a bound on what the document
expands to, so a config file or a command-line value is read in bounded time and memory.

A YAML document is parsed into a node graph in which an alias is one shared node; building Python
objects from it and then copying them (JSON, dataclasses) expands every alias. Nested aliases grow
exponentially ("billion laughs": 589 bytes -> 3 GB), so the expanded size is counted on the graph,
before anything is built.
"""

from __future__ import annotations

from typing import Any

import yaml

from hpcfed.errors import ConfigError

MAX_YAML_BYTES = 16 << 20
MAX_YAML_NODES = 1_000_000  # scalars + collections after expanding every alias
MAX_YAML_ALIASES = 10_000


def load_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load` that refuses alias bombs, recursive aliases and over-deep nesting with a
    one-line `ConfigError` naming `where` (a file, or a command-line override)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, where)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply") from None
    finally:
        loader.dispose()


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what is wrong and where (PyYAML's own message spans several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        return f"{what}{where}"
    return " ".join(str(exc).split())


def _check_expansion(root: yaml.Node, where: str) -> None:
    sizes: dict[int, int] = {}  # id(node) -> its expanded size
    seen_anchors = 0
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            kids = _children(node)
            sizes[key] = 1 + sum(sizes[id(k)] for k in kids)
            if sizes[key] > MAX_YAML_NODES:
                raise ConfigError(f"{where}: YAML expands to more than {MAX_YAML_NODES:,} values through its "
                                  f"aliases (*name); refusing it (an alias bomb?)")
            continue
        if key in sizes:
            seen_anchors += 1  # a node reached again: an alias
            if seen_anchors > MAX_YAML_ALIASES:
                raise ConfigError(f"{where}: YAML uses more than {MAX_YAML_ALIASES:,} aliases (*name); refusing it")
            continue
        if key in on_path:
            raise ConfigError(f"{where}: YAML alias refers to a collection that contains it (recursive alias)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []
