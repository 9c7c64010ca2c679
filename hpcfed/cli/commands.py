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
import importlib
import sys
from collections.abc import Callable
from types import ModuleType

# `hpcfed NAME ...` -> the module (`hpcfed.cli.NAME`) whose main(argv) runs it, in the order
# `hpcfed --help` lists them. Imported on use: every MPI rank starts as `hpcfed run`, and the search
# and status commands' imports are a few hundred ms of CPU a rank that a run never uses.
COMMANDS: tuple[str, ...] = ("run", "serve", "join", "keygen", "data", "search", "eval", "report", "status",
                             "inspect", "new", "bench")


def command_module(name: str) -> ModuleType:
    """The module of command `name` (one of `COMMANDS`)."""
    return importlib.import_module(f"hpcfed.cli.{name}")

USER_ERROR_EXIT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcfed", description="Federated learning for HPC clusters over MPI.",
                                epilog="`hpcfed COMMAND --help` tells more of each command.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        sub.add_parser(name, help=command_module(name).SUMMARY, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `hpcfed` command: run the subcommand named in `argv`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        command = command_module(argv[0])
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
