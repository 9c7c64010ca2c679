#!/usr/bin/env python
"""SEEC evaluation: sim_k of federated search against a centralized model, label precision@k.

    python tools/seec_eval.py doc2vec  --out runs/seec_eval [--launcher inprocess|mpi] [key=value ...]
    python tools/seec_eval.py node2vec --out runs/seec_eval_n2v [--launcher inprocess|mpi] [key=value ...]
    python tools/seec_eval.py score --central RUN --fed RUN [--mode joint|mapping|nomapping] [--k 10]
                                    (the same as the installed `hpcfed eval RUN --central RUN`)

``doc2vec`` runs, on 20 Newsgroups: the centralized model (one site, the union), joint learning
(2 sites), independent training + mappers (mapping and no-mapping), then scores each against the
centralized one with `hpcfed.search.evaluate.score` (the figures of ``hpcfed eval``: sim_k,
label precision@k, their cross-site views and the remote share; see docs/seec.md).
``node2vec`` runs Cora: centralized, joint without and with retention of cross-site edges.
Every score is written into that run's ``summary.json`` (``sim_10``, ``label_precision_at_10``)
and all of them into ``<out>/results.json``.

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

from hpcfed.search.evaluate import score  # noqa: E402
from hpcfed.search.index import MERGE_HELP, MERGES  # noqa: E402


# -- running federations ---------------------------------------------------------------------------------
def run_inprocess(config: str, overrides: list[str], num_clients: int, out: Path) -> dict:
    """The synchronous runtime's steps, in one process (no MPI, no encryption)."""
    from hpcfed.data.root import data_root
    from hpcfed.launch.parent import prepare_config
    from hpcfed.params import ParamLayout
    from hpcfed.registry import strategy_class, task_class
    from hpcfed.schema import build
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
