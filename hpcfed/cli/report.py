"""``hpcfed report DIR``: report.md and plots of a run's metrics (`hpcfed.report`)."""

from __future__ import annotations

import argparse
import json
import sys

from hpcfed import report

SUMMARY = "write report.md and plots from a run's metrics"


def main(argv: list[str]) -> int:
    """`hpcfed report DIR`: write report.md and the plots of a run; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed report", description=SUMMARY)
    p.add_argument("dir", help="run directory (the --out of `hpcfed run`) holding metrics.jsonl")
    p.add_argument("--out", default=None, help="where to write report.md and report/*.png (default: DIR)")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to OUT/tensorboard (needs `pip install tensorboard`)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    args = p.parse_args(argv)
    result = report.make_report(args.dir, out=args.out, tensorboard=args.tensorboard)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"wrote {result['report']} and {len(result['plots'])} plot(s)"
              + (f"; TensorBoard logs in {result['tensorboard']}" if "tensorboard" in result else ""))
        if result["skipped_lines"]:
            print(f"note: skipped {result['skipped_lines']} malformed line(s); see the report's last section",
                  file=sys.stderr)
    return 0
