"""Exact vs index search side by side, at the scale of a real collection (issue 24's goals).

    python tools/bench_search.py [--n 1000000] [--sites 4] [--dim 384] [--queries 1000] [--json]

Writes ``--sites`` synthetic exports of ``--n`` vectors in all into a temporary folder (deleted
afterwards; nothing lands in the repository), then runs the real CLI as separate processes and
measures each one's wall time and peak memory (``wait4``'s max RSS):

    1. ``hpcfed search index DIR``                        build every site's index
    2. ``hpcfed search query DIR --id ID [--exact]``      one query, start-up included
    3. ``hpcfed search query DIR --ids-file F [--exact]`` ``--queries`` queries in one call
    4. ``hpcfed search serve DIR``                        the service: ``--queries`` requests one
                                                           after the other over one HTTP connection

and recall@10 of the index answers against the exact ones (the same merged top-10 over every
site, the query's own document left out). Then, side by side in the same run (issue 41's goals):

    5. filters keeping 1 % and 10 % (``--where label=7``; ``label=0`` .. ``label=9``; every vector
       has one of 100 labels): recall@10 of the index against exact search over the kept vectors,
       and the service's latency and CPU time per query with each
    6. ``hpcfed search index DIR --append NEW``: 10 % more vectors, its time over the full build's,
       the drift it reports, and recall@10 after it against exact search over all the vectors

The exact answers of 5. and 6. are computed here one site at a time (`search_truth`), not by an
``--exact`` process that would hold every site's vectors at once (3.5-5.1 GB at 1 M).
``--goals-only`` runs the build, 5. (1 % only) and 6., in that order; ``--out`` keeps each step's
results as it ends.

The vectors imitate sentence embeddings (see `synthetic`: calibrated so that an IVF index finds their
neighbours about as well as it finds those of all-MiniLM-L6-v2 vectors of 88,015 real tweets);
``--vectors FILE.npy`` runs on real vectors instead.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_process import cpu_seconds, peak_rss_mb, run  # noqa: E402
from search_truth import exact_answers  # noqa: E402

from hpcfed.store.embeddings import export_path, write_export  # noqa: E402 (after the path is set)


def synthetic(n: int, d: int, seed: int, *, topics: int = 2000, rank: int = 32, spread: float = 1.5,
              noise: float = 0.4, common: float = 0.8, chunk: int = 65536) -> Iterator[np.ndarray]:
    """Blocks of vectors: a shared direction + a topic centre + the topic's own rank-32 spread + noise.

    Calibrated on the all-MiniLM-L6-v2 vectors of 88,015 real tweets (CrisisLexT6 + T26): mean cosine
    .162 (real .156); one IVF512,Flat index over 87,715 of them finds the exact top 10 with recall
    .900 / .953 at nprobe 32 / 64 (real .919 / .946). Their 10th-neighbour cosine is lower (.49 vs .65:
    tweets have near-duplicates). The structure is the same for every site (seeded apart from `seed`),
    so the sites share one vector space, as a joint run's do."""
    mean, centres, basis = _structure(d, topics, rank)
    rng = np.random.default_rng(seed)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        t = rng.integers(topics, size=m)
        z = rng.normal(size=(m, rank)).astype(np.float32)
        x = common * mean + centres[t] + noise * rng.normal(size=(m, d)).astype(np.float32)
        order = np.argsort(t, kind="stable")
        bounds = np.searchsorted(t[order], np.arange(topics + 1))
        for topic in range(topics):  # each topic spreads along its own directions
            rows = order[bounds[topic]:bounds[topic + 1]]
            x[rows] += spread * (z[rows] @ basis[topic])
        yield x


@functools.lru_cache(maxsize=1)
def _structure(d: int, topics: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shared direction, topic centres and topic bases of `synthetic` (made once per run, not once
    per site: the bases are topics x rank x d normals, drawn in float64 as before, so the vectors are the same)."""
    structure = np.random.default_rng(20240)
    mean = structure.normal(size=d).astype(np.float32)
    centres = structure.normal(size=(topics, d)).astype(np.float32)
    basis = (structure.normal(size=(topics, rank, d)) / np.sqrt(rank)).astype(np.float32)
    return mean, centres, basis


LABELS = 100  # every vector has label row % 100: `--where label=7` keeps 1 %


def write_collection(folder: Path, n: int, sites: int, d: int, given: np.ndarray | None = None, *,
                     prefix: str = "s", seed: int = 0) -> list[str]:
    """`sites` exports of n/sites vectors each (ids ``<prefix><site>-<row>``), synthetic or the rows of
    `given` dealt round-robin; returns every id."""
    ids: list[str] = []
    for site in range(sites):
        rows = n // sites + (1 if site < n % sites else 0)
        if given is not None:
            vectors = np.ascontiguousarray(given[site::sites], dtype=np.float32)
        else:
            vectors = np.concatenate(list(synthetic(rows, d, seed=site + 100 * seed)))
        site_ids = [f"{prefix}{site}-{i}" for i in range(rows)]
        write_export(export_path(folder, site), vectors, site_ids, np.arange(rows) % LABELS, entity="doc",
                     model="synthetic", site=site)
        ids += site_ids
        del vectors
    return ids


def recall(index_answers: list[dict], exact_answers: list[dict], k: int) -> tuple[float, float]:
    """Mean |index top-k ∩ exact top-k| / k over the queries (matched by position); and the same counting
    a result whose reported score reaches the exact k-th score as correct (near-duplicates tie, and
    which of them the exact search lists is arbitrary; exact for uncompressed indexes)."""
    plain, tied = [], []
    for a, e in zip(index_answers, exact_answers):
        want = e["results"][:k]
        denom = max(1, min(k, len(want)))
        plain.append(len({(r["site"], r["id"]) for r in a["results"][:k]} & {(r["site"], r["id"]) for r in want})
                     / denom)
        kth = want[-1]["score"] if want else float("inf")
        tied.append(sum(1 for r in a["results"][:k] if r["score"] >= kth - 1e-5) / denom)
    return round(float(np.mean(plain)), 4), round(float(np.mean(tied)), 4)


def serve_latency(folder: Path, ids: list[str], k: int, env: dict[str, str], where: dict | None = None) -> dict:
    """Start the service, ask each id once over one keep-alive connection; per-request latency."""
    cmd = [sys.executable, "-m", "hpcfed", "search", "serve", str(folder), "--port", "0"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        first = proc.stdout.readline()
        if not first:
            raise RuntimeError(f"the service did not start: {proc.stderr.read()[-2000:]}")
        ready = time.perf_counter() - start
        host, port = json.loads(first)["listening"].removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        latencies = []
        cpu_before = cpu_seconds(proc.pid)
        for doc_id in ids:
            body = json.dumps({"id": doc_id, "k": k, **({"where": where} if where else {})})
            t = time.perf_counter()
            conn.request("POST", "/search", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            latencies.append(time.perf_counter() - t)
            if response.status != 200:
                raise RuntimeError(f"/search answered {response.status}: {data[:300]!r}")
        conn.close()
        cpu = cpu_seconds(proc.pid) - cpu_before
        rss = peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    ms = sorted(1000 * x for x in latencies)
    return {"startup_s": round(ready, 2), "median_ms": round(statistics.median(ms), 2),
            "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 2), "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2),
            "queries_per_s": round(len(ms) / (sum(ms) / 1000), 1), "peak_rss_mb": rss,
            "cpu_ms_per_query": round(1000 * cpu / max(1, len(ms)), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="vectors in all")
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--index-args", default="", help="extra arguments for `hpcfed search index` (e.g. '--kind hnsw')")
    p.add_argument("--vectors", default=None,
                   help=".npy of real vectors to deal over the sites instead of synthetic ones (sets --n, --dim)")
    p.add_argument("--workdir", default=None, help="keep the collection here (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print the results as JSON only")
    p.add_argument("--no-append", action="store_true", help="skip the append measurement (6.)")
    p.add_argument("--goals-only", action="store_true",
                   help="only issue 41's goals: the build, the 1 %% filter (5.) and the append (6.)")
    p.add_argument("--recall-only", action="store_true",
                   help="only the build and recall@k of the index against exact search (for --vectors)")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the results as JSON here, after each step (a run cut short keeps what it had)")
    args = p.parse_args(argv)
    tmp = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hpcfed-bench-search-"))
    # PASSIVE: OpenMP threads that wait sleep instead of spinning, so that on a shared machine the CPU
    # time of a build is its work, not its threads waiting for the cores others hold
    env = {**os.environ, "HPCFED_KEYS_DIR": str(tmp / "keys"), "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("HPCFED_STATE_KEY", None)
    try:
        result = _bench(args, tmp, env)
    finally:
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


def _bench(args: argparse.Namespace, tmp: Path, env: dict[str, str]) -> dict:
    cli = [sys.executable, "-m", "hpcfed", "search"]
    folder = tmp / "run"
    load_before = os.getloadavg()
    t = time.perf_counter()
    given = np.load(args.vectors, mmap_mode="r") if args.vectors else None
    if given is not None:
        args.n, args.dim = given.shape
    ids = write_collection(folder, args.n, args.sites, args.dim, given)
    generated = round(time.perf_counter() - t, 1)
    rng = np.random.default_rng(1)
    queries = [ids[i] for i in rng.choice(len(ids), size=min(args.queries, len(ids)), replace=False)]
    (tmp / "ids.txt").write_text("\n".join(queries) + "\n")
    k = ["--k", str(args.k)]
    build = run([*cli, "index", str(folder), "--quiet", *args.index_args.split()], env)
    built = json.loads(build.pop("stdout"))["indexes"]
    res: dict = {"vectors": args.vectors or "synthetic", "n": args.n, "sites": args.sites, "dim": args.dim,
                 "queries": len(queries), "k": args.k,
                 "generate_s": generated, "cpu_count": os.cpu_count(), "load_avg_before": load_before,
                 "build": {**build, "factory": built[0].get("factory"), "nprobe": built[0].get("nprobe"),
                           "faiss_mb": round(sum(b.get("faiss_bytes", 0) for b in built) / 2**20)}}
    res["filters"] = {}
    save = _saver(args.out, res)
    save()
    if args.recall_only:
        res["exact"], res["index"] = {}, {}
        for mode in ("exact", "index"):
            many = run([*cli, "query", str(folder), "--ids-file", str(tmp / "ids.txt"), *k, "--jsonl",
                        *(["--exact"] if mode == "exact" else [])], env)
            res[mode] = [json.loads(line) for line in many.pop("stdout").splitlines()]
            res[f"{mode}_batch"] = many
        res["recall_at_k"], res["recall_at_k_ties"] = recall(res.pop("index"), res.pop("exact"), args.k)
        res["load_avg_after"] = os.getloadavg()
        save()
        return res
    # issue 41's goals first (a run cut short by its time limit still has them), then issue 24's figures
    res["filters"]["1 %"] = _filtered(cli, folder, tmp, queries, k, env, FILTERS["1 %"])
    save()
    if not args.no_append:
        res["append"] = _append(args, cli, tmp, folder, given, k, env, res["build"])
        save()
    if args.goals_only:
        res["load_avg_after"] = os.getloadavg()
        return res
    for mode in ("exact", "index"):
        flag = ["--exact"] if mode == "exact" else []
        one = run([*cli, "query", str(folder), "--id", queries[0], *k, "--compact", *flag], env)
        one.pop("stdout")
        many = run([*cli, "query", str(folder), "--ids-file", str(tmp / "ids.txt"), *k, "--jsonl", *flag], env)
        res[mode] = {"one_query": one, "batch": {key: v for key, v in many.items() if key != "stdout"}}
        res[mode]["answers"] = [json.loads(line) for line in many["stdout"].splitlines()]
    res["recall_at_k"], res["recall_at_k_ties"] = recall(res["index"].pop("answers"), res["exact"].pop("answers"),
                                                         args.k)
    res["service"] = serve_latency(folder, queries, args.k, env)
    save()
    res["filters"]["10 %"] = _filtered(cli, folder, tmp, queries, k, env, FILTERS["10 %"])
    res["load_avg_after"] = os.getloadavg()
    return res


def _saver(path: Path | None, res: dict) -> Callable[[], None]:
    """A function writing `res` so far to `path` (nothing without one), load average and time stamped."""
    def save() -> None:
        if path is not None:
            path.write_text(json.dumps({**res, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                        "load_avg_now": os.getloadavg()}, indent=2))
    return save


def _answers(cmd: list[str], env: dict[str, str]) -> tuple[dict, list[dict]]:
    out = run(cmd, env)
    return {key: v for key, v in out.items() if key != "stdout"}, [json.loads(x) for x in out["stdout"].splitlines()]


FILTERS = {"1 %": [7], "10 %": list(range(10))}  # labels kept (every vector has label row % 100)


def _filtered(cli: list[str], folder: Path, tmp: Path, queries: list[str], k: list[str], env: dict[str, str],
              labels: list[int]) -> dict:
    """Goal: a filter keeping 1 % -- recall@10 >= .95 against exact, service median <= 10 ms."""
    where = [f"--where=label={label}" for label in labels]
    many = [*cli, "query", str(folder), "--ids-file", str(tmp / "ids.txt"), *k, "--jsonl", *where]
    index_run, index_answers = _answers(many, env)
    truth = exact_answers([folder], len(list((folder / "embeddings").glob("site*.h5"))), queries, int(k[1]), labels)
    kept = all(r["label"] in labels for a in index_answers for r in a["results"])
    plain, ties = recall(index_answers, truth, int(k[1]))
    return {"where": f"label in {labels[0]}..{labels[-1]}", "every_hit_matches": kept, "recall_at_k": plain,
            "recall_at_k_ties": ties, "batch_index_s": index_run["seconds"], "batch_index_cpu_s": index_run["cpu_s"],
            "service": serve_latency(folder, queries, int(k[1]), env, {"label": labels})}


def _append(args: argparse.Namespace, cli: list[str], tmp: Path, folder: Path, given: np.ndarray | None,
            k: list[str], env: dict[str, str], build: dict) -> dict:
    """Goal: appending 10 % takes <= 15 % of a full build; recall@10 after it >= .95 (against exact search
    over the export and the appended vectors together)."""
    extra = max(args.sites, args.n // 10)
    more = None if given is None else np.asarray(given[: extra])  # real vectors: the first tenth again, new ids
    new_ids = write_collection(tmp / "new", extra, args.sites, args.dim, more, prefix="a", seed=1)
    appended = run([*cli, "index", str(folder), "--append", str(tmp / "new")], env)
    report = json.loads(appended.pop("stdout"))["indexes"]
    asked = [new_ids[i] for i in np.random.default_rng(2).choice(len(new_ids), size=min(200, len(new_ids)),
                                                                  replace=False)]
    (tmp / "new_ids.txt").write_text("\n".join(asked) + "\n")
    _, got = _answers([*cli, "query", str(folder), "--ids-file", str(tmp / "new_ids.txt"), *k, "--jsonl"], env)
    want = exact_answers([folder, tmp / "new"], args.sites, asked, int(k[1]))  # the export and the appended
    plain, ties = recall(got, want, int(k[1]))
    return {"rows": extra, **appended, "share_of_build": round(appended["seconds"] / max(build["seconds"], 1e-9), 3),
            "cpu_share_of_build": round(appended["cpu_s"] / max(build["cpu_s"], 1e-9), 3),
            "drift": [r.get("drift") for r in report], "rebuild_due": any(r.get("rebuild_due") for r in report),
            "recall_at_k": plain, "recall_at_k_ties": ties}


def _table(r: dict) -> str:
    rows = [
        f"{r['n']:,} x {r['dim']} {r['vectors']} vectors over {r['sites']} sites, {r['queries']} queries, k={r['k']}; "
        f"{r['cpu_count']} cores, load average {r['load_avg_before'][0]:.1f} -> {r['load_avg_after'][0]:.1f}",
        f"index build ({r['build']['factory']}, nprobe {r['build']['nprobe']}): {r['build']['seconds']} s "
        f"({r['build']['cpu_s']} s CPU), peak {r['build']['peak_rss_mb']} MB, "
        f"FAISS indexes {r['build']['faiss_mb']} MB",
    ]
    if "recall_at_k" in r and "exact" not in r:  # --recall-only
        return "\n".join([*rows, f"recall@{r['k']} against exact (ties counted): {r['recall_at_k']} "
                                  f"({r['recall_at_k_ties']})"])
    if "exact" in r:
        rows += [
            "| | exact (`--exact`) | index |",
            "|---|---|---|",
            *[f"| {what} | {r['exact'][key]['seconds']} s ({r['exact'][key]['cpu_s']} s CPU), "
              f"{r['exact'][key]['peak_rss_mb']} MB | {r['index'][key]['seconds']} s "
              f"({r['index'][key]['cpu_s']} s CPU), {r['index'][key]['peak_rss_mb']} MB |"
              for what, key in (("one query, start-up included", "one_query"),
                                (f"{r['queries']} queries in one `--ids-file` call", "batch"))],
            f"| recall@{r['k']} against exact (ties counted) | 1 | {r['recall_at_k']} ({r['recall_at_k_ties']}) |",
            f"service: start {r['service']['startup_s']} s, median {r['service']['median_ms']} ms, "
            f"p95 {r['service']['p95_ms']} ms, p99 {r['service']['p99_ms']} ms per query, "
            f"{r['service']['queries_per_s']} queries/s, {r['service']['cpu_ms_per_query']} ms of CPU per query, "
            f"peak {r['service']['peak_rss_mb']} MB"]
    rows += [
        "| filter (labels kept) | recall@k (ties counted) | every hit matches | service median / p95 | CPU per query |",
        "|---|---|---|---|---|",
        *[f"| {name} ({f['where']}) | {f['recall_at_k']} ({f['recall_at_k_ties']}) | {f['every_hit_matches']} | "
          f"{f['service']['median_ms']} / {f['service']['p95_ms']} ms | {f['service']['cpu_ms_per_query']} ms |"
          for name, f in r["filters"].items()],
    ]
    if "append" in r:
        a = r["append"]
        rows.append(
            f"append {a['rows']:,} vectors: {a['seconds']} s = {a['share_of_build']:.1%} of the full build "
            f"({r['build']['seconds']} s); CPU {a['cpu_s']} s = {a['cpu_share_of_build']:.1%} of the build's "
            f"{r['build']['cpu_s']} s; recall@{r['k']} after it {a['recall_at_k']} ({a['recall_at_k_ties']}); "
            f"drift {a['drift']}, rebuild due: {a['rebuild_due']}")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
