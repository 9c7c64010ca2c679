"""``hpcfed run CONFIG [--np K] [--out DIR] [--resume | --force] [key=value ...]``."""

from __future__ import annotations

import argparse
import sys

SUMMARY = "run a federation: server rank 0, clients 1..K"


def _parser() -> argparse.ArgumentParser:
    run = argparse.ArgumentParser(prog="hpcfed run", description=SUMMARY)
    run.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml")
    run.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rounds=5 task.lr=0.01 method=fedavg")
    run.add_argument("--np", type=int, default=None,
                     help="outside MPI: relaunch under `mpiexec -n NP` (server + NP-1 clients)")
    run.add_argument("--out", default=None, help="output directory (default runs/<config name>)")
    run.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in OUT")
    run.add_argument("--force", action="store_true",
                     help="OUT holds an earlier run: delete its results and start over (without it, hpcfed refuses)")
    run.add_argument("--mpiexec", default=None, help="launcher for --np (default: mpiexec on PATH)")
    return run


def main(argv: list[str]) -> int:
    """`hpcfed run`: the federation of CONFIG; exit status."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may come before or after the options
    stray = [a for a in extra if a.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = [*args.overrides, *extra]
    bare = [a for a in args.overrides if "=" not in a]
    if bare:
        print(f"hpcfed: error: override {bare[0]!r} must look like key=value "
              f"(e.g. rounds=5, task.lr=0.01); options start with -- (hpcfed run --help)", file=sys.stderr)
        return 2
    from hpcfed.launch.parent import run_command

    return run_command(args.config, args.overrides, np=args.np, out=args.out, resume=args.resume,
                       mpiexec=args.mpiexec, force=args.force)
