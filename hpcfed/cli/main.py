"""The ``hpcfed`` command line.

    hpcfed run CONFIG [--np K] [--out DIR] [--resume | --force] [key=value ...]
    hpcfed serve CONFIG --out DIR [--port-file F] [--port-range LO-HI] [--iface IF]   (docs/cluster.md)
    hpcfed join CONFIG --server F|HOST:PORT --site N [--out DIR]
    hpcfed keygen PATH
    hpcfed inspect FILE.h5
    hpcfed bench comm [--json]
    hpcfed data import-hin|import-messages ...
    hpcfed search ... / hpcfed eval RUN [--central RUN] / hpcfed report DIR
    hpcfed new DIR [--template torch|lora]

Subcommands that belong to one part of the system are listed in `DATA_COMMANDS` and
`EXTRA_COMMANDS` as ``"module:function"``; each function takes its argv and returns an exit code.
Errors the user can fix print one plain line (no traceback) and exit with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# `hpcfed data NAME ...` -> function(argv) -> int
DATA_COMMANDS: dict[str, str] = {
    "verify": "hpcfed.data.manifest:verify_main",
    "fetch": "hpcfed.data.manifest:fetch_main",
    "import-hin": "hpcfed.data.hin_import:import_main",
    "import-messages": "hpcfed.data.messages_import:main",
}

# `hpcfed NAME ...` -> function(argv) -> int
EXTRA_COMMANDS: dict[str, str] = {
    "eval": "hpcfed.search.evaluate:main",
    "report": "hpcfed.report:main",
    "search": "hpcfed.cli.search:main",
    "new": "hpcfed.cli.new:main",
    "serve": "hpcfed.launch.crossjob:serve_main",
    "join": "hpcfed.launch.crossjob:join_main",
}

USER_ERROR_EXIT = 2


def _load(spec: str) -> Callable[[list[str]], int]:
    module, attr = spec.split(":")
    command: Callable[[list[str]], int] = getattr(importlib.import_module(module), attr)
    return command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcfed", description="Federated learning for HPC clusters over MPI.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a federation (rank 0 = server, ranks 1..K = clients)")
    run.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml")
    run.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rounds=5 task.lr=0.01 method=fedavg")
    run.add_argument("--np", type=int, default=None,
                     help="outside MPI: relaunch under `mpiexec -n NP` (server + NP-1 clients)")
    run.add_argument("--out", default=None, help="output directory (default runs/<config name>)")
    run.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in OUT")
    run.add_argument("--force", action="store_true",
                     help="OUT holds an earlier run: delete its results and start over (without it, hpcfed refuses)")
    run.add_argument("--mpiexec", default=None, help="launcher for --np (default: mpiexec on PATH)")

    keygen = sub.add_parser("keygen", help="create an Ed25519 site identity (PATH and PATH.pub)")
    keygen.add_argument("path")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing key")

    inspect = sub.add_parser("inspect", help="print what a checkpoint or embedding export holds")
    inspect.add_argument("file")

    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("what", choices=["comm"])
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--no-shared-memory", action="store_true", help="every chunk through MPI")
    bench.add_argument("--mpiexec", default=None, help="start the two ranks with this mpiexec (e.g. across two nodes)")

    data = sub.add_parser("data", help="dataset tools: " + ", ".join(sorted(DATA_COMMANDS)))
    data.add_argument("action", choices=sorted(DATA_COMMANDS) or ["(none)"])
    data.add_argument("args", nargs=argparse.REMAINDER)

    for name in sorted(EXTRA_COMMANDS):
        extra = sub.add_parser(name, help=f"see `hpcfed {name} --help`", add_help=False)
        extra.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `hpcfed` command: run the subcommand named in `argv`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in EXTRA_COMMANDS:
        return _guard(lambda: _load(EXTRA_COMMANDS[argv[0]])(argv[1:]))
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "run":
        # key=value overrides may come before or after the options
        stray = [a for a in extra if a.startswith("-")]
        if stray:
            parser.error(f"unrecognized arguments: {' '.join(stray)}")
        args.overrides = [*args.overrides, *extra]
        bare = [a for a in args.overrides if "=" not in a]
        if bare:
            print(f"hpcfed: error: override {bare[0]!r} must look like key=value "
                  f"(e.g. rounds=5, task.lr=0.01); options start with -- (hpcfed run --help)", file=sys.stderr)
            return USER_ERROR_EXIT
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "run":
        from hpcfed.launch.rank import run_command

        return _guard(lambda: run_command(args.config, args.overrides, np=args.np, out=args.out,
                                          resume=args.resume, mpiexec=args.mpiexec, force=args.force))
    if args.command == "keygen":
        from hpcfed.comm.keys import generate_identity

        def keygen() -> int:
            public = generate_identity(args.path, overwrite=args.force)
            print(f"wrote {args.path} (private, mode 0600) and {args.path}.pub")
            print(f"add this line to the server's authorized_keys file:\n{public}")
            return 0

        return _guard(keygen)
    if args.command == "inspect":
        from hpcfed.store.inspect import inspect_file

        return _guard(lambda: (print(inspect_file(args.file)), 0)[1])
    if args.command == "bench":
        from hpcfed.comm.bench import main as bench_main

        flags = [f for f, on in (("--json", args.json), ("--quick", args.quick),
                                 ("--no-shared-memory", args.no_shared_memory)) if on]
        return _guard(lambda: bench_main(flags + (["--mpiexec", args.mpiexec] if args.mpiexec else [])))
    if args.command == "data":
        return _guard(lambda: _load(DATA_COMMANDS[args.action])(args.args))
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
