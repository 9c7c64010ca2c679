"""Liveness between separate jobs, which MPI does not give: heartbeats over the knock's socket.

A killed site job never shows up as an MPI error (an `Irecv` from it stays pending forever) and a
send to it hangs or crashes. After the knock (`hpcfed.comm.rendezvous`) its TCP socket stays open
as the pair's lifeline: each side writes a byte every `interval` s, and a peer is declared lost
when its socket closes (the kernel closes it the moment its process dies, however it died) or
stays silent for `timeout` s (a dead node, a cut network). `on_lost(rank, reason)` is called once
per lost peer, from the lifeline's thread; it must only record the loss (e.g.
`SpokeTransport.mark_lost`), never call MPI or the channel.

This runs on plain sockets in a thread of its own, so it never stalls MPI. Whatever a peer writes
on its lifeline is read and thrown away: only that something came matters.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable

_READ = 4096


class Lifelines:
    """The lifelines of this process: {peer rank: socket}, watched by one thread."""

    def __init__(self, on_lost: Callable[[int, str], None], *, interval: float = 1.0, timeout: float = 60.0) -> None:
        if not 0 < interval < timeout:
            raise ValueError(f"lifeline interval {interval} s must be positive and below the timeout {timeout} s")
        self.on_lost, self.interval, self.timeout = on_lost, interval, timeout
        self._socks: dict[int, socket.socket] = {}
        self._heard: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, rank: int, sock: socket.socket) -> None:
        """Watch `rank` through `sock` from now on (the thread starts with the first one)."""
        sock.setblocking(False)
        with self._lock:
            self._socks[rank] = sock
            self._heard[rank] = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hpcfed-lifeline", daemon=True)
            self._thread.start()

    def watched(self) -> list[int]:
        """The peers still watched (not lost, not closed)."""
        with self._lock:
            return sorted(self._socks)

    def _watch(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._beat()
                next_beat = now + self.interval
            with self._lock:
                socks = dict(self._socks)
            if not socks:
                self._stop.wait(self.interval)
                continue
            ready, _, _ = select.select(list(socks.values()), [], [], max(0.0, next_beat - time.monotonic()))
            for rank, sock in socks.items():
                if sock in ready:
                    self._read(rank, sock)
            self._check_silence()

    def _beat(self) -> None:
        with self._lock:
            socks = dict(self._socks)
        for rank, sock in socks.items():
            try:
                sock.send(b"\x01")
            except BlockingIOError:
                pass  # its buffer is full of our beats: it is not reading, silence will tell
            except OSError as exc:
                self._lose(rank, f"its lifeline failed ({exc.strerror or exc})")

    def _read(self, rank: int, sock: socket.socket) -> None:
        try:
            data = sock.recv(_READ)
        except BlockingIOError:
            return
        except ConnectionResetError:  # it died with our beats unread: its kernel answered with a reset
            data = b""
        except OSError as exc:
            self._lose(rank, f"its lifeline failed ({exc.strerror or exc})")
            return
        if not data:
            self._lose(rank, "its job ended (its lifeline closed)")
            return
        with self._lock:
            self._heard[rank] = time.monotonic()

    def _check_silence(self) -> None:
        now = time.monotonic()
        with self._lock:
            silent = [r for r, t in self._heard.items() if now - t > self.timeout]
        for rank in silent:
            self._lose(rank, f"silent on its lifeline for over {self.timeout:g} s")

    def _lose(self, rank: int, reason: str) -> None:
        with self._lock:
            sock = self._socks.pop(rank, None)
            self._heard.pop(rank, None)
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.close()
        self.on_lost(rank, reason)

    def drop(self, rank: int) -> None:
        """Stop watching `rank` and close its lifeline, without calling `on_lost` (it was not let in)."""
        with self._lock:
            sock = self._socks.pop(rank, None)
            self._heard.pop(rank, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        """Stop watching and close every lifeline (the peers see this process as gone)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            socks, self._socks = list(self._socks.values()), {}
            self._heard.clear()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
