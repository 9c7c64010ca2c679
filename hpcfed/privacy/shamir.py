"""Shamir's t-of-n secret sharing (Shamir 1979) of 32-byte secrets over the prime field GF(2^521 - 1).

Any `threshold` shares give the secret back (Lagrange interpolation at 0); fewer say nothing about it.
The field is larger than every 32-byte secret, so a secret is one field element. Coefficients come from
`secrets` (the OS CSPRNG).
"""

from __future__ import annotations

import secrets as _secrets

PRIME = (1 << 521) - 1  # a Mersenne prime
SECRET_BYTES = 32
SHARE_BYTES = 66  # a field element, big-endian


def split(secret: bytes, threshold: int, num_shares: int) -> list[tuple[int, bytes]]:
    """`num_shares` shares (x = 1..n, y as SHARE_BYTES) of `secret`, any `threshold` of which rebuild it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret is {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= num_shares:
        raise ValueError(f"threshold must be in 1..{num_shares}, got {threshold}")
    coeffs = [int.from_bytes(secret, "big")] + [_secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = []
    for x in range(1, num_shares + 1):
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        shares.append((x, y.to_bytes(SHARE_BYTES, "big")))
    return shares


def combine(shares: list[tuple[int, bytes]], threshold: int) -> bytes:
    """The secret from at least `threshold` shares with distinct x (only the first `threshold` are used)."""
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares cannot rebuild a secret of threshold {threshold}")
    points = []
    for x, y in shares[:threshold]:
        value = int.from_bytes(y, "big")
        if not 0 < x < PRIME or len(y) != SHARE_BYTES or value >= PRIME:
            raise ValueError(f"share x={x} is out of the field")
        points.append((x, value))
    if len({x for x, _ in points}) != len(points):
        raise ValueError("two shares have the same x")
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * SECRET_BYTES):
        raise ValueError("the shares do not rebuild a 32-byte secret (a share is wrong)")
    return secret.to_bytes(SECRET_BYTES, "big")
