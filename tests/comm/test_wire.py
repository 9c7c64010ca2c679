"""The wire format: round trips for every dtype and odd shape, strict rejection of malformed bytes."""

from __future__ import annotations

import contextlib
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcfed.comm import wire
from hpcfed.comm.wire import WireError, WireLimits

ALL_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


def _sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 100).astype(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7,), (2, 3, 5), (1,) * 9])
def test_round_trip_every_dtype_and_odd_shape(dtype, shape):
    a = _sample(dtype, shape)
    header, tensors = wire.decode(wire.encode({"round": 3, "name": "x"}, {"t": a}))
    assert header == {"round": 3, "name": "x"}
    out = tensors["t"]
    assert out.dtype == np.dtype(dtype).newbyteorder("<") and out.shape == a.shape
    np.testing.assert_array_equal(out, a)


def test_bfloat16_travels_as_two_bytes_per_value_and_keeps_its_dtype():
    a = np.linspace(-3, 3, 1000, dtype=np.float32).astype(ml_dtypes.bfloat16)
    f32 = wire.encoded_size({}, {"t": a.astype(np.float32)})
    bf16 = wire.encoded_size({}, {"t": a})
    assert f32 - bf16 == 2 * a.size
    _, tensors = wire.decode(wire.encode({}, {"t": a}))
    assert tensors["t"].dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(tensors["t"].view(np.uint16), a.view(np.uint16))


# A rank imports these; none may import ml_dtypes (0.7 s of CPU per process) until a bf16 tensor comes.
_FRESH_RANK = """
import sys
import numpy as np
import hpcfed.server.server, hpcfed.client.client, hpcfed.tasks.synthetic, hpcfed.tasks.torch_state, hpcfed.params
from hpcfed.comm import wire
assert "ml_dtypes" not in sys.modules, "a rank module imports ml_dtypes at import time"
_, tensors = wire.decode(sys.stdin.buffer.read())
assert "ml_dtypes" in sys.modules and tensors["t"].dtype == wire.bfloat16(), tensors["t"].dtype
sys.stdout.write(tensors["t"].view(np.uint16).tobytes().hex())
"""


def test_a_fresh_process_imports_ml_dtypes_only_to_decode_a_bfloat16_tensor():
    a = np.linspace(-3, 3, 50, dtype=np.float32).astype(ml_dtypes.bfloat16)
    proc = subprocess.run([sys.executable, "-c", _FRESH_RANK], input=wire.encode({}, {"t": a}), capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert bytes.fromhex(proc.stdout.decode()) == a.view(np.uint16).tobytes()


def test_a_two_byte_void_array_is_not_taken_for_bfloat16():
    # bfloat16's dtype string is "<V2", as any 2-byte void's: only the dtype itself may match.
    with pytest.raises(WireError, match="does not carry"):
        wire.encode({}, {"t": np.zeros(4, dtype="V2")})


def test_nan_and_inf_travel_in_tensors():
    a = np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)
    out = wire.decode(wire.encode({}, {"a": a}))[1]["a"]
    np.testing.assert_array_equal(out, a)


def test_non_contiguous_and_big_endian_inputs_are_converted():
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    strided = base[::2, 1::3]
    fortran = np.asfortranarray(base)
    big = np.arange(5, dtype=">i4")
    _, t = wire.decode(wire.encode({}, {"s": strided, "f": fortran, "b": big}))
    np.testing.assert_array_equal(t["s"], strided)
    np.testing.assert_array_equal(t["f"], base)
    assert t["b"].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(t["b"], np.arange(5))


def test_many_tensors_keep_names_order_and_alignment():
    tensors = {f"layer{i}/w\u00e9": _sample(ALL_DTYPES[i % len(ALL_DTYPES)], (i % 4, 3), i) for i in range(40)}
    buf = bytearray(wire.encode({"k": [1, 2.5, None, True, {"n": "x"}]}, tensors))
    header, out = wire.decode(buf)
    assert list(out) == list(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(out[k], v)
        assert out[k].flags.aligned
    assert header["k"] == [1, 2.5, None, True, {"n": "x"}]


def test_decoded_arrays_are_views_into_the_buffer():
    a = np.arange(1000, dtype=np.float32)
    buf = bytearray(wire.encode({}, {"a": a}))
    out = wire.decode(buf)[1]["a"]
    assert np.shares_memory(out, np.frombuffer(buf, dtype=np.uint8))
    ro = wire.decode(bytes(buf))[1]["a"]
    assert not ro.flags.writeable


def test_unaligned_buffer_is_copied_not_misread():
    a = np.arange(100, dtype=np.float64)
    raw = wire.encode({}, {"a": a})
    shifted = np.zeros(len(raw) + 1, dtype=np.uint8)
    shifted[1:] = np.frombuffer(raw, dtype=np.uint8)
    out = wire.decode(memoryview(shifted)[1:])[1]["a"]
    np.testing.assert_array_equal(out, a)


def test_encode_into_and_encoded_size_agree_with_encode():
    tensors = {"a": np.ones((3, 3), np.float32), "b": np.arange(3, dtype=np.int64)}
    n = wire.encoded_size({"x": 1}, tensors)
    out = bytearray(n)
    assert wire.encode_into({"x": 1}, tensors, memoryview(out)) == n
    assert bytes(out) == wire.encode({"x": 1}, tensors)


@pytest.mark.parametrize("value, fragment", [
    (np.array(["a", "b"]), "dtype"),
    (np.array([1 + 2j]), "dtype"),
    (np.array([object()], dtype=object), "dtype"),
    (np.zeros(3, dtype="V2"), "dtype"),  # 2-byte void: bfloat16's `.str` ("<V2") must not let it through
])
def test_unsupported_dtypes_are_refused_by_name(value, fragment):
    with pytest.raises(WireError, match=fragment) as err:
        wire.encode({}, {"bad": value})
    assert "'bad'" in str(err.value)


@pytest.mark.parametrize("header, fragment", [
    ({"x": float("nan")}, "NaN"),
    ({"x": {1: 2}}, "keys must be str"),
    ({"x": b"bytes"}, "type bytes"),
    ({"x": np.float32(1.0)}, "type float32"),
    ([1, 2], "must be a dict"),
])
def test_bad_headers_are_refused(header, fragment):
    with pytest.raises(WireError, match=fragment):
        wire.encode(header, {})


def test_limits_are_enforced_on_both_sides():
    tiny = WireLimits(max_tensors=2, max_header_bytes=64, max_total_bytes=4096, max_ndim=3, max_name_bytes=8)
    with pytest.raises(WireError, match="tensors"):
        wire.prepare({}, {str(i): np.zeros(1) for i in range(3)}, tiny)
    with pytest.raises(WireError, match="dimensions"):
        wire.prepare({}, {"a": np.zeros((1,) * 4)}, tiny)
    with pytest.raises(WireError, match="names must be"):
        wire.prepare({}, {"a" * 9: np.zeros(1)}, tiny)
    assert wire.decode(wire.encode({}, {"a": np.zeros(10)}), tiny)
    with pytest.raises(WireError, match="limit"):
        wire.decode(wire.encode({}, {"a": np.zeros(1000)}), tiny)
    with pytest.raises(WireError, match="limit"):
        wire.decode(wire.encode({"x": "y" * 100}, {}), tiny)
    with pytest.raises(WireError, match="declares 3 tensors"):
        wire.decode(wire.encode({}, {str(i): np.zeros(1) for i in range(3)}), tiny)


def _valid() -> bytes:
    return wire.encode({"round": 1}, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int64)})


def _table_entry_offset(buf: bytes) -> int:
    head_len = struct.unpack_from("<I", buf, 8)[0]
    return 32 + (head_len + 7) // 8 * 8


@pytest.mark.parametrize("mutate, fragment", [
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"\0", "padded"),
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b[:4] + b"\x09" + b[5:], "version"),
    (lambda b: b[:5] + b"\x01" + b[6:], "reserved"),
    (lambda b: b[:16], "preamble"),
    (lambda b: b"", "preamble"),
])
def test_structural_damage_is_reported(mutate, fragment):
    with pytest.raises(WireError, match=fragment):
        wire.decode(mutate(_valid()))


def _patch(buf: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(buf)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def test_table_fields_are_checked_before_data_is_touched():
    buf = _valid()
    e = _table_entry_offset(buf)  # entry 0: name_len u16, code u8, ndim u8, res u32, off u64, nbytes u64
    with pytest.raises(WireError, match="unknown dtype code"):
        wire.decode(_patch(buf, e + 2, "<B", 14))  # 11 is bfloat16 since dtypes stay on the wire
    with pytest.raises(WireError, match="shape"):
        wire.decode(_patch(buf, e + 16, "<Q", 25))
    with pytest.raises(WireError, match="data offset"):
        wire.decode(_patch(buf, e + 8, "<Q", 0))
    with pytest.raises(WireError, match="shape"):
        wire.decode(_patch(buf, e + 24, "<Q", 1 << 62))  # huge dimension: size mismatch, no allocation
    with pytest.raises(WireError, match="reserved"):
        wire.decode(_patch(buf, e + 4, "<I", 1))
    with pytest.raises(WireError, match="name length"):
        wire.decode(_patch(buf, e, "<H", 0))


def test_duplicate_names_and_invalid_utf8_are_rejected():
    buf = wire.encode({}, {"aa": np.zeros(1), "ab": np.zeros(1)})
    e0 = _table_entry_offset(buf)
    ent = 24 + 8 + 2
    e1 = e0 + (ent + 7) // 8 * 8
    dup = bytearray(buf)
    dup[e1 + 32: e1 + 34] = b"aa"
    with pytest.raises(WireError, match="twice"):
        wire.decode(bytes(dup))
    bad = bytearray(buf)
    bad[e0 + 32: e0 + 34] = b"\xff\xfe"
    with pytest.raises(WireError, match="UTF-8"):
        wire.decode(bytes(bad))


@pytest.mark.parametrize("text, fragment", [
    (b'{"a": NaN}', "NaN"),
    (b'{"a": 1, "a": 2}', "twice"),
    (b"[1, 2]", "JSON object"),
    (b"{\"a\": " + b"[" * 40 + b"]" * 40 + b"}", "deeper"),
    (b"{\"a\": " + b"[" * 100000 + b"]" * 100000 + b"}", "deeper|not valid"),
    (b"\xff{}", "UTF-8"),
    (b"{'a': 1}", "not valid JSON"),
    (b'{"a": ' + b"9" * 5000 + b"}", "integers must fit int64"),
    (b'{"a": ' + b"9" * 400 + b"}", "integers must fit int64"),
    (b'{"a": 9223372036854775808}', "outside int64"),
    (b'{"a": [1e400]}', "finite float64"),
    (b'{"a": -1e999}', "finite float64"),
    (b'{"a": Infinity}', "NaN/Infinity"),
])
def test_header_json_is_strict(text, fragment):
    pre = struct.pack("<4sBBHIIQQ", b"HPCW", 1, 0, 0, len(text), 0, 0, 0)
    body = pre + text + bytes((len(text) + 7) // 8 * 8 - len(text))
    data_offset = (len(body) + 63) // 64 * 64
    body += bytes(data_offset - len(body))
    buf = bytearray(body)
    struct.pack_into("<QQ", buf, 16, data_offset, data_offset)
    with pytest.raises(WireError, match=fragment):
        wire.decode(bytes(buf), WireLimits(max_header_bytes=1 << 20))


# -- fuzzing ----------------------------------------------------------------------------------------
_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_wire_error(data: bytes) -> None:
    try:
        header, tensors = wire.decode(data)
    except WireError:
        return
    assert isinstance(header, dict)
    for arr in tensors.values():
        arr.tobytes()  # the views must be readable end to end


@_FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_raise_only_wire_error(data):
    _decode_or_wire_error(data)
    _decode_or_wire_error(b"HPCW\x01\x00\x00\x00" + data)


@_FUZZ
@given(st.data())
def test_fuzz_mutated_bundles_raise_only_wire_error(data):
    buf = bytearray(_valid())
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "word"]))
        if not buf:
            break
        i = data.draw(st.integers(0, len(buf) - 1))
        if op == "flip":
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            buf[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=16))
        elif i + 8 <= len(buf):  # overwrite a length/offset-sized field with an extreme value
            struct.pack_into("<Q", buf, i, data.draw(st.sampled_from([0, 1, 63, 64, 2**31, 2**32, 2**63, 2**64 - 1])))
    _decode_or_wire_error(bytes(buf))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(ALL_DTYPES), st.lists(st.integers(0, 4), max_size=4)), max_size=6),
       st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1),
                                                       st.floats(allow_nan=False, allow_infinity=False),
                                                       st.text(max_size=20)), max_size=5))
def test_fuzz_round_trip(specs, header):
    tensors = {f"t{i}": _sample(dt, tuple(shape), i) for i, (dt, shape) in enumerate(specs)}
    got_header, got = wire.decode(wire.encode(header, tensors))
    assert got_header == header
    assert list(got) == list(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)


def _with_shape(shape_tail: int) -> bytes:
    """A bundle with one empty float32 tensor of shape (0, shape_tail), laid out canonically."""
    buf = bytearray(wire.encode({}, {"x": np.zeros((0, 2), np.float32)}))
    at = buf.find(struct.pack("<QQ", 0, 2))
    buf[at + 8: at + 16] = struct.pack("<Q", shape_tail)
    return bytes(buf)


@pytest.mark.parametrize("tail", [2**64 - 1, 2**63, (8 << 30) + 1])
def test_empty_tensor_with_a_huge_dimension_is_a_wire_error(tail):
    with pytest.raises(wire.WireError, match="more elements than"):
        wire.decode(_with_shape(tail))
    assert wire.decode(_with_shape(7))[1]["x"].shape == (0, 7)


def test_huge_header_numbers_are_refused_on_both_sides():
    with pytest.raises(wire.WireError, match="outside int64"):
        wire.encode({"num_examples": 10**400})
    with pytest.raises(wire.WireError, match="outside int64"):
        wire.encode({"v": [2**63]})
    assert wire.decode(wire.encode({"v": [2**63 - 1, -2**63, 1e308]}))[0] == {"v": [2**63 - 1, -2**63, 1e308]}


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=400))
def test_decode_raises_only_wire_error_on_any_bytes(raw):
    """Random bytes behind a valid preamble: never anything but a WireError."""
    pre = struct.pack("<4sBBHIIQQ", b"HPCW", 1, 0, 0, min(len(raw), 64), 1, 0, 32 + len(raw))
    for buf in (raw, pre + raw):
        with contextlib.suppress(wire.WireError):  # any other exception fails the test
            wire.decode(buf)
