"""Every public function and class in hpcfed/ says what it is for (CONTRIBUTING: docstrings on public
names). Read from the source with `ast`, so nothing is imported and the check takes well under a second.

    python3 tests/test_docstrings.py             # list the public names without a docstring
    python3 tests/test_docstrings.py --methods   # and the public methods of public classes too

A name is public when neither it nor its module starts with ``_``; the project templates
(hpcfed/templates/, copied for users by ``hpcfed new``) are the user's code, not the library's.
``--methods`` counts a method documented when a class it derives from within hpcfed documents it.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hpcfed"
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _modules() -> Iterator[tuple[str, str, ast.Module]]:
    """(dotted module name, file relative to the repository, parsed source) of every public module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if "templates" in rel.parts or any(p.startswith("_") and p != "__init__.py" for p in rel.parts):
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        yield name, rel.as_posix(), ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases]


def undocumented(methods: bool = False) -> list[str]:
    """``module.name (file:line)`` of each public function or class without a docstring; with
    `methods`, also each public method of a public class that neither it nor a base documents."""
    modules = list(_modules())
    documented: dict[str, list[tuple[list[str], set[str]]]] = defaultdict(list)  # class name -> (bases, methods)
    for _, _, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own = {m.name for m in node.body if isinstance(m, FUNCS) and ast.get_docstring(m)}
                documented[node.name].append((_base_names(node), own))

    def inherited(bases: list[str], name: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(name in own or inherited(grand, name, seen | {base})
                   for base in bases if base not in seen for grand, own in documented.get(base, []))

    missing = []
    for module, path, tree in modules:
        for node in tree.body:
            if not isinstance(node, DEFS) or node.name.startswith("_"):
                continue
            where = f"{module}.{node.name} ({path}:{node.lineno})"
            if ast.get_docstring(node) is None:
                missing.append(where)
            if methods and isinstance(node, ast.ClassDef):
                missing += [f"{module}.{node.name}.{m.name} ({path}:{m.lineno})" for m in node.body
                            if isinstance(m, FUNCS) and not m.name.startswith("_") and ast.get_docstring(m) is None
                            and not inherited(_base_names(node), m.name)]
    return missing


def test_every_public_function_and_class_has_a_docstring() -> None:
    missing = undocumented()
    assert not missing, (f"{len(missing)} public name(s) without a docstring; say what each is for and why "
                         "(not the name again), or make it private with a leading _:\n  " + "\n  ".join(missing))


def test_the_audit_finds_an_undocumented_name(tmp_path, monkeypatch) -> None:
    """The check can fail: a public function without a docstring in a module is reported, a private one
    and a documented one are not."""
    pkg = tmp_path / "hpcfed"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "mod.py").write_text('def bare():\n    pass\n\n\ndef _hidden():\n    pass\n\n\n'
                                        'def told():\n    """Why."""\n\n\nclass Plain:\n    def go(self):\n'
                                        '        pass\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert undocumented() == ["hpcfed.sub.mod.bare (hpcfed/sub/mod.py:1)",
                              "hpcfed.sub.mod.Plain (hpcfed/sub/mod.py:13)"]
    assert undocumented(methods=True)[-1] == "hpcfed.sub.mod.Plain.go (hpcfed/sub/mod.py:14)"


if __name__ == "__main__":
    found = undocumented(methods="--methods" in sys.argv)
    print("\n".join(found) or "every public name has a docstring")
    print(f"{len(found)} undocumented", file=sys.stderr)
