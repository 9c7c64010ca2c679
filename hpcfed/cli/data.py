"""``hpcfed data verify|fetch|import-docs|import-hin|import-messages ...``: the dataset tools.

    hpcfed data verify [NAME ...] [--root DIR] [--allow-missing]    (`hpcfed.data.manifest`)
    hpcfed data fetch NAME [--root DIR]
    hpcfed data import-docs INPUT|--texts F --labels F --out corpus.jsonl  (`hpcfed.data.docs_import`)
    hpcfed data import-hin DIR --out graph.npz ...                  (`hpcfed.data.hin_import`)
    hpcfed data import-messages INPUT --out OUT.parquet ...         (`hpcfed.data.messages_import`)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

SUMMARY = "datasets: verify, fetch, import documents, graphs, messages"


def main(argv: list[str]) -> int:
    """`hpcfed data ACTION ...`: run the dataset tool ACTION; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed data", description=SUMMARY)
    p.add_argument("action", choices=sorted(ACTIONS))
    p.add_argument("args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv[:1])
    return ACTIONS[args.action](argv[1:])


def verify_main(argv: list[str]) -> int:
    """`hpcfed data verify [NAMES]`: compare local datasets with the manifest's digests; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed data verify",
                                description="check local datasets against data_manifest.yaml")
    p.add_argument("names", nargs="*")
    p.add_argument("--root", default=None, help="data root (default $HPCFED_DATA, else ~/.cache/hpcfed/data)")
    p.add_argument("--allow-missing", action="store_true",
                   help="exit 0 when datasets are missing (those present must still verify)")
    args = p.parse_args(argv)
    from hpcfed.data.manifest import verify
    from hpcfed.data.root import data_root

    root = data_root(args.root)
    print(f"data root: {root} ({_root_origin(args.root)})")
    result = verify(args.names or None, root)
    for name, status in result.items():
        print(f"{name:16s} {status}")
    missing = [n for n, s in result.items() if s == "missing"]
    bad = [n for n, s in result.items() if s not in ("ok", "missing")]
    if missing:
        print(f"{len(missing)} of {len(result)} datasets missing under {root}: set HPCFED_DATA (or --root, or "
              f"data_root in a config) to the folder that holds them; sources: data_manifest.yaml, "
              f"`hpcfed data fetch NAME`", file=sys.stderr)
    if bad:
        print(f"{len(bad)} dataset(s) do not match data_manifest.yaml ({', '.join(bad)}): a partial or altered "
              f"copy; fetch it again", file=sys.stderr)
    return 1 if bad or (missing and not args.allow_missing) else 0


def _root_origin(explicit: str | None) -> str:
    if explicit:
        return "--root"
    if os.environ.get("HPCFED_DATA"):
        return "from $HPCFED_DATA"
    return "the default; set HPCFED_DATA to use another folder"


def fetch_main(argv: list[str]) -> int:
    """`hpcfed data fetch NAME`: download a dataset, then verify it; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed data fetch", description="download a dataset into the data root")
    p.add_argument("name")
    p.add_argument("--root", default=None)
    args = p.parse_args(argv)
    from hpcfed.data.manifest import fetch

    folder = fetch(args.name, Path(args.root) if args.root else None)
    print(f"fetched {args.name} into {folder}", file=sys.stderr)
    return verify_main([args.name] + (["--root", args.root] if args.root else []))


def import_hin_main(argv: list[str]) -> int:
    """`hpcfed data import-hin FOLDER --out FILE`: check the CSV tables, write the HIN file; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed data import-hin",
                                description="Validate a HIN given as CSV tables and write the project's HIN file.")
    p.add_argument("folder", help="folder with nodes_<T>.csv, edges_<XY>.csv, labels.csv [features.csv, splits.csv] "
                                  "(or .tsv), or a HeCo-layout folder (xy.txt, labels.npy)")
    p.add_argument("--out", required=True, help="output .npz (use it as task.dataset)")
    p.add_argument("--target", default=None, help="labelled node type letter (default: inferred from labels.csv)")
    p.add_argument("--metapaths", default=None, help="comma-separated, e.g. PAP,PSP (default: T?T per relation of T)")
    p.add_argument("--columns", default=None, help="the files' names for id, src, dst, label, split, "
                                                  "e.g. id=node_id,label=class")
    p.add_argument("--train-fraction", type=float, default=0.3)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from hpcfed.data.columns import parse_columns
    from hpcfed.data.heco import is_heco_folder, read_heco_folder
    from hpcfed.data.hin import metapath_instances, save_hin, stratified_split
    from hpcfed.data.hin_import import COLUMNS, read_hin_folder
    from hpcfed.data.root import DataError

    if not args.out.endswith(".npz"):
        raise DataError(f"--out {args.out}: the HIN file must end in .npz")
    metapaths = args.metapaths.split(",") if args.metapaths else None
    if is_heco_folder(args.folder):
        if args.columns:
            raise DataError(f"--columns: {args.folder} is a HeCo-layout folder (xy.txt, labels.npy), which has no "
                            f"named columns; leave --columns out")
        hin = read_heco_folder(args.folder, target=args.target, metapaths=metapaths)
        if not hin.splits:
            hin.splits = stratified_split(hin.labels, args.train_fraction, args.val_fraction, args.seed)
    else:
        hin = read_hin_folder(args.folder, target=args.target, metapaths=metapaths,
                              train_fraction=args.train_fraction, val_fraction=args.val_fraction, seed=args.seed,
                              columns=parse_columns(args.columns, COLUMNS))
    path = save_hin(hin, args.out)
    counts = ", ".join(f"{t}={c}" for t, c in sorted(hin.counts.items()))
    print(f"wrote {path}: nodes {counts}; relations "
          + ", ".join(f"{k}={len(v)}" for k, v in sorted(hin.relations.items()))
          + f"; {int((hin.labels >= 0).sum())} labelled {hin.target} nodes in {hin.num_classes} classes; splits "
          + ", ".join(f"{k}={len(v)}" for k, v in sorted(hin.splits.items()))
          + "; meta-path instances " + ", ".join(f"{mp}={metapath_instances(hin, mp)}" for mp in hin.metapaths))
    return 0


def import_messages_main(argv: list[str]) -> int:
    """`hpcfed data import-messages INPUT --out FILE`: check messages, write Parquet or JSONL; exit status."""
    from hpcfed.data.message_datasets import LOADERS
    from hpcfed.data.messages_import import EVENT_FROM, read_input

    p = argparse.ArgumentParser(prog="hpcfed data import-messages",
                                description="Validate social messages (id, text, time, event, user, mentions, "
                                            "hashtags, entities) and write Parquet or JSONL.")
    p.add_argument("input", help="CSV/TSV/JSONL/Parquet file, a folder with --event-from, or a built-in dataset: "
                                 + ", ".join(LOADERS))
    p.add_argument("--out", required=True, help="output file, .parquet or .jsonl")
    p.add_argument("--format", choices=["csv", "tsv", "jsonl", "parquet"], default=None,
                   help="input format (default: from the file suffix)")
    p.add_argument("--columns", default=None,
                   help="the file's names for our columns, e.g. id=tweet_id,text=tweet_text,event=disaster")
    p.add_argument("--time-from-id", choices=["snowflake"], default=None,
                   help="read each message's time from its Twitter (snowflake) id; no time column needed")
    p.add_argument("--event-from", choices=EVENT_FROM, default=None,
                   help="INPUT is a folder: the event is the sub-folder's name (folder) or the file's name (file)")
    p.add_argument("--skip-bad", action="store_true", help="skip and count bad rows instead of stopping")
    p.add_argument("--data-root", default=None, help="data root for built-in datasets (default $HPCFED_DATA)")
    args = p.parse_args(argv)
    from hpcfed.data.columns import parse_columns
    from hpcfed.data.message_datasets import load_site
    from hpcfed.data.messages import COLUMNS, write_messages
    from hpcfed.data.root import DataError

    if not args.out.endswith((".parquet", ".jsonl")):
        raise DataError(f"--out {args.out}: write a .parquet or .jsonl file")
    columns = parse_columns(args.columns, COLUMNS)
    if args.input in LOADERS:
        messages, report = load_site(args.input, args.data_root)
    else:
        messages, report = read_input(Path(args.input), fmt=args.format, columns=columns,
                                      time_from_id=args.time_from_id == "snowflake", event_from=args.event_from,
                                      on_error="skip" if args.skip_bad else "raise")
    if len(messages) == 0:
        raise DataError(f"{args.input}: no usable rows ({report.summary()})")
    write_messages(messages, args.out)
    for line in report.skipped[:20]:
        print(f"skipped: {line}", file=sys.stderr)
    if report.num_skipped > 20:
        print(f"skipped: ... and {report.num_skipped - 20} more", file=sys.stderr)
    print(f"{report.summary()}; {len(set(messages.events))} events -> {args.out}")
    return 0


def import_docs_main(argv: list[str]) -> int:
    """`hpcfed data import-docs`: check documents and labels, write the corpus JSONL; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed data import-docs",
                                description="Documents (text and optional id and label) from a table or two "
                                            "parallel files into the corpus file task.dataset=file reads.",
                                epilog="Format and examples: docs/seec.md (Files)")
    p.add_argument("input", nargs="?", default=None,
                   help="CSV/TSV/JSONL/Parquet table, or 20newsgroups[:train|test|all] (from the data root)")
    p.add_argument("--texts", type=Path, default=None, help="texts file (a table, or one document per line)")
    p.add_argument("--labels", type=Path, default=None,
                   help="labels file parallel to --texts (a table, or one label per line)")
    p.add_argument("--out", type=Path, required=True, help="output corpus file, .jsonl")
    p.add_argument("--format", choices=["csv", "tsv", "jsonl", "parquet"], default=None,
                   help="table format (default: from the file suffix)")
    p.add_argument("--columns", default=None, help="the file's names for ours, e.g. id=doc_id,text=body,label=topic")
    p.add_argument("--skip-bad", action="store_true", help="skip and count bad rows instead of stopping")
    p.add_argument("--data-root", default=None, help="data root for 20newsgroups (default $HPCFED_DATA)")
    args = p.parse_args(argv)
    from hpcfed.data.columns import parse_columns
    from hpcfed.data.docs_import import (
        COLUMNS,
        NEWSGROUPS_PREFIX,
        build_corpus,
        names_of,
        newsgroups_rows,
        parallel_rows,
        table_rows,
        write_corpus,
    )
    from hpcfed.data.root import DataError

    if args.out.suffix.lower() != ".jsonl":
        raise DataError(f"--out {args.out}: write a .jsonl file (the corpus format task.dataset=file reads)")
    if (args.input is None) == (args.texts is None):
        raise DataError("give either INPUT (one table) or --texts FILE --labels FILE (two parallel files)")
    if (args.texts is None) != (args.labels is None):
        raise DataError("--texts and --labels go together: one file of texts, one of labels in the same order")
    columns = parse_columns(args.columns, COLUMNS)
    on_error = "skip" if args.skip_bad else "raise"
    if args.texts is not None:
        rows, source = parallel_rows(args.texts, args.labels, args.format, columns, on_error), str(args.texts)
    elif args.input.split(":")[0] == NEWSGROUPS_PREFIX:
        rows, source = newsgroups_rows(args.input, args.data_root), args.input
    else:
        rows = table_rows(Path(args.input), args.format, *names_of(columns, COLUMNS), on_error)
        source = args.input
    corpus = build_corpus(rows, source, on_error)
    if not corpus.docs:
        raise DataError(f"{source}: no usable rows ({corpus.report.summary()})")
    write_corpus(corpus, args.out)
    for line in corpus.report.skipped[:20]:
        print(f"skipped: {line}", file=sys.stderr)
    if corpus.report.num_skipped > 20:
        print(f"skipped: ... and {corpus.report.num_skipped - 20} more", file=sys.stderr)
    print(f"{corpus.report.summary()}; {corpus.num_labels()} labels -> {args.out}")
    return 0


# `hpcfed data NAME ...` -> function(argv) -> exit status
ACTIONS: dict[str, Callable[[list[str]], int]] = {
    "verify": verify_main,
    "fetch": fetch_main,
    "import-docs": import_docs_main,
    "import-hin": import_hin_main,
    "import-messages": import_messages_main,
}
