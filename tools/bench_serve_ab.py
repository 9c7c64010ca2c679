"""The search service's latency from two source trees side by side: before and after a change.

    python tools/bench_serve_ab.py RUN --before TREE [--where label=7] [--rounds 10] [--requests 600]

RUN is a built collection (``tools/bench_search.py --workdir DIR`` keeps one: DIR/run, its index
key in DIR/keys and its query ids in DIR/ids.txt). Two ``hpcfed search serve RUN`` processes start,
one importing hpcfed from TREE (e.g. ``git archive BASE hpcfed | tar -x -C TREE``) and one from this
tree, and the same requests go to both in turn, one after the other, each over its own keep-alive
connection, the first of each round alternating between the two. Both services run at the same moments
on the same machine, so their ratio holds whatever else runs; each one's CPU time per request (all
its threads: HTTP, JSON and the search) is given beside the wall times.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from bench_process import cpu_seconds  # noqa: E402 (after the path is set)


class Service:
    """One ``hpcfed search serve`` process importing hpcfed from `tree`, and a connection to it."""

    def __init__(self, tree: Path, run: Path, env: dict[str, str]) -> None:
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, "-m", "hpcfed", "search", "serve", str(run), "--port", "0"],
                                     cwd=tree, env={**env, "PYTHONPATH": str(tree)}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError(f"the service from {tree} did not start: {self.proc.communicate()[1][-2000:]}")
        host, port = json.loads(first)["listening"].removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.latencies: list[float] = []
        self.cpu = 0.0

    def ask(self, body: str, *, timed: bool = True) -> None:
        """One /search request; its wall time and the service's CPU time for it are kept when `timed`."""
        cpu, t = cpu_seconds(self.proc.pid), time.perf_counter()
        self.conn.request("POST", "/search", body, {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        data = response.read()
        wall = time.perf_counter() - t
        if response.status != 200:
            raise RuntimeError(f"{self.tree}: /search answered {response.status}: {data[:300]!r}")
        if timed:
            self.latencies.append(wall)
            self.cpu += cpu_seconds(self.proc.pid) - cpu

    def summary(self) -> dict:
        ms = sorted(1000 * x for x in self.latencies)
        return {"tree": str(self.tree), "requests": len(ms), "median_ms": round(statistics.median(ms), 2),
                "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 2),
                "cpu_ms_per_request": round(1000 * self.cpu / max(1, len(ms)), 3)}

    def stop(self) -> None:
        self.conn.close()
        self.proc.terminate()
        self.proc.communicate(timeout=60)


def where_of(items: list[str]) -> dict[str, list[str]]:
    """``--where KEY=VALUE`` options as the service's ``"where"`` object."""
    out: dict[str, list[str]] = {}
    for item in items:
        key, _, value = item.partition("=")
        out.setdefault(key, []).append(value)
    return out


def main(argv: list[str] | None = None) -> int:
    """Serve RUN from both trees, ask each the same requests in alternating rounds, print the figures."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a built collection (bench_search.py --workdir DIR: DIR/run)")
    p.add_argument("--before", type=Path, required=True, help="the other source tree (its hpcfed/ is imported)")
    p.add_argument("--ids-file", type=Path, default=None, help="query ids (default: RUN/../ids.txt)")
    p.add_argument("--keys-dir", type=Path, default=None, help="the index key's folder (default: RUN/../keys)")
    p.add_argument("--where", action="append", default=[], help="KEY=VALUE filter, repeatable")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--requests", type=int, default=600, help="timed requests per service in all")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    ids = (args.ids_file or args.run.parent / "ids.txt").read_text().split()
    env = {**os.environ, "HPCFED_KEYS_DIR": str(args.keys_dir or args.run.parent / "keys"),
           "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("HPCFED_STATE_KEY", None)
    where = where_of(args.where)
    bodies = [json.dumps({"id": ids[i % len(ids)], "k": args.k, **({"where": where} if where else {})})
              for i in range(args.requests)]
    load = os.getloadavg()
    services = [Service(args.before.resolve(), args.run, env), Service(REPO, args.run, env)]
    try:
        for s in services:  # warm-up: the filter's masks and kept rows, untimed
            s.ask(bodies[0], timed=False)
        per = max(1, len(bodies) // max(1, args.rounds))
        for r, start in enumerate(range(0, len(bodies), per)):
            order = services if r % 2 == 0 else services[::-1]
            for body in bodies[start:start + per]:
                for s in order:
                    s.ask(body)
    finally:
        for s in services:
            s.stop()
    before, after = (s.summary() for s in services)
    result = {"run": str(args.run), "where": where, "load_avg_before": load, "load_avg_after": os.getloadavg(),
              "before": before, "after": after,
              "median_ratio": round(after["median_ms"] / before["median_ms"], 3),
              "cpu_ratio": round(after["cpu_ms_per_request"] / max(1e-9, before["cpu_ms_per_request"]), 3)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
