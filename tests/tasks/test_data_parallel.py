"""A site's share of a batch (`hpcfed.tasks.data_parallel`): every row once, and the loss scaled so
that DDP's average over the ranks is the whole batch's mean."""

from __future__ import annotations

import numpy as np

from hpcfed.tasks.data_parallel import SiteRanks, parallel, shard_rows


def test_the_ranks_shares_cover_each_row_once_in_order():
    for rows in (0, 1, 5, 32, 33):
        for size in (1, 2, 3):
            parts = [SiteRanks(local_rank=r, size=size, backend="gloo").shard(rows) for r in range(size)]
            assert [i for p in parts for i in range(rows)[p]] == list(range(rows))
            assert max(p.stop - p.start for p in parts) - min(p.stop - p.start for p in parts) <= 1


def test_scaled_local_means_average_to_the_batch_mean():
    rng = np.random.default_rng(0)
    losses = rng.normal(size=11)  # per-example losses of one batch of 11 rows over 3 ranks
    ranks = [SiteRanks(local_rank=r, size=3, backend="gloo") for r in range(3)]
    scaled = [losses[r.shard(11)].mean() * r.scale(r.shard(11).stop - r.shard(11).start, 11) for r in ranks]
    assert np.isclose(np.mean(scaled), losses.mean())  # DDP averages over the 3 ranks


def test_shard_rows_slices_nested_batches_and_one_rank_is_not_parallel():
    batch = {"x": np.arange(10).reshape(5, 2), "mask": [np.arange(5)], "name": "b"}
    part = shard_rows(batch, slice(1, 3))
    assert part["x"].tolist() == [[2, 3], [4, 5]] and part["mask"][0].tolist() == [1, 2] and part["name"] == "b"
    assert not parallel(None) and not parallel(SiteRanks(local_rank=0, size=1, backend="gloo"))
    assert parallel(SiteRanks(local_rank=0, size=2, backend="gloo"))
