"""Masks and fixed point for secure aggregation: key agreement, mask expansion, quantisation.

- Pairwise keys: X25519 agreement, then HKDF-SHA256 bound to the two sites and the purpose.
- Masks: AES-256 in CTR mode keyed with the full 32-byte secret, its keystream read as uint32. Never a
  seeded numpy generator and never a seed folded to 32 bits, which would make a mask brute-forceable.
- Fixed point: a value clipped to [-R, R] maps to an integer in [0, levels]; the sum of K such
  integers stays below 2^32 when levels <= (2^32 - 1) // K, so the masked sum mod 2^32 is exact.
"""

from __future__ import annotations

import hashlib

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


def expand(key: bytes, size: int, label: bytes = b"mask") -> np.ndarray:
    """`size` uint32 mask words from AES-256-CTR keyed with the whole 32-byte `key`."""
    if len(key) != 32:
        raise ValueError(f"a mask key is 32 bytes, got {len(key)}")
    nonce = hashlib.sha256(b"hpcfed-secagg-ctr/" + label).digest()[:16]
    enc = Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()
    stream = enc.update(bytes(4 * size)) + enc.finalize()
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32)


def levels_for(num_sites: int) -> int:
    """The largest fixed-point level such that `num_sites` values sum without wrapping mod 2^32."""
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")
    return ((1 << MODULUS_BITS) - 1) // num_sites


def quantise(values: np.ndarray, clip_range: float, levels: int) -> np.ndarray:
    """Values clipped to [-R, R], mapped to uint32 in [0, levels] (stochastic rounding is not used:
    the round trip error is at most R / levels)."""
    x = np.clip(np.asarray(values, dtype=np.float64), -clip_range, clip_range)
    return np.rint((x + clip_range) * (levels / (2 * clip_range))).astype(np.uint32)


def dequantise_sum(total: np.ndarray, count: int, clip_range: float, levels: int) -> np.ndarray:
    """The float64 sum of `count` values from the (unwrapped) sum of their fixed-point codes."""
    return total.astype(np.float64) * (2 * clip_range / levels) - count * clip_range


def encode(update: np.ndarray, num_examples: int, max_examples: int, clip_range: float, levels: int) -> np.ndarray:
    """A site's input: w·update in fixed point with w = n/max_examples, and n itself as one extra
    coordinate, so the weight travels masked too and the server learns only Σ n and Σ w·update."""
    if not 0 <= num_examples <= max_examples:
        raise ValueError(f"num_examples {num_examples} outside 0..{max_examples}")
    w = num_examples / max_examples
    return np.concatenate([quantise(w * np.asarray(update, np.float64), clip_range, levels),
                           np.array([num_examples], dtype=np.uint32)])


def decode(total: np.ndarray, count: int, max_examples: int, clip_range: float, levels: int) -> tuple[np.ndarray, int]:
    """The example-weighted mean update and Σ n from the unmasked sum of `count` sites' `encode`s."""
    examples = int(total[-1])
    weighted = dequantise_sum(total[:-1], count, clip_range, levels)
    if examples == 0:
        raise ValueError("the sites' example counts sum to 0: no weighted mean")
    return weighted * (max_examples / examples), examples
