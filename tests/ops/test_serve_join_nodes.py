"""`hpcfed serve` and `hpcfed join` across network namespaces (../shared/tools/two-nodes.sh): the
server in one, each site in another, in keys mode as across institutions, and the two sites unable
to reach each other (hub and spoke). Skipped where the tool cannot run (not root, no iproute2)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import crossjob_helpers as H
import pytest
from conftest import REPO

from hpcfed.comm.keys import generate_identity

pytestmark = [pytest.mark.mpi, pytest.mark.two_nodes]

# ../shared/tools beside the checkout, or beside the data ($HPCFED_DATA = .../shared/data) for a worktree elsewhere
_SHARED = [REPO.parent / "shared", *([Path(os.environ["HPCFED_DATA"]).parent] if "HPCFED_DATA" in os.environ else [])]
TOOL = Path(os.environ.get("HPCFED_TWO_NODES_TOOL") or next(
    (p for p in (s / "tools" / "two-nodes.sh" for s in _SHARED) if p.is_file()), _SHARED[0] / "tools" / "two-nodes.sh"))
HEAD = "hpcfed-mn0"  # the namespace with the bridge (10.200.0.10) that joins node1 (.1) and node2 (.2)
PROBE = "import socket, sys; s = socket.socket(); s.settimeout(3); print(s.connect_ex((sys.argv[1], 22)))"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory):
    """The emulated nodes, with node1 and node2 cut off from each other (isolated bridge ports):
    each reaches only the head namespace. Stopped after the module."""
    if not TOOL.is_file() or shutil.which("ip") is None or shutil.which("bridge") is None or os.geteuid() != 0:
        pytest.skip(f"needs root, iproute2 (ip, bridge) and {TOOL}")
    if HEAD in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
        pytest.skip("the two-node namespaces are in use by another run (../shared/tools/two-nodes.sh stop)")
    state = tmp_path_factory.mktemp("two-nodes")
    env = {**os.environ, "HPCFED_TWO_NODES": str(state)}
    proc = subprocess.run(["bash", str(TOOL), "start"], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 77:
        pytest.skip(f"two-nodes.sh cannot run here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    try:
        for port in ("v1", "v2"):
            subprocess.run(["ip", "netns", "exec", HEAD, "bridge", "link", "set", "dev", port, "isolated", "on"],
                           check=True, timeout=30)
        yield state
    finally:
        subprocess.run(["bash", str(TOOL), "stop"], env=env, capture_output=True, timeout=120)


def _on(node: str) -> list[str]:
    return ["bash", str(TOOL), "on", node]


def _reaches(node: str, address: str) -> bool:
    """Whether `node` gets any answer (a refusal counts) from `address`; a cut link times out."""
    out = subprocess.run([*_on(node), sys.executable, "-c", PROBE, address], capture_output=True, text=True,
                         timeout=60).stdout.strip()
    return out != "11" and out != "113"  # EAGAIN (timed out), EHOSTUNREACH


def _bytes(port: str) -> int:
    """Bytes through bridge port `port` so far (both ways)."""
    stats = Path(f"/sys/class/net/{port}/statistics")
    out = subprocess.run(["ip", "netns", "exec", HEAD, "cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"],
                         capture_output=True, text=True, check=True).stdout.split()
    return sum(map(int, out))


def _keys(folder: Path) -> list[str]:
    """Keys mode: a key per rank, each site's bound to its rank; and a stranger's key."""
    folder.mkdir()
    for name in ("rank0", "rank1", "rank2", "stranger"):
        generate_identity(folder / name)
    lines = []
    for rank in (1, 2):
        kind, b64, *_ = (folder / f"rank{rank}.pub").read_text().split()
        lines.append(f"{kind} {b64} rank={rank}\n")
    (folder / "authorized").write_text("".join(lines))
    return ["security.mode=keys", f"security.server_public_key={folder}/rank0.pub",
            f"security.authorized_keys={folder}/authorized"]


def test_sites_in_other_namespaces_that_cannot_reach_each_other_join_in_keys_mode(nodes, tmp_path, monkeypatch):
    monkeypatch.setenv("HPCFED_TWO_NODES", str(nodes))
    monkeypatch.setenv("MPIR_CVAR_CH4_NETMOD", "ofi")  # MPI over TCP between namespaces, as between clusters
    monkeypatch.setenv("FI_PROVIDER", "tcp")
    assert _reaches("node1", "10.200.0.10") and _reaches("node2", "10.200.0.10")
    assert not _reaches("node1", "10.200.0.2") and not _reaches("node2", "10.200.0.1")
    keys = _keys(tmp_path / "keys")
    common = [*H.SMALL, *keys, "federation.setup_timeout_s=120"]
    own = [f"security.identity={tmp_path}/keys/rank{{rank}}"]
    out = tmp_path / "srv"
    before = _bytes("v1"), _bytes("v2")
    server = H.serve(out, [*common, *own], "--iface", "br0", "--port-range", "50100-50199",
                     wrap=["ip", "netns", "exec", HEAD])
    port = out / "port.json"  # the sites read it through the shared file system, as on a cluster
    stranger = H.join(port, 1, tmp_path / "stranger", [*common, f"security.identity={tmp_path}/keys/stranger"],
                      "--iface", "mpi0", wrap=_on("node2"))
    sites = [H.join(port, i, tmp_path / f"site{i}", [*common, *own], "--iface", "mpi0", wrap=_on(f"node{i + 1}"))
             for i in (0, 1)]
    (srv_code, srv_text), (bad_code, bad_text), *joined = H.finish([server, stranger, *sites], 300)
    assert srv_code == 0 and [code for code, _ in joined] == [0, 0], srv_text[-4000:]
    assert bad_code == 2 and "is not authorized for site 1 (rank 2)" in bad_text, bad_text[-2000:]
    assert "knock from 10.200.0.2" in srv_text and "refused: key SHA256:" in srv_text
    assert '"address": "10.200.0.10:50100"' in port.read_text()
    for rank in (1, 2):  # each site's own key, first at the knock and then in the channel's handshake
        assert re.search(rf"site {rank - 1} joined as rank {rank} \(key SHA256:\S+\)", srv_text)
        assert re.search(rf"rank {rank} authenticated as .*SHA256:", srv_text), srv_text[:3000]
    assert set(H.summary(out)["clients"]) == {"0", "1"}
    assert max(H.trained(out, 0)) == max(H.trained(out, 1)) == 1  # both rounds, both sites
    model_bytes = 2264 * 4  # each round's model out and the upload back crossed each site's link
    assert _bytes("v1") - before[0] > 4 * model_bytes and _bytes("v2") - before[1] > 4 * model_bytes
