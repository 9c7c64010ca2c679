"""``hpcfed data import-messages``: validate a message table and write it in the documented format.

    hpcfed data import-messages INPUT [--format csv|tsv|jsonl|parquet] --out OUT.parquet|OUT.jsonl [--skip-bad]

Without ``--skip-bad`` the first bad row stops the import with a message naming the file, row and
field; with it, bad rows are skipped, counted and listed (the first 20) on stderr. The output can be
named in ``task.sites`` of an ``events`` config. Built-in datasets can be exported the same way:
``INPUT`` may be ``crisislext26``, ``crisislext6`` or ``arabic`` (read from the data root).
"""

from __future__ import annotations

import argparse
import sys

from hpcfed.data.messages import LOADERS, load_site, read_messages, write_messages
from hpcfed.data.root import DataError


def main(argv: list[str]) -> int:
    """`hpcfed data import-messages INPUT --out FILE`: check messages, write Parquet or JSONL; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed data import-messages",
                                description="Validate social messages (id, text, time, event, user, mentions, "
                                            "hashtags, entities) and write Parquet or JSONL.")
    p.add_argument("input", help="CSV/TSV/JSONL/Parquet file, or a built-in dataset: " + ", ".join(LOADERS))
    p.add_argument("--out", required=True, help="output file, .parquet or .jsonl")
    p.add_argument("--format", choices=["csv", "tsv", "jsonl", "parquet"], default=None,
                   help="input format (default: from the file suffix)")
    p.add_argument("--skip-bad", action="store_true", help="skip and count bad rows instead of stopping")
    p.add_argument("--data-root", default=None, help="data root for built-in datasets (default $HPCFED_DATA)")
    args = p.parse_args(argv)
    if not args.out.endswith((".parquet", ".jsonl")):
        raise DataError(f"--out {args.out}: write a .parquet or .jsonl file")
    if args.input in LOADERS:
        messages, report = load_site(args.input, args.data_root)
    else:
        messages, report = read_messages(args.input, fmt=args.format,
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
