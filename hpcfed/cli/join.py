"""``hpcfed join CONFIG --server F|HOST:PORT --site N [--out DIR] [--iface IF] [key=value ...]``.

One site as a job of its own, joining the server of ``hpcfed serve`` (`hpcfed.launch.crossjob`).
"""

from __future__ import annotations

import argparse

from hpcfed.cli.serve import add_common_options, parse_with_overrides

SUMMARY = "run one site as a job of its own, joining a server"


def _join_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcfed join", description="run one site as a job of its own")
    add_common_options(p)
    p.add_argument("--server", required=True, help="the server's port file, or its knock address HOST:PORT")
    p.add_argument("--site", required=True, type=int, help="this site's client id (0..K-1; it runs as rank N+1)")
    p.add_argument("--out", default=None, help="this site's folder (exports, shards; default runs/NAME-siteN)")
    return p


def main(argv: list[str]) -> int:
    """`hpcfed join`: the site job; exit status."""
    from hpcfed.launch.crossjob_join import join_main

    return join_main(parse_with_overrides(_join_parser(), argv), argv)
