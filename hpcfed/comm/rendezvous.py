"""How a site job finds the server job and is let in: a port file and an authenticated knock.

The server never waits in MPI's `Accept` for someone who may never come. It listens on a small
TCP socket whose address it publishes in a port file (`write_port_file`, atomically). A site
knocks there first (`knock`); only a site that proves its key is told the MPI port name, its rank
and the job id, and only then does the server call `Accept` (`hpcfed.comm.port`). The knock's
socket stays open afterwards as the pair's lifeline (`hpcfed.comm.lifeline`).

The exchange, each message a 4-byte big-endian length and a bounded JSON object (at most
`MAX_MESSAGE` bytes, every read with a deadline):

    server -> site   {"hpcfed": "knock-v1", "challenge": 32 random bytes (hex)}
    site -> server   {"site": client id, "nonce": 32 bytes (hex), "key": public key (keys mode),
                      "proof": prove("knock site", challenge + hello without proof)}
    server -> site   {"ok": true, "rank", "size", "job", "port", "proof": prove("knock server",
                      challenge + nonce + reply without proof)}   or   {"ok": false, "code", "reason"}

A refusal's `code` (one of `REFUSALS`; the site branches on it, anything else reads as "refused",
the reason is only shown): "still_present", "rate_limited" (`hpcfed.comm.knock_limit`), "out"
(evicted or excluded), "refused" (a bad key, a bad proof, a malformed knock).

The server lets a welcomed site in when it is ready for it (at once while it gathers its sites;
a late joiner at the next round, or the next step of an asynchronous run): it writes `GO` on the
socket, and only then does the site `Connect` and the server `Accept`, one site at a time, so an
`Accept` always takes the site it was meant for.

Keys mode: a site proves its Ed25519 identity, the one `authorized_keys` binds to rank client id + 1;
the site checks the reply against the pinned server key. PSK mode: both prove the pre-shared key.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcfed.comm import bounded_json, crypto
from hpcfed.comm.knock_limit import KnockLimit

MAX_MESSAGE = 8192  # an MPI port name is a few hundred bytes; nothing in the knock is larger
MAX_PORT_FILE = 4096
KNOCK_STEP_S = 5.0  # one knock's messages must come within this, or the knock is dropped
_HEAD = struct.Struct(">I")
_PROTOCOL = "knock-v1"
GO = b"G"  # server -> site, after the welcome: connect to the MPI port now

# A site knocks again, for a while, on the first two: its last job's end may not be seen yet, or it knocked too fast.
STILL_PRESENT, RATE_LIMITED, OUT, REFUSED = "still_present", "rate_limited", "out", "refused"
REFUSALS = frozenset({STILL_PRESENT, RATE_LIMITED, OUT, REFUSED})
NO_ANSWER = "no_answer"  # never sent: the peer did not answer in time, or closed (a busy or ending server)
KNOCK_WINDOW_S, KNOCKS_PER_WINDOW = 10.0, 8  # per site and address (a rejoining site's back-off: 5 in 15 s)
_RATE_TABLE = 4096  # (address, site) pairs remembered at most


class RendezvousError(ValueError):
    """A knock that failed or was refused, a port file that cannot be used; says what and the fix.
    `code` is the refusal's (one of `REFUSALS`; "refused" for any other failure)."""

    def __init__(self, message: str, code: str = REFUSED) -> None:
        super().__init__(message)
        self.code = code if code in REFUSALS or code == NO_ANSWER else REFUSED


class NoPortFile(RendezvousError):
    """The port file is not there (yet): a site started before its server waits for it."""


# -- the port file -------------------------------------------------------------------------------------
def write_port_file(path: Path, address: tuple[str, int]) -> None:
    """Publish the knock address at `path` atomically: a site never reads half a file."""
    doc = {"hpcfed_rendezvous": 1, "address": f"{address[0]}:{address[1]}", "pid": os.getpid(),
           "host": socket.gethostname(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(doc) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def parse_address(text: str, where: str) -> tuple[str, int]:
    """HOST:PORT (HOST a name, an IPv4 address or a bracketed IPv6 one) -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(host) > 255:
        raise RendezvousError(f"{where}: {text[:80]!r} is not HOST:PORT (e.g. node1:50100); pass the server's "
                              f"port file or the address `hpcfed serve` printed")
    return host, int(port)


def read_server(spec: str) -> tuple[tuple[str, int], str]:
    """--server F|HOST:PORT -> (address, a description of where it came from for errors)."""
    path = Path(spec)
    if not path.is_file():
        if path.exists() or "/" in spec or spec.endswith(".json"):
            raise NoPortFile(f"--server {spec}: no such port file; start `hpcfed serve ... --port-file {spec}` "
                                  f"first, or pass the server's HOST:PORT")
        return parse_address(spec, f"--server {spec}"), f"--server {spec}"
    raw = path.read_bytes()[: MAX_PORT_FILE + 1]
    where = f"port file {path}"
    if len(raw) > MAX_PORT_FILE:
        raise RendezvousError(f"{where} is over {MAX_PORT_FILE} bytes: not a port file of `hpcfed serve`")
    try:
        doc = bounded_json.loads_object(raw, 4)
    except ValueError as exc:
        raise RendezvousError(f"{where} is garbled ({exc}); it is rewritten by `hpcfed serve` at every start: "
                              f"restart the server or point --server at its current port file") from None
    if doc.get("hpcfed_rendezvous") != 1 or not isinstance(doc.get("address"), str):
        raise RendezvousError(f"{where} is not a port file of `hpcfed serve` (no hpcfed_rendezvous=1 and address)")
    written = f"written {doc.get('written', '?')} by pid {doc.get('pid', '?')} on {doc.get('host', '?')}"
    return parse_address(doc["address"], where), f"{where} ({written})"


# -- framing -------------------------------------------------------------------------------------------
def _send(sock: socket.socket, doc: dict[str, Any]) -> None:
    body = bounded_json.dumps(doc, 4)
    sock.sendall(_HEAD.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"the peer sent {len(buf)} of {n} bytes within the knock's deadline", NO_ANSWER)
        sock.settimeout(left)
        try:
            part = sock.recv(n - len(buf))
        except TimeoutError:
            continue
        if not part:
            raise RendezvousError(f"the peer closed the connection after {len(buf)} of {n} bytes", NO_ANSWER)
        buf += part
    return bytes(buf)


def _recv(sock: socket.socket, deadline: float) -> tuple[dict[str, Any], bytes]:
    (size,) = _HEAD.unpack(_recv_exact(sock, 4, deadline))
    if not 0 < size <= MAX_MESSAGE:
        raise RendezvousError(f"a knock message declares {size} bytes (limit {MAX_MESSAGE})")
    raw = _recv_exact(sock, size, deadline)
    try:
        return bounded_json.loads_object(raw, 4), raw
    except ValueError as exc:
        raise RendezvousError(f"a knock message is malformed: {exc}") from None


def _hex(doc: dict[str, Any], key: str, nbytes: int) -> bytes:
    value = doc.get(key)
    if not isinstance(value, str) or len(value) != 2 * nbytes:
        raise RendezvousError(f"{key!r} must be {nbytes} bytes in hex")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise RendezvousError(f"{key!r} is not hex") from None


def _unsigned(doc: dict[str, Any]) -> bytes:
    return bounded_json.dumps({k: v for k, v in doc.items() if k != "proof"}, 4)


# -- the site's side -----------------------------------------------------------------------------------
@dataclass
class Welcome:
    """What an accepted knock gives the site: its place in the star and the MPI port to connect to."""

    rank: int
    size: int
    job_id: bytes
    port: str
    sock: socket.socket  # stays open: the lifeline


def knock(address: tuple[str, int], cred: crypto.Credentials, client_id: int, timeout: float) -> Welcome:
    """Announce site `client_id` to the server at `address`; RendezvousError with the reason when
    nothing answers, the server refuses, or its reply does not prove the server's key.
    ConnectionError (nothing listens) is raised as is: the caller retries with a back-off."""
    deadline = time.monotonic() + timeout
    sock = socket.create_connection(address, timeout=timeout)
    try:
        hello = _hello_to(sock, cred, client_id, deadline)
        reply, _ = _recv(sock, deadline)
        welcome = _check_welcome(reply, cred, hello, client_id)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Welcome(*welcome, sock=sock)


def _hello_to(sock: socket.socket, cred: crypto.Credentials, client_id: int, deadline: float) -> dict[str, Any]:
    offer, _ = _recv(sock, deadline)
    if offer.get("hpcfed") != _PROTOCOL:
        raise RendezvousError(f"the server speaks {str(offer.get('hpcfed'))[:40]!r}, not {_PROTOCOL}: "
                              f"is the address that of `hpcfed serve`, of the same hpcfed version?")
    challenge = _hex(offer, "challenge", 32)
    hello: dict[str, Any] = {"site": client_id, "nonce": secrets.token_hex(32)}
    if cred.mode == "keys":
        hello["key"] = crypto.public_line(cred.identity).split()[1]  # type: ignore[arg-type]  # keys mode: the identity is set, checked when the credentials were made
    hello["proof"] = crypto.prove(cred, b"knock site", challenge + _unsigned(hello)).hex()
    _send(sock, hello)
    hello["challenge"] = challenge
    return hello


def _check_welcome(reply: dict[str, Any], cred: crypto.Credentials, hello: dict[str, Any],
                   client_id: int) -> tuple[int, int, bytes, str]:
    if reply.get("ok") is not True:
        raise RendezvousError(f"the server refused site {client_id}: {str(reply.get('reason'))[:300]}",
                              refusal_code(reply.get("code")))
    signed = hello["challenge"] + bytes.fromhex(hello["nonce"]) + _unsigned(reply)
    if not crypto.check_proof(cred, cred.server_public, b"knock server", signed, _hex(reply, "proof", 64)):
        raise RendezvousError("the server's reply does not prove "
                              + ("the pinned server key (security.server_public_key)" if cred.mode == "keys"
                                 else "the pre-shared key: the server runs with another key"))
    rank, size, port = reply.get("rank"), reply.get("size"), reply.get("port")
    if rank != client_id + 1 or not isinstance(size, int) or not rank < size <= 1 << 16:
        raise RendezvousError(f"the server placed site {client_id} at rank {rank} of {size}")
    if not isinstance(port, str) or not 0 < len(port) <= MAX_MESSAGE:
        raise RendezvousError("the server's reply holds no MPI port name")
    return rank, size, _hex(reply, "job", 32), port


def refusal_code(value: object) -> str:
    """A refusal's code as the server sent it (hostile): one of `REFUSALS`, else "refused"."""
    return value if isinstance(value, str) and value in REFUSALS else REFUSED


def await_go(sock: socket.socket, timeout: float) -> None:
    """Wait (at most `timeout` s) for the server to let this welcomed site in (`GO`)."""
    deadline = time.monotonic() + timeout
    try:
        got = _recv_exact(sock, 1, deadline)
    except RendezvousError as exc:
        raise RendezvousError(f"the server welcomed this site but did not let it in within {timeout:g} s "
                              f"({exc})") from None
    if got != GO:
        raise RendezvousError(f"the server sent {got!r} where it lets the site in ({GO!r})")


def send_go(sock: socket.socket) -> None:
    """Let a welcomed site in: it connects to the MPI port now (OSError: it is gone)."""
    sock.sendall(GO)


# -- the server's side ---------------------------------------------------------------------------------
@dataclass
class Knock:
    """A site that proved its key: its rank, the fingerprint it proved, and the open socket."""

    rank: int
    identity: str
    sock: socket.socket


class Listener:
    """The server's knock socket. `next_site` lets in authenticated sites one at a time; everyone
    else gets a refusal with the reason (and `log` a line naming the address)."""

    def __init__(self, cred: crypto.Credentials, *, size: int, job_id: bytes, port_name: str,
                 bind: tuple[str, int | tuple[int, int]], log: Callable[[str], None]) -> None:
        self.cred, self.size, self.job_id, self.port_name, self.log = cred, size, job_id, port_name, log
        self.sock = _listen(bind)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self._limit_table = KnockLimit(KNOCKS_PER_WINDOW, KNOCK_WINDOW_S, _RATE_TABLE)

    def next_site(self, deadline: float, taken: Collection[int]) -> Knock | None:
        """The next site to knock with a valid proof for a rank not in `taken` (a mapping may give,
        per rank, the reason its knock is refused), or None at `deadline`."""
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.sock], [], [], min(left, 1.0))
            if not ready:
                continue
            try:
                conn, peer = self.sock.accept()
            except OSError:
                continue
            try:
                found = self._admit(conn, taken, peer[0])
            except RendezvousError as exc:
                self.log(f"knock from {peer[0]}:{peer[1]} refused: {exc} [{exc.code}]")
                _refuse(conn, str(exc), exc.code)
                continue
            except OSError as exc:
                self.log(f"knock from {peer[0]}:{peer[1]} failed: {exc}")
                _refuse(conn, str(exc), REFUSED)
                continue
            return found
        return None

    def _admit(self, conn: socket.socket, taken: Collection[int], host: str) -> Knock:
        deadline = time.monotonic() + KNOCK_STEP_S
        challenge = secrets.token_bytes(32)
        _send(conn, {"hpcfed": _PROTOCOL, "challenge": challenge.hex()})
        hello, _ = _recv(conn, deadline)
        self._limit(host, hello.get("site"))
        rank, peer_key = self._check_hello(hello, challenge, taken)
        reply: dict[str, Any] = {"ok": True, "rank": rank, "size": self.size, "job": self.job_id.hex(),
                                 "port": self.port_name}
        nonce = _hex(hello, "nonce", 32)
        reply["proof"] = crypto.prove(self.cred, b"knock server", challenge + nonce + _unsigned(reply)).hex()
        _send(conn, reply)
        conn.settimeout(None)
        return Knock(rank, crypto.fingerprint(peer_key) if peer_key is not None else "psk", conn)

    def _limit(self, host: str, site: object) -> None:
        """Refuse ("rate_limited") a site's knock beyond the limit (`hpcfed.comm.knock_limit`)."""
        if not isinstance(site, int) or isinstance(site, bool) or not 0 <= site < self.size - 1:
            return  # refused by `_check_hello`, at no cost
        if n := self._limit_table.over(host, site):
            raise RendezvousError(f"site {site} knocked {n} times from {host} within {KNOCK_WINDOW_S:g} s "
                                  f"(at most {KNOCKS_PER_WINDOW}): knock again later", RATE_LIMITED)

    def _check_hello(self, hello: dict[str, Any], challenge: bytes, taken: Collection[int]) -> tuple[int, Any]:
        cid = hello.get("site")
        if not isinstance(cid, int) or isinstance(cid, bool) or not 0 <= cid < self.size - 1:
            raise RendezvousError(f"site {str(cid)[:20]!r} is not a site of this federation "
                                  f"(client ids 0..{self.size - 2})")
        rank = cid + 1
        peer_key = None
        if self.cred.mode == "keys":
            peer_key = self._site_key(hello, rank)
        if not crypto.check_proof(self.cred, peer_key, b"knock site", challenge + _unsigned(hello),
                                  _hex(hello, "proof", 64)):
            raise RendezvousError(f"site {cid}'s proof is invalid ("
                                  + ("signature does not match its key)" if peer_key is not None
                                     else "another pre-shared key)"))
        if rank in taken:
            why = taken.get(rank) if isinstance(taken, dict) else None
            if why:
                raise RendezvousError(why, OUT)
            raise RendezvousError(f"site {cid} is present and alive in this federation (or waits to be let in), "
                                  f"so key {crypto.fingerprint(peer_key) if peer_key is not None else '(psk)'} "
                                  f"cannot join as it: end the other job of site {cid}, or knock again once it "
                                  f"is declared lost (hpcfed serve --lifeline-timeout)", STILL_PRESENT)
        return rank, peer_key

    def _site_key(self, hello: dict[str, Any], rank: int) -> Any:
        try:
            key = crypto.public_from_b64(str(hello.get("key", ""))[:100])
        except ValueError as exc:
            raise RendezvousError(f"site {rank - 1} sent no valid public key ({exc})") from None
        allowed = self.cred.authorized
        want = allowed.get(rank) if isinstance(allowed, dict) else next(
            (k for k in allowed if crypto.public_raw(k) == crypto.public_raw(key)), None)
        owner = _owner(allowed, key)
        if owner is not None and owner != rank:
            raise RendezvousError(f"key {crypto.fingerprint(key)} is site {owner - 1}'s (rank {owner}), not site "
                                  f"{rank - 1}'s: each site knocks with its own key (--site {owner - 1} for this one)")
        if want is None or crypto.public_raw(want) != crypto.public_raw(key):
            raise RendezvousError(f"key {crypto.fingerprint(key)} is not authorized for site {rank - 1} "
                                  f"(rank {rank}); add its .pub line with rank={rank} to the server's authorized_keys")
        return want

    def close(self) -> None:
        self.sock.close()


def _owner(allowed: Any, key: Any) -> int | None:
    """The rank `authorized_keys` binds `key` to (None: no rank, or no binding by rank)."""
    if not isinstance(allowed, dict):
        return None
    raw = crypto.public_raw(key)
    return next((r for r, k in allowed.items() if crypto.public_raw(k) == raw), None)


def _refuse(conn: socket.socket, reason: str, code: str) -> None:
    try:
        conn.settimeout(1.0)
        _send(conn, {"ok": False, "code": code, "reason": reason[:300]})
    except OSError:
        pass  # it has gone already: nothing to tell
    finally:
        conn.close()


def _listen(bind: tuple[str, int | tuple[int, int]]) -> socket.socket:
    """A listening socket on `bind`'s host and port, or the first free port of a (LO, HI) range."""
    host, ports = bind
    candidates = range(ports[0], ports[1] + 1) if isinstance(ports, tuple) else [ports]
    for port in candidates:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            continue
        sock.listen(16)
        return sock
    raise RendezvousError(f"no free port to listen on at {host} in {ports} (--port-range): widen the range "
                          f"or free a port")
