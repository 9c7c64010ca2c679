"""A live 2-rank job for tests/comm/test_comm_live.py: ``mpiexec -n 2 python tests/comm/post_live.py OUT.json``.

Rank 1 is a site busy computing: it makes no MPI call at all until rank 0 has posted every message
and written a file saying so (the hand-over is a file, not MPI, and nothing is timed). Rank 0
records whether the channel saw any message taken before rank 1 was back (it must not) and that
all were taken afterwards. Rank 1 then checks every message arrived intact and in order.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.transport import MPITransport

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
    flag = out_path + ".posted"
    if rank == 0:
        posted = [ch.post(1, 3, {"i": i}, {"x": payload(i)}) for i in range(len(SIZES))]
        done_before = [out.done() for out in posted]  # rank 1 is still away from MPI
        with open(flag, "w") as fh:
            fh.write("posted")
        ack = None
        t0 = time.monotonic()
        while not all(out.done() for out in posted) and time.monotonic() - t0 < 120:
            # keeps the channel's own traffic (shared-memory credits) moving; the ack may come
            # in the same moment as the last credit, so it is kept, not dropped
            ack = ch.recv(source=1, kinds={4}, timeout=0.01) or ack
        ack = ack or ch.recv(source=1, kinds={4}, timeout=120)
        with open(out_path, "w") as fh:
            json.dump({"done_before_peer_back": done_before, "done_after": [out.done() for out in posted],
                       "ack": ack.header if ack else None}, fh)
    else:
        while not os.path.exists(flag):  # computing: no MPI call, so nothing is taken
            time.sleep(0.01)
        got = []
        for _ in SIZES:
            msg = ch.recv(source=0, kinds={3}, timeout=120)
            i = msg.header["i"]
            got.append([i, zlib.crc32(msg.tensors["x"].tobytes()) == zlib.crc32(payload(i).tobytes())])
        ch.send(0, 4, {"got": got})
    ch.close()


if __name__ == "__main__":
    main(sys.argv[1])
