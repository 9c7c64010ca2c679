"""One tensor larger than 2 GiB through the secure channel, rank 0 -> rank 1 (issue 14 item 3).

    mpiexec -n 2 python tools/bench_big_tensor.py [--gib 2.1] [--chunk-bytes N]

MPI counts are 32-bit and `cryptography`'s AES-GCM takes at most 2**31 - 1 bytes per call: the
channel cuts a message into frames of at most `chunk_bytes` (<= 1 GiB) and carries offsets and
totals as 64-bit fields, so no count near 2**31 ever reaches MPI or AES-GCM. This sends one uint8
tensor of `--gib` GiB twice (through the shared-memory ring, then through MPI only) and checks every
byte on arrival. Needs about 2 x the tensor in memory (one copy per rank). Not a test: it moves
gigabytes; run it by hand.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def _pattern(start: int, n: int) -> np.ndarray:
    return ((np.arange(start, start + n, dtype=np.int64) * 7 + 3) % 251).astype(np.uint8)


def main() -> int:
    """Send one tensor of `--gib` GiB from rank 0 to rank 1 and check every byte arrived; exit status."""
    from mpi4py import MPI

    from hpcfed.comm.channel import SecureChannel
    from hpcfed.comm.crypto import Credentials
    from hpcfed.comm.transport import MPITransport

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.1)
    p.add_argument("--chunk-bytes", type=int, default=4 << 20)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        print("run it under mpiexec -n 2", file=sys.stderr)
        return 2
    rank = comm.Get_rank()
    nbytes = int(args.gib * (1 << 30))
    transport = MPITransport(comm)
    secret = transport.bcast_bytes(secrets.token_bytes(48) if rank == 0 else None, 48)
    channel = SecureChannel(transport, Credentials(mode="psk", psk=secret[:32]), secret[32:],
                            chunk_bytes=args.chunk_bytes, max_message_bytes=16 << 30)
    channel.connect([1] if rank == 0 else [0], timeout=60)
    step = 64 << 20
    if rank == 0:
        big = np.empty(nbytes, dtype=np.uint8)
        for at in range(0, nbytes, step):
            big[at:at + step] = _pattern(at, min(step, nbytes - at))
    ok = True
    for path, ring in (("shared-memory ring", True), ("MPI only", False)):
        channel.shared_memory = ring
        comm.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            channel.send(1, 3, {"path": path}, {"big": big})
            # the ring sender returns once every chunk is in shared memory: wait for the receiver
            while comm.Iprobe(source=1, tag=76) is False:
                channel.poll()
                time.sleep(0.001)
            comm.recv(source=1, tag=76)
            dt = time.perf_counter() - t0  # received and decrypted; the byte check comes after
            good = comm.recv(source=1, tag=77)
            print(f"{path}: one {nbytes} byte tensor ({nbytes / (1 << 30):.2f} GiB) in {dt:.1f} s "
                  f"({nbytes / dt / 1e9:.2f} GB/s), every byte {'intact' if good else 'WRONG'}", flush=True)
            ok = ok and good
        else:
            msg = channel.recv(source=0, timeout=600)
            comm.send(True, dest=0, tag=76)
            got = msg.tensors["big"] if msg is not None else None
            good = got is not None and got.dtype == np.uint8 and got.shape == (nbytes,) and all(
                np.array_equal(got[at:at + step], _pattern(at, min(step, nbytes - at)))
                for at in range(0, nbytes, step))
            del msg, got
            comm.send(bool(good), dest=0, tag=77)
    if rank == 0:
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
              f"sealing threads {channel.crypto_threads}; chunk {args.chunk_bytes} bytes", flush=True)
    channel.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
