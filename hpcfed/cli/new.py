"""``hpcfed new DIR [--template torch|lora]``: write a small runnable federated project.

A template is a folder of files under ``hpcfed/templates/<name>/`` (package data) with ``{{name}}``
(the project's name: DIR's last part) and ``{{dir}}`` (DIR as given) filled in. The project runs
with ``hpcfed run DIR/config.yaml --np 3``: its config names ``task:SiteTask``, found next to it.
"""

from __future__ import annotations

import argparse
import re
from importlib import resources
from pathlib import Path

TEMPLATES = ("torch", "lora")
SUMMARY = "write a small runnable federated project"


def write_project(target: str | Path, template: str = "torch") -> list[Path]:
    """Create `target` from `template`; refuses an existing non-empty folder. Returns the files written."""
    if template not in TEMPLATES:
        raise ValueError(f"--template {template!r}: choose one of: {', '.join(TEMPLATES)}")
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{target} already exists and is not empty; choose a new folder (nothing was written)")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", target.resolve().name) or "project"
    source = resources.files("hpcfed") / "templates" / template
    files = sorted((f for f in source.iterdir() if f.is_file() and not f.name.startswith(".")), key=lambda f: f.name)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for f in files:
        text = f.read_text().replace("{{name}}", name).replace("{{dir}}", str(target))
        path = target / f.name
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    """`hpcfed new DIR [--template T]`: write a small runnable federated project; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed new", description=SUMMARY)
    p.add_argument("dir", help="new project folder (must not exist or be empty)")
    p.add_argument("--template", choices=TEMPLATES, default="torch",
                   help="torch: your PyTorch model on built-in data; lora: LoRA fine-tuning of a transformer")
    args = p.parse_args(argv)
    written = write_project(args.dir, args.template)
    print(f"wrote {', '.join(str(w) for w in written)}")
    print(f"run it:  hpcfed run {Path(args.dir) / 'config.yaml'} --np 3")
    return 0
