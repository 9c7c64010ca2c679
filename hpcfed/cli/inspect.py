"""``hpcfed inspect FILE.h5``: what a checkpoint or an embedding export holds."""

from __future__ import annotations

import argparse

SUMMARY = "print what a checkpoint or export (.h5) holds"


def main(argv: list[str]) -> int:
    """`hpcfed inspect FILE`: print the file's contents in words; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed inspect", description=SUMMARY)
    p.add_argument("file")
    args = p.parse_args(argv)
    from hpcfed.store.inspect import inspect_file

    print(inspect_file(args.file))
    return 0
