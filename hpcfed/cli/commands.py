"""The ``hpcfed`` command line: ``hpcfed COMMAND ...``, one module of `hpcfed.cli` per command (this one dispatches).

    hpcfed run CONFIG [--np K] [--out DIR] [--resume | --force] [key=value ...]
    hpcfed serve CONFIG --out DIR [--port-file F] [--port-range LO-HI] [--iface IF]   (docs/cluster.md)
    hpcfed join CONFIG --server F|HOST:PORT --site N [--out DIR]
    hpcfed keygen PATH [--rank N]
    hpcfed inspect FILE.h5
    hpcfed bench comm [--json]
    hpcfed data verify|fetch|import-hin|import-messages ...
    hpcfed search ... / hpcfed eval RUN [--central RUN] / hpcfed report DIR
    hpcfed new DIR [--template torch|lora]
    hpcfed status OUT [--once] [--metrics-port P]

Every command module has ``SUMMARY`` (its line in ``hpcfed --help``) and ``main(argv) -> int``.
Errors the user can fix print one plain line (no traceback) and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from types import ModuleType

from hpcfed.cli import bench, data, join, keygen, new, report, run, search, serve, status
from hpcfed.cli import eval as eval_command
from hpcfed.cli import inspect as inspect_command

# `hpcfed NAME ...` -> the module whose main(argv) runs it, in the order `hpcfed --help` lists them
COMMANDS: dict[str, ModuleType] = {
    "run": run, "serve": serve, "join": join, "keygen": keygen, "data": data, "search": search,
    "eval": eval_command, "report": report, "status": status, "inspect": inspect_command, "new": new,
    "bench": bench,
}

USER_ERROR_EXIT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcfed", description="Federated learning for HPC clusters over MPI.",
                                epilog="`hpcfed COMMAND --help` tells more of each command.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        sub.add_parser(name, help=module.SUMMARY, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `hpcfed` command: run the subcommand named in `argv`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        command = COMMANDS[argv[0]]
        return _guard(lambda: command.main(argv[1:]))
    _parser().parse_args(argv)  # --help, or the error naming the commands there are
    return 1


def _guard(fn: Callable[[], int]) -> int:
    """Run a command; user errors become one plain line and exit code 2."""
    from hpcfed.errors import USER_ERRORS

    try:
        return int(fn() or 0)
    except USER_ERRORS as exc:
        print(f"hpcfed: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print("hpcfed: interrupted", file=sys.stderr)
        return 130
