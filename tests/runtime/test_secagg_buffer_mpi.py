"""Secure buffered async aggregation (FedBuff's buffers under SecAgg+) under `mpiexec -n 5` (4 sites,
buffers of 2, site 3 four times slower), with a test-side spy (tests/privacy/buffer_spy.py) recording
everything rank 0 decrypts and what each site fed each buffer.

- Rank 0 never receives an UPDATE; no vector it decrypted correlates with any site's clipped delta
  beyond |r| 0.15.
- Each buffer's step (the model its members got back minus the model of its version) is the
  staleness-weighted mean Σ s_k δ_k / Σ s_k of its members' clipped deltas, s = 1/√(1+τ) as the
  weight coordinate carries it, within quantisation; and it is the step plain FedBuff
  (`FedBuff.on_update`) takes from the same members' trained models, so secure and plain runs differ
  only in their schedule (which sites share a buffer), never in what a buffer computes.
- The slow site never holds the fast ones up: they fill most buffers, and it lands in some.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import NUMPY_SITES, REPO, mpiexec

from hpcfed.privacy.buffered import StalenessRule

pytestmark = pytest.mark.mpi

SPY = REPO / "tests" / "privacy" / "buffer_spy.py"
SLOW, K, M = 3, 4, 65536  # M: privacy.secagg.max_examples, the weight's fixed-point unit


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("buffers")
    out, spy = tmp / "run", tmp / "spy"
    cmd = [mpiexec(), "-n", str(K + 1), sys.executable, str(SPY), str(spy), "run", "configs/quickstart_fedbuff.yaml",
           NUMPY_SITES, "--out", str(out), "rounds=4", "checkpoint_every=0", "eval_every=0",
           "privacy.secure_aggregation=true", "influence.enabled=false", f"federation.slowdown={{{SLOW}: 4.0}}",
           "federation.round_deadline_s=60"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HPCFED_PSK": "00" * 32}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out, spy


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return abs(float(np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1]))


def _fed(spy: Path) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    out = {}
    for path in spy.glob("site*-b*.npz"):
        site, buffer = path.stem[4:].split("-b")
        out[int(site), int(buffer)] = dict(np.load(path))
    return out


def test_rank0_decrypts_no_vector_correlated_with_any_sites_update(run):
    out, spy = run
    fed = _fed(spy)
    size = next(iter(fed.values()))["delta"].size
    received = [(json.loads(p.with_suffix(".json").read_text()), np.load(p))
                for p in sorted((spy / "rank0").glob("*.npz"))]
    assert 4 not in [h["kind"] for h, _ in received]  # no UPDATE: no site's model crossed in the clear
    vectors = [v for h, t in received for v in t.values() if v.size >= size and h["kind"] != 1]
    assert len(vectors) >= 2 * K
    for v in vectors:  # every masked vector rank 0 decrypted, against every site's clipped delta of every buffer
        for f in fed.values():
            assert _corr(v.ravel()[:size], f["delta"]) < 0.15
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["secure_aggregation"] is True and summary["evicted"] == []


def test_each_buffers_step_is_the_staleness_weighted_mean_of_its_members_deltas(run):
    _, spy = run
    fed = _fed(spy)
    rule, checked = StalenessRule(), 0
    by_buffer: dict[int, list[int]] = {}
    for site, b in fed:
        by_buffer.setdefault(b, []).append(site)
    models = {int(f["version"]) - int(f["staleness"]): f["sent"] for f in fed.values()}  # version -> model
    for b, members in sorted(by_buffer.items()):
        version = int(fed[members[0], b]["version"])
        assert sorted(members) == list(fed[members[0], b]["members"]) and len(members) == 2
        if version + 1 not in models or version not in models:
            continue
        q = np.array([rule.units(int(fed[c, b]["staleness"]), M) for c in members], dtype=np.float64)
        deltas = np.stack([fed[c, b]["delta"] for c in members])
        want = models[version] + (q[:, None] * deltas).sum(0) / q.sum()
        assert np.abs(models[version + 1] - want).max() < 1e-5, b
        checked += 1
    assert checked >= 4
    staleness = [int(f["staleness"]) for f in fed.values()]
    assert max(staleness) >= 1  # some member trained from an older version and was weighed down


def test_each_buffers_step_is_the_one_plain_fedbuff_takes_from_the_same_uploads(run):
    """Plain FedBuff's own `on_update`, fed each member's trained model (what a plain site uploads,
    unclipped) measured from the version it trained from, lands on the model the secure buffer made:
    the same weights, staleness rule, normalisation, and no clip or fixed-point range in the way."""
    from hpcfed.strategies.base import StrategyContext, Update
    from hpcfed.strategies.fedbuff import FedBuff

    _, spy = run
    fed = _fed(spy)
    models = {int(f["version"]) - int(f["staleness"]): f["sent"] for f in fed.values()}  # version -> model
    checked = stale = 0
    for b in sorted({b for _, b in fed}):
        members = sorted(site for site, bb in fed if bb == b)
        version = int(fed[members[0], b]["version"])
        bases = [version - int(fed[c, b]["staleness"]) for c in members]
        if version + 1 not in models or not all(v in models for v in [version, *bases]):
            continue
        plain = FedBuff(FedBuff.Config(), StrategyContext(num_clients=K, seed=0, buffer_size=len(members)))
        plain.initialize({"w": models[version].astype(np.float32)})
        plain.version, plain.models = version, {v: models[v].astype(np.float32) for v in {version, *bases}}
        for c, base in zip(members, bases):
            plain.on_update(Update(client_id=c, flat=fed[c, b]["trained"], num_examples=100, base_version=base))
        assert plain.version == version + 1, b
        assert np.abs(plain.global_flat - models[version + 1]).max() < 1e-5, b
        checked, stale = checked + 1, stale + (max(bases) < version)
    assert checked >= 4 and stale >= 1


def test_the_slow_site_holds_no_one_up_and_lands_in_some_buffers(run):
    out, spy = run
    fed = _fed(spy)
    joined = {c: sum(1 for site, _ in fed if site == c) for c in range(K)}
    # A quickstart fit is milliseconds and a buffer's secure exchanges are not, so on a loaded host the
    # slow site may keep pace with one fast site; never with all of them, and never ahead of one.
    others = [joined[c] for c in range(K) if c != SLOW]
    assert 1 <= joined[SLOW] <= min(others) and joined[SLOW] < max(others), joined
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(e["name"] == "buffer" for e in events) == len({b for _, b in fed})


def test_a_halted_secure_buffered_run_resumes_from_the_checkpoint_between_buffers(tmp_path):
    """Halted after 4 accepted uploads (two buffers of 2, 3 sites): the sites waiting for a buffer drop
    their uploads for the checkpoint (an interrupted buffer is lost, not the run); `--resume` goes on
    from version 3 on fresh keys (each buffer sets up its own) and ends at 12 uploads, version 7."""
    from conftest import run_cli

    from hpcfed.store import checkpoint as ck

    part = tmp_path / "part"
    common = [NUMPY_SITES, "rounds=4", "checkpoint_every=0", "eval_every=0", "privacy.secure_aggregation=true",
              "influence.enabled=false"]
    run_cli(["run", "configs/quickstart_fedbuff.yaml", "--out", str(part), *common, "halt_after_round=4"], np=4,
            timeout=240)
    assert ck.latest_valid(part / "checkpoints").round == 4 and not (part / "summary.json").exists()
    run_cli(["run", "configs/quickstart_fedbuff.yaml", "--out", str(part), *common, "--resume"], np=4, timeout=240)
    events = [json.loads(line) for line in (part / "metrics.jsonl").read_text().splitlines()]
    folded = [e["value"] for e in events if e["name"] == "num_updates"]
    versions = [e["value"] for e in events if e["name"] == "fedbuff_version"]
    assert sum(folded) == 12 and versions[:2] == [2.0, 3.0] and versions[-1] == 7.0
    assert [e["value"] for e in events if e["name"] == "buffer"][2] == 2.0  # buffer numbers go on from version 3
    summary = json.loads((part / "summary.json").read_text())
    assert summary["mean"]["accuracy"] > 0.3


def test_a_buffers_members_are_answered_in_the_order_they_became_ready(tmp_path):
    """3 sites in buffers of 3, each ready on a schedule against its id (site 2 at once, site 1 after
    0.6 s, site 0 after 1.2 s: tests/privacy/buffer_spy.py's SPY_READY_DELAY). After each buffer rank 0
    answers its members in the order it took them as ready, never by site id (the bias that made
    secure FedBuff weigh the low ids' sites more: hpcfed.server.buffered); the schedule makes the two
    orders differ, so the old id order fails here."""
    out, spy = tmp_path / "run", tmp_path / "spy"
    cmd = [mpiexec(), "-n", "4", sys.executable, str(SPY), str(spy), "run", "configs/quickstart_fedbuff.yaml",
           NUMPY_SITES, "--out", str(out), "rounds=2", "checkpoint_every=0", "eval_every=0",
           "privacy.secure_aggregation=true", "influence.enabled=false", "federation.buffer_size=3",
           "federation.round_deadline_s=60"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HPCFED_PSK": "00" * 32, "SPY_READY_DELAY": "1:0.6,0:1.2"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    pending: list[int] = []  # sites taken as ready since the last buffer, in rank 0's order
    expected: dict[int, list[int]] = {}  # buffer -> its members in the order they became ready
    answers: dict[int, list[int]] = {}
    current: int | None = None
    for event in map(json.loads, (spy / "order.jsonl").read_text().splitlines()):
        if "buffer" in event:
            current = event["buffer"]
            expected[current] = [c for c in pending if c in event["members"]]
            pending = [c for c in pending if c not in event["members"]]
            answers[current] = []
        elif "ready" in event:
            pending.append(event["ready"])
            current = None  # the answers of a buffer follow it at once; none before the first buffer count
        elif current is not None:
            answers[current].append(event["answered"])
    assert len(answers) == 2, answers
    for b, answered in answers.items():
        assert answered == expected[b], (b, answered, expected[b])
    # the schedule held: ready order is not id order, so answering by id fails the check above
    assert all(order == [2, 1, 0] for order in expected.values()), expected
