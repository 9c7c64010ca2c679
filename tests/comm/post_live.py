"""A live 2-rank job for tests/comm/test_comm_live.py: ``mpiexec -n 2 python tests/comm/post_live.py OUT.json``.

Rank 1 is a site busy computing: for BUSY_S seconds it makes no MPI call at all. Rank 0 posts it
messages meanwhile (one chunk through MPI, several chunks through the shared-memory ring or MPI)
and records how long each `post` took and when the channel saw each one taken. Rank 1 then checks
every message arrived intact and in order.
"""

from __future__ import annotations

import json
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.transport import MPITransport

BUSY_S = 2.0
CHUNK = 256 << 10
SIZES = [1 << 20, 1 << 20, 1 << 20, 1 << 20]  # 1 MiB each: a rendezvous-sized message, 4 chunks


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(SIZES[i] // 4).astype(np.float32)


def main(out_path: str) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    transport = MPITransport(comm)
    job = transport.bcast_bytes(b"post-test-job-id" if rank == 0 else None, 16)
    ch = SecureChannel(transport, Credentials(mode="psk", psk=b"p" * 32), job, chunk_bytes=CHUNK)
    ch.connect([1] if rank == 0 else [0], timeout=60)
    # One message both ways first, so that the shared-memory ring (if any) is set up.
    if rank == 0:
        ch.send(1, 1, {"warm": True}, {"x": payload(0)})
        assert ch.recv(source=1, kinds={2}, timeout=60) is not None
    else:
        assert ch.recv(source=0, kinds={1}, timeout=60) is not None
        ch.send(0, 2, {"ready": True})
    comm.Barrier()
    if rank == 0:
        t0 = time.monotonic()
        posted, post_s = [], []
        for i in range(len(SIZES)):
            t = time.monotonic()
            posted.append(ch.post(1, 3, {"i": i}, {"x": payload(i)}))
            post_s.append(time.monotonic() - t)
        done_at: list[float | None] = [None] * len(posted)
        ack = None
        while any(d is None for d in done_at) and time.monotonic() - t0 < 60:
            # keeps the channel's own traffic (shared-memory credits) moving; the ack may come
            # in the same moment as the last credit, so it is kept, not dropped
            ack = ch.recv(source=1, kinds={4}, timeout=0.01) or ack
            for i, out in enumerate(posted):
                if done_at[i] is None and out.done():
                    done_at[i] = time.monotonic() - t0
        ack = ack or ch.recv(source=1, kinds={4}, timeout=60)
        with open(out_path, "w") as fh:
            json.dump({"post_s": post_s, "done_at_s": done_at, "busy_s": BUSY_S,
                       "ack": ack.header if ack else None}, fh)
    else:
        time.sleep(BUSY_S)  # computing: no MPI call, so nothing is taken
        got = []
        for _ in SIZES:
            msg = ch.recv(source=0, kinds={3}, timeout=60)
            i = msg.header["i"]
            got.append([i, zlib.crc32(msg.tensors["x"].tobytes()) == zlib.crc32(payload(i).tobytes())])
        ch.send(0, 4, {"got": got})
    ch.close()


if __name__ == "__main__":
    main(sys.argv[1])
