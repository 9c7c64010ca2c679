"""Everything that touches `cryptography`: identities, the handshake, AEAD sealing.

Handshake (one per pair of ranks; the lower rank responds, so rank 0 is always the server)::

    initiator -> responder  HELLO   = ver | mode | 0 0 | eph_i (32) | nonce_i (32) | id_i (32)
    responder -> initiator  REPLY   = ver | mode | 0 0 | eph_r (32) | nonce_r (32) | id_r (32) | auth_r (64)
    initiator -> responder  FINISH  = auth_i (64)

    th     = SHA-256("hpcfed-handshake-v1" | len(job_id) | job_id | rank_i | rank_r | HELLO | REPLY[:100])
    auth_r = Ed25519-Sign(id_r, "responder" | th)   (keys mode; id_i/id_r are the identity public keys)
           | HMAC-SHA256(psk, "responder" | th)     (psk mode, zero-padded to 64; id fields are zero)
    auth_i = the same with "initiator"
    k_i2r | k_r2i = HKDF-SHA256(ikm = X25519(eph_i, eph_r) | psk, salt = th, info = "hpcfed v1 session keys", 64)

In keys mode the responder accepts only an initiator whose identity is in its authorized list and
the initiator accepts only the pinned server key. The ephemeral X25519 keys give forward secrecy;
binding the job id and both ranks into `th` means a handshake cannot be replayed into another job
or another pair. Each direction then gets its own AES-256-GCM key, and a frame's nonce is
`direction (4 bytes) | sequence number (8 bytes)`, with the sequence number strictly increasing per
direction, so a nonce is never reused under one key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field
from typing import Literal

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PROTOCOL_VERSION = 1
TAG_BYTES = 16
MAX_AEAD_INPUT = (1 << 31) - 1  # the `cryptography` AEAD limit per call
KEY_TYPE = "hpcfed-ed25519"

MODE_PSK, MODE_KEYS = 1, 2
_MODE = {"psk": MODE_PSK, "keys": MODE_KEYS}
_HELLO = struct.Struct("<BBH32s32s32s")  # 100 bytes
_REPLY = struct.Struct("<BBH32s32s32s64s")  # 164 bytes
_FINISH = struct.Struct("<64s")
HELLO_BYTES, REPLY_BYTES, FINISH_BYTES = _HELLO.size, _REPLY.size, _FINISH.size

DIR_INITIATOR_TO_RESPONDER = 1
DIR_RESPONDER_TO_INITIATOR = 2


class HandshakeError(Exception):
    """The peer could not be authenticated; the message says why (no secrets in it)."""


@dataclass
class Credentials:
    """What this rank proves itself with and whom it accepts.

    - ``psk``: `psk` (>= 16 bytes) is shared by every rank of the job.
    - ``keys``: `identity` is this rank's Ed25519 key; a responder (the server) accepts initiators
      whose public key is in `authorized`; an initiator (a client) accepts only `server_public`.
      `authorized` as {rank: key} binds each key to its rank: a key is accepted from that rank only.
    """

    mode: Literal["psk", "keys"]
    psk: bytes | None = None
    identity: Ed25519PrivateKey | None = None
    authorized: list[Ed25519PublicKey] | dict[int, Ed25519PublicKey] = field(default_factory=list)
    server_public: Ed25519PublicKey | None = None

    def __post_init__(self) -> None:
        if self.mode not in _MODE:
            raise ValueError(f"credentials mode {self.mode!r}: use 'psk' or 'keys'")
        if self.mode == "psk" and (not isinstance(self.psk, (bytes, bytearray)) or len(self.psk) < 16):
            raise ValueError("psk mode needs a pre-shared key of at least 16 bytes")
        if self.mode == "keys" and self.identity is None:
            raise ValueError("keys mode needs this rank's identity key (hpcfed keygen PATH)")


# -- keys and their text forms ----------------------------------------------------------------------
def new_identity() -> Ed25519PrivateKey:
    """A fresh Ed25519 identity key (a site's or the server's long-term signing key)."""
    return Ed25519PrivateKey.generate()


def public_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of a public key (of a private key's public half): what a handshake signs and sends."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_line(key: Ed25519PrivateKey | Ed25519PublicKey, comment: str = "") -> str:
    """``hpcfed-ed25519 <base64 of the 32 raw bytes> [comment]`` (the authorized_keys line)."""
    text = f"{KEY_TYPE} {base64.b64encode(public_raw(key)).decode()}"
    return f"{text} {comment}".rstrip()


def public_from_b64(text: str) -> Ed25519PublicKey:
    """The public key of an authorized_keys line's base64 field; ValueError naming what is wrong with it."""
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise ValueError("the key is not valid base64") from None
    if len(raw) != 32:
        raise ValueError(f"the key decodes to {len(raw)} bytes; an Ed25519 public key has 32")
    return Ed25519PublicKey.from_public_bytes(raw)


def fingerprint(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """``SHA256:<base64>`` of the raw public key, as OpenSSH prints it: how logs and summaries name an identity."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(public_raw(key)).digest()).decode().rstrip("=")


def private_to_pem(key: Ed25519PrivateKey) -> bytes:
    """The private key as unencrypted PKCS#8 PEM (the key file is protected by its 0600 mode, not a passphrase)."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def private_from_pem(data: bytes) -> Ed25519PrivateKey:
    """Read a PEM private key, refusing any that is not Ed25519 (an RSA or EC key would pass the PEM parser)."""
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"the key is a {type(key).__name__}, not an Ed25519 private key")
    return key


# -- AEAD -------------------------------------------------------------------------------------------
class Sealer:
    """One direction of a session: AES-256-GCM with nonce = direction | sequence number."""

    __slots__ = ("_aead", "_prefix")

    def __init__(self, key: bytes, direction: int) -> None:
        self._aead = AESGCM(key)
        self._prefix = struct.pack("<I", direction)

    def seal_into(self, seq: int, data: memoryview | bytes, aad: bytes, out: memoryview) -> None:
        """Encrypt `data` into `out` (exactly len(data) + 16 bytes: ciphertext then tag)."""
        self._aead.encrypt_into(self._prefix + seq.to_bytes(8, "little"), data, aad, out)

    def open_into(self, seq: int, data: memoryview | bytes, aad: bytes, out: memoryview) -> bool:
        """Decrypt and verify; False (and `out` holds garbage) when the frame is not authentic."""
        try:
            self._aead.decrypt_into(self._prefix + seq.to_bytes(8, "little"), data, aad, out)
        except InvalidTag:
            return False
        return True


@dataclass
class SessionKeys:
    """What a completed handshake yields: one AEAD key per direction, and who the peer proved to be."""

    send: Sealer
    recv: Sealer
    peer_identity: str  # fingerprint of the peer's identity key, or "psk"


def _transcript(job_id: bytes, initiator: int, responder: int, hello: bytes, reply_head: bytes) -> bytes:
    h = hashlib.sha256()
    h.update(b"hpcfed-handshake-v1")
    h.update(struct.pack("<I", len(job_id)) + job_id)
    h.update(struct.pack("<II", initiator, responder))
    h.update(hello)
    h.update(reply_head)
    return h.digest()


def _derive(shared: bytes, psk: bytes | None, th: bytes, initiator: bool) -> tuple[Sealer, Sealer]:
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=th, info=b"hpcfed v1 session keys").derive(
        shared + (psk or b""))
    k_i2r, k_r2i = okm[:32], okm[32:]
    i2r = Sealer(k_i2r, DIR_INITIATOR_TO_RESPONDER)
    r2i = Sealer(k_r2i, DIR_RESPONDER_TO_INITIATOR)
    return (i2r, r2i) if initiator else (r2i, i2r)


def _auth(cred: Credentials, label: bytes, th: bytes) -> bytes:
    if cred.mode == "keys":
        return cred.identity.sign(label + th)  # type: ignore[union-attr]  # keys mode: the identity (peer key) is set, checked when the credentials were made
    return hmac.new(cred.psk, label + th, hashlib.sha256).digest().ljust(64, b"\0")  # type: ignore[arg-type]  # the mode decides which of psk / identity is set, checked when the credentials were made


def _verify(cred: Credentials, peer_id: Ed25519PublicKey | None, label: bytes, th: bytes, tag: bytes) -> bool:
    if cred.mode == "keys":
        try:
            peer_id.verify(tag, label + th)  # type: ignore[union-attr]  # keys mode: the identity (peer key) is set, checked when the credentials were made
        except InvalidSignature:
            return False
        return True
    return hmac.compare_digest(_auth(cred, label, th), tag)


def prove(cred: Credentials, label: bytes, data: bytes) -> bytes:
    """A 64-byte tag over `label` and SHA-256(`data`) only this rank's key makes: an Ed25519
    signature (keys mode) or an HMAC under the PSK. For messages outside the handshake (the
    rendezvous of separate jobs); `label` keeps them apart from the handshake's own tags."""
    return _auth(cred, b"hpcfed-proof-v1 " + label, hashlib.sha256(data).digest())


def check_proof(cred: Credentials, peer_id: Ed25519PublicKey | None, label: bytes, data: bytes,
                tag: bytes) -> bool:
    """Whether `tag` is `prove(...)` of the holder of `peer_id` (keys mode) or of the PSK."""
    if len(tag) != 64 or (cred.mode == "keys" and peer_id is None):
        return False
    return _verify(cred, peer_id, b"hpcfed-proof-v1 " + label, hashlib.sha256(data).digest(), tag)


def _exchange(eph: X25519PrivateKey, peer_raw: bytes) -> bytes:
    try:
        return eph.exchange(X25519PublicKey.from_public_bytes(peer_raw))
    except ValueError:  # low-order point: the shared secret would be all zeros
        raise HandshakeError("the peer's ephemeral key is invalid") from None


def _check_mode(cred: Credentials, version: int, mode: int, reserved: int) -> None:
    if version != PROTOCOL_VERSION:
        raise HandshakeError(f"the peer speaks handshake version {version}, this rank {PROTOCOL_VERSION}")
    if mode != _MODE[cred.mode]:
        theirs = {v: k for k, v in _MODE.items()}.get(mode, f"unknown mode {mode}")
        raise HandshakeError(f"the peer uses security mode {theirs!r}, this rank {cred.mode!r} "
                             f"(set the same security.mode on every rank)")
    if reserved:
        raise HandshakeError("reserved handshake bits are set")


class Initiator:
    """The client side of one handshake."""

    def __init__(self, cred: Credentials, job_id: bytes, rank: int, peer: int) -> None:
        self.cred, self.job_id, self.rank, self.peer = cred, job_id, rank, peer
        self._eph = X25519PrivateKey.generate()
        eph_pub = self._eph.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        ident = public_raw(cred.identity) if cred.mode == "keys" else bytes(32)  # type: ignore[arg-type]  # the mode decides which of psk / identity is set, checked when the credentials were made
        self.hello = _HELLO.pack(PROTOCOL_VERSION, _MODE[cred.mode], 0, eph_pub, os.urandom(32), ident)

    def on_reply(self, reply: bytes) -> tuple[bytes, SessionKeys]:
        """Check the responder's REPLY; return (FINISH, session keys) or raise HandshakeError."""
        if len(reply) != REPLY_BYTES:
            raise HandshakeError(f"handshake reply is {len(reply)} bytes, expected {REPLY_BYTES}")
        version, mode, reserved, eph_r, _nonce, id_r, auth_r = _REPLY.unpack(reply)
        _check_mode(self.cred, version, mode, reserved)
        peer_id = None
        if self.cred.mode == "keys":
            if self.cred.server_public is None:
                raise HandshakeError("no server public key is pinned (security.server_public_key)")
            if not hmac.compare_digest(id_r, public_raw(self.cred.server_public)):
                raise HandshakeError(f"rank {self.peer} presented identity "
                                     f"{fingerprint(Ed25519PublicKey.from_public_bytes(id_r))}, not the pinned "
                                     f"server key {fingerprint(self.cred.server_public)}")
            peer_id = self.cred.server_public
        th = _transcript(self.job_id, self.rank, self.peer, self.hello, reply[:_REPLY.size - 64])
        if not _verify(self.cred, peer_id, b"responder", th, auth_r):
            raise HandshakeError(f"rank {self.peer} failed to prove its identity "
                                 f"({'wrong server key' if self.cred.mode == 'keys' else 'different pre-shared key'})")
        send, recv = _derive(_exchange(self._eph, eph_r), self.cred.psk, th, initiator=True)
        finish = _FINISH.pack(_auth(self.cred, b"initiator", th))
        who = fingerprint(peer_id) if peer_id is not None else "psk"
        return finish, SessionKeys(send, recv, who)


class Responder:
    """The server side of one handshake."""

    def __init__(self, cred: Credentials, job_id: bytes, rank: int, peer: int) -> None:
        self.cred, self.job_id, self.rank, self.peer = cred, job_id, rank, peer
        self._th = b""
        self._keys: tuple[Sealer, Sealer] | None = None
        self._peer_id: Ed25519PublicKey | None = None

    def on_hello(self, hello: bytes) -> bytes:
        """Check the initiator's HELLO; return the REPLY or raise HandshakeError."""
        if len(hello) != HELLO_BYTES:
            raise HandshakeError(f"handshake hello is {len(hello)} bytes, expected {HELLO_BYTES}")
        version, mode, reserved, eph_i, _nonce, id_i = _HELLO.unpack(hello)
        _check_mode(self.cred, version, mode, reserved)
        if self.cred.mode == "keys":
            allowed = self.cred.authorized
            if isinstance(allowed, dict):  # keys bound to ranks: only this rank's key is accepted
                owner = [r for r, k in allowed.items() if hmac.compare_digest(public_raw(k), id_i)]
                if owner and owner[0] != self.peer:
                    raise HandshakeError(f"rank {self.peer} presented the identity of rank {owner[0]} "
                                         f"({fingerprint(allowed[owner[0]])}); a site key is accepted from "
                                         f"its own rank only (authorized_keys 'rank=')")
                allowed = [allowed[self.peer]] if self.peer in allowed else []
            match = [k for k in allowed if hmac.compare_digest(public_raw(k), id_i)]
            if not match:
                try:
                    fp = fingerprint(Ed25519PublicKey.from_public_bytes(id_i))
                except ValueError:
                    fp = "an invalid key"
                raise HandshakeError(f"identity {fp} is not in the authorized keys")
            self._peer_id = match[0]
        eph = X25519PrivateKey.generate()
        eph_pub = eph.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        ident = public_raw(self.cred.identity) if self.cred.mode == "keys" else bytes(32)  # type: ignore[arg-type]  # the mode decides which of psk / identity is set, checked when the credentials were made
        head = _REPLY.pack(PROTOCOL_VERSION, _MODE[self.cred.mode], 0, eph_pub, os.urandom(32), ident, bytes(64))
        head = head[:_REPLY.size - 64]
        self._th = _transcript(self.job_id, self.peer, self.rank, hello, head)
        self._keys = _derive(_exchange(eph, eph_i), self.cred.psk, self._th, initiator=False)
        return head + _auth(self.cred, b"responder", self._th)

    def on_finish(self, finish: bytes) -> SessionKeys:
        if self._keys is None:
            raise HandshakeError("handshake finish before hello")
        if len(finish) != FINISH_BYTES:
            raise HandshakeError(f"handshake finish is {len(finish)} bytes, expected {FINISH_BYTES}")
        if not _verify(self.cred, self._peer_id, b"initiator", self._th, finish):
            raise HandshakeError("the initiator failed to prove its identity "
                                 f"({'signature invalid' if self.cred.mode == 'keys' else 'different pre-shared key'})")
        who = fingerprint(self._peer_id) if self._peer_id is not None else "psk"
        return SessionKeys(self._keys[0], self._keys[1], who)


def job_digest(job_id: bytes) -> bytes:
    """16 bytes that stand for the job id in every frame's associated data."""
    return hashlib.sha256(b"hpcfed-job-v1" + job_id).digest()[:16]
