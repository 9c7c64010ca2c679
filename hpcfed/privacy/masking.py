"""Masks and fixed point for secure aggregation: key agreement, mask expansion, quantisation.

- Pairwise keys: X25519 agreement, then HKDF-SHA256 bound to the two sites and the purpose.
- Masks: AES-256 in CTR mode keyed with the full 32-byte secret, its keystream read as uint32. Never a
  seeded numpy generator and never a seed folded to 32 bits, which would make a mask brute-forceable.
- Fixed point: a value clipped to [-R, R] maps to an integer in [0, levels]; the sum of K such
  integers stays below 2^32 when levels <= (2^32 - 1) // K, so the masked sum mod 2^32 is exact.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MODULUS_BITS = 32


def agree(private: X25519PrivateKey, peer_public: bytes, a: int, b: int, purpose: bytes) -> bytes:
    """The 32-byte key sites `a` and `b` share for `purpose` (X25519 + HKDF-SHA256; symmetric in a, b)."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    lo, hi = sorted((a, b))
    info = b"hpcfed-secagg/" + purpose + b"/" + lo.to_bytes(4, "big") + hi.to_bytes(4, "big")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


# Masks are applied a block at a time: the block of y and its keystream stay in the L2 cache while
# every mask is added, instead of one pass over memory per mask (AES-CTR's counter runs on between
# blocks, so the keystream is the one `expand` gives).
BLOCK_WORDS = 1 << 16


def _cipher(key: bytes, label: bytes) -> Any:
    if len(key) != 32:
        raise ValueError(f"a mask key is 32 bytes, got {len(key)}")
    nonce = hashlib.sha256(b"hpcfed-secagg-ctr/" + label).digest()[:16]
    return Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()


@functools.lru_cache(maxsize=2)
def _zeros(nbytes: int) -> memoryview:
    """`nbytes` zero bytes, kept: the cipher encrypts them straight into a numpy buffer."""
    return memoryview(bytes(nbytes))


def expand(key: bytes, size: int, label: bytes = b"mask") -> np.ndarray:
    """`size` uint32 mask words (little-endian) from AES-256-CTR keyed with the whole 32-byte `key`."""
    out = np.empty(size, dtype="<u4")
    _cipher(key, label).update_into(_zeros(out.nbytes), out.data.cast("B"))
    return out.astype(np.uint32, copy=False)


def apply_masks(y: np.ndarray, masks: Sequence[tuple[bytes, bytes, int]]) -> None:
    """y += Σ sign·expand(key, y.size, label) mod 2^32 over `masks` (key, label, sign ±1), in place.
    One AES-CTR stream per mask, encrypted a block at a time into one scratch block (no mask is
    ever held whole); uint32 arithmetic wraps mod 2^32."""
    if y.dtype != np.uint32 or y.ndim != 1 or not y.flags.c_contiguous:
        raise ValueError(f"a masked vector is contiguous 1-D uint32, got {y.dtype} {y.shape}")
    streams = [(_cipher(key, label), np.add if sign > 0 else np.subtract) for key, label, sign in masks]
    scratch = np.empty(min(BLOCK_WORDS, y.size), dtype="<u4")
    zeros = _zeros(scratch.nbytes)
    for start in range(0, y.size, BLOCK_WORDS):
        part = y[start:start + BLOCK_WORDS]
        stream = scratch[:part.size]
        view, zero = stream.data.cast("B"), zeros[:stream.nbytes]
        for enc, op in streams:
            enc.update_into(zero, view)
            op(part, stream, out=part)


def levels_for(num_sites: int) -> int:
    """The largest fixed-point level such that `num_sites` values sum without wrapping mod 2^32."""
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")
    return ((1 << MODULUS_BITS) - 1) // num_sites


def quantise(values: np.ndarray, clip_range: float, levels: int, factor: float = 1.0,
             out: np.ndarray | None = None) -> np.ndarray:
    """factor·values clipped to [-R, R], mapped to uint32 in [0, levels] (round to nearest, not
    stochastic: the round trip error is at most R / levels). Worked a block at a time in one
    cache-sized float64 temporary (as `apply_masks`: each block's five steps run while it is in
    the cache, not five passes over memory); written into `out` (uint32, values' size) when given.
    `values` is not changed."""
    scale = levels / (2 * clip_range)
    values = np.asarray(values).reshape(-1)
    if out is None:
        out = np.empty(values.size, dtype=np.uint32)
    scratch = np.empty(min(BLOCK_WORDS, values.size), dtype=np.float64)
    for start in range(0, values.size, BLOCK_WORDS):
        part = values[start:start + BLOCK_WORDS]
        x = scratch[:part.size]
        np.multiply(part, factor * scale, out=x, dtype=np.float64)
        np.clip(x, -clip_range * scale, clip_range * scale, out=x)
        x += clip_range * scale
        np.rint(x, out=x)
        np.copyto(out[start:start + part.size], x, casting="unsafe")
    return out


def dequantise_sum(total: np.ndarray, count: int, clip_range: float, levels: int) -> np.ndarray:
    """The float64 sum of `count` values from the (unwrapped) sum of their fixed-point codes."""
    x = total.astype(np.float64)
    x *= 2 * clip_range / levels
    x -= count * clip_range
    return x


def encode(update: np.ndarray, num_examples: int, max_examples: int, clip_range: float, levels: int,
           factor: float = 1.0) -> np.ndarray:
    """A site's input: w·factor·update in fixed point with w = n/max_examples, and n itself as one
    extra coordinate, so the weight travels masked too and the server learns only Σ n and Σ w·update.
    (`factor` folds a clip's scaling into the same pass.)"""
    if not 0 <= num_examples <= max_examples:
        raise ValueError(f"num_examples {num_examples} outside 0..{max_examples}")
    out = np.empty(np.asarray(update).size + 1, dtype=np.uint32)
    quantise(update, clip_range, levels, factor * num_examples / max_examples, out=out[:-1])
    out[-1] = num_examples
    return out


def decode(total: np.ndarray, count: int, max_examples: int, clip_range: float, levels: int) -> tuple[np.ndarray, int]:
    """The example-weighted mean update and Σ n from the unmasked sum of `count` sites' `encode`s."""
    examples = int(total[-1])
    weighted = dequantise_sum(total[:-1], count, clip_range, levels)
    if examples == 0:
        raise ValueError("the sites' example counts sum to 0: no weighted mean")
    return weighted * (max_examples / examples), examples
