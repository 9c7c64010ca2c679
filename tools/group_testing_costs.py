"""Group testing under secure aggregation (docs/threats.md, "Finding a site that breaks the
encoding"): how fast it isolates a hostile site, the smallest sum rank 0 ever sees, and what it
costs in round time.

    python tools/group_testing_costs.py [--k 8 16] [--seeds 20] [--min-group 2] [--real K] [--rounds 10]
                                        [--baseline /path/to/other/checkout] [--repeats 3]

1. The schedule and the inference rule as the server runs them (`hpcfed.privacy.group_testing`),
   with every honest site checking each request (`hpcfed.privacy.group_rules`), against a matrix
   of attackers, over `--seeds` seeds per K: rounds from the first refused sum to the eviction,
   honest sites evicted (must be 0), the smallest sum.
2. `--real K`: the quickstart under real mpiexec with K sites, side by side in one run: no attack
   on this tree and on `--baseline` (default: none), then one site sending garbage every round,
   and the run without that site; the median round time of each, the extra time of the group
   rounds, and the honest sites' accuracy against the run without the hostile site.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcfed.privacy.group_rules import Group, SiteRules  # noqa: E402  (this checkout's, not an installed one)
from hpcfed.privacy.group_testing import Isolation, Verdict  # noqa: E402

ATTACKERS = {  # name -> (hostile sites as offsets from the last, garbles(round, site), max_hostile)
    "every round": ((1,), lambda r, h: True, 1),
    "alternating rounds": ((1,), lambda r, h: r % 2 == 0, 1),
    "once (round 0)": ((1,), lambda r, h: r == 0, 1),
    "two colluders, every round": ((1, 2), lambda r, h: True, 2),
    "two colluders, taking turns": ((1, 2), lambda r, h: (r + h) % 2 == 0, 2),
}


def play(k: int, hostile: set[int], garbles, f: int = 1, min_group: int = 2, rounds: int = 12,
         seed: int = 0) -> tuple[list[Verdict], list[int], int]:
    """The server's group testing against `hostile` sites (garbles(round, site, its group) -> bool),
    every honest site checking each request with its real rules (`SiteRules`), a round whose whole
    sum is refused retried at once in groups on the same inputs (`hpcfed.server.secagg_round`);
    (the verdicts in order, the rounds with a refused sum, the smallest sum).
    tests/privacy/test_group_testing.py plays it too."""
    iso, live = Isolation(k, min_group, f, seed), set(range(k))
    sites = {s: SiteRules(s, k, min_group) for s in range(k)}
    evicted: list[Verdict] = []
    refused_rounds: list[int] = []
    smallest = k

    def attempt(rnd: int, picked: list[Group] | None) -> bool:
        nonlocal smallest
        groups = picked or [frozenset(live)]
        for s in live - hostile:
            if picked is not None:
                sites[s].accept(rnd, [sorted(g) for g in groups])  # raises if an honest site would refuse
            sites[s].revealed(rnd, live)
        smallest = min(smallest, *map(len, groups))
        bad = {h for h in hostile & live if garbles(rnd, h, next(g for g in groups if h in g))}
        refused = [g for g in groups if g & bad]
        refused_rounds.extend([rnd] if refused and rnd not in refused_rounds else [])
        for verdict in iso.record(rnd, groups, refused, picked is not None):
            evicted.append(verdict)
            live.discard(verdict.site)
            iso.evicted(verdict.site)
        return bool(refused)

    for rnd in range(rounds):
        picked = iso.groups_for(rnd, live)
        if attempt(rnd, picked) and picked is None and (retry := iso.groups_for(rnd, live)) is not None:
            attempt(rnd, retry)
    return evicted, refused_rounds, smallest


def simulate(k: int, hostile: set[int], garbles, f: int, seed: int, rounds: int,
             min_group: int = 2) -> tuple[int | None, int, int]:
    """(rounds from the first refused sum to the last hostile site's eviction or None, honest sites
    evicted, smallest sum) of one run."""
    evicted, refused_rounds, smallest = play(k, hostile, lambda r, h, g: garbles(r, h), f, min_group, rounds, seed)
    out = {v.site: v.round for v in evicted}
    done = None
    if refused_rounds and hostile <= set(out):
        done = max(out[h] for h in hostile) - refused_rounds[0] + 1
    return done, sum(v.site not in hostile for v in evicted), smallest


def simulation_table(ks: list[int], seeds: int, min_group: int) -> list[str]:
    rows = [f"min_group = {min_group}",
            "| K | attacker | isolated in (rounds, median / max) | runs isolated | honest evicted | smallest sum |",
            "|---|---|---|---|---|---|"]
    for k in ks:
        budget = math.ceil(math.log2(k)) + 2
        for name, (offsets, garbles, f) in ATTACKERS.items():
            hostile = {k - o for o in offsets}
            runs = [simulate(k, hostile, garbles, f, seed, 16, min_group) for seed in range(seeds)]
            took = [r[0] for r in runs if r[0] is not None]
            spread = f"{statistics.median(took):g} / {max(took)}" if took else "-"
            rows.append(f"| {k} | {name} | {spread} (budget {budget}) | {len(took)} of {seeds} | "
                        f"{sum(r[1] for r in runs)} | {min(r[2] for r in runs)} |")
            print(rows[-1], flush=True)
    return rows


def real_run(tree: Path, out: Path, k: int, rounds: int, *extra: str) -> dict:
    cmd = ["mpiexec", "-n", str(k + 1), sys.executable, "-m", "hpcfed", "run", str(REPO / "configs/quickstart.yaml"),
           "--out", str(out), f"rounds={rounds}", "privacy.secure_aggregation=true", "influence.enabled=false",
           "federation.round_deadline_s=120", "checkpoint_every=0", *extra]
    env = {**os.environ, "PYTHONPATH": str(tree), "HPCFED_PSK": "00" * 32, "PYTHONUNBUFFERED": "1"}
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, timeout=1800)
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    times = {e["round"]: e["value"] for e in events if e["name"] == "round_time_s"}
    grouped = {e["round"] for e in events if e["name"] == "secagg_groups"}
    honest = [v["accuracy"] for c, v in summary["clients"].items() if int(c) != k - 1]
    return {"times": times, "grouped": grouped, "honest": sum(honest) / len(honest), "evicted": summary["evicted"]}


def real_table(k: int, rounds: int, baseline: Path | None, repeats: int = 1) -> list[str]:
    """The real runs side by side; with a `baseline`, the two no-attack runs `repeats` times each,
    alternating (the load moves between runs: the median over all their rounds is compared)."""
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            runs.setdefault("no attack, this tree", []).append(real_run(REPO, Path(tmp) / f"a{i}", k, rounds))
            if baseline is not None:
                runs.setdefault("no attack, baseline", []).append(real_run(baseline, Path(tmp) / f"b{i}", k, rounds))
        runs["garbage every round"] = [real_run(REPO, Path(tmp) / "c", k, rounds, "attack=garbage")]
        runs["without the hostile site"] = [real_run(REPO, Path(tmp) / "d", k, rounds,
                                                     f"federation.exclude_sites=[{k - 1}]")]

    def median_time(group: list[dict]) -> float:  # round 0 sets its keys up in the round: left out
        return statistics.median([t for run in group for r, t in run["times"].items() if r > 0])

    base = median_time(runs["no attack, this tree"])
    rows = [f"| K = {k}, {rounds} rounds | runs | median round time (s) | / no attack, this tree | honest accuracy |",
            "|---|---|---|---|---|"]
    for name, group in runs.items():
        med = median_time(group)
        rows.append(f"| {name} | {len(group)} | {med:.3f} | {med / base:.2f} | "
                    f"{statistics.mean(run['honest'] for run in group):.3f} |")
    attacked = runs["garbage every round"][0]
    group_times = [t for r, t in attacked["times"].items() if r in attacked["grouped"]]
    if group_times:
        rows.append(f"| rounds with group sums in the attacked run ({len(group_times)}) | 1 | "
                    f"{statistics.mean(group_times):.3f} | {statistics.mean(group_times) / base:.2f} | evicted: "
                    f"{'; '.join(e['reason'] for e in attacked['evicted']) or 'none'} |")
    for row in rows:
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--real", type=int, default=None, help="K for the real mpiexec runs (none: skip them)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--min-group", type=int, default=2)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout, for the no-attack round time")
    parser.add_argument("--repeats", type=int, default=1, help="no-attack runs of each tree, alternating")
    args = parser.parse_args()
    if args.seeds > 0:
        simulation_table(args.k, args.seeds, args.min_group)
    if args.real:
        real_table(args.real, args.rounds, args.baseline, args.repeats)


if __name__ == "__main__":
    main()
