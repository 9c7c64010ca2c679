"""Joining separate MPI jobs through a port: `Open_port`, `Accept` and `Connect`, each bounded.

MPI gives these calls no deadline: an `Accept` nobody connects to waits forever, and a `Connect`
to a stale port hangs (MPICH ignores ``MPIR_CVAR_CH4_COMM_CONNECT_TIMEOUT``). So each runs in a
thread of its own while the caller waits with a deadline:

- `accept`: a pending `Accept` past its deadline is released by a throwaway `Connect` from a
  short-lived process of our own (``mpiexec -n 1``), whose intercommunicator is then dropped. The
  caller accepts only after a site has announced itself (`hpcfed.comm.rendezvous`), so an Accept
  never sits pending while the channel runs (a pending Accept stalls every other MPI call of the
  process for seconds).
- `connect`: past its deadline `PortError` is raised; the thread stays stuck inside MPI, so the
  caller must end the process (the site command does, with the reason).

`intercomm_transport` wraps a joined intercommunicator for `hpcfed.comm.spokes`. Like
`hpcfed.comm.transport`, this module moves bytes only and knows nothing of learning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from hpcfed.comm.transport import MPITransport

_GONE_POLL_S = 0.2  # how often a pending Accept looks whether the site it waits for has died
_RELEASE_S = 60.0  # how long the throwaway connect that frees a pending Accept may take


class PortError(RuntimeError):
    """An MPI port could not be opened, accepted on or connected to in time; says which and why."""


class PortStuck(PortError):
    """An Accept nobody answered could not be released (a site killed in the middle of its
    Connect can leave it so): its thread stays in MPI; serve on a fresh port (`open_port`)."""


def network_env(port_range: tuple[int, int] | None, iface: str | None,
                current: Mapping[str, str] | None = None) -> dict[str, str]:
    """The MPI settings of a job joined to others through a port; they must be in the environment
    before MPI starts. MPICH's OFI netmod over libfabric's TCP provider unless `current` (the
    environment) chose a netmod or provider: UCX, the wheel's default, moves a same-host message
    by reading the peer's memory (CMA), and aborts the whole process when the peer job dies in the
    middle (measured: a site SIGKILLed mid-upload took the server down with `process_vm_readv ...
    No such process`). Then the TCP listener pinned to `port_range` (for a firewall) and to the
    network interface `iface`."""
    current = os.environ if current is None else current
    env = {name: value for name, value in (("MPIR_CVAR_CH4_NETMOD", "ofi"), ("FI_PROVIDER", "tcp"))
           if name not in current}
    if port_range is not None:
        env["FI_TCP_PORT_LOW_RANGE"], env["FI_TCP_PORT_HIGH_RANGE"] = str(port_range[0]), str(port_range[1])
    if iface:
        env["FI_TCP_IFACE"] = iface
    return env


def open_port() -> str:
    """A fresh MPI port name (an encoded address a site's `Connect` reaches this process by)."""
    from mpi4py import MPI

    port: str = MPI.Open_port()
    return port


def close_port(port: str) -> None:
    """Release an MPI port opened by `open_port` once no more jobs may connect through it."""
    from mpi4py import MPI

    MPI.Close_port(port)


class _Worker:
    """`fn()` run in a daemon thread: MPI's dynamic-process calls take no deadline, the caller does."""

    def __init__(self, fn: Any) -> None:
        self._box: list[Any] = []
        self._thread = threading.Thread(target=self._body, args=(fn,), name="hpcfed-port", daemon=True)
        self._thread.start()

    def _body(self, fn: Any) -> None:
        try:
            self._box.append(fn())
        except BaseException as exc:  # handed to the caller, who raises it in its own thread
            self._box.append(exc)

    def wait(self, timeout: float) -> bool:
        """True once `fn` has returned or raised (within `timeout` s)."""
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    def result(self, what: str) -> Any:
        value = self._box[0]
        if isinstance(value, BaseException):
            raise PortError(f"{what} failed: {value}")
        return value


def accept(port: str, timeout: float, gone: Callable[[], bool] | None = None) -> Any | None:
    """The intercommunicator of the next process that connects to `port` within `timeout` s (or
    before `gone()`, looked at every `_GONE_POLL_S`: the site it waits for has died), or None (the
    pending Accept is then released by a connect of our own, and its result dropped)."""
    from mpi4py import MPI

    worker = _Worker(lambda: MPI.COMM_SELF.Accept(port))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.wait(min(_GONE_POLL_S, deadline - time.monotonic())):
            return worker.result("MPI Accept on this server's port")
        if gone is not None and gone():
            break
    if worker.wait(0):
        return worker.result("MPI Accept on this server's port")
    try:
        _release(port)
    except PortError as exc:
        raise PortStuck(str(exc)) from None
    if not worker.wait(_RELEASE_S):
        raise PortStuck(f"an Accept nobody answered could not be released within {_RELEASE_S:g} s")
    stray = worker.result("MPI Accept on this server's port")
    stray.Disconnect()  # our own throwaway process (or a late site, which then learns it was refused)
    return None


def _release(port: str) -> None:
    """Connect to our own pending Accept from a throwaway process, so that it returns."""
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    code = ("from mpi4py import MPI; import sys; "
            "c = MPI.COMM_SELF.Connect(sys.argv[1]); c.Disconnect()")
    if exe is None:
        raise PortError("an Accept nobody answered cannot be released: no mpiexec on PATH")
    try:
        subprocess.run([exe, "-n", "1", sys.executable, "-c", code, port], timeout=_RELEASE_S,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=dict(os.environ), check=False)
    except subprocess.TimeoutExpired:
        raise PortError(f"an Accept nobody answered could not be released within {_RELEASE_S:g} s") from None


def connect(port: str, timeout: float) -> Any:
    """The intercommunicator to the process that accepts on `port`; PortError after `timeout` s
    (the Connect stays stuck in its thread: end the process)."""
    from mpi4py import MPI

    worker = _Worker(lambda: MPI.COMM_SELF.Connect(port))
    if not worker.wait(timeout):
        raise PortError(f"MPI Connect to the server's port got no answer within {timeout:g} s (a server "
                        f"that died after its rendezvous, or a network that lets the rendezvous through "
                        f"but not MPI: open the MPI port range too)")
    return worker.result("MPI Connect to the server's port")


def disconnect_all(comms: list[Any], timeout: float) -> bool:
    """Disconnect every intercommunicator in `comms` (each a collective with its live peer) within
    `timeout` s in all; False if some peer never answered (end the process without waiting)."""
    def body() -> None:
        for comm in comms:
            comm.Disconnect()

    worker = _Worker(body)
    if not worker.wait(timeout):
        return False
    try:
        worker.result("MPI Disconnect")
    except PortError:
        return False
    return True


def intercomm_transport(comm: Any) -> MPITransport:
    """Frames over a joined intercommunicator: the peer is remote rank 0 of it."""
    return MPITransport(comm)
