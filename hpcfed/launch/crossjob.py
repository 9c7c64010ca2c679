"""`hpcfed serve` and what it shares with `hpcfed join` (`hpcfed.launch.crossjob_join`): one federation
whose server and sites are separate MPI jobs.

    hpcfed serve CONFIG --out DIR [--port-file F] [--port-range LO-HI] [--iface IF] [key=value ...]
    hpcfed join  CONFIG --server F|HOST:PORT --site N [--out DIR] [--iface IF] [key=value ...]

`serve` runs rank 0 as a job of its own: it opens an MPI port, listens for knocks and publishes
the knock address in the port file (`hpcfed.comm.rendezvous`). Each `join` is one site, as its
own job (``mpiexec -n R``, an ``sbatch`` on another cluster, a laptop with MPICH): its leader (the
job's rank 0) knocks, proves its key, connects to the MPI port and becomes rank N+1 of the star;
a site of R > 1 ranks (``federation.ranks_per_site``) trains with its other ranks as under `hpcfed
run` (`hpcfed.launch.site_group`), and the server sees its leader only. One intercommunicator
per site (`hpcfed.comm.spokes`), a lifeline per site (`hpcfed.comm.lifeline`); the server and
client code are those of `hpcfed run`. See docs/cluster.md, "Across clusters".
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from hpcfed.config import Config, ConfigError
from hpcfed.credentials import RankKeys
from hpcfed.launch.out_dir import prepare_out_dir
from hpcfed.launch.parent import prepare_config, under_mpi
from hpcfed.launch.rank import (
    HALT_SIGNAL,
    _setup_logging,  # one log format for every rank, however it was started
    channel_settings,
    closing_lines,
)

log = logging.getLogger("hpcfed")

CONNECT_S = 60.0  # a site's Connect to the port it was told; past this the site ends
DISCONNECT_S = 20.0  # the closing Disconnects, all of them; past this the job ends without them
SERVER_GONE_GRACE_S = 30.0  # a site whose server's lifeline closed ends after this, STOP or not
# After the run, how long the server waits for the sites' jobs to end before it ends its own without
# them (as `hpcfed run`'s rank 0 does: `hpcfed.launch.rank`): a site that ignores STOP keeps only its own job.
STOP_GRACE_S = 10.0


def port_range(text: str | None) -> tuple[int, int] | None:
    """--port-range LO-HI -> (LO, HI), at least two ports (one knocks, the rest carry MPI)."""
    if text is None:
        return None
    lo, sep, hi = text.partition("-")
    if not sep or not lo.isdigit() or not hi.isdigit() or not 1024 <= int(lo) < int(hi) <= 65535:
        raise ConfigError(f"--port-range {text!r}: write LO-HI with 1024 <= LO < HI <= 65535 (e.g. 50100-50199); "
                          f"the first free port takes the knocks, MPI uses the range too")
    return int(lo), int(hi)


def site_size(cfg: Config, site: int) -> int:
    """R, the ranks of site `site`'s job under `hpcfed join` (``federation.ranks_per_site``: one for
    every site, or one per site); a site of many ranks needs ``federation.num_clients``, since its
    other ranks build the site's data before the leader has heard from the server."""
    per = cfg.federation.ranks_per_site
    ranks = per if isinstance(per, int) else per[site]
    if ranks > 1 and cfg.federation.num_clients is None and isinstance(per, int):
        raise ConfigError(f"{cfg.source}: federation.ranks_per_site={per}: a site of {ranks} ranks needs "
                          f"federation.num_clients (its ranks build the site's data before the leader joins)")
    return ranks


def check_site_job(ranks: int, size: int, site: int) -> None:
    """The job `hpcfed join --site N` runs in has the site's R ranks (ConfigError with the fix)."""
    if size != ranks:
        raise ConfigError(f"hpcfed join --site {site}: federation.ranks_per_site gives site {site} {ranks} rank(s) "
                          f"but this job has {size}; start it with mpiexec -n {ranks} (srun --ntasks={ranks}), "
                          f"or without mpiexec (it starts {ranks})")


def _relaunch(command: str, argv: list[str], ranks: int = 1) -> int:
    """Outside MPI: run this command again as an MPI job of `ranks` ranks (MPI's ports need a process
    manager; a site of many ranks is a job of its R ranks)."""
    import shutil

    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise ConfigError("no mpiexec on PATH; install an MPI (`pip install mpich`) or use your site's module")
    cmd = [exe, "-n", str(ranks), sys.executable, "-m", "hpcfed", command, *argv]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, check=False).returncode


# -- the server ----------------------------------------------------------------------------------------
def serve_main(args: argparse.Namespace, argv: list[str]) -> int:
    """``hpcfed serve`` (`args` parsed from `argv` by `hpcfed.cli.serve`): rank 0 of a federation whose
    sites join as jobs of their own."""
    cfg = prepare_config(args.config, args.overrides)
    ports = port_range(args.port_range)
    if cfg.federation.num_clients is None:
        raise ConfigError(f"{cfg.source}: hpcfed serve needs federation.num_clients (how many sites join)")
    out = Path(args.out)
    prepare_out_dir(out, cfg, resume=args.resume, force=args.force)
    if not under_mpi():
        return _relaunch("serve", [a for a in argv if a != "--force"])
    from hpcfed.comm.port import network_env

    os.environ.update(network_env(ports, args.iface))  # before MPI starts: libfabric reads them once
    _setup_logging(0, out, cfg.federation.num_clients + 1)
    return _contained(lambda: _Served(cfg, args, out, ports).run())


class _Served:
    """The server job: rendezvous, one link per site, then `Server.run` over the spokes."""

    def __init__(self, cfg: Config, args: argparse.Namespace, out: Path, ports: tuple[int, int] | None) -> None:
        self.cfg, self.args, self.out, self.ports = cfg, args, out, ports
        self.size = (cfg.federation.num_clients or 0) + 1
        self.keys = RankKeys(cfg.security, 0)  # the server's keys, read once and passed down

    def run(self) -> int:
        from hpcfed.comm import port as mpiport
        from hpcfed.comm.rendezvous import Listener, write_port_file
        from hpcfed.comm.spokes import SpokeTransport
        from hpcfed.launch.crossjob_sites import HaltedAtStart, SiteDoor

        cred = self.keys.credentials()
        job_id = secrets.token_bytes(32)
        port_name = mpiport.open_port()
        host = _advertised_host(self.args.iface)
        listener = Listener(cred, size=self.size, job_id=job_id, port_name=port_name,
                            bind=("0.0.0.0", self.ports or 0), log=log.warning)
        door = SiteDoor(listener, port_name, SpokeTransport(0, self.size, {}), self.args.lifeline_timeout)
        port_file = Path(self.args.port_file or self.out / "port.json")
        write_port_file(port_file, (host, listener.address[1]))
        log.info("serving %d sites at %s:%d (port file %s): start each with `hpcfed join %s --server %s --site N`",
                 self.size - 1, host, listener.address[1], port_file, self.args.config, port_file)
        fed = self.cfg.federation
        halt = _HaltAtStart(self.out)
        door.refused_at_start = self._evicted_on_resume()
        try:
            wait = fed.setup_timeout_s if self.args.start_deadline is None else self.args.start_deadline
            absent = door.gather(time.monotonic() + wait, fed.min_sites,
                                 f"start `hpcfed join {self.args.config} --server PORT_FILE --site N` for each, "
                                 f"or wait longer (--start-deadline, federation.setup_timeout_s)",
                                 left_out=set(fed.exclude_sites) | set(door.refused_at_start), halted=halt.reason)
            threading.Thread(target=door.take_knocks, name="hpcfed-knocks", daemon=True).start()
            summary = self._federate(door, cred, job_id, absent)
        except HaltedAtStart as exc:
            log.warning("%s", exc)
            door.lifelines.close()  # the sites let in see the server go, and knock again for a while
            return 0
        finally:
            door.close()
        for line in closing_lines(summary, self.out, self.cfg):
            log.info("%s", line)
        self._close(door)
        return 0

    def _evicted_on_resume(self) -> dict[int, str]:
        """On --resume, the sites the checkpoint records as evicted: not waited for while gathering
        (their knocks are refused with the reason), each named in the log."""
        if not self.args.resume:
            return {}
        from hpcfed.server.setup import evicted_on_resume

        out = evicted_on_resume(self.out, self.keys.file_auth("checkpoint"), self.size - 1)
        for cid, reason in sorted(out.items()):
            log.warning("site %d was evicted in the checkpoint this run resumes from (%s): it is not expected, "
                        "and its knock is refused", cid, reason)
        return out

    def _federate(self, door: Any, cred: Any, job_id: bytes, absent: set[int]) -> dict[str, Any]:
        from hpcfed.comm.api import ChannelError
        from hpcfed.comm.channel import SecureChannel
        from hpcfed.server.server import Server

        timeout = self.cfg.federation.setup_timeout_s
        channel = SecureChannel(door.transport, cred, job_id, log=logging.getLogger("hpcfed.comm").warning,
                                **channel_settings(self.cfg))
        def look() -> None:  # a site whose lifeline closed meanwhile is left out at once (`_drop_unconnected`)
            for rank in door.transport.lost():
                channel.peer_gone(rank)

        channel.watch_peers(look)
        try:  # a site that fails or stays silent is dropped at setup (`_drop_unconnected`), not the server
            channel.connect([r + 1 for r in range(self.size - 1) if r not in absent], timeout=timeout,
                            require_all=False)
        except ChannelError as exc:
            log.warning("%s: the federation goes on without them", exc)
        channel.watch_peers(None)
        for rank in channel.peers:
            log.info("rank %d authenticated as %s", rank, channel.identity(rank))
        server = Server(self.cfg, channel, self.out, resume=self.args.resume, keys=self.keys)
        signal.signal(HALT_SIGNAL, lambda *_: server.request_halt())
        server.late_sites(absent, lambda: door.admit(channel, timeout))
        door.serve(server)
        summary = server.run()
        self.live_at_end = door.alive()
        door.finished.set()
        channel.close()
        return summary

    def _close(self, door: Any) -> None:
        """Disconnect the sites still alive (each waits for it), then drop the lifelines."""
        from hpcfed.comm import port as mpiport

        links = door.transport.links()
        comms = [links[r].comm for r in self.live_at_end]
        done = mpiport.disconnect_all(comms, DISCONNECT_S)
        if not done:
            log.warning("a site did not disconnect within %g s; ending without it", DISCONNECT_S)
        staying = _still_connected(door.lifelines, self.live_at_end, STOP_GRACE_S)
        if staying:
            log.warning("site(s) %s still connected %g s after the run ended (told to stop): ending the server's "
                        "job without them (the results are written; their own jobs end at their wall time)",
                        ", ".join(str(r - 1) for r in staying), STOP_GRACE_S)
        door.lifelines.close()


def _still_connected(lifelines: Any, ranks: list[int], grace: float) -> list[int]:
    """Of `ranks`, the sites whose lifeline is still open `grace` s from now: their job has not
    ended though told to stop (an honest site closes it right after its Disconnect)."""
    deadline = time.monotonic() + grace
    while (staying := sorted(set(ranks) & set(lifelines.watched()))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return staying


class _HaltAtStart:
    """While the server gathers its sites: the operator's halt (OUT/HALT, taken away here as the
    running server does, or SIGUSR2) ends the wait. The server's own handler replaces the signal's."""

    def __init__(self, out: Path) -> None:
        from hpcfed.launch.jobwatch import HALT_FILE

        self.path = out / HALT_FILE
        self.signalled = False
        signal.signal(HALT_SIGNAL, self._signal)

    def _signal(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def reason(self) -> str | None:
        """Why to halt now (None: go on gathering)."""
        if self.signalled:
            return "SIGUSR2"
        try:
            self.path.unlink()
        except OSError:
            return None
        return f"{self.path} found"


def _advertised_host(iface: str | None) -> str:
    """The address sites reach this host at: that of `iface`, else of the host name."""
    import socket

    if iface:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                raise ConfigError(f"--iface {iface}: no IPv4 address on that interface (see `ip addr`)") from None
        return socket.inet_ntoa(packed[20:24])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _end_now(code: int) -> NoReturn:
    """End this process without MPI_Finalize (a thread is stuck in MPI, or the peer is gone)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _contained(body: Callable[[], int]) -> NoReturn:
    """Run a command's MPI part and end the process with its code, never through MPI_Finalize:
    that is collective over every job still connected, and a lost peer would hold it forever."""
    from hpcfed.errors import USER_ERRORS

    try:
        code = body()
    except USER_ERRORS as exc:
        log.error("%s", exc)
        code = 2
    except BaseException as exc:
        log.error("%s: %s (a bug: the traceback follows)\n%s", type(exc).__name__, exc, traceback.format_exc())
        code = 1
    _end_now(code)
