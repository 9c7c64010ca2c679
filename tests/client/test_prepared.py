"""A site's preparation before its knock (hpcfed.client.prepared): its newest shard, read ahead,
serves the server's pick only when the pick is that very shard; any other pick is read from disk
and checked there, so a wrong digest or a shard of another run (another key) is still refused,
naming the file."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.client.config import ClientConfig
from hpcfed.client.prepared import prepare
from hpcfed.config import SecurityConfig, from_mapping
from hpcfed.credentials import RankKeys
from hpcfed.registry import resolve
from hpcfed.store import site_state

K = 2


def _config() -> ClientConfig:
    cfg = from_mapping({"rounds": 2, "task": {"name": "synthetic", "samples_per_site": 50},
                        "federation": {"num_clients": K}}, [])
    resolve(cfg)
    return ClientConfig.from_config(cfg)


def test_the_shard_read_ahead_serves_only_the_servers_pick_of_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCFED_PSK", "00" * 32)
    config, keys = _config(), RankKeys(SecurityConfig(), 1)
    first = prepare(config, 0, K, tmp_path, "cpu", keys)
    assert first.shards == [] and first.newest is None and first.fits(0, K) and not first.fits(0, K + 1)
    state = first.task.state_dict()
    _, older = site_state.write_shard(first.state_dir, 2, 0, state, first.state_auth, keep=3)
    monkeypatch.setenv("HPCFED_OTHER_PSK", "11" * 32)  # another run's key writes a newer shard
    other = RankKeys(SecurityConfig(psk_env="HPCFED_OTHER_PSK"), 1).file_auth("site-shard")
    _, foreign = site_state.write_shard(first.state_dir, 6, 0, state, other, keep=3)
    _, newest = site_state.write_shard(first.state_dir, 4, 0, state, first.state_auth, keep=3)

    again = prepare(config, 0, K, tmp_path, "cpu", keys)
    assert again.shards == [[4, newest], [2, older]]  # the other run's shard is not held
    assert again.newest is not None and again.newest[:2] == (4, newest)
    assert again.shard_state(4, newest) is again.newest[2]  # the server picked the one read ahead
    _, arrays = again.shard_state(2, older)  # another pick: read and checked now
    assert set(arrays) == set(state[1]) and all(np.array_equal(arrays[k], state[1][k]) for k in arrays)
    with pytest.raises(site_state.ShardError, match=r"shard-0+2\.h5 is not the shard the checkpoint manifest names"):
        again.shard_state(2, newest)
    with pytest.raises(site_state.ShardError, match=r"shard-0+6\.h5"):
        again.shard_state(6, foreign)
