"""Measuring one CLI process for the bench tools: wall time, CPU time and peak memory.

`run` starts a command and waits for it; `cpu_seconds` and `peak_rss_mb` read a running process's
(a service's) figures from /proc. Used by `bench_search.py` and `bench_serve_ab.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs a command as its own child and writes that child's rusage to a file. Linux charges a child
# the peak RSS of the memory it was forked from (an exec records the old mm's high-water mark), so a
# command started straight from this process would report at least this process's own size (1.8 GB
# for a 0.5 GB append at 1 M); started from this small launcher, it reports its own.
_MEASURED = """import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_kb": usage.ru_maxrss}, f)
sys.exit(os.waitstatus_to_exitcode(status) & 255)
"""


def run(cmd: list[str], env: dict[str, str]) -> dict:
    """Run one CLI process; its wall time, CPU time (user + system, its threads and children), peak RSS
    (wait4, taken by a small launcher: see `_MEASURED`) and stdout. On a shared machine the CPU time is
    the figure to compare: the wall time also counts the time the scheduler gave to other processes."""
    with tempfile.TemporaryDirectory(prefix="hpcfed-bench-run-") as folder:
        usage_file = Path(folder) / "usage.json"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _MEASURED, str(usage_file), *cmd], cwd=REPO, env=env,
                              capture_output=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode()[-3000:]}")
        usage = json.loads(usage_file.read_text())
    return {"seconds": round(seconds, 2), "cpu_s": round(usage["cpu_s"], 2),
            "peak_rss_mb": round(usage["maxrss_kb"] / 1024), "stdout": proc.stdout.decode()}


def cpu_seconds(pid: int) -> float:
    """The service's CPU seconds so far (all its threads): on a loaded machine, what a query costs
    whatever the scheduler does to its wall time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> int:
    """A running process's peak RSS so far in MB (VmHWM; -1 when it says none)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024)
    return -1
