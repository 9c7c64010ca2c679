"""A live 3-rank job for tests/comm/test_comm_live.py: ``mpiexec -n 3 python tests/comm/comm_live.py OUT.json``.

Rank 0 serves; rank 1 is an honest site (small and multi-chunk messages, each echoed back);
rank 2 completes the handshake and then sends every hostile frame of `comm_attacks.attacks`
through the real MPI transport, plus an oversize frame, then one honest message. Rank 0 writes
its channel stats, what it received, and how often it polled while idle to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time
import zlib

import numpy as np
from comm_attacks import attacks
from mpi4py import MPI

from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.frame import HDR
from hpcfed.comm.transport import MPITransport

HONEST_ROUNDS = 12
CHUNK = 64 << 10
OVERSIZE = HDR + CHUNK + 16 + 1


def main(out_path: str) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    transport = MPITransport(comm)
    job = transport.bcast_bytes(b"live-test-job-id" if rank == 0 else None, 16)
    log: list[str] = []
    ch = SecureChannel(transport, Credentials(mode="psk", psk=b"k" * 32), job, chunk_bytes=CHUNK,
                       log=log.append)
    ch.connect([1, 2] if rank == 0 else [0], timeout=60)
    plan = attacks(ch, 0) if rank == 2 else []
    if rank == 0:
        got: dict[str, list] = {"honest": [], "hostile_texts": []}
        done = set()
        while done != {1, 2}:
            msg = ch.recv(timeout=60)
            if msg is None:
                raise SystemExit("rank 0: no message for 60 s")
            if msg.kind == 2:
                done.add(msg.source)
            elif msg.source == 1:
                p = msg.tensors["p"]
                got["honest"].append([msg.header["i"], int(zlib.crc32(p.tobytes())), int(p.size)])
                ch.send(1, 5, {"echo": msg.header["i"]}, {"p": p})
            else:
                got["hostile_texts"].append(msg.header.get("text"))
        polls0, sleeps0 = ch.stats.polls, ch.stats.idle_sleeps
        idle = ch.recv(timeout=2.0)
        got["idle_polls"] = ch.stats.polls - polls0
        got["idle_sleeps"] = ch.stats.idle_sleeps - sleeps0
        got["idle_got_message"] = idle is not None
        for r in (1, 2):
            ch.send(r, 3, {"bye": True})
        got["stats"] = ch.stats.as_dict()
        got["log"] = log
        with open(out_path, "w") as fh:
            json.dump(got, fh, indent=1)
    elif rank == 1:
        rng = np.random.default_rng(1)
        for i in range(HONEST_ROUNDS):
            p = rng.standard_normal(200_000 if i % 3 == 0 else 100).astype(np.float32)  # 800 KB: 13 chunks
            ch.send(0, 4, {"i": i, "crc": zlib.crc32(p.tobytes())}, {"p": p})
            echo = ch.recv(source=0, kinds={5}, timeout=60)
            assert echo is not None and echo.header == {"echo": i} and np.array_equal(echo.tensors["p"], p)
        ch.send(0, 2, {"done": True})
        assert ch.recv(source=0, kinds={3}, timeout=60) is not None
    else:
        for _name, frame, _reason in plan:
            transport.isend(memoryview(frame), 0).test()
            time.sleep(0.002)
        big = np.zeros(OVERSIZE, dtype=np.uint8)
        req = transport.isend(memoryview(big), 0)
        while not req.test():
            time.sleep(0.001)
        ch.send(0, 2, {"done": True, "text": "honest after attacks"})
        assert ch.recv(source=0, kinds={3}, timeout=60) is not None
        with open(out_path + ".plan", "w") as fh:
            json.dump([[name, reason] for name, _f, reason in plan] + [["oversize", "oversize frame"]], fh)
    ch.close()


if __name__ == "__main__":
    main(sys.argv[1])
