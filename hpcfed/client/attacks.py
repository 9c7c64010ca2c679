"""Malicious-site behaviours the runtime itself can play (``attack=NAME``: the last client turns
malicious), for measuring what bounded influence leaves an attacker (`tools/insider_attacks.py`).

Task-defined attacks (DAMe's ``model`` / ``data``) live in their tasks; these work with any task
because they only rewrite what the site uploads:

- ``claim_examples``: a constant model, claiming 10**12 training examples (FedAvg's weight).
- ``scale``: the trained model times 1e30 (finite, enormous).
- ``sign_flip``: the received model minus 10 x the site's honest step.
- ``flood``: 20 copies of every upload, none of them asked for (async).

Under secure aggregation (`hpcfed.client.secagg`) the same four act on the site's input before
masking: the tampered model's delta, weighted by the claimed count, goes into fixed point without
the site's own clip to C or its bound on the count (`unbounded_input`: a modified binary keeps
neither), within the range the encoding allows; ``flood`` sends 20 copies of each masked input.

Under secure aggregation only (``garbage*``, `garbage_input`): random field elements instead of
the site's fixed-point input (so its masked input is random too), for group testing
(`hpcfed.privacy.group_testing`): ``garbage`` (every coordinate, every round), ``garbage_weight``
(the weight only), ``garbage_vector`` (the weighted delta only), ``garbage_once`` (round 0 only),
``garbage_alternate`` (even rounds).

Misbehaviour the server evicts a site for (`hpcfed.server.eviction`): the site's first upload is
replaced by one malformed UPDATE, and then it stays quiet (``then_flood``: it keeps sending after
it is evicted):

- ``bad_header``: a header integer beyond int64 (``client_version`` = 2**64).
- ``bad_shape``: a tensor of shape (0, 2**64-1).
- ``bad_count``: ``num_examples`` beyond int64.
- ``bad_header_then_flood``: ``bad_header``, then `FLOOD_AFTER` model-sized UPDATEs after eviction.

The sender's own encoder refuses all three, so the hostile site lifts its own checks while it
sends: what arrives is what a modified binary would send.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcfed.params import Params
from hpcfed.privacy import masking

if TYPE_CHECKING:
    from hpcfed.privacy.site_input import InputSpec

RUNTIME_ATTACKS = ("claim_examples", "scale", "sign_flip", "flood")
GARBAGE_ATTACKS = ("garbage", "garbage_weight", "garbage_vector", "garbage_once", "garbage_alternate")
FLOOD_COPIES = 20
MALFORMED_ATTACKS = ("bad_header", "bad_shape", "bad_count", "bad_header_then_flood")
FLOOD_AFTER = 100  # UPDATEs an evicted ``..._then_flood`` site sends anyway ...
FLOOD_FLOATS = 2 << 20  # ... of 8 MiB each (800 MiB in all: more than rank 0 could hold unnoticed)
BEYOND_INT64 = 2**64


def tamper(attack: str, trained: Params, received: Params, num_examples: int) -> tuple[Params, int, int]:
    """(parameters to upload, claimed examples, copies to send) for one malicious upload."""
    if attack == "claim_examples":
        return {k: np.full_like(v, 0.5) if _is_float(v) else v for k, v in trained.items()}, 10**12, 1
    if attack == "scale":
        return {k: (v * np.float32(1e30)).astype(v.dtype) if _is_float(v) else v
                for k, v in trained.items()}, num_examples, 1
    if attack == "sign_flip":
        return {k: (received[k] - 10 * (v - received[k])).astype(v.dtype) if _is_float(v) else v
                for k, v in trained.items()}, num_examples, 1
    if attack == "flood":
        return trained, num_examples, FLOOD_COPIES
    raise ValueError(f"unknown runtime attack {attack!r}; choose one of: {', '.join(RUNTIME_ATTACKS)}")


def unbounded_input(delta: np.ndarray, claimed: int, spec: InputSpec) -> np.ndarray:
    """A malicious site's secure aggregation input: w·delta in fixed point with w = claimed /
    max_examples, NOT clipped to C, each coordinate still within the encoding's ±R, and the claimed
    count written mod 2^32 where an honest site refuses one above max_examples."""
    codes = np.empty(delta.size + 1, dtype=np.uint32)
    masking.quantise(delta, spec.value_range, spec.levels, claimed / spec.max_examples, out=codes[:-1])
    codes[-1] = claimed % (1 << 32)
    return codes


def garbage_input(attack: str, codes: np.ndarray, rnd: int) -> np.ndarray:
    """A hostile site's secure aggregation input under a ``garbage*`` attack in round `rnd`: random
    uint32 field elements where the attack puts them (`codes` as they are in a round it behaves)."""
    if (attack == "garbage_once" and rnd != 0) or (attack == "garbage_alternate" and rnd % 2):
        return codes
    rng = np.random.default_rng()
    out = codes.copy()
    part = slice(-1, None) if attack == "garbage_weight" else slice(None, -1) if attack == "garbage_vector" \
        else slice(None)
    out[part] = rng.integers(0, 1 << 32, size=out[part].size, dtype=np.uint64).astype(np.uint32)
    return out


def _is_float(v: np.ndarray) -> bool:
    return np.asarray(v).dtype.kind == "f" or str(np.asarray(v).dtype) == "bfloat16"


def malformed_update(attack: str, header: dict[str, Any], tensors: dict[str, np.ndarray],
                     send: Callable[[dict[str, Any], dict[str, np.ndarray]], None]) -> None:
    """Send one malformed UPDATE for `attack` (one of `MALFORMED_ATTACKS`) through `send`."""
    from hpcfed.comm import bounded_json, wire

    if attack == "bad_shape":
        with _patched(wire, "struct", _ShapeLie()):
            send(header, {"params": np.zeros((0, 1), dtype=np.float32)})
        return
    field = "num_examples" if attack == "bad_count" else "client_version"
    with _patched(bounded_json, "INT_MAX", BEYOND_INT64 * 2):  # the encoder's own bound, lifted
        send({**header, field: BEYOND_INT64}, tensors)


@contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class _ShapeLie:
    """`struct` as the wire encoder sees it, except that a (0, 1) shape goes out as (0, 2**64-1)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(struct, name)

    @staticmethod
    def pack(fmt: str, *values: Any) -> bytes:
        if fmt == "<2Q" and values == (0, 1):
            values = (0, BEYOND_INT64 - 1)
        return struct.pack(fmt, *values)
