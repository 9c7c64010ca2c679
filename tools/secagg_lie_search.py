"""Can a server that lies about who survived unmask one site under secure aggregation's consistency
check? An exhaustive search, as an integer program, over every way of handing out survivor sets
on the round's public SecAgg+ graph (`hpcfed.privacy.secagg.round_graph`), no site colluding:

    python tools/secagg_lie_search.py [--k 16] [--round 1] [--target 3] [--sets 16] [--degree D]
                                      [--no-check] [--time-limit 120]

The model (docs/threats.md, "Secure aggregation"): the server hands each site one survivor set
(sites handed the same set form a class; a set holds every site of its class, since an honest site
signs only a set with itself in it). With the check a site reveals only when at least its
threshold of neighbours were handed, and so signed, its set; it then gives, per neighbour, a seed
share if the neighbour is in its set, a key share otherwise. The server unmasks the target when its
threshold of neighbours reveal its seed and, for every neighbour v of the target, v's threshold of
neighbours reveal v's key (the target's own key would need over half of its neighbourhood on the
other side, which its seed already takes). "infeasible" means no assignment with at most `--sets`
distinct sets does it; `--no-check` drops the signature rule and finds the attack the check stops.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hpcfed

from hpcfed.privacy.secagg import round_graph, threshold_for


def search(k: int, rnd: int, target: int, sets: int, degree: int | None, check: bool, time_limit: float) -> str:
    graph = round_graph(k, rnd, degree)
    t = {w: threshold_for(len(graph[w])) for w in graph}
    watched = [target, *sorted(graph[target])]  # whose membership of each set matters
    index: dict[tuple[object, ...], int] = {}

    def var(*name: object) -> int:
        return index.setdefault(name, len(index))

    rows: list[tuple[dict[int, float], float, float]] = []

    def add(coefs: list[tuple[int, float]], lo: float, hi: float) -> None:
        row: dict[int, float] = {}
        for i, a in coefs:
            row[i] = row.get(i, 0.0) + a
        rows.append((row, lo, hi))

    classes = range(sets)
    for w in graph:  # in: site w handed set c; reveals: w answers, with set c
        add([(var("in", w, c), 1) for c in classes], 1, 1)
        for c in classes:
            add([(var("reveals", w, c), 1), (var("in", w, c), -1)], -np.inf, 0)
            if check:  # its threshold of neighbours signed set c
                add([(var("reveals", w, c), t[w])] + [(var("in", x, c), -1) for x in graph[w]], -np.inf, 0)
    for c in classes:
        for x in watched:  # has: x is in set c; a site is in the set it is handed
            add([(var("has", c, x), 1), (var("in", x, c), -1)], 0, np.inf)
    seed = []
    for w in graph[target]:
        for c in classes:
            z = var("seed", w, c)
            add([(z, 1), (var("reveals", w, c), -1)], -np.inf, 0)
            add([(z, 1), (var("has", c, target), -1)], -np.inf, 0)
            seed.append(z)
    add([(z, 1) for z in seed], t[target], np.inf)
    for v in graph[target]:
        keys = []
        for w in graph[v]:
            for c in classes:
                z = var("key", v, w, c)
                add([(z, 1), (var("reveals", w, c), -1)], -np.inf, 0)
                add([(z, 1), (var("has", c, v), 1)], -np.inf, 1)
                keys.append(z)
        add([(z, 1) for z in keys], t[v], np.inf)
    matrix = np.zeros((len(rows), len(index)))
    for r, (row, _, _) in enumerate(rows):
        for i, a in row.items():
            matrix[r, i] = a
    result = milp(np.zeros(len(index)), integrality=np.ones(len(index)), bounds=Bounds(0, 1),
                  constraints=LinearConstraint(matrix, [lo for _, lo, _ in rows], [hi for _, _, hi in rows]),
                  options={"time_limit": time_limit})
    return {0: "FEASIBLE: a lying server unmasks the target", 2: "infeasible: no lie unmasks the target"}.get(
        result.status, f"undecided ({result.message})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--round", type=int, default=1)
    ap.add_argument("--target", type=int, default=3)
    ap.add_argument("--sets", type=int, default=16, help="most distinct survivor sets the server hands out")
    ap.add_argument("--degree", type=int, default=None)
    ap.add_argument("--no-check", action="store_true", help="without the consistency check")
    ap.add_argument("--time-limit", type=float, default=120.0)
    a = ap.parse_args()
    verdict = search(a.k, a.round, a.target, a.sets, a.degree, not a.no_check, a.time_limit)
    print(f"K={a.k} round={a.round} target={a.target} sets<={a.sets} degree={a.degree or 'default'} "
          f"check={'off' if a.no_check else 'on'}: {verdict}")


if __name__ == "__main__":
    main()
