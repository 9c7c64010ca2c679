"""Chaos soak of a long-lived federation: `hpcfed serve` and K `hpcfed join` jobs, secure aggregation
on, with site jobs SIGKILLed and restarted on a seeded schedule (issue 38).

    python tools/chaos_soak.py [--minutes 3] [--sites 3] [--seed 0] [--kill-every 20-60] [--away 2-20]
                               [--out DIR] [--plain] [--json]

Every `--kill-every` seconds (drawn uniformly, seeded) one site job is killed whole (SIGKILL to its
mpiexec, proxy and rank; a quarter of the time two at once), at whatever protocol stage it is in,
and started again `--away` seconds later with the same command: it knocks with its key and rejoins
the same server (from its own newest shard of a committed checkpoint). The server is never told.
At the end the tool writes OUT/srv/HALT, waits for every job, and checks:

- no site was evicted (a killed site is dropped and comes back; it never misbehaved);
- rounds went on: every window of the run completed rounds, and the rounds lost are named with
  their reason (a secure-aggregation shortfall when a site dies mid-round);
- every kill was followed by a rejoin (except kills within the last minute);
- rank 0's memory stayed flat: its peak RSS in the last window is within 10 % of the first's.

It prints a table (kills, rejoins, rounds done and lost, peak RSS per window) and exits 1 when a
check fails. The machine may be shared: the round counts vary with the load, the checks do not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/quickstart.yaml"
PSK = "5a" * 32
RSS_EVERY_S = 2.0
MARKER = ".chaos-soak"
RSS_TOLERANCE = 0.10  # the last window's peak RSS may exceed the first's by this much


def _overrides(sites: int, secure: bool) -> list[str]:
    return ["rounds=1000000", f"federation.num_clients={sites}", "task.samples_per_site=100", "eval_every=0",
            "checkpoint_every=2", "federation.on_client_failure=continue", "federation.quorum=0.5",
            "federation.setup_timeout_s=120", "federation.round_deadline_s=30", "influence.reject_factor=1000",
            f"privacy.secure_aggregation={'true' if secure else 'false'}", "federation.slowdown={0: 3}"]


class Soak:
    """The jobs of one soak, the schedule's record and the server's memory samples."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self.srv = self.out / "srv"
        self.overrides = _overrides(args.sites, not args.plain)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HPCFED_PSK": PSK,
                    "PYTHONPATH": str(REPO)}
        self.sites: dict[int, subprocess.Popen[bytes]] = {}
        self.kills: list[tuple[float, int]] = []  # (seconds into the soak, site)
        self.starts: list[tuple[float, int]] = []
        self.rss: list[tuple[float, int]] = []  # (seconds into the soak, rank 0's RSS in bytes)
        self.t0 = time.monotonic()
        self._stop = threading.Event()

    # -- jobs ------------------------------------------------------------------------------------------
    def _popen(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as f:
            return subprocess.Popen(["mpiexec", "-n", "1", sys.executable, "-m", "hpcfed", *args], cwd=REPO,
                                    env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def start_server(self) -> subprocess.Popen[bytes]:
        return self._popen(["serve", CONFIG, *self.overrides, "--out", str(self.srv),
                            "--start-deadline", "120"], self.out / "server.out")

    def start_site(self, cid: int) -> None:
        self.sites[cid] = self._popen(["join", CONFIG, *self.overrides, "--server", str(self.srv / "port.json"),
                                       "--site", str(cid), "--out", str(self.out / f"site{cid}")],
                                      self.out / f"site{cid}.out")
        self.starts.append((self.now(), cid))

    def kill_site(self, cid: int) -> None:
        proc = self.sites.pop(cid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.kills.append((self.now(), cid))

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- rank 0's memory -------------------------------------------------------------------------------
    def sample_rss(self, server: subprocess.Popen[bytes]) -> None:
        """In a thread: rank 0's resident memory every RSS_EVERY_S (the python under its mpiexec)."""
        rank0 = None
        while not self._stop.wait(RSS_EVERY_S):
            rank0 = rank0 or next((p for p in _descendants(server.pid) if b"serve" in _cmdline(p)), None)
            rss = _rss_bytes(rank0) if rank0 is not None else None
            if rss is not None:
                self.rss.append((self.now(), rss))
            else:
                rank0 = None

    # -- the soak ----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        args, rng = self.args, random.Random(self.args.seed)
        if self.out.exists():  # only a folder this tool made is emptied
            if not (self.out / MARKER).exists():
                raise SystemExit(f"chaos soak: {self.out} exists and is not a chaos soak's folder: pick another --out")
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        (self.out / MARKER).write_text("made by tools/chaos_soak.py\n")
        lo, hi = (float(x) for x in args.kill_every.split("-"))
        away_lo, away_hi = (float(x) for x in args.away.split("-"))
        server = self.start_server()
        for cid in range(args.sites):
            self.start_site(cid)
        sampler = threading.Thread(target=self.sample_rss, args=(server,), daemon=True)
        sampler.start()
        self._wait(lambda: _rounds(self.srv) > 0, 300, server, "the first round")
        self.t0 = time.monotonic()  # the soak's clock starts with the rounds
        self.rss.clear()
        end = self.t0 + 60 * args.minutes
        next_kill, returns = self.t0 + rng.uniform(lo, hi), dict[int, float]()
        while time.monotonic() < end:
            if server.poll() is not None:
                break
            now = time.monotonic()
            for cid, when in list(returns.items()):
                if now >= when:
                    del returns[cid]
                    self.start_site(cid)
            if now >= next_kill and self.sites:
                for cid in rng.sample(sorted(self.sites), min(len(self.sites), 2 if rng.random() < 0.25 else 1)):
                    self.kill_site(cid)
                    returns[cid] = now + rng.uniform(away_lo, away_hi)
                next_kill = now + rng.uniform(lo, hi)
            time.sleep(0.2)
        for cid in list(returns):
            self.start_site(cid)  # back for the end, so that the last checks see every site
        duration = self.now()
        self._wait(lambda: _all_present(self.srv), 240, server, "every site present again")
        (self.srv / "HALT").touch()
        code = _finish(server, 300)
        self._stop.set()
        for proc in self.sites.values():
            _finish(proc, 120)
        return self.report(code, duration)

    def _wait(self, ready: Any, timeout: float, server: subprocess.Popen[bytes], what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if server.poll() is not None or time.monotonic() > deadline:
                state = "ended" if server.poll() is not None else "running"
                raise SystemExit(f"chaos soak: never {what} (server {state}); see {self.out}/server.out")
            time.sleep(0.5)

    # -- the verdict --------------------------------------------------------------------------------------
    def report(self, code: int, duration: float) -> dict[str, Any]:
        events = _events(self.srv)
        log = (self.srv / "logs" / "rank0.log").read_text()
        live = json.loads((self.srv / "live.json").read_text())
        window = max(60.0, duration / 6)
        windows = [(w * window, (w + 1) * window) for w in range(max(1, round(duration / window)))]
        done = sorted({e["round"] for e in events if e["name"] == "round_time_s"})
        lost = {int(m.group(1)): " ".join(m.group(2).split(";")[0].split()[:12])
                for m in re.finditer(r"round (\d+) lost: (.*)", log)}
        wall = _round_times(events, self.t0)
        rows = []
        for a, b in windows:
            peak = max((r for t, r in self.rss if a <= t < b), default=0)
            rounds = sum(1 for t in wall.values() if a <= t < b)
            rows.append({"from_s": round(a), "to_s": round(b), "kills": sum(1 for t, _ in self.kills if a <= t < b),
                         "rounds": rounds, "peak_rss_mib": round(peak / 2**20, 1)})
        rejoins = sum(1 for e in events if e["name"] == "rejoined")
        evicted = [s["client"] for s in live["sites"] if s["state"] in ("evicted", "excluded")]
        late_kills = sum(1 for t, _ in self.kills if t > duration - 60)
        first, last = rows[0]["peak_rss_mib"], rows[-1]["peak_rss_mib"]
        checks = {
            "server ended cleanly": code == 0 and "Traceback" not in log,
            "no site evicted": not evicted,
            "rounds in every window": all(r["rounds"] > 0 for r in rows),
            "every kill followed by a rejoin": rejoins >= len(self.kills) - late_kills,
            "rank 0 peak RSS flat (last window within 10 % of the first)": last <= first * (1 + RSS_TOLERANCE),
        }
        return {"minutes": round(duration / 60, 2), "sites": self.args.sites, "seed": self.args.seed,
                "secure_aggregation": not self.args.plain, "kills": len(self.kills), "rejoins": rejoins,
                "rounds_done": len(done), "rounds_lost": len(lost),
                "lost_reasons": _count(lost.values()), "evicted": evicted, "windows": rows, "checks": checks}


def _descendants(pid: int) -> list[int]:
    """The processes under `pid` (Linux /proc), children first."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop(0)
        try:
            kids = [int(c) for c in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
        except OSError:
            continue
        found += kids
        todo += kids
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _rss_bytes(pid: int) -> int | None:
    """Resident memory of `pid` (VmRSS), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _events(out: Path) -> list[dict[str, Any]]:
    events = []
    with contextlib.suppress(OSError):
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def _rounds(out: Path) -> int:
    return sum(1 for e in _events(out) if e["name"] == "round_time_s")


def _round_times(events: list[dict[str, Any]], t0: float) -> dict[int, float]:
    """Round -> when it ended, in seconds into the soak (metrics.jsonl's `time` is since the run's
    start: aligned on the soak's first round, where the soak's clock starts)."""
    ends = {e["round"]: float(e.get("time", 0.0)) for e in events if e["name"] == "round_time_s"}
    if not ends:
        return {}
    first = min(ends.values())
    return {r: t - first for r, t in ends.items()}


def _all_present(out: Path) -> bool:
    try:
        live = json.loads((out / "live.json").read_text())
    except (OSError, ValueError):
        return False
    return all(s["state"] == "present" for s in live["sites"])


def _count(reasons: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for why in reasons:
        counts[why] = counts.get(why, 0) + 1
    return counts


def _finish(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9


def _print(result: dict[str, Any]) -> None:
    print(f"chaos soak: {result['minutes']} min, K = {result['sites']}, seed {result['seed']}, secure aggregation "
          f"{'on' if result['secure_aggregation'] else 'off'}")
    print(f"kills {result['kills']}, rejoins {result['rejoins']}, rounds done {result['rounds_done']}, "
          f"rounds lost {result['rounds_lost']}, evicted {result['evicted'] or 'none'}")
    for why, n in result["lost_reasons"].items():
        print(f"  lost x{n}: {why}")
    print("| window (s) | kills | rounds | rank 0 peak RSS (MiB) |\n|---|---|---|---|")
    for r in result["windows"]:
        print(f"| {r['from_s']}-{r['to_s']} | {r['kills']} | {r['rounds']} | {r['peak_rss_mib']} |")
    for name, ok in result["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-every", default="20-60", metavar="LO-HI", help="seconds between kills (uniform)")
    p.add_argument("--away", default="2-20", metavar="LO-HI", help="seconds a killed site stays away (uniform)")
    p.add_argument("--out", default="/tmp/hpcfed-chaos")
    p.add_argument("--plain", action="store_true", help="without secure aggregation")
    p.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = p.parse_args(argv)
    result = Soak(args).run()
    _print(result)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
