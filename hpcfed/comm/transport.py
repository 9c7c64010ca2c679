"""Moving opaque frames between ranks. The only module that moves frames with mpi4py (`port`
joins separate jobs with it).

A transport moves byte frames and nothing else: no pickle, no objects. Frames between one pair of
ranks arrive in the order they were sent (MPI's non-overtaking rule, one tag for everything).

- `MPITransport`: buffer-based ``Isend`` / ``Iprobe`` / ``Irecv`` on bytes over a communicator.
- `InProcTransport`: the same interface over in-memory queues, one object per simulated rank, for
  unit tests of the channel without MPI (the pattern of Dask's ``distributed/comm/inproc.py``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

FRAME_TAG = 0x4846  # one tag for all frames keeps MPI's per-pair ordering


class Request(Protocol):
    """A started non-blocking send or receive: poll it with `test`, abandon it with `cancel`."""

    def test(self) -> bool:
        """Whether the operation has completed (it also lets MPI make progress on it)."""

    def cancel(self) -> None:
        """Abandon the operation (its peer is gone or stalled) without waiting; MPI may still read
        or write its buffer later, so the caller never reuses that buffer."""


class Transport(Protocol):
    """What the channel needs of a way to move frames between ranks: MPI (`MPITransport`), the spokes
    of separate jobs, or in-process queues for tests; the channel never calls mpi4py itself."""

    rank: int
    size: int

    def isend(self, frame: memoryview, dest: int) -> Request:
        """Start sending one frame to `dest`; the buffer must stay untouched until the request completes."""

    def iprobe(self, source: int | None = None) -> tuple[int, int] | None:
        """(source, bytes) of a frame that has arrived (from `source`, or from any rank), or None."""

    def irecv_into(self, source: int, out: memoryview) -> Request:
        """Start receiving the next frame from `source` into `out`. A probed frame may still be on
        its way (past MPI's eager limit only its envelope has arrived), so this never blocks."""

    def discard(self, source: int) -> Request:
        """Start dropping the next frame from `source` without reading it (an oversize frame)."""

    def bcast_bytes(self, data: bytes | None, nbytes: int, root: int = 0) -> bytes:
        """`root`'s `nbytes` bytes (`data` there) at every rank."""

    def shm_create(self, tag: str, nbytes: int) -> tuple[str, memoryview] | None:
        """Shared memory the peer on this node maps too, so that big chunks skip MPI's copy; None where
        /dev/shm is missing or full."""

    def shm_attach(self, name: str, nbytes: int) -> memoryview | None:
        """Map the shared memory a peer created (`shm_create`); None when it is not on this node or
        not the size announced."""

    def shm_unlink(self, name: str) -> None:
        """Remove the named shared memory once both sides have mapped it (or given up)."""


# -- node-local shared memory -----------------------------------------------------------------------
_SHM_DIR = "/dev/shm"


def _shm_create(tag: str, nbytes: int) -> tuple[str, memoryview] | None:
    """A fresh 0600 file in /dev/shm of `nbytes`, mapped; None where there is none or no room.
    The space is reserved up front (posix_fallocate): writing to a tmpfs mapping that has run out
    of room would kill the process with SIGBUS."""
    if not os.path.isdir(_SHM_DIR) or not hasattr(os, "posix_fallocate"):
        return None
    name = f"hpcfed-{tag}-{secrets.token_hex(8)}"
    path = os.path.join(_SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        _unlink(path)
        return None
    os.close(fd)
    return name, memoryview(mm)


def _shm_attach(name: str, nbytes: int) -> memoryview | None:
    if not name.startswith("hpcfed-") or "/" in name or len(name) > 200:
        return None
    try:
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
    except OSError:  # another node, or already gone
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            return None
        return memoryview(mmap.mmap(fd, nbytes))
    except OSError:
        return None
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):  # already gone
        os.unlink(path)


# -- MPI --------------------------------------------------------------------------------------------
class _MPIRequest:
    __slots__ = ("_discarding", "_done", "_is_send", "_req")

    def __init__(self, req: object, is_send: bool, discarding: bool = False) -> None:
        self._req = req
        self._done = False
        self._is_send = is_send
        self._discarding = discarding  # a receive into 1 byte: its truncation error is its completion

    def test(self) -> bool:
        if not self._done:
            try:
                self._done = bool(self._req.Test())  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
            except Exception as exc:
                if not (self._discarding and _is_truncation(exc)):
                    raise
                self._done = True  # MPI defines a truncated receive as consuming the message
        return self._done

    def cancel(self) -> None:
        """Give the request up without blocking. A send is not cancelled but left to complete on
        its own: cancelling one that the receiver has matched hangs in MPICH when the receiver is
        stopped, and a half-cancelled send can leave the receiver a probe that no longer matches.
        Its buffer is kept alive until the process ends."""
        if self._done:
            return
        if not self._is_send:
            # A receive not yet matched is cancelled; one matched to a frame whose sender died
            # can neither be cancelled nor complete (waiting on it would hang): it is left pending.
            self._req.Cancel()  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
            with contextlib.suppress(Exception):
                if self._req.Test():  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
                    self._done = True
                    return
        _ABANDONED.append(self._req)
        self._done = True


# Requests given up on by `cancel`; MPI may still use their buffers (mpi4py's request holds them), so
# they must outlive it.
_ABANDONED: list[object] = []


def _is_truncation(exc: Exception) -> bool:
    from mpi4py import MPI

    return isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_TRUNCATE


class MPITransport:
    """Frames over an mpi4py communicator with buffer calls only (never the pickle-based
    lowercase ``send``/``recv``). Frames are at most a few MiB (the channel chunks), far from
    MPI's int32 count limit."""

    def __init__(self, comm: object | None = None, tag: int = FRAME_TAG) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank: int = self.comm.Get_rank()  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
        self.size: int = self.comm.Get_size()  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
        self.tag = tag
        self._status = MPI.Status()

    def isend(self, frame: memoryview, dest: int) -> _MPIRequest:
        req = self.comm.Isend([frame, self._MPI.BYTE], dest=dest, tag=self.tag)  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
        return _MPIRequest(req, is_send=True)

    def iprobe(self, source: int | None = None) -> tuple[int, int] | None:
        """(source, bytes) of a frame that has arrived (from `source`, or from any rank), or None."""
        st = self._status
        src = self._MPI.ANY_SOURCE if source is None else source
        if not self.comm.Iprobe(source=src, tag=self.tag, status=st):  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
            return None
        count = st.Get_count(self._MPI.BYTE)
        if count == self._MPI.UNDEFINED or count < 0:
            count = 1 << 62  # larger than any limit: the channel discards it as oversize
        return st.Get_source(), count

    def irecv_into(self, source: int, out: memoryview) -> _MPIRequest:
        req = self.comm.Irecv([out, self._MPI.BYTE], source=source, tag=self.tag)  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
        return _MPIRequest(req, is_send=False)

    def discard(self, source: int) -> _MPIRequest:
        """Start dropping the next frame from `source` without reading it (an oversize frame):
        receiving it into a 1-byte buffer ends the receive with a truncation error, which MPI
        defines as consuming the message."""
        req = self.comm.Irecv([bytearray(1), self._MPI.BYTE], source=source, tag=self.tag)  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
        return _MPIRequest(req, is_send=False, discarding=True)

    def bcast_bytes(self, data: bytes | None, nbytes: int, root: int = 0) -> bytes:
        buf = np.zeros(nbytes, dtype=np.uint8)
        if self.rank == root:
            if data is None or len(data) != nbytes:
                raise ValueError(f"bcast_bytes: the root must pass exactly {nbytes} bytes")
            buf[:] = np.frombuffer(data, dtype=np.uint8)
        self.comm.Bcast([buf, self._MPI.BYTE], root=root)  # type: ignore[attr-defined]  # mpi4py's Comm/Request, typed `object` so that comm imports mpi4py lazily
        return buf.tobytes()

    def shm_create(self, tag: str, nbytes: int) -> tuple[str, memoryview] | None:
        """Shared memory the peer maps too (when it runs on this node): big chunks then skip
        MPI's copy. None where /dev/shm is missing or full."""
        return _shm_create(tag, nbytes)

    def shm_attach(self, name: str, nbytes: int) -> memoryview | None:
        return _shm_attach(name, nbytes)

    def shm_unlink(self, name: str) -> None:
        _unlink(os.path.join(_SHM_DIR, name))


# -- in-process -------------------------------------------------------------------------------------
class _Done:
    __slots__ = ()

    def test(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


_DONE = _Done()

# tap(source, dest, frame) -> frames actually delivered (tests use it to tamper, drop or replay)
Tap = Callable[[int, int, bytes], list[bytes]]


class _Hub:
    def __init__(self, size: int, tap: Tap | None) -> None:
        self.size = size
        self.tap = tap
        self.lock = threading.Lock()
        self.inbox: list[deque[tuple[int, bytes]]] = [deque() for _ in range(size)]
        self.bcast: dict[int, bytes] = {}
        self.bcast_cv = threading.Condition(self.lock)
        self.shm: dict[str, memoryview] = {}


class InProcTransport:
    """One simulated rank of an in-memory job; create a job with `InProcTransport.group(size)`.
    Sends copy the frame and complete at once; run each rank's channel in its own thread."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub = hub
        self.rank = rank
        self.size = hub.size

    @classmethod
    def group(cls, size: int, tap: Tap | None = None) -> list[InProcTransport]:
        hub = _Hub(size, tap)
        return [cls(hub, r) for r in range(size)]

    def isend(self, frame: memoryview, dest: int) -> _Done:
        if not 0 <= dest < self.size:
            raise ValueError(f"rank {dest} does not exist (size {self.size})")
        data = bytes(frame)
        frames = self._hub.tap(self.rank, dest, data) if self._hub.tap else [data]
        with self._hub.lock:
            self._hub.inbox[dest].extend((self.rank, f) for f in frames)
        return _DONE

    def inject(self, dest: int, frame: bytes) -> None:
        """Deliver raw bytes from this rank, bypassing the tap (hostile-peer tests)."""
        with self._hub.lock:
            self._hub.inbox[dest].append((self.rank, bytes(frame)))

    def iprobe(self, source: int | None = None) -> tuple[int, int] | None:
        with self._hub.lock:
            for src, frame in self._hub.inbox[self.rank]:
                if source is None or src == source:
                    return src, len(frame)
            return None

    def _pop(self, source: int) -> bytes:
        with self._hub.lock:
            q = self._hub.inbox[self.rank]
            for i, (src, frame) in enumerate(q):
                if src == source:
                    del q[i]
                    return frame
        raise RuntimeError(f"no frame from rank {source} to receive (probe first)")

    def irecv_into(self, source: int, out: memoryview) -> _Done:
        frame = self._pop(source)
        if len(frame) > len(out):
            raise ValueError(f"frame of {len(frame)} bytes does not fit the {len(out)}-byte buffer")
        out[: len(frame)] = frame
        return _DONE

    def discard(self, source: int) -> _Done:
        self._pop(source)
        return _DONE

    def bcast_bytes(self, data: bytes | None, nbytes: int, root: int = 0) -> bytes:
        hub = self._hub
        with hub.bcast_cv:
            if self.rank == root:
                if data is None or len(data) != nbytes:
                    raise ValueError(f"bcast_bytes: the root must pass exactly {nbytes} bytes")
                hub.bcast[root] = bytes(data)
                hub.bcast_cv.notify_all()
            elif not hub.bcast_cv.wait_for(lambda: root in hub.bcast, timeout=60):
                raise TimeoutError("bcast_bytes: the root never sent")
            return hub.bcast[root]

    def shm_create(self, tag: str, nbytes: int) -> tuple[str, memoryview] | None:
        name = f"hpcfed-{tag}-{secrets.token_hex(8)}"
        with self._hub.lock:
            self._hub.shm[name] = memoryview(bytearray(nbytes))
            return name, self._hub.shm[name]

    def shm_attach(self, name: str, nbytes: int) -> memoryview | None:
        with self._hub.lock:
            mv = self._hub.shm.get(name)
        return mv if mv is not None and len(mv) == nbytes else None

    def shm_unlink(self, name: str) -> None:
        with self._hub.lock:
            self._hub.shm.pop(name, None)
