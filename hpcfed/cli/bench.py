"""``hpcfed bench comm``: the secure channel's throughput between two ranks (`hpcfed.comm.bench`)."""

from __future__ import annotations

import argparse

SUMMARY = "measure the secure channel between two ranks"


def main(argv: list[str]) -> int:
    """`hpcfed bench comm [--json] [--quick] [--no-shared-memory] [--mpiexec M]`; exit status."""
    bench = argparse.ArgumentParser(prog="hpcfed bench", description=SUMMARY)
    bench.add_argument("what", choices=["comm"])
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--no-shared-memory", action="store_true", help="every chunk through MPI")
    bench.add_argument("--mpiexec", default=None, help="start the two ranks with this mpiexec (e.g. across two nodes)")
    args = bench.parse_args(argv)
    from hpcfed.comm.bench import run_bench

    run_bench(args.json, quick=args.quick, shared_memory=not args.no_shared_memory, mpiexec=args.mpiexec)
    return 0
