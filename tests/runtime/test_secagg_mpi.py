"""Secure aggregation under `mpiexec -n 5` (4 sites), with a test-side spy (tests/privacy/secagg_spy.py)
recording everything rank 0 decrypts and what each site fed the protocol; site 3 goes silent in
round 0 after it shared its keys (a dropout after share submission). Rounds 0 and 1 exchange their
keys within the round (round 1 because site 3 missed round 0's unmasking); round 2's keys and shares
travel with round 1's masked inputs and unmasking (set up ahead).

- Rank 0 never receives an UPDATE; no vector it received is correlated with any site's plaintext
  update or fixed-point input, and no masked input agrees with its site's codes beyond chance.
- The aggregate equals plain FedAvg (the example-weighted mean of the clipped deltas) of the sites
  whose inputs are in the round, within quantisation: round 0 without site 3, rounds 1 and 2 with all four.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import NUMPY_SITES, REPO, mpiexec
from cryptography.exceptions import InvalidSignature

from hpcfed.comm.keys import generate_identity, load_authorized_keys
from hpcfed.privacy.secagg import Advert
from hpcfed.store import checkpoint as ck

pytestmark = pytest.mark.mpi

SPY = REPO / "tests" / "privacy" / "secagg_spy.py"
DEADLINE_S = 4


def _run(out: Path, spy: Path, ranks: int = 5, silent: int = 3, args: tuple[str, ...] = (
        "rounds=3", "checkpoint_every=1", "federation.quorum=0.75")) -> subprocess.CompletedProcess:
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(SPY), str(spy), str(silent), "run",
           "configs/quickstart.yaml", NUMPY_SITES, "--out", str(out), *args, "privacy.secure_aggregation=true",
           "influence.enabled=false", f"federation.round_deadline_s={DEADLINE_S}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HPCFED_PSK": "00" * 32, "SPY_SILENT_S": str(DEADLINE_S + 2)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return abs(float(np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1]))


def test_rank0_sees_only_masked_inputs_and_the_sum_equals_fedavg_of_the_survivors(tmp_path):
    out, spy = tmp_path / "run", tmp_path / "spy"
    _run(out, spy)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["secure_aggregation"] is True and summary["evicted"] == []
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(e["round"], e["client"]) for e in events if e["name"] == "straggler"] == [(0, 3)]

    sites = {(c, r): np.load(spy / f"site{c}-r{r}.npz") for c in range(4) for r in range(3)}
    size = sites[0, 0]["sent"].size
    received = [(json.loads(p.with_suffix(".json").read_text()), np.load(p))
                for p in sorted((spy / "rank0").glob("*.npz"))]
    kinds = [h["kind"] for h, _ in received]
    assert 4 not in kinds  # no UPDATE: no site's model crossed in the clear
    masked = [(h, t["masked"]) for h, t in received if h["kind"] == 16]
    assert len(masked) == 12  # 4 sites x 3 rounds (site 3's round-0 input came late, refused as stale)
    set_up = {(h["kind"], h["header"]["round"]) for h, _ in received if h["kind"] in (12, 14)}  # SA_ADVERT, SA_SHARES
    assert set_up == {(12, 0), (14, 0), (12, 1), (14, 1)}  # round 2's keys came with round 1's messages:
    assert all("next_advert" in h["header"] for h, _ in masked if h["header"]["round"] == 1)
    assert sum(h["kind"] == 18 and h["header"]["round"] == 1 and "next_to" in h["header"] for h, _ in received) == 4
    for header, y in masked:
        site, rnd = header["source"] - 1, header["header"]["round"]
        assert "num_examples" not in header["header"]  # the weight travels masked only
        assert np.mean(y == sites[site, rnd]["codes"]) < 0.01
    vectors = [v for _, t in received for v in t.values() if v.size >= size]
    assert len(vectors) >= 8
    for v in vectors:  # every vector rank 0 decrypted, against every site's plaintext of every round
        for s in sites.values():
            assert _corr(v.ravel()[:size], s["delta"]) < 0.15 and _corr(v.ravel()[:size + 1], s["codes"]) < 0.15

    def fedavg(rnd: int, who: list[int]) -> np.ndarray:
        w = np.array([float(sites[c, rnd]["weight"]) for c in who])
        deltas = np.stack([sites[c, rnd]["delta"] for c in who])
        return sites[who[0], rnd]["sent"] + (w[:, None] * deltas).sum(0) / w.sum()

    after0 = sites[0, 1]["sent"]  # the model every site received for round 1
    assert all(np.array_equal(after0, sites[c, 1]["sent"]) for c in range(4))
    assert np.abs(after0 - fedavg(0, [0, 1, 2])).max() < 1e-5
    assert np.abs(after0 - fedavg(0, [0, 1, 2, 3])).max() > 1e-4  # site 3's late input is not in it
    assert np.abs(sites[0, 2]["sent"] - fedavg(1, [0, 1, 2, 3])).max() < 1e-5
    with h5py.File(ck.list_checkpoints(out / "checkpoints")[0], "r") as f:  # the newest: round 2's, set up ahead
        final = f["strategy/global"][()]
    assert np.abs(final - fedavg(2, [0, 1, 2, 3])).max() < 1e-5


def test_keys_mode_every_agreement_key_rank0_relays_is_signed_by_its_site_for_its_round(tmp_path):
    """Keys mode (security.mode=keys, each site's identity key bound to its rank): 3 sites, 2 rounds,
    the second set up ahead. Every agreement key that crosses rank 0 carries its site's Ed25519
    signature over (round, site, keys), checked here against the site's public key file."""
    keys = tmp_path / "keys"
    keys.mkdir()
    for rank in range(4):  # as `hpcfed keygen` writes them
        generate_identity(keys / f"rank{rank}")
    lines = []
    for rank in (1, 2, 3):
        kind, b64, *rest = (keys / f"rank{rank}.pub").read_text().split()
        lines.append(" ".join([kind, b64, f"rank={rank}", *rest]))
    (keys / "authorized").write_text("\n".join(lines) + "\n")
    out, spy = tmp_path / "run", tmp_path / "spy"
    _run(out, spy, ranks=4, silent=-1, args=(
        "rounds=2", "checkpoint_every=0", "security.mode=keys", f"security.server_public_key={keys}/rank0.pub",
        f"security.identity={keys}/rank{{rank}}", f"security.authorized_keys={keys}/authorized"))
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["clients"]) == {"0", "1", "2"} and summary["privacy"]["secure_aggregation"] is True
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["value"] for e in events if e["name"] == "num_updates"] == [3, 3]
    assert not [e for e in events if e["name"] == "secagg_sum_refused"]
    public = {rank - 1: key for rank, key in load_authorized_keys(keys / "authorized").items()}
    received = [json.loads(p.read_text()) for p in sorted((spy / "rank0").glob("*.json"))]
    adverts = [(h["header"]["round"], h["header"]["advert"]) for h in received if h["kind"] == 12]
    adverts += [(h["header"]["round"] + 1, h["header"]["next_advert"]) for h in received
                if h["kind"] == 16 and h["header"]["round"] == 0]  # round 1's keys, sent ahead
    assert sorted((rnd, a[0]) for rnd, a in adverts) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert not [h for h in received if h["kind"] == 12 and h["header"]["round"] == 1]  # none within round 1
    for rnd, (site, c, s, sig) in adverts:
        advert = Advert(site, bytes.fromhex(c), bytes.fromhex(s))
        public[site].verify(bytes.fromhex(sig), advert.signed_bytes(rnd))  # raises InvalidSignature if not
        with pytest.raises(InvalidSignature):
            public[site].verify(bytes.fromhex(sig), advert.signed_bytes(rnd + 1))
    sites = {(c, r): np.load(spy / f"site{c}-r{r}.npz") for c in range(3) for r in range(2)}
    w = np.array([float(sites[c, 0]["weight"]) for c in range(3)])
    mean = sites[0, 0]["sent"] + (w[:, None] * np.stack([sites[c, 0]["delta"] for c in range(3)])).sum(0) / w.sum()
    assert np.abs(sites[0, 1]["sent"] - mean).max() < 1e-5
