"""`hpcfed search serve` as a real process on the loopback interface, asked by a real HTTP client
(urllib): answers equal the CLI's, bad input gets a clear 4xx, and the service keeps serving."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from search_data import write_doc2vec_models, write_sites

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.usefixtures("own_keys")  # index keys in a temporary folder

TOKEN = "t0ken-for-the-tests-" + "x" * 12


class Service:
    """A running `hpcfed search serve` process and the URL it printed."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "hpcfed", "search", "serve", *args, "--port", "0"],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            first = lines.get(timeout=120)
        except queue.Empty:
            self.stop()
            raise AssertionError("the service printed no address within 120 s") from None
        if not first:
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"the service exited {self.proc.returncode}: {err[-2000:]}")
        self.url = json.loads(first)["listening"]

    def call(self, path: str, body: object = None, *, raw: bytes | None = None, token: str | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(self.url + path, data=data, headers=dict(headers or {}))
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def stop(self) -> int:
        """SIGTERM, then the exit code (the pipes read to the end and closed)."""
        self.proc.terminate()
        try:
            self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate(timeout=30)
        return self.proc.returncode


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, keys_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("serve")
    write_sites(out, [500, 400])
    write_doc2vec_models(out, 2)
    env = {"HPCFED_KEYS_DIR": str(keys_dir)}
    run_cli(["search", "index", str(out), "--kind", "ivf", "--nprobe", "64", "--quiet"], env=env)
    return out


@pytest.fixture(scope="module")
def service(run: Path, keys_dir: Path) -> Iterator[Service]:
    s = Service([str(run)], env={"HPCFED_KEYS_DIR": str(keys_dir)})
    yield s
    assert s.stop() == 0


def test_health_and_openapi(service: Service) -> None:
    status, health = service.call("/health")
    assert status == 200 and health["status"] == "ok"
    assert [(s["site"], s["count"], s["dim"]) for s in health["sites"]] == [("0", 500, 32), ("1", 400, 32)]
    assert all(s["index"].startswith("IVF") for s in health["sites"])
    status, doc = service.call("/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.") and set(doc["paths"]) == {"/", "/health",
                                                                                       "/openapi.json", "/search"}


def test_answers_equal_the_cli(service: Service, run: Path) -> None:
    for merge in ("score", "zscore", "interleave"):
        status, got = service.call("/search", {"id": "s1-7", "k": 5, "merge": merge})
        cli = json.loads(run_cli(["search", "query", str(run), "--id", "s1-7", "--k", "5", "--merge", merge]).stdout)
        assert status == 200 and got["queries"] == cli["queries"]
    status, got = service.call("/search", {"text": "flood near the river", "home": "1", "k": 3})
    cli = json.loads(run_cli(["search", "query", str(run), "--text", "flood near the river", "--home", "1",
                              "--k", "3"]).stdout)
    assert status == 200 and got["queries"] == cli["queries"]


def test_batch_of_ids_texts_and_vectors_keeps_the_order(service: Service) -> None:
    vector = np.linspace(-1, 1, 32).tolist()
    body = {"k": 4, "queries": [{"vector": vector, "home": "0"}, {"id": "s0-2"}, {"text": "storm", "home": "0"},
                                {"id": "s1-3"}]}
    status, got = service.call("/search", body)
    assert status == 200
    assert [q["home"] for q in got["queries"]] == ["0", "0", "0", "1"]
    assert [q["query"] for q in got["queries"]][1:] == [{"id": "s0-2"}, {"text": "storm", "home": "0"}, {"id": "s1-3"}]
    assert all(len(q["results"]) == 4 for q in got["queries"])
    _, alone = service.call("/search", {"vector": vector, "home": "0", "k": 4})
    assert alone["queries"][0]["results"] == got["queries"][0]["results"]


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b'{"id": "nope"}', 404, "'nope' is in none of the sites"),
    (b'{"id": "s0-1", "k": 0}', 400, "k must be an integer from 1 to 100"),
    (b'{"id": "s0-1", "k": 10000}', 400, "k must be an integer from 1 to 100"),
    (b'{"id": "s0-1", "k": true}', 400, "k must be an integer"),
    (b'{"id": "s0-1", "merge": "best"}', 400, "merge must be one of"),
    (b'{"vector": [1, 2, 3], "home": "0"}', 400, "list of 32 numbers"),
    (b'{"vector": [1e999], "home": "0"}', 400, "list of 32 numbers"),
    (b'{"text": "x", "home": "9"}', 400, "home must name a site"),
    (b'{"id": "s0-1", "text": "x"}', 400, "exactly one of id, text, vector"),
    (b'{"queries": []}', 400, "non-empty list"),
    (b'{"queries": [{"id": 5}]}', 400, "id must be a non-empty string"),
    (b'{"queries": [' + b'{"id": "s0-1"},' * 1000 + b'{"id": "s0-1"}]}', 413, "at most 1000"),
    (b"[" * 100_000, 400, "not valid JSON"),
])
def test_malformed_requests_get_a_clear_4xx(service: Service, body: bytes, status: int, message: str) -> None:
    got_status, got = service.call("/search", raw=body)
    assert got_status == status and message in got["error"]
    assert service.call("/health")[0] == 200  # and the service goes on


def test_bounds_on_the_request_itself(service: Service) -> None:
    status, got = service.call("/search", raw=b"{}", headers={"Content-Length": str(64 << 20)})
    assert status == 413 and "at most" in got["error"]
    status, got = service.call("/nowhere")
    assert status == 404 and "openapi" in got["error"]
    status, got = service.call("/search")
    assert status == 405
    vector = [0.5] * 32
    vector[0] = float("nan")
    status, got = service.call("/search", raw=json.dumps({"vector": vector, "home": "0"}).encode())
    assert status == 400 and "finite" in got["error"]


def test_token_is_required_when_set(run: Path, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    s = Service([str(run), "--token-file", str(tmp_path / "token")])
    try:
        assert s.call("/health")[0] == 401
        assert s.call("/search", {"id": "s0-1"}, token="wrong-token-of-enough-length")[0] == 401
        status, got = s.call("/search", {"id": "s0-1", "k": 2}, token=TOKEN)
        assert status == 200 and len(got["queries"][0]["results"]) == 2
    finally:
        assert s.stop() == 0


def test_refuses_to_listen_beyond_localhost_without_a_token(run: Path) -> None:
    proc = run_cli(["search", "serve", str(run), "--host", "0.0.0.0", "--port", "0"], check=False, timeout=120,
                   env={"HPCFED_SEARCH_TOKEN": ""})
    assert proc.returncode == 2 and "needs a token" in proc.stderr


def test_refuses_a_forged_index_at_start(run: Path, tmp_path: Path) -> None:
    import shutil

    forged = tmp_path / "run"
    shutil.copytree(run, forged)
    shutil.copyfile(forged / "embeddings" / "site1.doc.ann", forged / "embeddings" / "site0.doc.ann")
    proc = run_cli(["search", "serve", str(forged), "--port", "0"], check=False, timeout=120)
    assert proc.returncode == 2 and "site0.doc.ann holds 400 but the export site0.h5 has 500" in proc.stderr
