"""The chaos soak, suite-sized (issue 38): `tools/chaos_soak.py` for under a minute at K = 3 with
secure aggregation, site jobs SIGKILLed every 8-15 s and the server's own job killed once and
resumed. Asserted on what the run wrote (`tools/chaos_checks.py` again, on its folder): no round
applied wrongly or twice (each folded sum is exactly its listed sites' inputs, each round's model
the last one's plus its own step, across the resume), no job ended by itself, rounds lost only to
a secure-aggregation shortfall, every site the server lost let back in (and one at least). (Rank 0's memory is the long
soak's figure: a minute is all warm-up.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO))
from tools.chaos_checks import lost_rounds, wrong_rounds

pytestmark = pytest.mark.mpi


def test_a_short_chaos_soak_loses_nothing_but_named_rounds(tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, "tools/chaos_soak.py", "--minutes", "0.9", "--sites", "3", "--seed", "1",
                           "--kill-every", "8-15", "--away", "2-5", "--server-kills", "1", "--out", str(out),
                           "--task", "synthetic_numpy", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert "{" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("\n{") + 1:])
    checks = result["checks"]
    # Every killed site comes back, by a rejoin or by the resumed server's gathering (the check "every
    # site the server lost was let back in" below). Whether any comes back by a rejoin within 54 s
    # depends on the load: a site job prepares (torch, data, model, shard) before it knocks, and one
    # full suite under load saw 5 kills and every site back through the gathering only. The rejoin
    # path itself is asserted deterministically in test_serve_rejoin.py and test_serve_join_sites.py.
    assert result["kills"] >= 2 and result["server_kills"] == 1, proc.stdout[-3000:]
    assert wrong_rounds(out / "srv", out / "audit", 3) == [] == result["wrong"]
    assert result["rounds_done"] >= 5 and result["ended"] == [], proc.stdout[-3000:]
    for name in ("0 rounds applied wrongly (audit)", "0 runs ended (no job ended by itself; the server ended cleanly)",
                 "rounds lost only to a secure-aggregation shortfall", "no site evicted",
                 "every site the server lost was let back in"):
        assert checks[name], (name, proc.stdout[-3000:])
    log = (out / "srv" / "logs" / "rank0.log").read_text()
    assert all("secure aggregation" in why for _, why in lost_rounds(log))
    assert log.count("setup done") == 2  # the start and the resume
    audited = [json.loads(line) for line in (out / "srv" / "metrics.jsonl").read_text().splitlines()]
    assert any(e["name"] == "audit_sum" for e in audited)  # the check had something to check
