"""``hpcfed search``: cross-site semantic search over per-site HDF5 exports.

    hpcfed search query RUN (--id ID | --text TEXT [--home S] | --ids-file F | --texts-file F)
                            [--mode auto|joint|mapping|nomapping] [--k 10] [--jsonl] [--exact] [--where KEY=VALUE]
    mpiexec -n K+1 python -m hpcfed search live RUN (--id ID | --text TEXT [--home S]) [...]
    hpcfed search index RUN [--kind auto|flat|ivf|hnsw] [--compress auto|none|int8|pq]
    hpcfed search serve RUN [--host 127.0.0.1] [--port 8765] [--token-file F]
    hpcfed search train-mappers RUN [--lr 1e-4] [--epochs 20] [--batch-size 64] [--hidden 1200] [--holdout 0.1]

RUN is a run directory (``RUN/embeddings/site<k>.h5``, ``RUN/models``, ``RUN/mappers``) or a folder
of ``site<k>.h5`` exports. Output is JSON: ``{"queries": [{"query", "home", "mode", "results":
[{"site", "id", "score", "label", "label_name"}, ...]}]}`` (``label_name`` where the export names
its labels: DAMe's events, a doc2vec corpus's classes), results merged by score over all sites (``--merge
score``, spec §4.4), rank by rank, home site first (``--merge interleave``, the paper's Table III),
or by each site's standardized score (``--merge zscore``; the reported scores are then z-scores).
``--jsonl`` prints one query's answer per line instead.

`query`, `live` and `serve` search a site through its index (``site<k>.<entity>.ann``, built by
``search index``, `hpcfed.search.ann`) when there is one, else exactly; ``--exact`` always searches
exactly (the reference, and fine for small exports).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcfed.search.ann_build import COMPRESSIONS, KINDS
from hpcfed.search.index import MERGE_HELP, MERGES

SUMMARY = "search the sites' exported vectors, or serve them"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcfed search", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    for name, help_text in (("query", "offline: every site's export in one folder"),
                            ("live", "over MPI: each rank serves its own export (run under mpiexec -n K+1)"),
                            ("serve", "a long-lived HTTP JSON service over every site's index")):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("exports", help="run directory or folder of site<k>.h5 exports")
        _search_options(q)
        if name != "serve":
            q.add_argument("--id", action="append", default=[], help="query by the id of a document/node (repeatable)")
            q.add_argument("--text", action="append", default=[],
                           help="query by new text (doc2vec; repeatable). Rough: a 25-word sentence found its "
                                "class in 1 of 8 answers on 20NG; prefer --id, use --infer-epochs 400 (docs/seec.md)")
            q.add_argument("--ids-file", default=None, help="file of ids to query, one per line")
            q.add_argument("--texts-file", default=None, help="file of texts to query, one per line (doc2vec)")
            q.add_argument("--home", default="0", help="site that vectorises --text queries (default 0)")
            q.add_argument("--k", type=int, default=10)
            q.add_argument("--compact", action="store_true", help="one-line JSON")
        if name == "query":
            q.add_argument("--jsonl", action="store_true", help="one JSON answer per line")
            q.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                           help="only documents with this attribute (repeatable): site=S, label=L, label_name=N, "
                                "time=FROM..TO, or any attribute the exports carry")
        if name == "live":
            q.add_argument("--config", default=None,
                           help="YAML whose security: section to use (default: psk from $HPCFED_PSK)")
            q.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any rank")
        if name == "serve":
            _serve_options(q)
    _index_parser(sub.add_parser("index", help="build or refresh each site's search index beside its export"))
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


def _search_options(q: argparse.ArgumentParser) -> None:
    q.add_argument("--mode", choices=["auto", "joint", "mapping", "nomapping"], default="auto",
                   help="auto (default): what the run was made for, as `hpcfed eval` picks it (docs/seec.md)")
    q.add_argument("--merge", choices=list(MERGES), default="score", help=MERGE_HELP)
    q.add_argument("--entity", default=None, help="export entity (default: the first, e.g. doc or node)")
    q.add_argument("--models", default=None, help="folder of site<k>.h5 models (default RUN/models)")
    q.add_argument("--mappers", default=None, help="folder of mappers (default RUN/mappers)")
    q.add_argument("--exact", action="store_true", help="search every export exactly, even where an index exists")
    q.add_argument("--nprobe", type=int, default=None, help="IVF cells searched per query (default: the index's)")
    q.add_argument("--ef-search", type=int, default=None, help="HNSW candidates per query (default: the index's)")
    q.add_argument("--force", action="store_true",
                   help="--mode joint even where the sites trained spaces of their own (DAMe, doc2vec mapping runs)")
    q.add_argument("--infer-epochs", type=int, default=None,
                   help="doc2vec inference epochs for --text queries (default: the model's; more steadies "
                        "short keyword queries, see docs/seec.md)")


def _serve_options(p: argparse.ArgumentParser) -> None:
    """The service's own options (the search options are shared with `query`)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one; the chosen one is printed)")
    p.add_argument("--token-file", default=None,
                   help="file holding the bearer token (default $HPCFED_SEARCH_TOKEN); required off localhost")
    p.add_argument("--max-k", type=int, default=100, help="largest k a request may ask")
    p.add_argument("--max-batch", type=int, default=1000, help="most queries in one request")
    p.add_argument("--max-body-kib", type=int, default=4096, help="largest request body, KiB")
    p.add_argument("--max-connections", type=int, default=64, help="connections served at once")
    p.add_argument("--request-timeout", type=float, default=30.0, help="seconds a client may take to send")


def _index_parser(x: argparse.ArgumentParser) -> None:
    x.add_argument("exports", help="run directory or folder of site<k>.h5 exports")
    x.add_argument("--entity", default=None, help="export entity (default: the first, e.g. doc or node)")
    x.add_argument("--kind", choices=list(KINDS), default="auto",
                   help="auto: flat up to 20,000 vectors, else ivf; hnsw: fastest queries, slowest build")
    x.add_argument("--compress", choices=list(COMPRESSIONS), default="auto",
                   help="auto: int8 for ivf/hnsw, none for flat; int8: 1 byte per dimension (SQ8); none: float32; "
                        "pq: d/8 bytes per vector (IVF-PQ), lower recall")
    x.add_argument("--nlist", type=int, default=0, help="IVF cells (default about 2*sqrt(n), a power of two)")
    x.add_argument("--nprobe", type=int, default=0,
                   help="IVF cells searched per query (default: the cells holding about 20,000 vectors, at least "
                        "64, raised at build until the index finds .97 of 200 of its own vectors' neighbours)")
    x.add_argument("--hnsw-m", type=int, default=32, help="HNSW links per vector")
    x.add_argument("--ef-construction", type=int, default=40)
    x.add_argument("--ef-search", type=int, default=0, help="HNSW candidates per query (default 64)")
    x.add_argument("--site", action="append", default=[], help="only this site (repeatable; default all)")
    x.add_argument("--read-mib", type=int, default=64, help="read the export this many MiB of vectors at a time")
    x.add_argument("--threads", type=int, default=0, help="FAISS threads (default: all cores)")
    x.add_argument("--force", action="store_true", help="rebuild even where the index is up to date")
    x.add_argument("--append", default=None, metavar="NEW_RUN",
                   help="add the vectors of NEW_RUN's exports to each site's existing index, without a rebuild")
    x.add_argument("--quiet", action="store_true", help="no progress bars")


def main(argv: list[str]) -> int:
    """`hpcfed search query|live|train-mappers ...`: print the results as JSON; exit status."""
    args = _parser().parse_args(argv)
    if args.action == "index":
        return _index(args)
    if getattr(args, "mode", None) == "auto":
        # mapping for a mapping run with mappers, nomapping for spaces of their own, else joint
        from hpcfed.search.evaluate import auto_mode

        args.mode = auto_mode(Path(args.exports), Path(args.mappers) if args.mappers else None, args.entity)
    if args.action == "serve":
        from hpcfed.search.service import serve

        return serve(args)
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
    if args.ids_file or args.texts_file:
        from hpcfed.search.batch import read_lines

        args.id += read_lines(args.ids_file, "id") if args.ids_file else []
        args.text += read_lines(args.texts_file, "text") if args.texts_file else []
    if not args.id and not args.text:
        raise ValueError("give a query: --id ID, --text TEXT, --ids-file FILE or --texts-file FILE")
    if args.action == "live":
        from hpcfed.search.live import run_live

        return run_live(args)
    return _offline(args)


def _offline(args: argparse.Namespace) -> int:
    from hpcfed.search.batch import TextVectorizer, answer_ids, answer_texts, write_answers
    from hpcfed.search.service import open_search

    search, base = open_search(args)
    where = search.where(args.where)
    answers = answer_ids(search, args.id, args.k, where)
    if args.text:
        vectorize = TextVectorizer(Path(args.models) if args.models else base / "models", args.infer_epochs)
        answers += answer_texts(search, args.text, str(args.home), args.k, vectorize, where)
    write_answers(sys.stdout, answers, len(search.indexes), jsonl=args.jsonl, compact=args.compact)
    return 0


def _index(args: argparse.Namespace) -> int:
    import faiss

    from hpcfed.search.ann_build import IndexSpec, build_index, index_is_current
    from hpcfed.search.global_search import site_exports

    if args.threads > 0:
        faiss.omp_set_num_threads(args.threads)
    if args.read_mib < 1:
        raise ValueError(f"--read-mib must be >= 1, got {args.read_mib}")
    if args.append:
        from hpcfed.search.append import append_run

        appended = append_run(args.exports, args.append, entity=args.entity, block_bytes=args.read_mib << 20)
        print(json.dumps({"indexes": appended}, indent=2))
        return 0
    spec = IndexSpec(kind=args.kind, compress=args.compress, nlist=args.nlist, nprobe=args.nprobe,
                     hnsw_m=args.hnsw_m, ef_construction=args.ef_construction, ef_search=args.ef_search)
    exports = site_exports(args.exports)
    unknown = [s for s in args.site if s not in exports]
    if unknown:
        raise ValueError(f"--site {unknown[0]}: no such site (sites: {', '.join(exports)})")
    report = []
    for site, path in exports.items():
        if args.site and site not in args.site:
            continue
        if not args.force and index_is_current(path, args.entity, spec):
            report.append({"site": site, "export": str(path), "status": "up to date"})
            continue
        built = build_index(path, entity=args.entity, spec=spec, site=site, block_bytes=args.read_mib << 20,
                            progress=not args.quiet)
        report.append({**built, "status": "built"})
    out: dict[str, object] = {"indexes": report}
    if any(r.get("export_verified") is False for r in report):
        out["hint"] = export_key_hint(Path(args.exports))
    print(json.dumps(out, indent=2))
    return 0


def export_key_hint(exports: Path) -> str:
    """What "export_verified": false means and how to verify: the key of the job that wrote the exports."""
    from hpcfed.credentials import job_key_path

    run = exports if (exports / "embeddings").is_dir() else exports.parent
    key = job_key_path(run)
    where = (f"; `hpcfed run --np` made this run's key: export HPCFED_STATE_KEY=$(cat {key})" if key.is_file()
             else "; a `hpcfed run --np` run without HPCFED_PSK keeps its key in ~/.hpcfed/keys/ (README: "
                  "Where the key lives)")
    return ("export_verified false: each export's checksum was checked, not its tag (who wrote it); set "
            "HPCFED_STATE_KEY to the PSK of the job that wrote the exports" + where)
