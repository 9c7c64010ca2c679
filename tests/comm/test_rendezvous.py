"""The knock of separate jobs over real TCP sockets: port files, proofs, and every refusal's reason."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time

import pytest

from hpcfed.comm import crypto, rendezvous
from hpcfed.comm.rendezvous import Listener, NoPortFile, RendezvousError, knock, read_server, write_port_file

PSK = bytes(range(32))
JOB = bytes(32)
PORT_NAME = "tag#0$connentry#0123$"


class _Server:
    """A listener answering in a thread; `found` holds what `next_site` returned, `refusals` the log."""

    def __init__(self, cred: crypto.Credentials, size: int = 3, taken: set[int] | None = None,
                 wait: float = 10) -> None:
        self.refusals: list[str] = []
        self.listener = Listener(cred, size=size, job_id=JOB, port_name=PORT_NAME, bind=("127.0.0.1", 0),
                                 log=self.refusals.append)
        self.found: list = []
        self.taken = taken or set()
        self.wait = wait  # a refused knock leaves the listener waiting for the next one until then
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        knocked = self.listener.next_site(time.monotonic() + self.wait, self.taken)
        self.found.append(knocked)

    def close(self) -> None:
        self._thread.join(15)
        self.listener.close()
        for k in self.found:
            if k is not None:
                k.sock.close()


def _keys(n: int) -> list:
    return [crypto.new_identity() for _ in range(n)]


def test_a_site_with_the_key_learns_its_rank_the_job_and_the_port():
    server = _Server(crypto.Credentials(mode="psk", psk=PSK))
    welcome = knock(server.listener.address, crypto.Credentials(mode="psk", psk=PSK), 1, timeout=5)
    server.close()
    assert (welcome.rank, welcome.size, welcome.job_id, welcome.port) == (2, 3, JOB, PORT_NAME)
    assert server.found[0].rank == 2 and server.found[0].identity == "psk"
    welcome.sock.close()


def test_keys_mode_binds_each_key_to_its_rank_and_the_site_pins_the_server():
    srv, site0, site1, stranger = _keys(4)
    authorized = {1: site0.public_key(), 2: site1.public_key()}
    server_cred = crypto.Credentials(mode="keys", identity=srv, authorized=authorized)

    def site(key, server_key=srv):
        return crypto.Credentials(mode="keys", identity=key, server_public=server_key.public_key())

    server = _Server(server_cred)
    welcome = knock(server.listener.address, site(site1), 1, timeout=5)
    server.close()
    assert welcome.rank == 2 and server.found[0].identity == crypto.fingerprint(site1)
    welcome.sock.close()

    for key, cid, reason in [(stranger, 0, "not authorized for site 0"),
                             (site0, 1, "is site 0's \\(rank 1\\), not site 1's: each site knocks with its own key")]:
        server = _Server(server_cred, wait=0.4)
        with pytest.raises(RendezvousError, match=f"refused site {cid}: key SHA256:.* {reason}"):
            knock(server.listener.address, site(key), cid, timeout=5)
        server.close()
        assert server.found == [None] and reason.replace("\\", "") in server.refusals[0]

    server = _Server(server_cred)  # an impostor server (another key) is caught by the site
    with pytest.raises(RendezvousError, match="does not prove the pinned server key"):
        knock(server.listener.address, site(site0, server_key=stranger), 0, timeout=5)
    server.close()


def test_a_wrong_psk_a_stranger_rank_and_a_second_join_are_refused_with_the_reason():
    cases = [(crypto.Credentials(mode="psk", psk=bytes(32)), 0, set(), "proof is invalid", "refused"),
             (crypto.Credentials(mode="psk", psk=PSK), 5, set(), "not a site of this federation", "refused"),
             (crypto.Credentials(mode="psk", psk=PSK), 0, {1}, "site 0 is present and alive", "still_present"),
             (crypto.Credentials(mode="psk", psk=PSK), 1, {2: "site 1 is out: evicted"}, "site 1 is out: evicted",
              "out")]
    for cred, cid, taken, reason, code in cases:
        server = _Server(crypto.Credentials(mode="psk", psk=PSK), taken=taken, wait=0.4)
        with pytest.raises(RendezvousError, match=reason) as refused:
            knock(server.listener.address, cred, cid, timeout=5)
        server.close()
        assert refused.value.code == code  # the site branches on the code, never on the text
        assert server.found == [None] and reason in server.refusals[0] and f"[{code}]" in server.refusals[0]


def test_knocks_beyond_the_limit_for_one_site_are_refused_before_any_proof():
    server = _Server(crypto.Credentials(mode="psk", psk=PSK), taken={1}, wait=8)
    codes = []
    for _ in range(rendezvous.KNOCKS_PER_WINDOW + 3):
        with pytest.raises(RendezvousError) as refused:
            knock(server.listener.address, crypto.Credentials(mode="psk", psk=PSK), 0, timeout=5)
        codes.append(refused.value.code)
    # another site from the same address is not limited by site 0's knocks: it gets in
    welcome = knock(server.listener.address, crypto.Credentials(mode="psk", psk=PSK), 1, timeout=5)
    server.close()
    assert codes == ["still_present"] * rendezvous.KNOCKS_PER_WINDOW + ["rate_limited"] * 3
    assert "knocked 8 times from 127.0.0.1" in server.refusals[-1] and server.found[0].rank == 2
    welcome.sock.close()


class _LyingServer:
    """A knock socket that answers every hello with `reply` (a hostile or broken server)."""

    def __init__(self, reply: dict) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.address = self.sock.getsockname()
        self.reply = json.dumps(reply).encode()
        self.knocks = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.knocks += 1
                offer = json.dumps({"hpcfed": "knock-v1", "challenge": "00" * 32}).encode()
                conn.sendall(struct.pack(">I", len(offer)) + offer)
                conn.recv(8192)
                conn.sendall(struct.pack(">I", len(self.reply)) + self.reply)
                conn.close()


@pytest.mark.parametrize("code,parsed", [
    ("still_present", "still_present"), ("rate_limited", "rate_limited"), ("out", "out"),
    ("still_present " * 1000, "refused"), (7, "refused"), (None, "refused"), (["out"], "refused"),
    ({"still_present": 1}, "refused"), ("STILL_PRESENT", "refused"),
])
def test_a_refusal_code_from_the_server_is_parsed_as_hostile_input(code, parsed):
    server = _LyingServer({"ok": False, "code": code, "reason": "x" * 5000})
    with pytest.raises(RendezvousError) as refused:
        knock(server.address, crypto.Credentials(mode="psk", psk=PSK), 0, timeout=5)
    server.sock.close()
    assert refused.value.code == parsed and len(str(refused.value)) < 400


def test_a_joining_site_knocks_again_only_on_the_codes_that_say_so(tmp_path):
    from hpcfed.errors import FederationError
    from hpcfed.launch.crossjob_join import _knock_until

    psk = crypto.Credentials(mode="psk", psk=PSK)
    for reply, again in [({"ok": False, "code": "out", "reason": "site 0 is out: evicted"}, False),
                         ({"ok": False, "code": "refused", "reason": "present and alive"}, False),  # text not read
                         ({"ok": False, "code": "rate_limited", "reason": "slow down"}, True)]:
        server = _LyingServer(reply)
        with pytest.raises((RendezvousError, FederationError), match=reply["reason"]):
            _knock_until(f"{server.address[0]}:{server.address[1]}", psk, 0, 3.0)
        server.sock.close()
        assert (server.knocks > 1) == again, (reply, server.knocks)
    server = _Server(psk, taken={1}, wait=6)  # still present for a while, then let in: it knocks until then
    threading.Timer(1.5, server.taken.clear).start()
    welcome, _ = _knock_until(f"{server.listener.address[0]}:{server.listener.address[1]}", psk, 0, 10.0)
    server.close()
    assert welcome.rank == 1 and server.found[0].rank == 1
    welcome.sock.close()


def _raw_knock(address: tuple[str, int], payload: bytes) -> bytes:
    with socket.create_connection(address, timeout=10) as s:
        s.recv(4096)  # the challenge
        s.sendall(payload)
        try:
            return s.recv(4096)
        except OSError:
            return b""


@pytest.mark.parametrize("payload,reason", [
    (struct.pack(">I", 1 << 30), "declares 1073741824 bytes"),
    (struct.pack(">I", 5) + b"[1,2]", "must be a JSON object"),
    (struct.pack(">I", 9) + b"\xff\xfe{}{}{}{", "not valid UTF-8"),
    (struct.pack(">I", 40) + b'{"site": 0}', "sent 11 of 40 bytes"),
])
def test_hostile_knocks_are_refused_and_the_listener_keeps_going(payload, reason, monkeypatch):
    monkeypatch.setattr(rendezvous, "KNOCK_STEP_S", 0.5)  # a knock that stalls is dropped after this
    server = _Server(crypto.Credentials(mode="psk", psk=PSK))
    answer = _raw_knock(server.listener.address, payload)
    if "of 40" not in reason:
        assert reason.split()[0] in answer.decode(errors="replace")
    welcome = knock(server.listener.address, crypto.Credentials(mode="psk", psk=PSK), 0, timeout=5)
    server.close()
    assert reason in server.refusals[0] and server.found[0].rank == 1
    welcome.sock.close()


def test_port_files_are_read_with_the_fix_in_every_error(tmp_path):
    path = tmp_path / "port.json"
    write_port_file(path, ("10.0.0.7", 50100))
    assert read_server(str(path))[0] == ("10.0.0.7", 50100)
    assert read_server("node1:50100")[0] == ("node1", 50100)
    assert read_server("[::1]:7")[0] == ("::1", 7)
    with pytest.raises(NoPortFile, match="no such port file"):
        read_server(str(tmp_path / "gone.json"))
    path.write_bytes(b'{"hpcfed_rendezvous": 1, "address": "x:1"')
    with pytest.raises(RendezvousError, match=r"port file .* is garbled .*restart the server"):
        read_server(str(path))
    path.write_text(json.dumps({"address": "x:1"}))
    with pytest.raises(RendezvousError, match="not a port file of `hpcfed serve`"):
        read_server(str(path))
    path.write_text(json.dumps({"hpcfed_rendezvous": 1, "address": "x:99999"}))
    with pytest.raises(RendezvousError, match="is not HOST:PORT"):
        read_server(str(path))
    path.write_bytes(b" " * 5000)
    with pytest.raises(RendezvousError, match="over 4096 bytes"):
        read_server(str(path))
    with pytest.raises(RendezvousError, match="is not HOST:PORT"):
        read_server("nonsense")


def test_a_welcomed_site_connects_only_on_go_and_anything_else_is_a_clear_error():
    for sent, expected in ((rendezvous.GO, None), (b"X", "the server sent b'X' where it lets the site in"),
                           (b"", "did not let it in within 2 s (the peer closed the connection"),
                           (None, "did not let it in within 0.3 s (the peer sent 0 of 1 bytes")):
        server_side, site_side = socket.socketpair()
        if sent is not None:
            server_side.sendall(sent)
            if not sent:
                server_side.close()
        wait = 0.3 if sent is None else 2
        if expected is None:
            rendezvous.await_go(site_side, wait)
        else:
            with pytest.raises(RendezvousError, match=expected.replace("(", r"\(").replace("'", ".")):
                rendezvous.await_go(site_side, wait)
        site_side.close()
        server_side.close()
