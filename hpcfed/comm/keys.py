"""Identity key files: ``hpcfed keygen PATH`` and the authorized-keys list.

- ``PATH``: the Ed25519 private key, PEM (PKCS#8, unencrypted), mode 0600, like an SSH key.
- ``PATH.pub``: one line ``hpcfed-ed25519 <base64 of the 32-byte public key> [comment]``.
- An authorized-keys file (the server's ``security.authorized_keys``) holds such lines, one per
  site, each bound to the MPI rank that site runs as: ``hpcfed-ed25519 <base64> rank=N [comment]``
  (N = 1..K). The server accepts a key only from its own rank, so one site cannot pose as another,
  and a key may be listed for one rank only. Blank lines and lines starting with ``#`` are ignored.
"""

from __future__ import annotations

import getpass
import os
import socket
import stat
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hpcfed.comm import crypto


def generate_identity(path: str | os.PathLike[str], *, overwrite: bool = False, comment: str | None = None) -> str:
    """Create an Ed25519 identity at `path` (0600) and `path`.pub; return the public key line."""
    path = Path(path).expanduser()
    pub_path = Path(f"{path}.pub")
    if not overwrite:
        for p in (path, pub_path):
            if p.exists():
                raise ValueError(f"{p} already exists; refusing to overwrite an identity (pass --force to replace it)")
    if not path.parent.is_dir():
        raise ValueError(f"directory {path.parent} does not exist; create it first")
    key = crypto.new_identity()
    if comment is None:
        try:
            comment = f"{getpass.getuser()}@{socket.gethostname()}"
        except (KeyError, OSError):
            comment = socket.gethostname()
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by the umask and ignored for an old file
        os.write(fd, crypto.private_to_pem(key))
    finally:
        os.close(fd)
    os.replace(tmp, path)
    line = crypto.public_line(key, comment)
    pub_path.write_text(line + "\n")
    return line


def load_identity(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Read a private key written by `generate_identity`; refuse one that others can read."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"identity key {path} does not exist; create it with `hpcfed keygen {path}`")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ValueError(f"identity key {path} is readable by others (mode {mode:04o}); run `chmod 600 {path}`")
    try:
        return crypto.private_from_pem(path.read_bytes())
    except ValueError as exc:
        raise ValueError(f"identity key {path} is not an hpcfed (Ed25519 PEM) private key: {exc}") from None


def load_public_keys(path: str | os.PathLike[str]) -> list[Ed25519PublicKey]:
    """Read an authorized-keys (or .pub) file: one ``hpcfed-ed25519 <base64> [comment]`` per line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"public key file {path} does not exist")
    keys = []
    for num, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split(None, 2)
        if parts[0] != crypto.KEY_TYPE or len(parts) < 2:
            raise ValueError(f"{path}:{num}: expected '{crypto.KEY_TYPE} <base64 key> [comment]', "
                             f"got {text[:40]!r} (copy the line from the site's PATH.pub)")
        try:
            keys.append(crypto.public_from_b64(parts[1]))
        except ValueError as exc:
            raise ValueError(f"{path}:{num}: {exc}") from None
    if not keys:
        raise ValueError(f"{path} holds no public keys (add lines from the sites' .pub files)")
    return keys


def load_authorized_keys(path: str | os.PathLike[str]) -> dict[int, Ed25519PublicKey]:
    """Read the server's authorized-keys file: {rank: key}; every line must carry ``rank=N``."""
    path = Path(path).expanduser()
    keys = load_public_keys(path)  # the format checks, with line numbers
    bound: dict[int, Ed25519PublicKey] = {}
    lines = [t for t in (ln.strip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines())
             if t and not t.startswith("#")]
    for text, key in zip(lines, keys):
        num = _line_number(path, text)
        ranks = [tok[5:] for tok in text.split()[2:] if tok.startswith("rank=")]
        if len(ranks) != 1 or not ranks[0].isdigit() or int(ranks[0]) < 1:
            b64 = text.split()[1]
            raise ValueError(f"{path}:{num}: the key is not bound to one site rank; write the line as "
                             f"'{crypto.KEY_TYPE} {b64[:12]}... rank=N' with N the MPI rank that site runs as "
                             f"(1..K; a site's key is accepted from that rank only)")
        rank = int(ranks[0])
        if rank in bound:
            raise ValueError(f"{path}:{num}: rank {rank} is listed twice; each rank has exactly one key")
        raw = crypto.public_raw(key)
        other = [r for r, k in bound.items() if crypto.public_raw(k) == raw]
        if other:
            raise ValueError(f"{path}:{num}: this key is already bound to rank {other[0]}; one key per site "
                             f"(run `hpcfed keygen` for each site)")
        bound[rank] = key
    return bound


def _line_number(path: Path, text: str) -> int:
    for num, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if line.strip() == text:
            return num
    return 0

