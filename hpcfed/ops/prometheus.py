"""The live view's figures as a Prometheus text endpoint (`hpcfed status OUT --metrics-port P`).

Built on prometheus_client: a collector reads OUT/live.json (and the sites' ε from metrics.jsonl)
at each scrape, so the endpoint always shows the newest snapshot and holds no state of its own.
It listens on 127.0.0.1 unless a bearer token is given (`--token-file`): HPC centres scrape from a
monitoring host, and an endpoint on a shared node must not tell every user of the node who takes
part in a federation. Metrics (labels: ``run``, and ``site`` per site):

- ``hpcfed_up`` 1 while the run is running or setting up, 0 once it has ended
- ``hpcfed_progress_done`` / ``hpcfed_progress_total`` rounds (or accepted async updates)
- ``hpcfed_model_version``, ``hpcfed_next_checkpoint`` (-1: none due)
- ``hpcfed_sites{state}`` how many sites are present, late, rejoining, dropped, evicted, excluded
- ``hpcfed_site_up{site}`` 1 for a present site; ``hpcfed_site_last_round{site}``;
  ``hpcfed_site_last_heard_seconds{site}``; ``hpcfed_site_bytes_received_total{site}`` and
  ``hpcfed_site_bytes_sent_total{site}`` (rank 0's message bytes from and to it);
  ``hpcfed_site_epsilon{site}`` (record-level DP spend, when reported)
- ``hpcfed_server_bytes_received_total``, ``..._sent_total``, ``hpcfed_server_updates_accepted_total``,
  ``hpcfed_server_rejected_messages_total``, ``hpcfed_server_peak_rss_bytes``
- ``hpcfed_snapshot_age_seconds`` how old the snapshot is (a stalled rank 0 shows here)
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hpcfed.comm.addresses import is_loopback
from hpcfed.ops.live_view import LiveStatusError, read_live, site_epsilons

STATES = ("present", "late", "rejoining", "dropped", "evicted", "excluded")


class LiveCollector:
    """A prometheus_client collector over one run directory's live status."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def collect(self) -> Iterator[Metric]:
        try:
            snap = read_live(self.out_dir)
        except LiveStatusError:
            up = GaugeMetricFamily("hpcfed_up", "1 while the federation runs, 0 once it ended (or before it "
                                   "wrote its status)", labels=["run"])
            up.add_metric([""], 0)
            yield up
            return
        yield from _run_metrics(snap)
        yield from _site_metrics(snap, site_epsilons(self.out_dir))


def _number(value: object, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _run_metrics(snap: dict[str, Any]) -> Iterator[Metric]:
    run = str(snap.get("run", ""))
    progress, server = snap.get("progress") or {}, snap.get("server") or {}

    def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
        metric = GaugeMetricFamily(name, text, labels=["run"])
        metric.add_metric([run], value)
        return metric

    def counter(name: str, text: str, value: float) -> CounterMetricFamily:
        metric = CounterMetricFamily(name, text, labels=["run"])
        metric.add_metric([run], value)
        return metric

    yield gauge("hpcfed_up", "1 while the federation runs, 0 once it ended",
                1.0 if snap.get("status") in ("running", "setting up") else 0.0)
    yield gauge("hpcfed_progress_done", "rounds (async: accepted updates) done", _number(progress.get("done")))
    yield gauge("hpcfed_progress_total", "rounds (async: accepted updates) in the run", _number(progress.get("total")))
    yield gauge("hpcfed_model_version", "the server's model version", _number(snap.get("version")))
    yield gauge("hpcfed_next_checkpoint", "round (async: accepted updates) of the next checkpoint; -1 none due",
                _number(snap.get("next_checkpoint"), -1.0))
    yield gauge("hpcfed_snapshot_age_seconds", "seconds since rank 0 wrote the status",
                max(0.0, time.time() - _number(snap.get("time"), time.time())))
    yield counter("hpcfed_server_bytes_received", "frame bytes rank 0 received", _number(server.get("bytes_in")))
    yield counter("hpcfed_server_bytes_sent", "frame bytes rank 0 sent", _number(server.get("bytes_out")))
    yield counter("hpcfed_server_updates_accepted", "uploads folded into the model",
                  _number(server.get("updates_accepted")))
    yield counter("hpcfed_server_rejected_messages", "messages rank 0 refused", _number(server.get("rejected")))
    yield gauge("hpcfed_server_peak_rss_bytes", "rank 0's peak resident memory", _number(server.get("peak_rss_bytes")))


def _site_metrics(snap: dict[str, Any], epsilons: dict[int, float]) -> Iterator[Metric]:
    run = str(snap.get("run", ""))
    sites = [s for s in snap["sites"] if isinstance(s, dict)]
    states = GaugeMetricFamily("hpcfed_sites", "sites in each state", labels=["run", "state"])
    for state in STATES:
        states.add_metric([run, state], sum(1 for s in sites if s.get("state") == state))
    yield states
    per_site: list[tuple[str, str, type, Callable[[dict[str, Any]], float | None]]] = [
        ("hpcfed_site_up", "1 for a site taking part now", GaugeMetricFamily,
         lambda s: 1.0 if s.get("state") == "present" else 0.0),
        ("hpcfed_site_last_round", "the newest round the site uploaded for", GaugeMetricFamily,
         lambda s: None if s.get("last_round") is None else _number(s.get("last_round"))),
        ("hpcfed_site_last_heard_seconds", "seconds since rank 0 last heard from the site", GaugeMetricFamily,
         lambda s: None if s.get("last_heard_s") is None else _number(s.get("last_heard_s"))),
        ("hpcfed_site_bytes_received", "message bytes rank 0 received from the site", CounterMetricFamily,
         lambda s: _number(s.get("bytes_in"))),
        ("hpcfed_site_bytes_sent", "message bytes rank 0 sent to the site", CounterMetricFamily,
         lambda s: _number(s.get("bytes_out"))),
        ("hpcfed_site_epsilon", "the site's record-level DP spend", GaugeMetricFamily,
         lambda s: epsilons.get(s.get("client"))),  # type: ignore[arg-type]  # a non-int id finds none
    ]
    for name, text, family, value_of in per_site:
        metric = family(name, text, labels=["run", "site"])
        for site in sites:
            value = value_of(site)
            if value is not None:
                metric.add_metric([run, str(site.get("client"))], value)
        yield metric


def _with_token(app: Callable[..., Iterable[bytes]], token: str) -> Callable[..., Iterable[bytes]]:
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required (Authorization: Bearer TOKEN)\n"]
        return app(environ, start_response)

    return guarded


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the operator's terminal


def serve_metrics(out_dir: Path, port: int, host: str = "127.0.0.1", token_file: Path | None = None) -> WSGIServer:
    """Serve /metrics for the run in `out_dir` from a daemon thread; returns the server (its
    `server_port` is the port bound, useful with `port` 0)."""
    token = None
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--token-file {token_file}: cannot read it ({exc.strerror})") from None
        if len(token) < 16:
            raise ValueError(f"--token-file {token_file}: the token is {len(token)} characters; use at least 16 "
                             f"(e.g. python3 -c 'import secrets; print(secrets.token_hex(16))' > FILE)")
    if token is None and not is_loopback(host):
        raise ValueError(f"--metrics-host {host} would let anyone who reaches it read the run's status: give "
                         f"--token-file FILE (scrapers send Authorization: Bearer TOKEN), or serve on 127.0.0.1")
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port must be in 0..65535, got {port}")
    registry = CollectorRegistry(auto_describe=True)
    registry.register(LiveCollector(Path(out_dir)))
    app = make_wsgi_app(registry)
    server = make_server(host, port, app if token is None else _with_token(app, token), handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="hpcfed-metrics", daemon=True).start()
    return server
