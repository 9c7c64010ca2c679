"""``hpcfed eval RUN [--central RUN]``: the cross-site search figures of a run (`hpcfed.search.evaluate`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hpcfed.search.evaluate import auto_mode, score
from hpcfed.search.global_search import MODES
from hpcfed.search.index import MERGE_HELP, MERGES

SUMMARY = "score a run's cross-site search (precision, sim_k)"


def main(argv: list[str]) -> int:
    """`hpcfed eval RUN [--central RUN]`: print the cross-site figures as JSON; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed eval", description=SUMMARY,
                                epilog="Figures and their meaning: docs/seec.md")
    p.add_argument("run", help="run directory (RUN/embeddings/site<k>.h5) or a folder of site exports")
    p.add_argument("--central", default=None, help="a method=centralized run of the same documents: adds sim_k")
    p.add_argument("--mode", choices=["auto", *MODES], default="auto")
    p.add_argument("--merge", choices=list(MERGES), default="score", help=MERGE_HELP)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--entity", default=None, help="export entity (default: the first, e.g. doc)")
    p.add_argument("--mappers", default=None, help="folder of mappers (default RUN/mappers)")
    p.add_argument("--max-queries", type=int, default=None, help="score a seeded random sample of documents")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="do not add the figures to RUN/summary.json")
    args = p.parse_args(argv)
    run = Path(args.run)
    mappers = Path(args.mappers) if args.mappers else None
    mode = auto_mode(run, mappers, args.entity) if args.mode == "auto" else args.mode
    result = score(Path(args.central) if args.central else None, run, mode=mode, k=args.k, entity=args.entity,
                   max_queries=args.max_queries, seed=args.seed, mappers_dir=mappers,
                   write_summary=not args.no_write, merge=args.merge)
    print(json.dumps(result, indent=2))
    return 0
