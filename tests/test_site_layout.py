"""Which rank is which site's (`hpcfed.site_layout`), the refusals of a layout the ranks cannot make,
and the configs a site of many ranks refuses (`hpcfed.registry.check_site_parallel`)."""

from __future__ import annotations

import re

import pytest
from conftest import run_cli

from hpcfed.config import ConfigError, load
from hpcfed.launch.crossjob import check_site_job, site_size
from hpcfed.registry import resolve
from hpcfed.site_layout import SiteLayout, layout_for, world_size_for


def test_sites_are_laid_out_site_by_site_with_the_leader_first():
    layout = layout_for(2, 5)
    assert layout.sizes == (2, 2) and layout.num_sites == 2 and layout.world_size == 5
    assert layout.world_ranks(0) == [1, 2] and layout.world_ranks(1) == [3, 4]
    assert [layout.leader(k) for k in range(2)] == [1, 3]
    assert [layout.site_of(r) for r in range(5)] == [None, (0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.describe(4) == "rank 4 (client 1, its rank 1)"
    assert layout.describe(3) == "rank 3 (client 1, its leader)"
    assert layout_for(1, 4).single_rank and layout_for(1, 4).describe(2) == "rank 2 (client 1)"


def test_unequal_sites_from_a_list():
    layout = layout_for([2, 1, 3], 7)
    assert layout.world_ranks(1) == [3] and layout.world_ranks(2) == [4, 5, 6] and layout.site_of(5) == (2, 1)
    assert SiteLayout.of([2, 1, 3], 3) == layout and SiteLayout.of(2, 2) == layout_for(2, 5)
    assert world_size_for([2, 1, 3], None) == 7 and world_size_for(2, 3) == 7 and world_size_for(2, None) is None


def test_a_layout_the_ranks_cannot_make_is_refused_with_the_arithmetic():
    with pytest.raises(ConfigError, match=r"ranks_per_site=2 does not divide the 3 client ranks of a job of 4 "
                                          r"\(1 \+ 3 = 1 \+ 1·2 \+ 1\); start it with --np 3 or --np 5"):
        layout_for(2, 4)
    with pytest.raises(ConfigError, match=r"ranks_per_site=\[2, 2\] needs 1 \+ 2 \+ 2 = 5 ranks but the job has 4"):
        layout_for([2, 2], 4)
    with pytest.raises(ConfigError, match="every site needs at least 1 rank"):
        layout_for(0, 5)
    with pytest.raises(ConfigError, match="every site needs at least 1 rank"):
        layout_for([2, 0], 3)


def test_config_refusals_name_the_key():
    with pytest.raises(ConfigError, match=re.escape("federation.ranks_per_site 0: every site needs at least 1 rank")):
        load("configs/quickstart.yaml", ["federation.ranks_per_site=0"])
    with pytest.raises(ConfigError, match="ranks_per_site lists 2 sites but num_clients is 3"):
        load("configs/quickstart.yaml", ["federation.ranks_per_site=[1,2]", "federation.num_clients=3"])
    resolve(load("configs/quickstart.yaml", ["federation.ranks_per_site=2", "privacy.record_dp.epsilon=8"]))


def test_a_joined_site_job_has_its_own_ranks_or_is_refused_with_the_arithmetic():
    cfg = load("configs/quickstart.yaml", ["federation.ranks_per_site=[2,1]", "federation.num_clients=2"])
    assert site_size(cfg, 0) == 2 and site_size(cfg, 1) == 1
    check_site_job(2, 2, 0)
    with pytest.raises(ConfigError, match=re.escape("hpcfed join --site 0: federation.ranks_per_site gives site 0 "
                                                    "2 rank(s) but this job has 3; start it with mpiexec -n 2")):
        check_site_job(2, 3, 0)
    with pytest.raises(ConfigError, match=r"a site of 2 ranks needs federation\.num_clients"):
        site_size(load("configs/quickstart.yaml", ["federation.ranks_per_site=2"]), 0)


def test_a_task_that_is_not_data_parallel_is_refused(tmp_path):
    cfg = load("configs/quickstart.yaml", ["federation.ranks_per_site=2", "task.name=node2vec"])
    cfg.task.options.clear()
    with pytest.raises(ConfigError, match="task 'node2vec' trains on one rank per site"):
        resolve(cfg)


def test_hpcfed_run_refuses_np_that_makes_no_whole_sites(tmp_path):
    proc = run_cli(["run", "configs/quickstart.yaml", "federation.ranks_per_site=2", "--np", "4",
                    "--out", str(tmp_path / "run")], check=False, timeout=120)
    assert proc.returncode != 0
    assert "ranks_per_site=2 does not divide the 3 client ranks of a job of 4" in proc.stderr, proc.stderr[-2000:]
