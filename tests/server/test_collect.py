"""What a collector hands the sync loop (`hpcfed.server.collect.RoundUploads`), and the secure one's
check of the strategy's declaration (the real collectors run in tests/server/test_insider.py, the
MPI runs of tests/runtime/test_secagg_mpi.py and tests/ops/test_secagg_dropout.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.server.collect import RoundUploads
from hpcfed.server.secagg_round import SecAggCollector
from hpcfed.strategies.base import StrategyContext, Update
from hpcfed.strategies.fedavg import FedAvg
from hpcfed.strategies.robust import Median

CONTEXT = StrategyContext(num_clients=3, seed=0)


def _update(cid: int) -> Update:
    return Update(cid, np.zeros(2, dtype=np.float32), 10)


def test_a_refused_upload_is_an_answer_but_not_folded_and_a_lost_round_folds_nothing():
    uploads = RoundUploads(4, sat_out={2})
    uploads.add(_update(1), None)
    uploads.add(_update(0), {"round": 4, "path": "s0.h5", "digest": "ab"})
    uploads.refused.add(1)
    assert uploads.answered == {0, 1} and [u.client_id for u in uploads.folded()] == [0]
    assert uploads.shards == {1: None, 0: {"round": 4, "path": "s0.h5", "digest": "ab"}}
    uploads.lost = True
    assert uploads.folded() == [] and uploads.answered == {0, 1}


@pytest.mark.parametrize("strategy", [Median(Median.Config(), CONTEXT), FedAvg(FedAvg.Config(rule="krum"), CONTEXT)])
def test_the_secure_collector_refuses_a_strategy_by_its_declaration(strategy):
    # The declaration is checked before anything of the server's core is used (config checks refuse it first).
    with pytest.raises(TypeError, match="declares aggregates='each_upload'"):
        SecAggCollector(None, strategy)  # the core is never reached: refused before it is read
