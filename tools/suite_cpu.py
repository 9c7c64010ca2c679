"""Rank the test suite's tests and modules by the CPU they cost, from a run made with HPCFED_SUITE_CPU.

    mkdir -p /tmp/cpu && HPCFED_SUITE_CPU=/tmp/cpu python3 -m pytest -q -n 3 --dist loadgroup
    python tools/suite_cpu.py /tmp/cpu --top 30

Wall time on a shared machine says how long a test waited as much as what it cost; CPU (the test's
own, plus mpiexec's and every rank's it started) says which tests to make cheaper. It still grows
somewhat with load (MPI ranks poll for a while after each message), so compare runs at a like load.
Processes a test started but never waited for (daemons under Slurm, a killed server's orphans) are
not counted. The suite's wall time on N cores is at least its total CPU / N.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def read_records(folder: Path) -> list[dict]:
    """Every test's record from the per-worker JSON-lines files in `folder`."""
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"no *.jsonl files in {folder}: run the suite with HPCFED_SUITE_CPU={folder} first")
    return [json.loads(line) for path in files for line in path.read_text(encoding="utf-8").splitlines() if line]


def cpu_of(record: dict) -> float:
    """A test's CPU seconds: its worker's own and its child processes'."""
    return float(record["own_cpu_s"]) + float(record["children_cpu_s"])


def by_module(records: list[dict]) -> dict[str, float]:
    """CPU seconds per test module (the part of a node id before '::')."""
    totals: dict[str, float] = defaultdict(float)
    for record in records:
        totals[record["test"].split("::", 1)[0]] += cpu_of(record)
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=25, help="how many tests and modules to list")
    args = parser.parse_args()
    records = read_records(args.folder)
    total = sum(map(cpu_of, records))
    children = sum(float(r["children_cpu_s"]) for r in records)
    print(f"{len(records)} tests, {total:.0f} s of CPU ({children:.0f} s in processes they started); "
          f"at least {total / 2 / 60:.1f} min on 2 cores")
    print(f"\nmodules by CPU (top {args.top}):")
    for module, cpu in sorted(by_module(records).items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {cpu:7.1f} s  {100 * cpu / total:5.1f} %  {module}")
    print(f"\ntests by CPU (top {args.top}):")
    for record in sorted(records, key=cpu_of, reverse=True)[: args.top]:
        print(f"  {cpu_of(record):7.1f} s  wall {record['wall_s']:6.1f} s  {record['test']}")


if __name__ == "__main__":
    main()
