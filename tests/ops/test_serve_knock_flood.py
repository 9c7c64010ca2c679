"""A flood of knocks at a running `hpcfed serve` (issue 38, bad input): 1,000 knocks in about ten
seconds from four loops -- garbage, strangers' keys, ids of no site, and a second job for a live site
-- while the server runs its rounds. Every knock is refused with a code, the twin's beyond the
per-site limit as "rate_limited" (before any proof is checked); the rounds go on during the flood,
with only the two honest sites folded; the accuracy goes on rising; rank 0's memory stays bounded;
and the run ends cleanly when halted."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time

import crossjob_helpers as H
import psutil
import pytest

from hpcfed.comm import crypto, rendezvous

pytestmark = pytest.mark.mpi

OVERRIDES = [*H.SMALL, "rounds=100000", "eval_every=2", "checkpoint_every=4",
             "federation.setup_timeout_s=600"]  # a loaded host loads a site in minutes
KNOCKS = 1000
_LOCK = threading.Lock()


def _rank0(server) -> psutil.Process:
    return next(p for p in psutil.Process(server.pid).children(recursive=True) if "serve" in " ".join(p.cmdline()))


def _garbage(address: tuple[str, int], payload: bytes) -> None:
    with socket.create_connection(address, timeout=10) as s:
        s.recv(4096)  # the challenge
        s.sendall(payload)
        s.recv(4096)  # the refusal (or the close)


def _flood(address: tuple[str, int]) -> dict[str, int]:
    """KNOCKS knocks from four loops at once, one of each kind: the refusal codes they got."""
    codes: dict[str, int] = {}
    loops = [threading.Thread(target=_loop, args=(address, kind, codes)) for kind in range(4)]
    for t in loops:
        t.start()
    for t in loops:
        t.join()
    return codes


def _loop(address: tuple[str, int], kind: int, codes: dict[str, int]) -> None:
    good = crypto.Credentials(mode="psk", psk=bytes.fromhex(H.PSK))
    stale = crypto.Credentials(mode="psk", psk=os.urandom(32))
    for i in range(kind, KNOCKS, 4):
        try:
            if kind == 0:
                _garbage(address, struct.pack(">I", 9) + b"\xff\xfe{}{}{}{")
                code = "garbage"
            else:
                cred, site = [(stale, i % 2), (good, 7 + i), (good, 0)][kind - 1]  # stale key, no site, a twin
                knock(address, cred, site)
                code = "ok"
        except rendezvous.RendezvousError as exc:
            code = exc.code
        except OSError:
            code = "closed"
        with _LOCK:
            codes[f"{kind}:{code}"] = codes.get(f"{kind}:{code}", 0) + 1


def knock(address: tuple[str, int], cred: crypto.Credentials, site: int) -> None:
    welcome = rendezvous.knock(address, cred, site, timeout=10)
    welcome.sock.close()  # (never reached: every knock of the flood is refused)


@pytest.mark.timeout(1200)  # a loaded host starts the three jobs in minutes
def test_a_flood_of_knocks_is_refused_while_the_rounds_go_on(tmp_path):
    out, port = tmp_path / "srv", tmp_path / "srv" / "port.json"
    out.mkdir()
    log_file = (tmp_path / "server.out").open("w")  # the flood logs ~1,000 lines: a pipe nobody reads would fill
    server = subprocess.Popen([H.mpiexec(), "-n", "1", sys.executable, "-m", "hpcfed", "serve", H.CONFIG, *OVERRIDES,
                               "--out", str(out), "--start-deadline", "900"], cwd=H.REPO, env=H.env(),
                              stdout=log_file, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log_file.close()  # the server's job holds its own copy
    sites = [H.join(port, i, tmp_path / f"site{i}", OVERRIDES) for i in range(2)]
    rounds = lambda: [e["round"] for e in H.events(out) if e["name"] == "round_time_s"]
    H.wait_for("a few rounds", lambda: len(rounds()) >= 6, [server, *sites], timeout=900)
    rank0 = _rank0(server)
    rss_before, before, t0 = rank0.memory_info().rss, len(rounds()), time.monotonic()
    address, _ = rendezvous.read_server(str(port))
    codes = _flood(address)
    flood_s, during = time.monotonic() - t0, len(rounds()) - before
    rss_after = rank0.memory_info().rss
    (out / "HALT").touch()
    (code, _), *ends = H.finish([server, *sites], 180)
    text = (tmp_path / "server.out").read_text()
    assert code == 0 and all(c == 0 for c, _ in ends), text[-4000:] + "".join(t[-1500:] for _, t in ends)
    per = KNOCKS // 4
    assert codes["0:garbage"] == per and codes["2:refused"] == per, codes  # no site: refused before any limit
    # stale keys and the twin claim sites 0 and 1: each site's first knocks of a window are judged (a bad
    # proof, a live site), the rest are limited before their proof is checked
    assert codes.get("1:refused", 0) + codes.get("1:rate_limited", 0) == per and codes["1:rate_limited"] > per / 2
    assert codes.get("3:still_present", 0) + codes.get("3:rate_limited", 0) == per and codes["3:rate_limited"] > per / 2
    assert not [k for k in codes if k.endswith(":ok")], codes  # nobody got in
    assert during >= 2, f"{during} rounds during the {flood_s:.1f} s flood"  # the rounds went on
    evs = H.events(out)
    assert {e["value"] for e in evs if e["name"] == "num_updates"} == {2}  # only the two honest sites, every round
    acc = [e["value"] for e in evs if e["name"] == "val_accuracy" and e["client"] == 0]
    assert acc[-1] >= acc[0] and acc[-1] > 0.3, acc  # training went on, undisturbed
    assert rss_after - rss_before < 20 * 2**20, (rss_before, rss_after)  # bounded: nothing kept per knock
    log = (out / "logs" / "rank0.log").read_text()
    limited = codes["1:rate_limited"] + codes["3:rate_limited"]
    assert log.count("[rate_limited]") == limited and "Traceback" not in text
