"""``hpcfed serve CONFIG --out DIR [--port-file F] [--port-range LO-HI] [--iface IF] [key=value ...]``.

Rank 0 as a job of its own; sites join it with ``hpcfed join`` (`hpcfed.launch.crossjob`,
docs/cluster.md "Across clusters"). The options both commands share are here.
"""

from __future__ import annotations

import argparse

SUMMARY = "run the server as a job of its own; sites join it"


def add_common_options(p: argparse.ArgumentParser) -> None:
    """The options of both `hpcfed serve` and `hpcfed join`."""
    p.add_argument("config", help="the federation's YAML config (the same on every side)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rounds=5")
    p.add_argument("--iface", default=None, help="network interface MPI uses (sets FI_TCP_IFACE)")
    p.add_argument("--lifeline-timeout", type=float, default=60.0,
                   help="seconds of silence on a peer's lifeline before it is declared lost (default 60)")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcfed serve", description="run rank 0 as a job of its own; sites join it")
    add_common_options(p)
    p.add_argument("--out", required=True, help="the run's folder (summary, metrics, checkpoints)")
    p.add_argument("--port-file", default=None, help="where to publish the knock address (default OUT/port.json)")
    p.add_argument("--port-range", default=None, metavar="LO-HI",
                   help="TCP ports for the knock and for MPI (open these in the firewall)")
    p.add_argument("--force", action="store_true", help="OUT holds an earlier run: start over")
    p.add_argument("--start-deadline", type=float, default=None, metavar="S",
                   help="start after S s with the sites present (at least federation.min_sites); the others "
                        "join later, from the next round (default: federation.setup_timeout_s)")
    return p


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed, with the key=value overrides wherever they stand among the options."""
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in [*args.overrides, *extra] if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized argument {stray[0]!r} (overrides look like key=value)")
    args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str]) -> int:
    """`hpcfed serve`: the server job; exit status."""
    from hpcfed.launch.crossjob import serve_main

    return serve_main(parse_with_overrides(_serve_parser(), argv), argv)
