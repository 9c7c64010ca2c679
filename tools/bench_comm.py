"""Secure channel vs raw MPI vs one-core AES-GCM vs the naive pickle path (see hpcfed/comm/bench.py).

    python tools/bench_comm.py [--json] [--quick]      # relaunches itself under mpiexec -n 2
    mpiexec -n 2 python tools/bench_comm.py --json     # or start it under MPI yourself
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hpcfed.comm.bench import main, run_bench

__all__ = ["run_bench"]

if __name__ == "__main__":
    sys.exit(main())
