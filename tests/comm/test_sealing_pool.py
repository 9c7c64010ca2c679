"""Chunks of a big message sealed and opened by a pool of threads: the same frames as one thread,
tampering still caught (a later chunk that fails refuses its whole message), an abandoned message
waits for its chunks being opened, a failing sealer neither hangs nor leaks threads, and
comm.crypto_threads validated."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from test_channel import _connect

from hpcfed.comm import crypto
from hpcfed.comm.api import ChannelError
from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.frame import HDR
from hpcfed.comm.sealing import default_crypto_threads
from hpcfed.comm.transport import InProcTransport
from hpcfed.config import ConfigError, load

REPO = Path(__file__).resolve().parents[2]
PSK = bytes(range(32))
KEY = bytes(range(100, 132))


def _pair(threads: int, tap=None, chunk_bytes: int = 8192) -> list[SecureChannel]:
    ts = InProcTransport.group(2, tap=tap)
    chans = [SecureChannel(t, Credentials(mode="psk", psk=PSK), b"job-1", chunk_bytes=chunk_bytes,
                           shared_memory=False, crypto_threads=threads) for t in ts]
    assert _connect(chans) == {}
    return chans


def _recording(frames: list[bytes]):
    """A tap that keeps a copy of every frame rank 1 sends and delivers it unchanged."""
    def tap(src: int, dst: int, frame: bytes) -> list[bytes]:
        if src == 1:
            frames.append(bytes(frame))
        return [frame]
    return tap


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)  # several tensors, so chunks span tensor boundaries
    return {"a": rng.standard_normal(9_000), "b": rng.standard_normal(777).astype(np.float32),
            "c": np.arange(20_001, dtype=np.int8)}


@pytest.mark.parametrize("threads", [2, 4])
def test_a_pool_sends_the_same_frames_as_one_thread(threads):
    wires: dict[int, list[bytes]] = {}
    for n in (1, threads):
        frames: list[bytes] = []
        chans = _pair(n, tap=_recording(frames))
        # the same session key in both runs (the handshake's are random), so ciphertexts compare
        chans[1]._session.peers[0].tx = crypto.Sealer(KEY, crypto.DIR_INITIATOR_TO_RESPONDER)
        chans[0]._session.peers[1].rx = crypto.Sealer(KEY, crypto.DIR_INITIATOR_TO_RESPONDER)
        del frames[:]
        chans[1].send(0, 4, {"n": 1}, _tensors())
        m = chans[0].recv(timeout=10)
        assert m is not None and m.header == {"n": 1}
        for k, v in _tensors().items():
            np.testing.assert_array_equal(m.tensors[k], v)
        assert chans[0].stats.rejected == {}
        wires[n] = frames
        for ch in chans:
            ch.close()
    assert len(wires[1]) > 10
    assert wires[1] == wires[threads]


@pytest.mark.parametrize("chunk_bytes", [8192, 80_000])  # opened at once / later chunks opened on the pool
def test_tampering_is_caught_with_the_pool(chunk_bytes):
    victim = {"armed": True}
    big = chunk_bytes > 70_000
    payload = _big() if big else _tensors()

    def tap(src: int, dst: int, frame: bytes) -> list[bytes]:
        if src == 1 and victim["armed"] and len(frame) > chunk_bytes - 100 and frame[32] == 3:  # chunk index 3
            victim["armed"] = False
            return [frame[:HDR + 50] + bytes([frame[HDR + 50] ^ 4]) + frame[HDR + 51:]]
        return [frame]

    chans = _pair(4, tap=tap, chunk_bytes=chunk_bytes)
    chans[1].send(0, 4, {"n": 1}, payload)
    chans[1].send(0, 4, {"n": 2}, payload)
    m = chans[0].recv(timeout=10)
    assert m is not None and m.header == {"n": 2}
    for k, v in payload.items():
        np.testing.assert_array_equal(m.tensors[k], v)
    assert chans[0].stats.rejected["authentication failed"] == 1
    assert chans[0].recv(timeout=0.2) is None
    for ch in chans:
        ch.close()


def _big() -> dict[str, np.ndarray]:
    # frames above the 64 KiB that arrive whole when probed go through the pooled receive path
    return {"x": np.random.default_rng(3).standard_normal(160_000), "y": np.arange(70_001, dtype=np.int16)}


def test_later_chunks_are_opened_on_the_pool_and_the_first_at_once(monkeypatch):
    real = crypto.Sealer.open_into
    where: list[tuple[int, str]] = []

    def recorded(self, seq, data, aad, out):
        where.append((int.from_bytes(aad[16 + 32:16 + 36], "little"), threading.current_thread().name))
        return real(self, seq, data, aad, out)

    chans = _pair(3, chunk_bytes=80_000)
    monkeypatch.setattr(crypto.Sealer, "open_into", recorded)
    chans[1].send(0, 4, {"n": 1}, _big())
    m = chans[0].recv(timeout=10)
    assert m is not None and m.header == {"n": 1}
    for k, v in _big().items():
        np.testing.assert_array_equal(m.tensors[k], v)
    chunks = [(index, name) for index, name in where if name != threading.current_thread().name]
    assert len(chunks) >= 10 and all(name.startswith("hpcfed-crypto0") for _, name in chunks)
    assert (0, threading.current_thread().name) in where and 0 not in {index for index, _ in chunks}
    assert chans[0].stats.rejected == {} and chans[0].stats.open_s > 0
    for ch in chans:
        ch.close()


def test_an_abandoned_message_is_dropped_after_its_pooled_chunks_and_the_next_one_arrives():
    dropped = {"armed": True}

    def tap(src: int, dst: int, frame: bytes) -> list[bytes]:
        count = int.from_bytes(frame[36:40], "little")
        if src == 1 and dropped["armed"] and len(frame) > 70_000 and frame[32] == count - 2:  # a late chunk
            dropped["armed"] = False
            return []
        return [frame]

    chans = _pair(3, tap=tap, chunk_bytes=80_000)
    chans[1].send(0, 4, {"n": 1}, _big())
    chans[1].send(0, 4, {"n": 2}, _big())
    m = chans[0].recv(timeout=10)
    assert m is not None and m.header == {"n": 2}
    np.testing.assert_array_equal(m.tensors["y"], _big()["y"])
    assert chans[0].stats.rejected == {"chunk out of sequence": 1, "incomplete message abandoned": 1}
    assert chans[0].recv(timeout=0.2) is None
    for ch in chans:
        ch.close()


def test_a_failing_sealer_raises_a_channel_error_and_threads_are_joined(monkeypatch):
    chans = _pair(3)
    real = crypto.Sealer.seal_into
    calls = {"n": 0}

    def flaky(self, seq, data, aad, out):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated sealing fault")
        return real(self, seq, data, aad, out)

    monkeypatch.setattr(crypto.Sealer, "seal_into", flaky)
    with pytest.raises(ChannelError, match="sealing a message to rank 0 failed: simulated sealing fault"):
        chans[1].send(0, 4, {"n": 1}, _tensors())
    chans[1].send(0, 4, {"n": 2}, _tensors())  # the channel goes on; the broken message is abandoned
    m = chans[0].recv(timeout=10)
    assert m is not None and m.header == {"n": 2}
    # this pair's pool threads (other tests' channels may still hold threads of the same name)
    threads = [t for ch in chans if ch._crypto.executor is not None for t in ch._crypto.executor._threads]
    assert threads and all(t.name.startswith("hpcfed-crypto") and t.is_alive() for t in threads)
    for ch in chans:
        ch.close()
    assert not any(t.is_alive() for t in threads)


def test_crypto_threads_default_and_validation():
    assert 1 <= default_crypto_threads() <= 8
    ts = InProcTransport.group(1)
    for bad in (0, -1, 65, 2.5, True):
        with pytest.raises(ValueError, match=r"comm\.crypto_threads"):
            SecureChannel(ts[0], Credentials(mode="psk", psk=PSK), b"j", crypto_threads=bad)
    assert load(REPO / "configs" / "quickstart.yaml", ["comm.crypto_threads=3"]).comm.crypto_threads == 3
    for bad in ("0", "-2", "1000"):
        with pytest.raises(ConfigError, match="crypto_threads"):
            load(REPO / "configs" / "quickstart.yaml", [f"comm.crypto_threads={bad}"])


def test_default_threads_share_the_cores_among_the_ranks_of_the_node(monkeypatch):
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("MPI_LOCALNRANKS", "1")
    assert default_crypto_threads() == 8
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    assert default_crypto_threads() == 4
    monkeypatch.setenv("MPI_LOCALNRANKS", "32")
    assert default_crypto_threads() == 1


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_messages_at_chunk_boundaries_arrive_whole(threads, extra):
    """Totals one byte either side of a multiple of the chunk size: the same offset/count logic a
    tensor over 2 GiB goes through with 4 MiB chunks (tools/bench_big_tensor.py moves a real one)."""
    chans = _pair(threads, chunk_bytes=4096)
    probe = chans[1]._tx.prepare(0, 4, {}, {"t": np.zeros(0, np.uint8)})[1].total  # prefix bytes
    n = 5 * 4096 - probe + extra
    data = np.arange(n, dtype=np.int64).astype(np.uint8)
    chans[1].send(0, 4, {}, {"t": data})
    m = chans[0].recv(timeout=10)
    assert m is not None and m.tensors["t"].shape == (n,)
    np.testing.assert_array_equal(m.tensors["t"], data)
    assert chans[0].stats.rejected == {}


def test_post_with_the_pool_sends_the_same_frames_as_one_thread():
    wires: dict[int, list[bytes]] = {}
    for n in (1, 3):
        frames: list[bytes] = []
        chans = _pair(n, tap=_recording(frames))
        chans[1]._session.peers[0].tx = crypto.Sealer(KEY, crypto.DIR_INITIATOR_TO_RESPONDER)
        chans[0]._session.peers[1].rx = crypto.Sealer(KEY, crypto.DIR_INITIATOR_TO_RESPONDER)
        del frames[:]
        out = chans[1].post(0, 4, {"n": 1}, _tensors())
        m = chans[0].recv(timeout=10)
        assert m is not None and m.header == {"n": 1} and out.done()
        np.testing.assert_array_equal(m.tensors["c"], _tensors()["c"])
        wires[n] = frames
        for ch in chans:
            ch.close()
    assert len(wires[1]) > 10 and wires[1] == wires[3]
