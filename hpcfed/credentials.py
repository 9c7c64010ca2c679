"""Config `security:` section -> this rank's keys (`RankKeys`): its `hpcfed.comm.crypto.Credentials`,
the tags of its state files, its secret seeds; built once where the rank starts and passed down.

It builds on `hpcfed.comm` (crypto, keys): the dependency runs one way, from here down to comm,
which knows nothing of the configuration.

Two modes:
- ``psk``: one pre-shared 32-byte key (hex) for the whole job, from ``$HPCFED_PSK`` (or
  ``security.psk_env``) or ``security.psk_file``. `hpcfed run --np` creates a fresh one per job.
- ``keys``: every site has an Ed25519 identity (`hpcfed keygen`); the server lists the allowed site
  public keys in ``security.authorized_keys``, each bound to its rank (``rank=N`` on the line), and
  clients pin ``security.server_public_key``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hpcfed.comm.crypto import Credentials, public_raw
from hpcfed.comm.keys import load_authorized_keys, load_identity, load_public_keys
from hpcfed.config import ConfigError, SecurityConfig
from hpcfed.store.sealed import FileAuth


class RankKeys:
    """This rank's keys, read once from the `security:` section where the rank starts and passed
    down to what needs them: the channel's credentials, the tags of its state files, its secret
    seeds, secure aggregation's signing key. Each is read on first use (a psk-mode run never looks
    for identity files); a problem is a `ConfigError` naming the key."""

    def __init__(self, sec: SecurityConfig, rank: int) -> None:
        self.sec, self.rank = sec, rank
        self._psk: bytes | None = None
        self._identity: Ed25519PrivateKey | None = None
        self._credentials: Credentials | None = None

    def psk(self) -> bytes:
        """The job's pre-shared key (psk mode)."""
        if self._psk is None:
            self._psk = _read_psk(self.sec)
        return self._psk

    def identity(self, missing: str) -> Ed25519PrivateKey:
        """This rank's Ed25519 identity (keys mode); `missing` is the error when none is configured."""
        if self._identity is None:
            if not self.sec.identity:
                raise ConfigError(missing)
            self._identity = load_identity(_expand(self.sec.identity, self.rank))
        return self._identity

    def credentials(self) -> Credentials:
        """This rank's credentials for the secure channel."""
        if self._credentials is None:
            self._credentials = self._load_credentials()
        return self._credentials

    def _load_credentials(self) -> Credentials:
        sec, rank = self.sec, self.rank
        if sec.mode == "psk":
            return Credentials(mode="psk", psk=self.psk(), identity=None, authorized=[], server_public=None)
        identity = self.identity("security.mode=keys needs security.identity (path to this rank's key; "
                                 "'{rank}' expands), made with `hpcfed keygen PATH`")
        if rank == 0:
            if not sec.authorized_keys:
                raise ConfigError("security.mode=keys: the server needs security.authorized_keys "
                                  "(one site public key per line, with rank=N)")
            authorized = _authorized_keys(sec, rank)
            return Credentials(mode="keys", psk=None, identity=identity, authorized=authorized, server_public=None)
        if not sec.server_public_key:
            raise ConfigError("security.mode=keys: clients need security.server_public_key (the server's .pub file)")
        server = load_public_keys(_expand(sec.server_public_key, rank))
        if len(server) != 1:
            raise ConfigError(f"security.server_public_key must hold exactly one key, found {len(server)}")
        return Credentials(mode="keys", psk=None, identity=identity, authorized=[], server_public=server[0])

    def file_auth(self, purpose: str) -> FileAuth:
        """The key that tags this rank's state files of `purpose` (see `hpcfed.store.sealed`).

        psk mode: HMAC keyed from the job PSK (never stored in the run directory); keys mode: this
        rank's Ed25519 identity signs, and its public half verifies."""
        if self.sec.mode == "psk":
            return FileAuth.from_psk(self.psk(), purpose)
        return FileAuth.from_identity(
            self.identity("security.mode=keys needs security.identity to sign checkpoints and shards"), purpose)

    def secret_seed(self, purpose: str) -> int:
        """A 256-bit seed only the holders of this rank's key can compute (HKDF-SHA256 of the job PSK,
        or of the identity key in keys mode, labelled with `purpose`): randomness a run must reproduce
        on --resume (DP noise) without anyone who reads the run's outputs, where the config seed is
        written, being able to reproduce it too."""
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        if self.sec.mode == "psk":
            ikm = self.psk()
        else:
            ikm = self.identity("security.mode=keys needs security.identity (it keys the run's secret seeds)") \
                .private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                               serialization.NoEncryption())
        okm = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"hpcfed secret seed v1/" + purpose.encode()).derive(ikm)
        return int.from_bytes(okm, "big")

    def secagg_identities(self) -> tuple[Ed25519PrivateKey | None, dict[int, bytes] | None]:
        """Secure aggregation's signing key for this site and its peers' raw public keys by client id,
        in keys mode (psk mode: none, agreement keys go unsigned; README "What the server sees")."""
        sec = self.sec
        if sec.mode == "psk":
            return None, None
        if not sec.identity or not sec.authorized_keys:
            raise ConfigError("privacy.secure_aggregation in keys mode needs security.identity and "
                              "security.authorized_keys on every site (to sign its agreement keys and check its "
                              "peers')")
        peers = _authorized_keys(sec, self.rank)
        return self.identity(""), {r - 1: public_raw(key) for r, key in peers.items()}


def _read_psk(sec: SecurityConfig) -> bytes:
    """The job PSK from security.psk_file (0600) or the environment variable security.psk_env."""
    if sec.psk_file:
        path = Path(sec.psk_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"security.psk_file {path} does not exist")
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:  # like an identity key: a secret others can read authenticates them too
            raise ConfigError(f"security.psk_file {path} is readable by others (mode {mode:04o}); "
                              f"run `chmod 600 {path}`")
        text, where = path.read_text().strip(), f"security.psk_file {path}"
    else:
        text, where = os.environ.get(sec.psk_env, "").strip(), f"${sec.psk_env}"
        if not text:
            raise ConfigError(
                f"no pre-shared key: set {sec.psk_env} to 64 hex digits on every rank, e.g. "
                f"`export {sec.psk_env}=$(python -c 'import secrets; print(secrets.token_hex(32))')` "
                f"(hpcfed run --np does this for you), or use security.psk_file / security.mode=keys")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{where} is not hex") from None
    if len(key) < 16:
        raise ConfigError(f"{where} holds {len(key)} bytes; use at least 16 (32 recommended)")
    return key


def _expand(template: str, rank: int) -> Path:
    return Path(template.replace("{rank}", str(rank)).replace("{client_id}", str(rank - 1))).expanduser()


def job_key_path(out_dir: Path) -> Path:
    """Where `job_psk` keeps the key of the run in `out_dir` (whether or not it exists)."""
    import hashlib

    keys = Path(os.environ.get("HPCFED_KEYS_DIR") or Path.home() / ".hpcfed" / "keys").expanduser()
    return keys / hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:24]


def job_psk(out_dir: Path, resume: bool) -> str:
    """The PSK of a job launched with `hpcfed run --np` and no key of its own.

    A fresh key per job would make every checkpoint unverifiable on --resume, and storing it in the
    run directory would let whoever can write there forge one. So the key lives in a user-private
    file outside it, ``$HPCFED_KEYS_DIR`` (default ``~/.hpcfed/keys``)/<run id> (mode 0600), where the
    run id is a hash of the run directory's real path: --resume finds it, a fresh run replaces it."""
    import secrets

    path = job_key_path(out_dir)
    keys = path.parent
    if resume and path.is_file():
        text = path.read_text().strip()
        try:
            if len(bytes.fromhex(text)) >= 16:
                return text
        except ValueError:
            pass
        raise ConfigError(f"{path}: the stored job key for {out_dir} is not hex; delete it or set HPCFED_PSK")
    keys.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(keys, 0o700)
    key = secrets.token_hex(32)
    fd = os.open(path.with_name(path.name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path.with_name(path.name + ".tmp"), path)
    return key


def _authorized_keys(sec: SecurityConfig, rank: int) -> dict[int, Ed25519PublicKey]:
    """security.authorized_keys read for `rank`; a malformed file is a config error naming the key."""
    try:
        return load_authorized_keys(_expand(sec.authorized_keys or "", rank))  # callers checked it is set
    except ValueError as exc:
        raise ConfigError(f"security.authorized_keys: {exc}") from None
