"""Reassembly: a chunk that does not fit its message (out of order, overlapping, past the declared
total, a count that does not match the size, too big) is refused before anything is decrypted;
message buffers are recycled only when no tensor views them."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from hpcfed.comm.frame import F_CONFIRM, F_DATA, F_SHM_OFFER
from hpcfed.comm.reassembly import Assembly, PayloadPool, check_chunk, opened
from hpcfed.comm.stats import ChannelStats

MAX = 1 << 30
C = 4096  # chunk size of these messages


def _asm(count: int = 4, total: int = 4 * C, msg_id: int = 5) -> Assembly:
    return Assembly(msg_id, 4, total, count, np.zeros(total, np.uint8))


def test_chunks_in_order_fit_and_the_last_one_completes():
    asm = _asm()
    assert check_chunk(None, F_DATA, 5, 0, 4, 0, C, 4 * C, MAX) is None
    for i in range(1, 4):
        assert not asm.took(i - 1, (i - 1) * C, C, i)
        assert check_chunk(asm, F_DATA, 5, i, 4, i * C, C, 4 * C, MAX) is None
    assert asm.took(3, 3 * C, C, 9) and asm.filled == 4 * C and asm.last_seq == 9


@pytest.mark.parametrize("asm, args, reason, words", [
    (None, (5, 1, 4, C, C, 4 * C), "chunk out of sequence", "without its earlier chunks"),
    ("asm", (6, 1, 4, C, C, 4 * C), "chunk out of sequence", "without its earlier chunks"),  # another message
    ("asm", (5, 1, 3, C, C, 4 * C), "chunk out of sequence", "without its earlier chunks"),  # count changed
    ("asm", (5, 1, 4, C, C, 4 * C + 1), "chunk out of sequence", "without its earlier chunks"),  # total changed
    ("asm", (5, 2, 4, 2 * C, C, 4 * C), "chunk out of sequence", "where chunk 1 was expected"),  # skipped one
    ("asm", (5, 1, 4, C - 1, C, 4 * C), "chunk out of sequence", "where chunk 1 was expected"),  # overlaps
    ("asm", (5, 1, 4, C + 1, C, 4 * C), "chunk out of sequence", "where chunk 1 was expected"),  # leaves a gap
])
def test_a_chunk_out_of_place_is_refused(asm, args, reason, words):
    a = _asm()
    a.took(0, 0, C, 1)
    msg_id, index, count, offset, length, total = args
    got = check_chunk(a if asm == "asm" else None, F_DATA, msg_id, index, count, offset, length, total, MAX)
    assert got is not None and got[0] == reason and words in got[1]


@pytest.mark.parametrize("ftype, index, count, offset, length, total, words", [
    (F_DATA, 0, 1, 0, 10, 1 << 31, "exceeds comm.max_message_bytes"),
    (F_DATA, 0, 0, 0, 10, 10, "chunk 0 of 0"),
    (F_DATA, 4, 4, 0, 10, 4 * C, "chunk 4 of 4"),
    (F_DATA, 0, 3, 0, 10, 10, "chunk 0 of 3 for a 10-byte message"),  # more chunks than 4 KiB pieces
    (F_DATA, 0, 1, 0, 11, 10, "covers bytes 0..11 of 10"),  # past the declared total
    (F_DATA, 0, 1, 0, 9, 10, "covers bytes 0..9 of 10"),  # the last chunk ends short
    (F_DATA, 0, 2, 0, 0, 2 * C, "covers bytes 0..0"),  # an empty middle chunk
    (F_DATA, 0, 1, 5, 5, 10, "first chunk at offset 5"),
    (F_CONFIRM, 0, 1, 0, 1, 1, "confirmation carries no data"),
    (F_SHM_OFFER, 0, 1, 0, 2000, 2000, "one small chunk"),
])
def test_a_chunk_that_lies_about_its_message_is_malformed(ftype, index, count, offset, length, total, words):
    got = check_chunk(None, ftype, 1, index, count, offset, length, total, 1 << 30)
    assert got is not None and got[0] == "malformed frame" and words in got[1]


def test_opened_waits_for_the_pool_and_fails_if_any_chunk_failed():
    stats = ChannelStats()
    asm = _asm()
    assert opened(asm, stats)  # nothing on the pool
    ok, bad, broken = Future(), Future(), Future()
    ok.set_result(0.25)
    bad.set_result(-1.0)
    broken.set_exception(RuntimeError("thread died"))
    asm.opening = [ok, ok]
    assert opened(asm, stats) and stats.open_s == 0.5 and asm.opening == []
    for failing in (bad, broken):
        asm.opening = [ok, failing]
        assert not opened(asm, stats)


def test_a_buffer_is_reused_only_when_no_tensor_views_it():
    pool = PayloadPool(chunk_bytes=C)
    first = pool.buffer(1000)
    ident = first.__array_interface__["data"][0]
    view = first[10:20]  # a decoded tensor still alive
    del first
    second = pool.buffer(1000)
    assert second.__array_interface__["data"][0] != ident
    del view, second
    again = pool.buffer(1000)
    assert again.__array_interface__["data"][0] in {b.__array_interface__["data"][0] for b in pool.bufs}
    slightly_smaller = pool.buffer(990)  # within 1/16: served by a bigger free buffer, cut to size
    assert len(slightly_smaller) == 990
    del again, slightly_smaller


def test_release_and_the_first_chunk_scratch():
    pool = PayloadPool(chunk_bytes=C)
    buf = pool.buffer(5000)
    pool.release(buf[:4000])  # a view of it releases it too
    assert pool.bufs == []
    s = pool.scratch0(100)
    assert len(s) == 100 and len(s.base) >= C
    pool.clear()
    assert pool.bufs == []
