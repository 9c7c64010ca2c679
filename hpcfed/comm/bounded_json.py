"""The JSON of a message header, with bounds: what may be written and what is read back.

Numbers must be int64 integers or finite float64 values (a 10**400 or a NaN/Infinity literal is
refused while parsing, so nothing downstream can overflow on them); an object may not name a key
twice; nesting is bounded. Any violation raises `JSONBoundError` saying what and where (a path
such as ``header.layers[3]``); `wire` turns it into a `WireError`.
"""

from __future__ import annotations

import json
import math
from typing import Any

INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1  # header integers are int64
_MAX_INT_DIGITS = 20  # longer literals are refused before Python converts them


class JSONBoundError(ValueError):
    """A header value outside the bounds; the message says what and where."""


def check(value: Any, depth: int, limit: int, path: str) -> None:
    """Refuse a value that JSON cannot carry within the bounds (`path` names it in the message)."""
    if depth > limit:
        raise JSONBoundError(f"header nests deeper than {limit} levels at {path}")
    if value is None or isinstance(value, (str, bool)):
        return
    if isinstance(value, int):
        if not INT_MIN <= value <= INT_MAX:
            raise JSONBoundError(f"header integer at {path} is outside int64 ({str(value)[:24]}...); "
                                 f"send it as a string or a float")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise JSONBoundError(f"header value at {path} is {value}; JSON has no NaN/Inf (send null instead)")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check(item, depth + 1, limit, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise JSONBoundError(f"header key {k!r} at {path} is {type(k).__name__}; keys must be str")
            check(item, depth + 1, limit, f"{path}.{k}")
        return
    raise JSONBoundError(f"header value at {path} has type {type(value).__name__}; "
                         f"only str/int/float/bool/None/list/dict travel in a header (tensors go in the bundle)")


def _no_constant(name: str) -> Any:
    raise JSONBoundError(f"header contains {name}; JSON has no NaN/Infinity")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JSONBoundError(f"header has the key {key!r} twice in one object")
        out[key] = value
    return out


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_INT_DIGITS:
        raise JSONBoundError(f"header integer {text[:24]}... has {len(text)} digits; integers must fit int64")
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise JSONBoundError(f"header integer {text} is outside int64")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONBoundError(f"header number {text[:24]} does not fit a finite float64")
    return value


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_DECODER = json.JSONDecoder(parse_constant=_no_constant, object_pairs_hook=_unique_pairs,
                            parse_int=_bounded_int, parse_float=_finite_float)


def dumps(value: dict[str, Any], max_depth: int) -> bytes:
    """`value` as compact UTF-8 JSON, after `check`."""
    check(value, 0, max_depth, "header")
    return _ENCODER.encode(value).encode("utf-8")


def loads_object(raw: memoryview | bytes, max_depth: int) -> dict[str, Any]:
    """Parse UTF-8 JSON that must be an object within the bounds."""
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONBoundError(f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        value = _DECODER.decode(text)
    except JSONBoundError:
        raise
    except RecursionError:
        raise JSONBoundError(f"header nests deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        raise JSONBoundError(f"header is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise JSONBoundError(f"header must be a JSON object, got {type(value).__name__}")
    if text.count("[") + text.count("{") > max_depth:  # else it cannot nest too deep
        check(value, 0, max_depth, "header")
    return value
