"""``hpcfed status OUT``: a running federation's sites, rounds, traffic and privacy spend, live
(`hpcfed.ops.live_view`), and the same figures as a Prometheus endpoint (`hpcfed.ops.prometheus`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hpcfed.ops.live_view import watch

SUMMARY = "watch a run live; serve its figures to Prometheus"


def main(argv: list[str]) -> int:
    """`hpcfed status OUT [--once] [--interval S] [--metrics-port P [--metrics-host H --token-file F]]`."""
    parser = argparse.ArgumentParser(prog="hpcfed status", description=SUMMARY,
                                     epilog="It reads OUT/live.json, which rank 0 rewrites while the run lasts.")
    parser.add_argument("out", type=Path, help="the run's directory (hpcfed run --out)")
    parser.add_argument("--once", action="store_true", help="print one table and exit (no refreshing)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default 2)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="also serve the figures as a Prometheus text endpoint on this port (/metrics)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address to serve on (default 127.0.0.1; any other needs --token-file)")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="file holding a bearer token scrapers must send (Authorization: Bearer TOKEN)")
    parser.add_argument("--no-view", action="store_true",
                        help="with --metrics-port: only serve the endpoint, draw nothing (for a background service)")
    args = parser.parse_args(argv)
    if not args.interval > 0:
        parser.error(f"--interval must be > 0 seconds, got {args.interval}")
    if args.no_view and args.metrics_port is None:
        parser.error("--no-view needs --metrics-port (without either there is nothing to do)")
    if args.metrics_port is None:
        return watch(args.out, args.interval, args.once)
    from hpcfed.ops.prometheus import serve_metrics

    server = serve_metrics(args.out, args.metrics_port, args.metrics_host, args.token_file)
    print(f"serving Prometheus metrics at http://{args.metrics_host}:{server.server_port}/metrics "
          f"(until interrupted)", flush=True)
    try:
        if not args.no_view:
            watch(args.out, args.interval, args.once)
        while True:  # scrapers keep reading the newest figures (the last ones once the run has ended)
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()
        server.server_close()
