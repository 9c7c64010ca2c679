"""An operator's live view (issue 38, item 5): `hpcfed status OUT` against a live run, a real scrape
of its Prometheus endpoint during the run, the token rule, and bad status files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from ops_helpers import finish, start, wait_for
from prometheus_client.parser import text_string_to_metric_families

from hpcfed.ops.prometheus import serve_metrics
from hpcfed.server.live import LIVE_FILE

pytestmark = pytest.mark.mpi


def _live(out: Path) -> dict:
    try:
        return json.loads((out / LIVE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _scrape(url: str, token: str | None = None) -> dict[tuple[str, tuple], float]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_status_and_a_real_scrape_of_a_live_run(tmp_path: Path):
    out = tmp_path / "run"
    # site 0 trains 40x slower than it would: the run lasts long enough to be looked at, then is halted
    proc = start(out, ["rounds=400", "federation.slowdown={0: 40}", "checkpoint_every=0"])
    try:
        wait_for(lambda: (_live(out).get("progress") or {}).get("done", 0) >= 2, 180, "two rounds in live.json", proc)
        view = run_cli(["status", str(out), "--once"]).stdout
        assert view.count("present") == 2 and "rounds" in view and "sync fedavg" in view, view

        server = subprocess.Popen([sys.executable, "-m", "hpcfed", "status", str(out), "--metrics-port", "0",
                                   "--no-view"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = server.stdout.readline()  # type: ignore[union-attr]  # piped above
            assert "serving Prometheus metrics at http://127.0.0.1:" in line, line + server.stderr.read()  # type: ignore[union-attr]
            url = line.split(" at ", 1)[1].split()[0]
            metrics = _scrape(url)
            assert metrics[("hpcfed_up", ())] == 1
            assert metrics[("hpcfed_progress_done", ())] >= 2
            assert metrics[("hpcfed_progress_total", ())] == 400
            for site in ("0", "1"):
                assert metrics[("hpcfed_site_up", (("site", site),))] == 1
                assert metrics[("hpcfed_site_bytes_received_total", (("site", site),))] > 0
                assert metrics[("hpcfed_site_last_round", (("site", site),))] >= 1
            assert metrics[("hpcfed_sites", (("state", "present"),))] == 2
            assert metrics[("hpcfed_sites", (("state", "evicted"),))] == 0
        finally:
            server.terminate()
            server.communicate(timeout=30)  # waits, and closes the pipes
        (out / "HALT").touch()
        finish(proc, out, timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    final = _live(out)
    assert final["status"] == "ended"
    assert all(site["state"] == "present" for site in final["sites"])


def _fake_run(folder: Path) -> Path:
    folder.mkdir()
    snap = {"format": "hpcfed-live", "format_version": 1, "time": time.time(), "status": "running", "run": "r",
            "mode": "sync", "strategy": "fedavg", "progress": {"done": 3, "total": 8, "unit": "rounds", "eta_s": 5.0},
            "version": 4, "next_checkpoint": 3, "server": {"bytes_in": 10, "bytes_out": 20, "updates_accepted": 6},
            "sites": [{"client": 0, "rank": 1, "state": "present", "last_round": 2, "last_heard_s": 0.5,
                       "bytes_in": 5, "bytes_out": 10, "reason": ""},
                      {"client": 1, "rank": 2, "state": "evicted", "last_round": 1, "last_heard_s": 9.0,
                       "bytes_in": 5, "bytes_out": 10, "reason": "malformed update"}]}
    (folder / LIVE_FILE).write_text(json.dumps(snap))
    (folder / "metrics.jsonl").write_text(
        '{"round": 2, "client": 0, "name": "record_dp_epsilon", "value": 1.5, "time": 1.0}\n'
        '{"round": 2, "client": 1, "name": "record_dp_epsilon", "value": "NaN", "time": 1.0}\n')
    return folder


def test_the_endpoint_wants_the_token_when_one_is_set(tmp_path: Path):
    out = _fake_run(tmp_path / "run")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-0123456789\n")
    server = serve_metrics(out, 0, "127.0.0.1", token_file)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            _scrape(url)
        assert refused.value.code == 401
        refused.value.close()
        with pytest.raises(urllib.error.HTTPError) as wrong:
            _scrape(url, "wrong-token-0123456789")
        wrong.value.close()
        metrics = _scrape(url, "s3cret-token-0123456789")
    finally:
        server.shutdown()
        server.server_close()
    assert metrics[("hpcfed_sites", (("state", "evicted"),))] == 1
    assert metrics[("hpcfed_site_up", (("site", "1"),))] == 0
    assert metrics[("hpcfed_site_epsilon", (("site", "0"),))] == 1.5
    assert ("hpcfed_site_epsilon", (("site", "1"),)) not in metrics  # a non-finite value is not a figure


def test_an_open_address_needs_a_token(tmp_path: Path):
    out = _fake_run(tmp_path / "run")
    with pytest.raises(ValueError, match="--token-file"):
        serve_metrics(out, 0, "0.0.0.0")
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(ValueError, match="at least 16"):
        serve_metrics(out, 0, "127.0.0.1", short)


@pytest.mark.parametrize("content, expect", [
    (None, "does not exist"),
    ("{not json", "cannot read it as JSON"),
    ('{"format": "something-else", "sites": []}', "not an hpcfed live status file"),
    ("[1, 2, 3]", "not an hpcfed live status file"),
    ("oversize", "more than a live status file can be"),
], ids=["missing", "not-json", "other-format", "a-list", "oversize"])
def test_bad_status_files_get_one_line(tmp_path: Path, content: str | None, expect: str):
    out = tmp_path / "run"
    out.mkdir()
    if content is not None:
        (out / LIVE_FILE).write_text("x" * (5 << 20) if content == "oversize" else content)
    proc = run_cli(["status", str(out), "--once"], check=False)
    assert proc.returncode == 2
    assert expect in proc.stderr and str(out / LIVE_FILE) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_view_of_a_fake_run_names_the_eviction(tmp_path: Path):
    out = _fake_run(tmp_path / "run")
    view = run_cli(["status", str(out), "--once"], env={"COLUMNS": "160"}).stdout
    assert "evicted" in view and "malformed update" in view and "1.50" in view and "3/8 rounds" in view


@pytest.mark.parametrize("gaps, text", [
    ([[3, 7], [12, None]], "3→7, 12→"),
    ([[r, r + 1] for r in range(10)], "7 more, 7→8, 8→9, 9→10"),
    (None, "-"), ("3→7", "-"), ([], "-"),
    ([[3, 7], [True, 2], ["1", 2], [1], [1, 2, 3], [2**70, 1], [4, "x"], {"a": 1}], "3→7"),  # hostile: skipped
], ids=["open", "many", "none", "a-string", "empty", "hostile"])
def test_gaps_are_drawn_from_what_the_live_file_holds(gaps, text):
    from hpcfed.ops.live_view import gaps_text

    assert gaps_text(gaps) == text
