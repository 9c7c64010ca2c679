"""Identity key files: ``hpcfed keygen PATH`` and the authorized-keys list.

- ``PATH``: the Ed25519 private key, PEM (PKCS#8, unencrypted), mode 0600, like an SSH key.
- ``PATH.pub``: one line ``hpcfed-ed25519 <base64 of the 32-byte public key> [comment]``.
- An authorized-keys file (the server's ``security.authorized_keys``) holds such lines, one per
  site; blank lines and lines starting with ``#`` are ignored.
"""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import stat
from pathlib import Path

from hpcfed.comm import crypto


def generate_identity(path: str | os.PathLike, *, overwrite: bool = False, comment: str | None = None) -> str:
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


def load_identity(path: str | os.PathLike) -> "crypto.Ed25519PrivateKey":
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


def load_public_keys(path: str | os.PathLike) -> list["crypto.Ed25519PublicKey"]:
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


def keygen_main(argv: list[str]) -> int:
    """``hpcfed keygen PATH [--force] [--comment TEXT]``."""
    p = argparse.ArgumentParser(prog="hpcfed keygen", description="create an Ed25519 site identity")
    p.add_argument("path")
    p.add_argument("--force", action="store_true", help="overwrite an existing key")
    p.add_argument("--comment", default=None)
    args = p.parse_args(argv)
    line = generate_identity(args.path, overwrite=args.force, comment=args.comment)
    print(f"wrote {args.path} (private, mode 0600) and {args.path}.pub")
    print(f"add this line to the server's authorized_keys file:\n{line}")
    return 0
