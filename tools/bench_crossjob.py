"""The secure channel between separate jobs (`hpcfed serve` / `hpcfed join`) against one job's COMM_WORLD.

    python tools/bench_crossjob.py [--sizes 1MB,64MB] [--reps N] [--namespaces] [--json]

Side by side in one run, each pair of processes sending the same bundles one way (rank 0 -> the
other, then a one-byte acknowledgement), raw MPI and through the secure channel (AES-256-GCM,
chunked, no shared-memory ring: none exists between jobs):

- ``world-shm``: one job of 2 ranks, MPICH's default (shared memory on one host);
- ``world-tcp``: one job of 2 ranks over TCP (``ofi``/``tcp``, ``MPIR_CVAR_NOLOCAL=1``);
- ``crossjob``: two jobs of one rank each, joined through an MPI port (`Open_port`/`Accept`/
  `Connect`), one intercommunicator, over TCP: what `hpcfed serve`/`join` use;
- with ``--namespaces`` (root, ../shared/tools/two-nodes.sh): ``world-2ns`` (one job, a rank on
  each emulated node) and ``crossjob-2ns`` (the server job in the head namespace, the site job on
  node1), over veth links.

The goal: cross-job bandwidth >= 0.8 x that of one job over TCP. The machine may be shared: the
figures are noisy; the ratios are taken within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

SIZES = {"1KB": 1 << 10, "1MB": 1 << 20, "64MB": 64 << 20}
TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
HEAD = "hpcfed-mn0"


# -- inside MPI: one side of a pair ----------------------------------------------------------------------
def _pair(role: str, rendezvous: str) -> tuple[Any, Any, bool]:
    """(communicator, secure channel, whether this side sends) for `role`: world, server or site."""
    from mpi4py import MPI

    from hpcfed.comm import port as mpiport
    from hpcfed.comm.channel import SecureChannel
    from hpcfed.comm.crypto import Credentials
    from hpcfed.comm.spokes import SpokeTransport
    from hpcfed.comm.transport import MPITransport

    secret = bytes.fromhex(os.environ["BENCH_SECRET"])
    if role == "world":
        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        transport: Any = MPITransport(comm)
    elif role == "server":
        name = mpiport.open_port()
        Path(rendezvous + ".tmp").write_text(name)
        os.replace(rendezvous + ".tmp", rendezvous)
        comm, rank = mpiport.accept(name, 120), 0
        transport = SpokeTransport(0, 2, {1: mpiport.intercomm_transport(comm)})
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(rendezvous) and time.monotonic() < deadline:
            time.sleep(0.05)
        comm, rank = mpiport.connect(Path(rendezvous).read_text(), 120), 1
        transport = SpokeTransport(1, 2, {0: mpiport.intercomm_transport(comm)})
    channel = SecureChannel(transport, Credentials(mode="psk", psk=secret[:32]), secret[32:],
                            chunk_bytes=4 << 20, shared_memory=False)
    channel.connect([1 - rank], timeout=60)
    return comm, channel, rank == 0


def _timed(comm: Any, sender: bool, peer: int, send: Any, recv: Any, reps: int) -> float:
    from mpi4py import MPI

    ack = np.zeros(1, dtype=np.uint8)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        send() if sender else recv()
    if sender:
        comm.Recv([ack, MPI.BYTE], source=peer, tag=99)
    else:
        comm.Send([ack, MPI.BYTE], dest=peer, tag=99)
    return time.perf_counter() - t0


def _measure(role: str, rendezvous: str, sizes: dict[str, int], reps: int, out: str | None) -> None:
    comm, channel, sender = _pair(role, rendezvous)
    peer = (1 if sender else 0) if role == "world" else 0
    result = {label: _one_size(comm, channel, sender, peer, nbytes, max(4, min(reps, (768 << 20) // nbytes)))
              for label, nbytes in sizes.items()}
    channel.close()
    if sender and out:
        Path(out).write_text(json.dumps(result))
    if role != "world":
        comm.Disconnect()


def _one_size(comm: Any, channel: Any, sender: bool, peer: int, nbytes: int, n: int) -> dict[str, float]:
    """Raw MPI and the secure channel, `n` bundles of `nbytes` one way; the best of two tries each."""
    from mpi4py import MPI

    payload = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    buf = np.empty_like(payload)

    def secure_recv() -> None:
        msg = channel.recv(source=0, timeout=120)
        if msg is None or msg.tensors["p"].shape != payload.shape:
            raise RuntimeError("bench: the secure channel lost a message")

    raw = min(_timed(comm, sender, peer, lambda: comm.Send([payload, MPI.FLOAT], dest=peer, tag=1),
                     lambda: comm.Recv([buf, MPI.FLOAT], source=peer, tag=1), n) for _ in range(2))
    sec = min(_timed(comm, sender, peer, lambda: channel.send(1, 3, {}, {"p": payload}), secure_recv, n)
              for _ in range(2))
    return {"bytes": nbytes, "reps": n, "raw_mpi_gbps": n * nbytes / raw / 1e9, "secure_gbps": n * nbytes / sec / 1e9}


# -- outside MPI: the launcher -------------------------------------------------------------------------
def _launch(cases: list[tuple[list[str], dict[str, str]]], timeout: float) -> None:
    """Start each (command, extra environment) at once; wait for all, failing with the first error."""
    procs = [subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for cmd, env in cases]
    for proc in procs:
        text, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{' '.join(proc.args)} exited {proc.returncode}:\n{text[-3000:]}")


def _two_nodes() -> Path | None:
    for shared in (REPO.parent / "shared", Path(os.environ.get("HPCFED_DATA", "/nonexistent")).parent):
        if (shared / "tools" / "two-nodes.sh").is_file():
            return shared / "tools" / "two-nodes.sh"
    return None


def run(sizes: dict[str, int], reps: int, namespaces: bool) -> dict[str, Any]:
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        raise SystemExit("no mpiexec on PATH (pip install mpich)")
    me = [sys.executable, str(Path(__file__).resolve()), "--sizes", ",".join(sizes), "--reps", str(reps)]
    results: dict[str, Any] = {}
    tool = _two_nodes() if namespaces else None
    if namespaces and (tool is None or os.geteuid() != 0 or shutil.which("ip") is None):
        raise SystemExit("--namespaces needs root, iproute2 and ../shared/tools/two-nodes.sh")
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "two-nodes"
        os.environ["BENCH_SECRET"] = secrets.token_bytes(48).hex()
        os.environ["HPCFED_TWO_NODES"] = str(state)
        if tool is not None:
            subprocess.run(["bash", str(tool), "start"], check=True, capture_output=True, timeout=120)
        try:
            for case, launches in _cases(mpiexec, me, Path(tmp), tool, state).items():
                _launch(launches, 900)
                results[case] = json.loads((Path(tmp) / f"{case}.json").read_text())
        finally:
            if tool is not None:
                subprocess.run(["bash", str(tool), "stop"], capture_output=True, timeout=120)
    return results


def _cases(mpiexec: str, me: list[str], tmp: Path, tool: Path | None,
           state: Path) -> dict[str, list[tuple[list[str], dict[str, str]]]]:
    def world(case: str, env: dict[str, str], launcher: list[str]) -> list[tuple[list[str], dict[str, str]]]:
        return [([*launcher, "-n", "2", *me, "--role", "world", "--out", str(tmp / f"{case}.json")], env)]

    def crossjob(case: str, env: dict[str, str], server_wrap: list[str], site_wrap: list[str],
                 ifaces: tuple[str, str] | None = None) -> list[tuple[list[str], dict[str, str]]]:
        port = str(tmp / f"{case}.port")
        server_env = {**env, **({"FI_TCP_IFACE": ifaces[0]} if ifaces else {})}
        site_env = {**env, **({"FI_TCP_IFACE": ifaces[1]} if ifaces else {})}
        return [([*server_wrap, mpiexec, "-n", "1", *me, "--role", "server", "--rendezvous", port, "--out",
                  str(tmp / f"{case}.json")], server_env),
                ([*site_wrap, mpiexec, "-n", "1", *me, "--role", "site", "--rendezvous", port], site_env)]

    cases = {"world-shm": world("world-shm", {}, [mpiexec]),
             "world-tcp": world("world-tcp", {**TCP, "MPIR_CVAR_NOLOCAL": "1"}, [mpiexec]),
             "crossjob": crossjob("crossjob", TCP, [], [])}
    if tool is not None:
        on = ["bash", str(tool), "on"]
        two = {**TCP, "FI_TCP_IFACE": "mpi0", "MPIEXEC_2NODE_HOSTS": "node1:1,node2:1"}
        cases["world-2ns"] = world("world-2ns", two, [str(state / "mpiexec")])
        cases["crossjob-2ns"] = crossjob("crossjob-2ns", TCP, ["ip", "netns", "exec", HEAD], [*on, "node1"],
                                         ("br0", "mpi0"))
    return cases


def _table(results: dict[str, Any]) -> str:
    lines = [f"{'case':>13} {'size':>6} {'raw MPI':>9} {'secure':>9}  (GB/s, one way)"]
    for case, rows in results.items():
        for label, row in rows.items():
            lines.append(f"{case:>13} {label:>6} {row['raw_mpi_gbps']:9.3f} {row['secure_gbps']:9.3f}")
    for base, other in (("world-tcp", "crossjob"), ("world-2ns", "crossjob-2ns")):
        if base in results and other in results:
            for label in results[base]:
                ratio = results[other][label]["secure_gbps"] / results[base][label]["secure_gbps"]
                lines.append(f"{other} / {base}, {label} secure: {ratio:.2f} (goal >= 0.8)")
    lines.append(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1MB,64MB", help=f"bundle sizes, of {', '.join(SIZES)}")
    p.add_argument("--reps", type=int, default=40, help="messages per measurement (at most 768 MB of them)")
    p.add_argument("--namespaces", action="store_true", help="also across emulated nodes (root; two-nodes.sh)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--role", choices=["world", "server", "site"], help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = {s: SIZES[s] for s in args.sizes.split(",")}
    if args.role:
        _measure(args.role, args.rendezvous, sizes, args.reps, args.out)
        return 0
    results = run(sizes, args.reps, args.namespaces)
    print(json.dumps(results, indent=2) if args.json else _table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
