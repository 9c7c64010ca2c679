"""``hpcfed search serve``: a long-lived HTTP JSON service over every site's index.

    hpcfed search serve RUN [--host 127.0.0.1] [--port 8765] [--token-file FILE] [--mode ...] [--merge ...]

    GET  /              the search page (`hpcfed.search.page`): a query box, filters, results by site
    GET  /health        {"status": "ok", "mode", "merge", "sites": [{"site", "count", "dim", "index"}]}
    GET  /openapi.json  an OpenAPI 3.0 description of these three endpoints
    POST /search        {"id": ID} | {"text": TEXT, "home": S} | {"vector": [d numbers], "home": S}
                        or {"queries": [those, ...]}; optional "k" (1..--max-k), "merge" and
                        "where" ({"site": "0", "label": [...], "time": "FROM..TO", ...}, filters.py)
                        -> {"queries": [answer, ...]}, answers as `hpcfed search query` prints them

The indexes (or, without one, the exports for exact search) are loaded once and kept in memory; the
service answers from many threads (FAISS searches release the GIL). It listens on 127.0.0.1 unless
told otherwise, and bound anywhere else it refuses to start without a bearer token (``--token-file``
or ``$HPCFED_SEARCH_TOKEN``; with one, every request must carry ``Authorization: Bearer TOKEN``).
Requests are bounded (body size, queries per request, k, text length, connections, a socket timeout)
and bad input gets a 4xx with ``{"error": "..."}`` saying what was wrong.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.comm.addresses import is_loopback
from hpcfed.search.batch import TextVectorizer, UnknownIdError, answer_ids, answer_texts, answer_vectors
from hpcfed.search.filters import FilterError, Where, parse_json
from hpcfed.search.global_search import GlobalSearch
from hpcfed.search.index import MERGES
from hpcfed.search.page import page_bytes

MAX_TEXT_CHARS = 20_000
PARALLEL_SEARCHES = 4  # requests parsed and searched at once (each may hold a 4 MiB body's objects)


class HttpError(Exception):
    """A request the service refuses: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class SearchService:
    """The state every request shares: the loaded search per merge, the text models, the limits."""

    def __init__(self, search: GlobalSearch, vectorize: TextVectorizer, *, token: str | None, max_k: int,
                 max_batch: int, max_body: int) -> None:
        self.searches = {m: GlobalSearch(search.indexes, search.mode, search.mappers, m, search.infos) for m in MERGES}
        self.default = search
        self.vectorize = vectorize
        self.token = token
        self.max_k, self.max_batch, self.max_body = max_k, max_batch, max_body

    def health(self) -> dict[str, Any]:
        sites = [{"site": s, "count": len(ix.ids), "dim": ix.dim, "index": getattr(ix, "kind", "exact")}
                 for s, ix in self.default.indexes.items()]
        return {"status": "ok", "mode": self.default.mode, "merge": self.default.merge, "sites": sites,
                "max_k": self.max_k, "max_batch": self.max_batch}

    def answer(self, body: object) -> dict[str, Any]:
        """Validate one /search request and answer it (`HttpError` on bad input)."""
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        k = body.get("k", 10)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.max_k:
            raise HttpError(400, f"k must be an integer from 1 to {self.max_k}")
        merge = body.get("merge", self.default.merge)
        if merge not in self.searches:
            raise HttpError(400, f"merge must be one of: {', '.join(MERGES)}")
        queries = body.get("queries", [body])
        if not isinstance(queries, list) or not queries:
            raise HttpError(400, "queries must be a non-empty list of query objects")
        if len(queries) > self.max_batch:
            raise HttpError(413, f"{len(queries)} queries in one request; at most {self.max_batch}")
        search = self.searches[merge]
        try:
            where = search.where(parse_json(body["where"])) if body.get("where") else None
        except FilterError as exc:
            raise HttpError(400, str(exc)) from None
        parsed = [self._query(q, i, search) for i, q in enumerate(queries)]
        return {"queries": self._search(search, parsed, k, where)}

    def _query(self, q: object, i: int, search: GlobalSearch) -> tuple[str, Any, str]:
        where = f"queries[{i}]"
        if not isinstance(q, dict):
            raise HttpError(400, f"{where} must be an object")
        given = [key for key in ("id", "text", "vector") if key in q]
        if len(given) != 1:
            raise HttpError(400, f"{where} needs exactly one of id, text, vector")
        key, value = given[0], q[given[0]]
        home = q.get("home", "0")
        if key != "id" and (not isinstance(home, str) or home not in search.indexes):
            raise HttpError(400, f"{where}.home must name a site: {', '.join(search.indexes)}")
        if key == "id":
            if not isinstance(value, str) or not value:
                raise HttpError(400, f"{where}.id must be a non-empty string")
            return key, value, ""
        if key == "text":
            if not isinstance(value, str) or not value.strip() or len(value) > MAX_TEXT_CHARS:
                raise HttpError(400, f"{where}.text must be a non-empty string of at most {MAX_TEXT_CHARS} characters")
            return key, value, home
        dim = search.indexes[home].dim
        if not isinstance(value, list) or len(value) != dim or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            raise HttpError(400, f"{where}.vector must be a list of {dim} numbers (site {home}'s dimension)")
        vector = np.asarray(value, np.float64)
        if not np.isfinite(vector).all() or np.abs(vector).max(initial=0.0) > 1e30:
            raise HttpError(400, f"{where}.vector must hold finite numbers")
        return key, vector.astype(np.float32), home

    def _search(self, search: GlobalSearch, parsed: list[tuple[str, Any, str]], k: int,
                where: Where | None) -> list[dict[str, Any]]:
        """Answer in batches (ids together, vectors and texts per home), then restore the request's order."""
        out: dict[int, dict[str, Any]] = {}
        ids = [(i, v) for i, (kind, v, _) in enumerate(parsed) if kind == "id"]
        if ids:
            try:
                answers = answer_ids(search, [v for _, v in ids], k, where)
            except UnknownIdError as exc:
                raise HttpError(404, str(exc)) from None
            out.update(zip((i for i, _ in ids), answers))
        for home in sorted({h for kind, _, h in parsed if kind != "id"}):
            texts = [(i, v) for i, (kind, v, h) in enumerate(parsed) if kind == "text" and h == home]
            if texts:
                try:
                    found = answer_texts(search, [v for _, v in texts], home, k, self.vectorize, where)
                except ValueError as exc:
                    raise HttpError(400, str(exc)) from None
                out.update(zip((i for i, _ in texts), found))
            vecs = [(i, v) for i, (kind, v, h) in enumerate(parsed) if kind == "vector" and h == home]
            if vecs:
                found = answer_vectors(search, np.stack([v for _, v in vecs]), home, k, where=where)
                out.update(zip((i for i, _ in vecs), found))
        return [out[i] for i in range(len(parsed))]


def openapi(service: SearchService) -> dict[str, Any]:
    """A small OpenAPI 3.0 description of the service."""
    from hpcfed import __version__

    schema = {"$ref": "#/components/schemas/Error"}
    error = {"description": "bad input", "content": {"application/json": {"schema": schema}}}
    ok = {"200": {"description": "ok"}}
    query = {"type": "object", "description": "exactly one of id, text (doc2vec sites), vector",
             "properties": {"id": {"type": "string"}, "text": {"type": "string", "maxLength": MAX_TEXT_CHARS},
                            "vector": {"type": "array", "items": {"type": "number"}},
                            "home": {"type": "string", "description": "site whose space a text/vector is in"}}}
    request = {"allOf": [query, {"type": "object", "properties": {
        "queries": {"type": "array", "items": query, "maxItems": service.max_batch},
        "k": {"type": "integer", "minimum": 1, "maximum": service.max_k, "default": 10},
        "merge": {"type": "string", "enum": list(MERGES)},
        "where": {"type": "object", "description": "filters: site, label, label_name, time (FROM..TO) or any "
                                                   "attribute the exports carry; a key's value or list of values"}}}]}
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "hpcfed search", "version": __version__},
        "paths": {
            "/": {"get": {"summary": "the search page (HTML)", "responses": ok}},
            "/health": {"get": {"summary": "sites, counts and index kinds", "responses": ok}},
            "/openapi.json": {"get": {"summary": "this document", "responses": ok}},
            "/search": {"post": {
                "summary": "top-k over every site, merged",
                "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                "responses": {"200": {"description": "{queries: [{query, home, mode, merge, results: "
                                                      "[{site, id, score, label}]}]}"},
                              "400": error, "401": error, "404": error, "411": error, "413": error}}}},
        "components": {"schemas": {"Error": {"type": "object", "properties": {"error": {"type": "string"}}}}},
    }
    if service.token:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


class Handler(BaseHTTPRequestHandler):
    """One connection: routes, bounds, token, JSON in and out."""

    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "hpcfed-search"
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

    def setup(self) -> None:
        """One FAISS thread per connection thread (OpenMP's setting is per thread): requests already run in
        parallel, and an OpenMP team per millisecond search waits a scheduler slice for each helper thread
        on a busy machine (measured: 58 ms instead of 4 ms per query)."""
        import faiss

        faiss.omp_set_num_threads(1)
        super().setup()

    def do_GET(self) -> None:
        if self.path in ("/", "/index.html"):  # the page holds no data: it asks /health and /search, with the token
            self._send(200, page_bytes(), "text/html; charset=utf-8")
            return
        self._handle(lambda: self._get())

    def do_POST(self) -> None:
        self._handle(lambda: self._post())

    def _get(self) -> dict[str, Any]:
        self._authorize()
        if self.path == "/health":
            return self.server.service.health()
        if self.path == "/openapi.json":
            return openapi(self.server.service)
        if self.path == "/search":
            raise HttpError(405, "use POST for /search")
        raise HttpError(404, f"no such path {self.path[:100]!r}; see /openapi.json")

    def _post(self) -> dict[str, Any]:
        self._authorize()
        if self.path != "/search":
            raise HttpError(405 if self.path in ("/health", "/openapi.json") else 404,
                            f"POST goes to /search, not {self.path[:100]!r}")
        length = self.headers.get("Content-Length")
        if length is None:
            raise HttpError(411, "a Content-Length header is required")
        if not length.isdigit():
            raise HttpError(400, "Content-Length must be a number")
        if int(length) > self.server.service.max_body:
            raise HttpError(413, f"request body of {int(length)} bytes; at most {self.server.service.max_body}")
        with self.server.busy:  # bodies parsed at once are bounded: memory is, whatever the connections
            raw = self.rfile.read(int(length))
            try:
                body = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                raise HttpError(400, "the request body is not valid JSON") from None
            return self.server.service.answer(body)

    def _authorize(self) -> None:
        token = self.server.service.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), token.encode())):
            raise HttpError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)")

    def _handle(self, route: Any) -> None:
        try:
            self._reply(200, route())
        except HttpError as exc:
            self.close_connection = self.close_connection or exc.status in (411, 413)  # body left unread
            self._reply(exc.status, {"error": str(exc)})
        except (ValueError, TimeoutError) as exc:  # a user error deeper in the search
            self._reply(400, {"error": str(exc)})
        except Exception as exc:  # the service stays up; the client learns it failed
            print(f"hpcfed search serve: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            self.close_connection = True
            self._reply(500, {"error": "internal error; see the service's log"})

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, (json.dumps(body) + "\n").encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Content-Type-Options", "nosniff")
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a search service logs failures, not every query."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: SearchService, max_connections: int,
                 timeout: float) -> None:
        self.service = service
        self.slots = threading.BoundedSemaphore(max(1, max_connections))
        self.busy = threading.BoundedSemaphore(PARALLEL_SEARCHES)
        self.request_timeout = timeout
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # too many at once: drop this one, keep serving the rest
            self.shutdown_request(request)
            return
        request.settimeout(self.request_timeout)
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            text = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--token-file {args.token_file}: {exc.strerror or exc}") from None
    else:
        text = os.environ.get("HPCFED_SEARCH_TOKEN", "").strip()
    if text and len(text) < 16:
        raise ValueError("the service token must be at least 16 characters (e.g. `openssl rand -hex 32`)")
    return text or None


def open_search(args: argparse.Namespace) -> tuple[GlobalSearch, Path]:
    """The search over RUN's exports as the command line's options ask (`query` and `serve` share
    them), and the run's folder (where its models and mappers are)."""
    run = Path(args.exports)
    base = run if (run / "embeddings").is_dir() else run.parent
    search = GlobalSearch.from_folder(run, entity=args.entity, mode=args.mode, merge=args.merge,
                                      mappers_dir=Path(args.mappers) if args.mappers else base / "mappers",
                                      exact=args.exact, nprobe=args.nprobe, ef_search=args.ef_search,
                                      force=args.force)
    return search, base


def serve(args: argparse.Namespace) -> int:
    """Load every site's index, listen, answer until SIGTERM or Ctrl-C."""
    token = _token(args)
    if not is_loopback(args.host) and token is None:
        raise ValueError(f"serving on {args.host} (not this machine only) needs a token: --token-file FILE or "
                         f"$HPCFED_SEARCH_TOKEN")
    for name in ("max_k", "max_batch", "max_body_kib", "max_connections"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    search, base = open_search(args)
    models = Path(args.models) if args.models else base / "models"
    service = SearchService(search, TextVectorizer(models, args.infer_epochs),
                            token=token, max_k=args.max_k, max_batch=args.max_batch, max_body=args.max_body_kib << 10)
    try:
        server = _Server((args.host, args.port), service, args.max_connections, args.request_timeout)
    except OSError as exc:
        raise ValueError(f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc})") from None
    port = server.server_address[1]
    print(json.dumps({"listening": f"http://{args.host}:{port}", **service.health()}), flush=True)
    signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
