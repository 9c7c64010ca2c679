#!/usr/bin/env python
"""SEEC evaluation: sim_k of federated search against a centralized model, label precision@k.

    python tools/seec_eval.py doc2vec  --out runs/seec_eval [--launcher inprocess|mpi] [key=value ...]
    python tools/seec_eval.py node2vec --out runs/seec_eval_n2v [--launcher inprocess|mpi] [key=value ...]
    python tools/seec_eval.py score --central RUN --fed RUN [--mode joint|mapping|nomapping] [--k 10]

``doc2vec`` runs, on 20 Newsgroups: the centralized model (one site, the union), joint learning
(2 sites), independent training + mappers (mapping and no-mapping), then scores each against the
centralized one (paper §V.A.3: sim_k = |top_k^central ∩ top_k^fed| / k, mean over documents).
``node2vec`` runs Cora: centralized, joint without and with retention of cross-site edges.
Every score is written into that run's ``summary.json`` (``sim_10``, ``label_precision_at_10``)
and all of them into ``<out>/results.json``. Besides the merged search, ``score`` reports the
cross-site view: ``cross_site_sim_k`` compares only the other sites' answers with the central
top-k among those sites' documents (what joint learning or a mapper adds; the home site needs
neither), and ``remote_share_of_results`` is the fraction of merged results from other sites.

``--launcher mpi`` runs each federation with ``hpcfed run --np K`` (the real runtime);
``inprocess`` drives the same Task and FedAvg classes in one process, round by round, as the sync
runtime does (setup -> server_setup -> rounds of set_parameters/fit/aggregate -> final export):
useful where MPI is unavailable, and lighter on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcfed.search.global_search import GlobalSearch, map_query  # noqa: E402
from hpcfed.search.index import MERGE_HELP, MERGES, STANDARDIZED_MERGES, SiteIndex, merge_results  # noqa: E402
from hpcfed.search.metrics import label_precision_at_k, mean_sim_k  # noqa: E402


# -- running federations ---------------------------------------------------------------------------------
def run_inprocess(config: str, overrides: list[str], num_clients: int, out: Path) -> dict:
    """The synchronous runtime's steps, in one process (no MPI, no encryption)."""
    from hpcfed.config import build
    from hpcfed.data.root import data_root
    from hpcfed.launcher import prepare_config
    from hpcfed.params import ParamLayout
    from hpcfed.registry import strategy_class, task_class
    from hpcfed.strategies.base import StrategyContext, Update
    from hpcfed.tasks.base import Site

    cfg = prepare_config(config, overrides)
    if cfg.federation.num_clients is not None:
        num_clients = cfg.federation.num_clients
    task_cls = task_class(cfg.task.name)
    task_cfg = build(task_cls.Config, cfg.task.options, where=cfg.source, prefix="task.")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tasks = [task_cls(task_cfg, Site(client_id=c, num_clients=num_clients, seed=cfg.seed, out_dir=out,
                                     data_root=data_root(cfg.data_root), method=cfg.method, config_hash=cfg.hash()))
             for c in range(num_clients)]
    payloads = {c: t.setup() for c, t in enumerate(tasks)}
    initial0 = tasks[0].get_parameters()
    replies, init = task_cls.server_setup(task_cfg, payloads)
    for c, t in enumerate(tasks):
        t.on_setup(replies.get(c, ({}, {})))
    s_cls = strategy_class(cfg.strategy.name)
    strategy = s_cls(build(s_cls.Config, cfg.strategy.options, where=cfg.source, prefix="strategy."),
                     StrategyContext(num_clients=num_clients, seed=cfg.seed, task_cls=task_cls, task_config=task_cfg))
    strategy.initialize(init if init is not None else initial0)
    layout: ParamLayout = strategy.layout
    metrics_log = (out / "metrics.jsonl").open("w")
    for rnd in range(cfg.rounds):
        updates = []
        for c, t in enumerate(tasks):
            t.set_parameters({k: np.array(v) for k, v in layout.unflatten(strategy.model_for(c)).items()})
            res = t.fit(rnd)
            updates.append(Update(client_id=c, flat=layout.flatten(t.get_parameters()), num_examples=res.num_examples,
                                  metrics=res.metrics))
            for name, value in res.metrics.items():
                metrics_log.write(json.dumps({"round": rnd, "client": c, "name": name, "value": value}) + "\n")
        strategy.aggregate(rnd, updates)
        strategy.version += 1
        print(f"  [{cfg.name}] round {rnd + 1}/{cfg.rounds} ({time.monotonic() - t0:.0f} s)", flush=True)
    results = {}
    for c, t in enumerate(tasks):
        t.set_parameters({k: np.array(v) for k, v in layout.unflatten(strategy.final_model_for(c)).items()})
        results[str(c)] = t.evaluate(cfg.rounds, final=True)
        t.export_embeddings(out)
    metrics_log.close()
    names = sorted({k for r in results.values() for k in r})
    mean = {k: float(np.mean([r[k] for r in results.values() if k in r])) for k in names}
    summary = {**mean, "mean": mean, "clients": results, "rounds": cfg.rounds, "wall_time_s": time.monotonic() - t0,
               "launcher": "inprocess", "config": cfg.to_dict(), "config_hash": cfg.hash()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def run_mpi(config: str, overrides: list[str], num_clients: int, out: Path) -> dict:
    """Run one federation under mpiexec (K clients + server) and return its summary."""
    cmd = [sys.executable, "-m", "hpcfed", "run", config, *overrides, "--np", str(num_clients + 1), "--out", str(out),
           "--force"]
    print("  $", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    return json.loads((out / "summary.json").read_text())


# -- scoring ------------------------------------------------------------------------------------------------
def score(central: Path, fed: Path, *, mode: str, k: int = 10, entity: str | None = None,
          max_queries: int | None = None, seed: int = 0, mappers_dir: Path | None = None,
          write_summary: bool = True, merge: str = "score") -> dict:
    """sim_k and label precision@k of `fed`'s global search against `central` (one site with every id).

    `merge` = score (spec §4.4), interleave (rank by rank, home first) or zscore (by standardized
    scores); the result is stored in ``summary.json`` under ``sim_k[mode]`` (score) or
    ``sim_k[mode + "_" + merge]``.
    """
    central_search = GlobalSearch.from_folder(central, entity=entity, exact=True)  # the reference: no index
    if len(central_search.indexes) != 1:
        raise ValueError(f"{central}: the centralized run must have exactly one site, "
                         f"found {len(central_search.indexes)}")
    cidx = next(iter(central_search.indexes.values()))
    fed_search = GlobalSearch.from_folder(fed, entity=entity, mode=mode, mappers_dir=mappers_dir, merge=merge,
                                          exact=True)
    central_lists, fed_lists, labels, fed_labels, central_labels = [], [], [], [], []
    # Cross-site view: only the other sites' answers, against the central top-k among those sites'
    # documents. The merged sim_k mixes in the home site's own answers (the same space, no mapping
    # needed); this isolates what joint learning / a mapper contributes.
    x_central, x_fed, x_fed_labels, x_labels = [], [], [], []
    remote_share = []
    rng = np.random.default_rng(seed)
    for home, index in fed_search.indexes.items():
        ids = [i for i in index.ids if i in cidx.position]
        if max_queries is not None:
            share = max(1, max_queries // len(fed_search.indexes))
            if share < len(ids):
                ids = [ids[i] for i in sorted(rng.choice(len(ids), share, replace=False))]
        if not ids:
            continue
        fed_hits = fed_search.search(home, np.stack([index.vector_of(i) for i in ids]), k, ids)
        c_hits = cidx.hits(np.stack([cidx.vector_of(i) for i in ids]), k, ids)
        central_lists += [[h.id for h in r] for r in c_hits]
        fed_lists += [[h.id for h in r] for r in fed_hits]
        labels += [int(index.labels[index.position[i]]) for i in ids]
        fed_labels += [[h.label for h in r] for r in fed_hits]
        central_labels += [[h.label for h in r] for r in c_hits]
        remote_share += [sum(h.site != home for h in r) / max(len(r), 1) for r in fed_hits]
        others = [s for s in fed_search.indexes if s != home]
        if others:
            other_ids = [i for s in others for i in fed_search.indexes[s].ids if i in cidx.position]
            c_other = SiteIndex("central", other_ids, np.stack([cidx.vector_of(i) for i in other_ids]),
                                np.array([cidx.labels[cidx.position[i]] for i in other_ids]))
            qc = np.stack([cidx.vector_of(i) for i in ids])
            qf = np.stack([index.vector_of(i) for i in ids])
            per_site = [fed_search.indexes[s].hits(map_query(fed_search.mode, home, s, qf, fed_search.mappers), k,
                                                   standardize=merge in STANDARDIZED_MERGES)
                        for s in others]
            remote = [merge_results([lists[n] for lists in per_site], k, merge, home) for n in range(len(ids))]
            x_fed += [[h.id for h in r] for r in remote]
            x_fed_labels += [[h.label for h in r] for r in remote]
            x_central += [[h.id for h in r] for r in c_other.hits(qc, k)]
            x_labels += [int(index.labels[index.position[i]]) for i in ids]
    result = {f"sim_{k}": mean_sim_k(central_lists, fed_lists, k),
              f"label_precision_at_{k}": label_precision_at_k(labels, fed_labels, k),
              f"central_label_precision_at_{k}": label_precision_at_k(labels, central_labels, k),
              "num_queries": len(labels), "mode": mode, "merge": merge, "k": k,
              "remote_share_of_results": float(np.mean(remote_share)) if remote_share else float("nan")}
    if x_central:
        result[f"cross_site_sim_{k}"] = mean_sim_k(x_central, x_fed, k)
        result[f"cross_site_label_precision_at_{k}"] = label_precision_at_k(x_labels, x_fed_labels, k)
    if write_summary:
        path = fed / "summary.json"
        summary = json.loads(path.read_text()) if path.is_file() else {}
        name = mode if merge == "score" else f"{mode}_{merge}"
        key = "" if name == "joint" else f"_{name}"
        summary[f"sim_{k}{key}"] = result[f"sim_{k}"]
        summary[f"label_precision_at_{k}{key}"] = result[f"label_precision_at_{k}"]
        summary.setdefault("sim_k", {})[name] = result
        path.write_text(json.dumps(summary, indent=2, default=str))
    return result


# -- experiments -------------------------------------------------------------------------------------------------
def _runner(args: argparse.Namespace):
    run = run_mpi if args.launcher == "mpi" else run_inprocess

    def runner(config: str, overrides: list[str], num_clients: int, out: Path) -> dict:
        if args.reuse and (out / "summary.json").is_file():
            print(f"  reusing {out}", flush=True)
            return json.loads((out / "summary.json").read_text())
        return run(config, overrides, num_clients, out)

    return runner


def experiment_doc2vec(args: argparse.Namespace) -> dict:
    """20NG doc2vec: centralized, joint and mapping runs, each scored against the centralized."""
    runner = _runner(args)
    out = Path(args.out)
    ov = list(args.overrides)
    res: dict = {}
    timings = {}
    t = time.monotonic()
    runner("configs/seec_20ng_joint.yaml", [*ov, "method=centralized"], 1, out / "central")
    timings["central"] = time.monotonic() - t
    if "joint" in args.only:
        t = time.monotonic()
        runner("configs/seec_20ng_joint.yaml", [*ov, "method=joint"], args.sites, out / "joint")
        timings["joint"] = time.monotonic() - t
        res["joint"] = score(out / "central", out / "joint", mode="joint", k=args.k, max_queries=args.max_queries)
        print("joint:", res["joint"], flush=True)
    if "mapping" in args.only:
        from hpcfed.models.mapper import MapperConfig
        from hpcfed.search.mapping import train_mappers

        t = time.monotonic()
        runner("configs/seec_20ng_mapping.yaml", [*ov, "method=mapping"], args.sites, out / "mapping")
        mcfg = MapperConfig(lr=args.mapper_lr, epochs=args.mapper_epochs)
        res["mapper"] = train_mappers(out / "mapping", config=mcfg)
        timings["mapping"] = time.monotonic() - t
        for mode in ("mapping", "nomapping"):
            for merge in MERGES:
                name = mode if merge == "score" else f"{mode}_{merge}"
                res[name] = score(out / "central", out / "mapping", mode=mode, k=args.k, max_queries=args.max_queries,
                                  merge=merge)
                print(f"{name}:", res[name], flush=True)
    res["timings_s"] = timings
    return res


def experiment_node2vec(args: argparse.Namespace) -> dict:
    """Cora node2vec: centralized, then joint runs with and without cross-site edges, scored."""
    runner = _runner(args)
    out = Path(args.out)
    ov = list(args.overrides)
    res: dict = {}
    runner("configs/seec_cora_node2vec.yaml", [*ov, "method=centralized"], 1, out / "central")
    for name, retain in (("no_retention", "false"), ("retention", "true")):
        runner("configs/seec_cora_node2vec.yaml", [*ov, "method=joint", f"task.retain_cross_site={retain}"],
               args.sites, out / name)
        res[name] = score(out / "central", out / name, mode="joint", k=args.k, max_queries=args.max_queries)
        print(f"{name}:", res[name], flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    """Run a SEEC experiment (results.json in --out), or score one run against the centralized; exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("doc2vec", "node2vec"):
        e = sub.add_parser(name)
        e.add_argument("--out", required=True)
        e.add_argument("--launcher", choices=["inprocess", "mpi"], default="inprocess")
        e.add_argument("--sites", type=int, default=2)
        e.add_argument("--k", type=int, default=10)
        e.add_argument("--max-queries", type=int, default=None, help="score a random sample of documents")
        e.add_argument("--mapper-lr", type=float, default=1e-4, help="paper: 1e-5 (under-fits in 20 epochs)")
        e.add_argument("--mapper-epochs", type=int, default=20, help="paper: 20")
        e.add_argument("--reuse", action="store_true", help="keep runs whose summary.json exists")
        # choices: without them "--only joint task.x=1" would swallow the override as a phase name
        e.add_argument("--only", nargs="+", default=["joint", "mapping"], choices=["joint", "mapping"],
                       help="doc2vec: joint and/or mapping (put key=value overrides before --only)")
        e.add_argument("overrides", nargs="*", help="key=value overrides for every run, e.g. task.max_docs=3000")
    s = sub.add_parser("score")
    s.add_argument("--central", required=True)
    s.add_argument("--fed", required=True)
    s.add_argument("--mode", choices=["joint", "mapping", "nomapping"], default="joint")
    s.add_argument("--merge", choices=list(MERGES), default="score", help=MERGE_HELP)
    s.add_argument("--k", type=int, default=10)
    s.add_argument("--entity", default=None)
    s.add_argument("--mappers", default=None)
    s.add_argument("--max-queries", type=int, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HPCFED_DATA", str((REPO / ".." / "shared" / "data").resolve()))
    if args.cmd == "score":
        result = score(Path(args.central), Path(args.fed), mode=args.mode, k=args.k, entity=args.entity,
                       max_queries=args.max_queries, mappers_dir=Path(args.mappers) if args.mappers else None,
                       merge=args.merge)
        print(json.dumps(result, indent=2))
        return 0
    result = experiment_doc2vec(args) if args.cmd == "doc2vec" else experiment_node2vec(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results_path = Path(args.out) / "results.json"
    if results_path.is_file():  # runs of the same folder (e.g. --only joint, then --only mapping) accumulate
        result = {**json.loads(results_path.read_text()), **result}
    results_path.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "mapper"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
