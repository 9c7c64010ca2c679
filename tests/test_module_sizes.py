"""One concept per module: no module of the library or the tools is over 400 lines (CONTRIBUTING)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def test_no_module_over_400_lines() -> None:
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for folder in ("hpcfed", "tools") for path in (REPO / folder).rglob("*.py")}
    over = sorted(f"{name} ({n} lines)" for name, n in sizes.items() if n > MAX_LINES)
    assert not over, f"split by concern (one concept per module): {', '.join(over)}"
