"""The star of channels: one job id for all ranks, rank 0 connected to every other rank and each of
them to rank 0, with the settings passed through; a rank that never comes is named."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hpcfed.comm.api import ChannelError
from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.star import draw_job_id, open_star, star_peers
from hpcfed.comm.transport import InProcTransport

PSK = bytes(range(32))


def _on_every_rank(fn, size: int) -> list:
    """fn(transport) on one thread per rank; their results (or exceptions) by rank."""
    ts = InProcTransport.group(size)
    out: list = [None] * size

    def run(r: int) -> None:
        try:
            out[r] = fn(ts[r])
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_rank_gets_rank_0s_job_id_behind_the_tag():
    ids = _on_every_rank(lambda t: draw_job_id(t, b"search:42:"), 4)
    assert len(set(ids)) == 1 and ids[0].startswith(b"search:42:") and len(ids[0]) == len(b"search:42:") + 16
    again = _on_every_rank(lambda t: draw_job_id(t, b"search:42:"), 4)
    assert again[0] != ids[0]  # drawn afresh for each job


def test_star_peers():
    assert star_peers(0, 4) == [1, 2, 3] and star_peers(2, 4) == [0] and star_peers(0, 1) == []


def test_open_star_connects_rank_0_with_every_other_rank():
    def rank(t: InProcTransport) -> SecureChannel:
        job_id = draw_job_id(t, b"job:")
        return open_star(t, Credentials(mode="psk", psk=PSK), job_id, timeout=20, chunk_bytes=8192,
                         shared_memory=False, crypto_threads=1)

    chans = _on_every_rank(rank, 3)
    assert all(isinstance(c, SecureChannel) for c in chans), chans
    assert chans[0].peers == [1, 2] and chans[1].peers == [0] and chans[2].peers == [0]
    assert chans[1].chunk_bytes == 8192 and not chans[1].shared_memory and chans[1].crypto_threads == 1
    chans[2].send(0, 4, {"hello": 2}, {"x": np.arange(5000, dtype=np.float32)})  # several chunks
    msg = chans[0].recv(source=2, timeout=10)
    assert msg is not None and msg.header == {"hello": 2} and msg.tensors["x"][-1] == 4999
    for c in chans:
        c.close()


def test_a_rank_that_never_comes_is_named():
    ts = InProcTransport.group(3)
    with pytest.raises(ChannelError, match=r"rank\(s\) 1, 2 did not complete the secure handshake within 0.2 s"):
        open_star(ts[0], Credentials(mode="psk", psk=PSK), b"job", timeout=0.2)
