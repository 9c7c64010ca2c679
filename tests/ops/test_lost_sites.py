"""A lost or late site does not end the federation (issue 27).

With `federation.on_client_failure: continue` a client SIGKILLed mid-run is dropped at once (sync
and async): the others finish, summary.json names the dropped site with its round and cause, and
later checkpoints keep its last shard, so a `--resume` with the site back takes it in again. A site
that is late once has its late update counted and dropped, is never refused or evicted for it, and
takes part in the rounds after. SIGUSR1 (hydra's word that a rank ended) no longer halts; SIGUSR2
and OUT/HALT do."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import h5py
import pytest
import yaml
from conftest import REPO
from ops_helpers import checkpoints, events, finish, job_pids, kill_all, output, start, wait_for

pytestmark = pytest.mark.mpi

ROUNDS = 30
CONTINUE = ["federation.on_client_failure=continue", "federation.quorum=0.5", "federation.round_deadline_s=60"]


def _ranks(out: Path, n: int, proc) -> dict[str, int]:
    assert proc.poll() is None, output(proc)[-3000:]
    return wait_for(lambda: (p := job_pids(out)) and all(f"rank{r}" in p for r in range(n)) and p, 90,
                    "the rank processes")


def _finish(proc, out: Path, timeout: float = 180) -> str:
    return finish(proc, out, timeout)


def _round_times(out: Path) -> list[float]:
    return [e["value"] for e in events(out) if e["name"] == "round_time_s"]


def test_sync_site_killed_mid_run_is_dropped_at_once_and_rejoins_on_resume(tmp_path):
    out = tmp_path / "run"
    # Rounds of ~0.2 s, a checkpoint every 2; the run is halted by OUT/HALT after the kill, then resumed.
    proc = start(out, [*CONTINUE, f"rounds={ROUNDS}", "checkpoint_every=2", "federation.slowdown={0: 4, 1: 4, 2: 4}"],
                 np_=4)
    try:
        wait_for(lambda: len(checkpoints(out)) >= 2, 180, "two checkpoints", proc)
        pids = _ranks(out, 4, proc)
        os.kill(pids["rank2"], signal.SIGKILL)  # client 1, mid-round
        wait_for(lambda: any(e["name"] == "client_failed" for e in events(out)), 60, "client 1 to be dropped", proc)
        os.kill(pids["rank0"], signal.SIGUSR1)  # hydra's "a rank ended": no halt, nothing else dropped
        dropped_at = checkpoints(out)[-1]
        wait_for(lambda: checkpoints(out)[-1] > dropped_at, 60, "a checkpoint without client 1", proc)
        (out / "HALT").touch()
        text = _finish(proc, out)
    finally:
        kill_all(out, proc)
    assert "halted after round" in text and not (out / "HALT").exists() and not (out / "summary.json").exists()
    assert "client 1 (rank 2) ended without a word (killed or crashed); continuing without it" in text, text[-3000:]
    assert text.count("continuing without it") == 1, text[-3000:]
    # dropped at once: no round waited for the dead site (the deadline is 60 s)
    assert max(_round_times(out)) < 30, max(_round_times(out))  # a hang, not a figure: wide margin
    failed = [e for e in events(out) if e["name"] == "client_failed"]
    assert [e["client"] for e in failed] == [1]
    # The newest manifest: clients 0 and 2 of its own round, client 1's last shard with its round.
    newest = out / "checkpoints" / checkpoints(out)[-1]
    with h5py.File(newest, "r") as f:
        rnd = int(f.attrs["round"])
        sites = {k: dict(f["sites"][k].attrs) for k in f["sites"]}
    assert set(sites) == {"0", "1", "2"} and "round" not in sites["0"] and "round" not in sites["2"], sites
    assert int(sites["1"]["round"]) < failed[0]["round"] < rnd, (sites, failed, rnd)

    # --resume with every site back: client 1 loads its own last shard and takes part again.
    proc = start(out, [*CONTINUE, f"rounds={ROUNDS}", "checkpoint_every=2", "federation.slowdown={0: 4, 1: 4, 2: 4}"],
                 np_=4, resume=True)
    text = _finish(proc, out)
    assert f"(round {rnd})" in text, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["clients"]) == ["0", "1", "2"] and summary["dropped"] == []
    part = summary["participation"]
    assert part["0"]["contributed"] == part["2"]["contributed"] == ROUNDS, part
    missed = [e["round"] for e in events(out) if e["name"] == "num_updates" and e["value"] == 2]
    assert missed and max(missed) <= rnd and part["1"]["contributed"] == ROUNDS - len(missed), (part, missed)


def test_async_site_killed_mid_run_is_dropped_and_the_rest_finish(tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    cfg.update(rounds=15, checkpoint_every=5)
    cfg["strategy"] = {"name": "feddwa"}
    cfg["federation"].update(mode="async", on_client_failure="continue", round_deadline_s=60,
                             slowdown={0: 6, 1: 6, 2: 6})
    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    proc = start(out, [], config=str(path), np_=4)
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists()
                 and (out / "metrics.jsonl").read_text().count('"fit_time_s"') >= 6, 180, "the first updates", proc)
        os.kill(_ranks(out, 4, proc)["rank3"], signal.SIGKILL)  # client 2
        t0 = time.monotonic()
        wait_for(lambda: any(e["name"] == "client_failed" for e in events(out)), 60, "client 2 to be dropped", proc)
        took = time.monotonic() - t0
        text = _finish(proc, out)
    finally:
        kill_all(out, proc)
    assert took < 30, f"dropped {took:.0f} s after the kill (the silence deadline is 60 s)"
    assert "the federation finished without rank 3 (client 2)" in text, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates_accepted"] == 45 and sorted(summary["clients"]) == ["0", "1"], summary["clients"]
    [dropped] = summary["dropped"]
    assert dropped["client"] == 2 and dropped["rank"] == 3 and "killed or crashed" in dropped["cause"]
    assert 0 < dropped["round"] < 45 and summary["dropped_clients"] == [2]
    part = summary["participation"]
    assert sum(p["contributed"] for p in part.values()) == 45 and part["2"]["contributed"] < 15, part


def test_a_late_site_is_counted_never_refused_and_takes_part_again(tmp_path):
    out = tmp_path / "run"
    deadline = 6  # seconds: far above a round (~0.2 s) even on a loaded machine
    # Equal sites; client 1 stops itself right after its upload of round 5 (the moment between an
    # upload and the next model, as a preempted node would), past one round's deadline, then goes
    # on. Its next model is posted, never a send that waits on it (which would take it for hung).
    proc = start(out, ["rounds=25", "checkpoint_every=0", "federation.quorum=0.6",
                       f"federation.round_deadline_s={deadline}", "federation.slowdown={0: 4, 1: 4, 2: 4}"],
                 np_=4, extra_env={"HPCFED_FAULT_STOP_AFTER_UPLOAD": "2:5"})
    pids = {}
    try:
        pids = _ranks(out, 4, proc)
        wait_for(lambda: "stops itself after its upload" in output(proc), 180, "client 1 to stop", proc)
        time.sleep(deadline + 1.5)
        os.kill(pids["rank2"], signal.SIGCONT)
        text = _finish(proc, out)
    finally:
        with contextlib.suppress(ProcessLookupError, KeyError):
            os.kill(pids["rank2"], signal.SIGCONT)
        kill_all(out, proc)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evicted"] == [] and "stale update" not in summary["rejected"]["runtime"], summary["rejected"]
    part = summary["participation"]
    assert part["1"]["late"] >= 1 and part["0"]["late"] == part["2"]["late"] == 0, part
    assert part["0"]["contributed"] == part["2"]["contributed"] == 25 and part["1"]["contributed"] >= 18, part
    late = [e for e in events(out) if e["name"] == "late_update"]
    assert late and all(e["client"] == 1 and e["value"] < e["round"] for e in late), late
    # it trained on the current model at once and was in time again for the rounds after
    after = {e["round"] for e in events(out) if e["name"] == "fit_time_s" and e["client"] == 1}
    assert {r for r in after if r > late[-1]["round"]} == set(range(late[-1]["round"] + 1, 25)), sorted(after)
    assert "late update of round" in text and "rejected message" not in text, text[-3000:]


def test_a_site_killed_during_the_handshake_is_dropped_in_setup_and_the_rest_finish(tmp_path):
    out = tmp_path / "run"
    # Client 1 (rank 2) kills itself before its secure handshake; setup_timeout_s is 300 s, so a
    # run that finishes in well under that did not wait the timeout out.
    started = time.monotonic()
    proc = start(out, [*CONTINUE, "rounds=3", "checkpoint_every=0", "federation.min_sites=2"], np_=4,
                 extra_env={"HPCFED_FAULT_KILL_IN_HANDSHAKE": "2"})
    try:
        text = _finish(proc, out, timeout=150)
    finally:
        kill_all(out, proc)
    assert time.monotonic() - started < 150
    summary = json.loads((out / "summary.json").read_text())
    [dropped] = summary["dropped"]
    assert dropped["client"] == 1 and dropped["round"] == -1, dropped
    assert "ended" in dropped["cause"] and "during setup" in dropped["cause"], dropped
    assert sorted(summary["clients"]) == ["0", "2"] and summary["dropped_clients"] == [1], summary["clients"]
    assert max(e["round"] for e in events(out) if e["name"] == "num_updates") == 2
    assert "continuing without it" in text, text[-3000:]
