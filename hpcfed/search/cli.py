"""``hpcfed search``: cross-site semantic search over per-site HDF5 exports.

    hpcfed search query RUN (--id ID | --text TEXT [--home S]) [--mode joint|mapping|nomapping] [--k 10]
    mpiexec -n K+1 python -m hpcfed search live RUN (--id ID | --text TEXT [--home S]) [...]
    hpcfed search train-mappers RUN [--lr 1e-4] [--epochs 20] [--batch-size 64] [--hidden 1200] [--holdout 0.1]

RUN is a run directory (``RUN/embeddings/site<k>.h5``, ``RUN/models``, ``RUN/mappers``) or a folder
of ``site<k>.h5`` exports. Output is JSON: ``{"queries": [{"query", "home", "mode", "results":
[{"site", "id", "score", "label"}, ...]}]}``, results merged by score over all sites (``--merge
score``, spec §4.4), rank by rank, home site first (``--merge interleave``, the paper's Table III),
or by each site's standardized score (``--merge zscore``; the reported scores are then z-scores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hpcfed.search.index import MERGE_HELP, MERGES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcfed search", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    for name, help_text in (("query", "offline: every site's export in one folder"),
                            ("live", "over MPI: each rank serves its own export (run under mpiexec -n K+1)")):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("exports", help="run directory or folder of site<k>.h5 exports")
        q.add_argument("--id", action="append", default=[], help="query by the id of a document/node (repeatable)")
        q.add_argument("--text", action="append", default=[], help="query by new text (doc2vec; repeatable)")
        q.add_argument("--home", default="0", help="site that vectorises --text queries (default 0)")
        q.add_argument("--mode", choices=["joint", "mapping", "nomapping"], default="joint")
        q.add_argument("--k", type=int, default=10)
        q.add_argument("--merge", choices=list(MERGES), default="score", help=MERGE_HELP)
        q.add_argument("--entity", default=None, help="export entity (default: the first, e.g. doc or node)")
        q.add_argument("--models", default=None, help="folder of site<k>.h5 models (default RUN/models)")
        q.add_argument("--mappers", default=None, help="folder of mappers (default RUN/mappers)")
        q.add_argument("--compact", action="store_true", help="one-line JSON")
        if name == "live":
            q.add_argument("--config", default=None,
                           help="YAML whose security: section to use (default: psk from $HPCFED_PSK)")
            q.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any rank")
    t = sub.add_parser("train-mappers", help="fit m_{i->j} for every pair of sites of a method=mapping run")
    t.add_argument("exports")
    t.add_argument("--out", default=None, help="folder for the mappers (default RUN/mappers)")
    t.add_argument("--lr", type=float, default=1e-4,
                   help="Adam learning rate (paper: 1e-5, which under-fits in 20 epochs; "
                        "1e-4 is best on held-out public vectors)")
    t.add_argument("--epochs", type=int, default=20)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--hidden", type=int, default=1200)
    t.add_argument("--dropout", type=float, default=0.2)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--holdout", type=float, default=0.0,
                   help="share of the public documents kept out of training to report held-out mean cosine "
                        "(for choosing --lr/--epochs; the stored mappers then saw only the rest)")
    return p


def main(argv: list[str]) -> int:
    """`hpcfed search query|live|train-mappers ...`: print the results as JSON; exit status."""
    args = _parser().parse_args(argv)
    if args.action == "train-mappers":
        from hpcfed.models.mapper import MapperConfig
        from hpcfed.search.mapping import train_mappers

        cfg = MapperConfig(hidden=args.hidden, dropout=args.dropout, lr=args.lr, epochs=args.epochs,
                           batch_size=args.batch_size, seed=args.seed)
        report = train_mappers(args.exports, args.out, cfg, holdout=args.holdout)
        print(json.dumps({"mappers": report}, indent=2))
        return 0
    if args.k < 1:
        raise ValueError(f"--k must be >= 1, got {args.k}")
    if not args.id and not args.text:
        raise ValueError("give a query: --id ID or --text TEXT")
    if args.action == "live":
        from hpcfed.search.live import run_live

        return run_live(args)
    return _offline(args)


def _offline(args: argparse.Namespace) -> int:
    from hpcfed.search.global_search import GlobalSearch

    run = Path(args.exports)
    base = run if (run / "embeddings").is_dir() else run.parent
    search = GlobalSearch.from_folder(run, entity=args.entity, mode=args.mode, merge=args.merge,
                                      mappers_dir=Path(args.mappers) if args.mappers else base / "mappers")
    out = []
    for doc_id in args.id:
        home = search.home_of(doc_id)
        hits = search.search_id(doc_id, args.k)
        out.append({"query": {"id": doc_id}, "home": home, "mode": args.mode, "merge": args.merge,
                    "results": [h.as_dict() for h in hits]})
    for text in args.text:
        from hpcfed.data.corpus import tokenize
        from hpcfed.models.doc2vec import infer, load_model

        home = str(args.home)
        if home not in search.indexes:
            raise ValueError(f"--home {home}: no such site (sites: {', '.join(search.indexes)})")
        models = Path(args.models) if args.models else base / "models"
        model, settings = load_model(models / f"site{home}.h5")
        v = infer(model, tokenize(text), settings)
        hits = search.search(home, v[None], args.k)[0]
        out.append({"query": {"text": text, "home": home}, "home": home, "mode": args.mode, "merge": args.merge,
                    "results": [h.as_dict() for h in hits]})
    print(json.dumps({"queries": out, "sites": len(search.indexes)}, indent=None if args.compact else 2))
    return 0
