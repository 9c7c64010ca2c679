"""`hpcfed search live` under mpiexec: label names as `query` gives them, and the refusal of joint mode
over sites whose spaces are their own (unless --force)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from search_data import EVENTS, clustered, write_message_sites

from hpcfed.store.embeddings import export_path, write_export
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("own_keys")  # index keys in a temporary folder
KEYS = ("site", "id", "score", "label", "label_name")


def test_live_results_carry_label_names_as_the_offline_query(tmp_path: Path) -> None:
    write_message_sites(tmp_path, [120, 80])
    query = ["--id", "m1-4", "--k", "6", "--compact"]
    live = json.loads(run_cli(["search", "live", str(tmp_path), *query, "--timeout", "60"], np=3).stdout)
    offline = json.loads(run_cli(["search", "query", str(tmp_path), *query]).stdout)
    got = live["queries"][0]["results"]
    assert len(got) == 6 and all(r["label_name"] == EVENTS[r["label"]] for r in got)
    assert got == [{key: r[key] for key in KEYS} for r in offline["queries"][0]["results"]]


def test_live_joint_mode_over_own_spaces_is_refused_unless_forced(tmp_path: Path) -> None:
    for site in (0, 1):
        write_export(export_path(tmp_path, site), clustered(50, 8, seed=site), [f"s{site}-{i}" for i in range(50)],
                     np.arange(50) % 3, entity="message", model="dame-gat", site=site, extra={"shared_space": False})
    args = ["search", "live", str(tmp_path), "--id", "s0-1", "--timeout", "60", "--compact"]
    refused = run_cli([*args, "--mode", "joint"], np=3, check=False)
    assert refused.returncode == 2
    assert "--mode joint treats the sites' vectors as one space, but site 0's" in refused.stderr
    own = json.loads(run_cli([*args, "--mode", "nomapping"], np=3).stdout)["queries"][0]
    assert own["mode"] == "nomapping" and len(own["results"]) == 10
    auto = json.loads(run_cli(args, np=3).stdout)["queries"][0]  # the default picks each site's own space
    assert auto["mode"] == "nomapping" and auto["results"] == own["results"]
    forced = json.loads(run_cli([*args, "--mode", "joint", "--force"], np=3).stdout)["queries"][0]
    assert [r["id"] for r in forced["results"]] == [r["id"] for r in own["results"]]
