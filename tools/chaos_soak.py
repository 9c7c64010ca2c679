"""Chaos soak of a long-lived federation: `hpcfed serve` and K `hpcfed join` jobs, secure aggregation
on, with site jobs SIGKILLed and restarted on a seeded schedule (issue 38).

    python tools/chaos_soak.py [--minutes 3] [--sites 3] [--seed 0] [--kill-every 20-60] [--away 2-20]
                               [--server-kills 1] [--out DIR] [--plain] [--json]

Every `--kill-every` seconds (drawn uniformly, seeded) one site job is killed whole (SIGKILL to its
mpiexec, proxy and rank; a quarter of the time two at once), at whatever protocol stage it is in,
and started again `--away` seconds later with the same command: it knocks with its key and rejoins
the same server (from its own newest shard of a committed checkpoint). The server is never told.
`--server-kills` times (once by default, at a seeded point of the run's middle) the server's own
job is SIGKILLed instead and started again with `--resume`: the sites knock again and resume with it.
Every job runs with ``HPCFED_AUDIT`` (`hpcfed.privacy.audit`): the sites record a probe of each
input they mask, the server of each sum it unmasks and of the model. At the end the tool writes
OUT/srv/HALT, waits for every job, and checks (`tools/chaos_checks.py`, on what the run wrote):

- 0 rounds applied wrongly: each round once, each folded sum exactly the sum of its listed sites'
  inputs, each round's model the last one's plus its own step (across the server's resume too);
- 0 runs ended: no job ended by itself (only the tool's kills end jobs), the server ended cleanly;
- rounds lost only to a secure-aggregation shortfall (a site died mid-round), each named;
- no site was evicted (a killed site is dropped and comes back; it never misbehaved);
- every site the server lost was let back in (a job killed before it knocked is no loss: the
  server never had it);
- rank 0's memory stayed flat: its peak RSS in the last 10 minutes is within 10 % of the first 10
  minutes' (the last and first thirds in a soak under 30 minutes).

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
sys.path.insert(0, str(REPO))
from tools.chaos_checks import events as _events  # noqa: E402  (the repository's root is on the path above)
from tools.chaos_checks import lost_rounds, rejoin_rounds, sites_not_back, wrong_rounds  # noqa: E402

CONFIG = "configs/quickstart.yaml"
PSK = "5a" * 32
RSS_EVERY_S = 2.0
MARKER = ".chaos-soak"
RSS_TOLERANCE = 0.10  # the last window's peak RSS may exceed the first's by this much


def _overrides(sites: int, secure: bool, task: str) -> list[str]:
    return [f"task.name={task}", "rounds=1000000", f"federation.num_clients={sites}", "task.samples_per_site=100",
            "eval_every=0", "checkpoint_every=2", "federation.on_client_failure=continue", "federation.quorum=0.5",
            "federation.setup_timeout_s=300", "federation.round_deadline_s=30", "influence.reject_factor=1000",
            f"privacy.secure_aggregation={'true' if secure else 'false'}", "federation.slowdown={0: 3}"]


class Soak:
    """The jobs of one soak, the schedule's record and the server's memory samples."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self.config = CONFIG
        self.srv = self.out / "srv"
        self.overrides = _overrides(args.sites, not args.plain, args.task)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HPCFED_PSK": PSK,
                    "PYTHONPATH": str(REPO), "HPCFED_AUDIT": str(self.out / "audit")}
        self.sites: dict[int, subprocess.Popen[bytes]] = {}
        self.kills: list[tuple[float, int]] = []  # (seconds into the soak, site)
        self.starts: list[tuple[float, int]] = []
        self.rss: list[tuple[float, int]] = []  # (seconds into the soak, rank 0's RSS in bytes)
        self.server_kills: list[float] = []
        self.ended: list[str] = []  # jobs that ended by themselves during the soak
        self.round_seen: dict[int, float] = {}  # round -> when the soak first saw it done (its own clock)
        self.server: subprocess.Popen[bytes] | None = None
        self.t0 = time.monotonic()
        self._stop = threading.Event()

    # -- jobs ------------------------------------------------------------------------------------------
    def _popen(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as f:
            return subprocess.Popen(["mpiexec", "-n", "1", sys.executable, "-m", "hpcfed", *args], cwd=REPO,
                                    env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def start_server(self, resume: bool = False) -> subprocess.Popen[bytes]:
        self.server = self._popen(["serve", self.config, *self.overrides, "--out", str(self.srv),
                                   "--start-deadline", "600", *(["--resume"] if resume else [])],
                                  self.out / "server.out")
        return self.server

    def kill_server(self) -> None:
        assert self.server is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()
        self.server_kills.append(self.now())

    def start_site(self, cid: int) -> None:
        self.sites[cid] = self._popen(["join", self.config, *self.overrides, "--server", str(self.srv / "port.json"),
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
    def sample_rss(self) -> None:
        """In a thread: rank 0's resident memory every RSS_EVERY_S (the python under the server's
        mpiexec, found again after a resume), and when each round was first seen done."""
        rank0, server = None, None
        while not self._stop.wait(RSS_EVERY_S):
            if self.server is not server:
                rank0, server = None, self.server
            if server is not None:
                rank0 = rank0 or next((p for p in _descendants(server.pid) if b"serve" in _cmdline(p)), None)
            rss = _rss_bytes(rank0) if rank0 is not None else None
            if rss is not None:
                self.rss.append((self.now(), rss))
            else:
                rank0 = None
            for e in _events(self.srv):
                if e["name"] == "round_time_s":
                    self.round_seen.setdefault(e["round"], self.now())

    # -- the soak ----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        rng = random.Random(self.args.seed)
        if self.out.exists():  # only a folder this tool made is emptied
            if not (self.out / MARKER).exists():
                raise SystemExit(f"chaos soak: {self.out} exists and is not a chaos soak's folder: pick another --out")
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        (self.out / MARKER).write_text("made by tools/chaos_soak.py\n")
        try:
            return self._soak(rng)
        finally:  # whatever happened, no job of the soak outlives it
            self._stop.set()
            for proc in [*self.sites.values(), *([self.server] if self.server is not None else [])]:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def _soak(self, rng: random.Random) -> dict[str, Any]:
        args = self.args
        lo, hi = (float(x) for x in args.kill_every.split("-"))
        away_lo, away_hi = (float(x) for x in args.away.split("-"))
        self.start_server()
        for cid in range(args.sites):
            self.start_site(cid)
        sampler = threading.Thread(target=self.sample_rss, daemon=True)
        sampler.start()
        self._wait(lambda: _rounds(self.srv) > 0, 900, "the first round")
        self.t0 = time.monotonic()  # the soak's clock starts with the rounds
        self.rss.clear()
        self.round_seen.clear()
        end = self.t0 + 60 * args.minutes
        next_kill, returns = self.t0 + rng.uniform(lo, hi), dict[int, float]()
        server_at = sorted(self.t0 + 60 * args.minutes * rng.uniform(0.3, 0.7) for _ in range(args.server_kills))
        server_back = None
        while time.monotonic() < end:
            now = time.monotonic()
            if server_back is None and self.server is not None and self.server.poll() is not None:
                self.ended.append(f"the server ({self.now():.0f} s: exit {self.server.returncode})")
                break
            for cid, proc in list(self.sites.items()):
                if proc.poll() is not None:  # a job that ended by itself: counted, and started again
                    self.ended.append(f"site {cid} ({self.now():.0f} s: exit {proc.returncode})")
                    del self.sites[cid]
                    returns[cid] = now + away_lo
            if server_at and now >= server_at[0]:
                server_at.pop(0)
                self.kill_server()
                server_back = now + rng.uniform(away_lo, away_hi)
            if server_back is not None and now >= server_back:
                self.start_server(resume=True)
                server_back = None
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
        if server_back is not None:
            self.start_server(resume=True)
        duration = self.now()
        self._wait(lambda: _all_present(self.srv), 600, "every site present again")
        (self.srv / "HALT").touch()
        assert self.server is not None
        code = _finish(self.server, 300)
        self._stop.set()
        for proc in self.sites.values():
            _finish(proc, 120)
        return self.report(code, duration)

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        server = self.server
        assert server is not None
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
        lost = lost_rounds(log)
        rows = []
        for a, b in windows:
            peak = max((r for t, r in self.rss if a <= t < b), default=0)
            rows.append({"from_s": round(a), "to_s": round(b), "kills": sum(1 for t, _ in self.kills if a <= t < b),
                         "server_kills": sum(1 for t in self.server_kills if a <= t < b),
                         "rounds": sum(1 for t in self.round_seen.values() if a <= t < b),
                         "peak_rss_mib": round(peak / 2**20, 1)})
        span = 600.0 if duration >= 1800 else duration / 3  # the first and last 10 minutes (thirds if short)
        first = max((r for t, r in self.rss if t < span), default=0) / 2**20
        last = max((r for t, r in self.rss if t >= duration - span), default=0) / 2**20
        rejoins = len(re.findall(r"client \d+ \(rank \d+\) is back", log))
        evicted = [s["client"] for s in live["sites"] if s["state"] in ("evicted", "excluded")]
        wrong = wrong_rounds(self.srv, self.out / "audit", self.args.sites)
        shortfall = "secure aggregation"  # its sum cannot be unmasked, or too few sites for one
        checks = {
            "0 rounds applied wrongly (audit)": not wrong,
            "0 runs ended (no job ended by itself; the server ended cleanly)": not self.ended and code == 0
            and "Traceback" not in log,
            "rounds lost only to a secure-aggregation shortfall": all(shortfall in why for _, why in lost),
            "no site evicted": not evicted,
            "rounds in every window": all(r["rounds"] > 0 for r in rows),
            "every site the server lost was let back in": not sites_not_back(log),
            f"rank 0 peak RSS flat (last {span / 60:.0f} min within 10 % of the first)":
                last <= first * (1 + RSS_TOLERANCE),
        }
        return {"minutes": round(duration / 60, 2), "sites": self.args.sites, "seed": self.args.seed,
                "secure_aggregation": not self.args.plain, "kills": len(self.kills),
                "server_kills": len(self.server_kills), "rejoins": rejoins, "rounds_done": len(done),
                "rounds_lost": [{"round": r, "cause": why} for r, why in lost], "wrong": wrong,
                "ended": self.ended, "evicted": evicted, "rss_first_mib": round(first, 1),
                "rss_last_mib": round(last, 1), "rss_span_min": round(span / 60, 1),
                "rejoin_rounds": [r["rounds"] for r in rejoin_rounds(self.srv)], "windows": rows, "checks": checks}


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




def _rounds(out: Path) -> int:
    return sum(1 for e in _events(out) if e["name"] == "round_time_s")




def _all_present(out: Path) -> bool:
    try:
        live = json.loads((out / "live.json").read_text())
    except (OSError, ValueError):
        return False
    return all(s["state"] == "present" for s in live["sites"])




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
    print(f"site kills {result['kills']}, server kills {result['server_kills']}, rejoins {result['rejoins']}, "
          f"rounds done {result['rounds_done']}, rounds applied wrongly {len(result['wrong'])}, runs ended "
          f"{len(result['ended'])}, rounds lost {len(result['rounds_lost'])}, evicted {result['evicted'] or 'none'}")
    for lost in result["rounds_lost"]:
        print(f"  round {lost['round']} lost: {lost['cause']}")
    for what in result["wrong"] + result["ended"]:
        print(f"  {what}")
    print(f"rank 0 peak RSS: first {result['rss_span_min']} min {result['rss_first_mib']} MiB, last "
          f"{result['rss_span_min']} min {result['rss_last_mib']} MiB")
    delays = result["rejoin_rounds"]
    print(f"rounds from a rejoining site's knock to its first folded upload (1: the next round): {delays}; "
          f"within one round: {sum(1 for d in delays if d is not None and d <= 1)} of {len(delays)}")
    print("| window (s) | site kills | server kills | rounds | rank 0 peak RSS (MiB) |\n|---|---|---|---|---|")
    for r in result["windows"]:
        print(f"| {r['from_s']}-{r['to_s']} | {r['kills']} | {r['server_kills']} | {r['rounds']} | "
              f"{r['peak_rss_mib']} |")
    for name, ok in result["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-every", default="20-60", metavar="LO-HI", help="seconds between kills (uniform)")
    p.add_argument("--away", default="2-20", metavar="LO-HI", help="seconds a killed site stays away (uniform)")
    p.add_argument("--server-kills", type=int, default=1, help="times the server's job is killed and resumed")
    p.add_argument("--out", default="/tmp/hpcfed-chaos")
    p.add_argument("--plain", action="store_true", help="without secure aggregation")
    p.add_argument("--task", default="synthetic", choices=("synthetic", "synthetic_numpy"),
                   help="the quickstart's network in torch, or in NumPy (sites that start without torch)")
    p.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = p.parse_args(argv)
    result = Soak(args).run()
    _print(result)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
