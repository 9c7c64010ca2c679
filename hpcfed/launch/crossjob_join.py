"""`hpcfed join`: one site of a federation whose server is a job of its own (`hpcfed serve`).

    hpcfed join  CONFIG --server F|HOST:PORT --site N [--out DIR] [--iface IF] [key=value ...]

The site is a job of R ranks (``federation.ranks_per_site``; started as ``mpiexec -n R`` when run
without a launcher). Its rank 0, the leader, knocks at the server's address, proves its key,
connects to the MPI port and becomes rank N+1 of the star; the others train with it
(`hpcfed.launch.site_group`) and never reach the server. It comes back the same way after its job
ends (a requeue, a crash). The server's side and what both share are `hpcfed.launch.crossjob`. See
docs/guides/cluster.md, "Across clusters".
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from hpcfed import registry
from hpcfed.config import Config, ConfigError
from hpcfed.credentials import RankKeys
from hpcfed.errors import FederationError
from hpcfed.launch.crossjob import (
    CONNECT_S,
    DISCONNECT_S,
    SERVER_GONE_GRACE_S,
    _contained,  # one way for a cross-job rank to end, for serve and join alike
    _end_now,
    _relaunch,
    check_site_job,
    site_size,
)
from hpcfed.launch.parent import prepare_config, under_mpi
from hpcfed.launch.rank import (
    HALT_SIGNAL,
    _setup_logging,  # one log format for every rank, however it was started
    channel_settings,
)

log = logging.getLogger("hpcfed")
# How long a site knocks again while the server still counts it present: its last job's lifeline
# closes within a second or two of that job's end, then the server drops it and lets it back in.
STILL_PRESENT_RETRY_S = 15.0
_RESIGNAL_S = 0.5  # how often the main thread is interrupted again until it has heard its server went away
PORT_FILE_POLL_S = 0.5  # how often a site waiting for its server's port file looks again
GATHER_WAIT_S = 3600.0  # how long a site let in waits for the server's handshake (its lifeline sees a dead server)


# -- a site --------------------------------------------------------------------------------------------
def join_main(args: argparse.Namespace, argv: list[str]) -> int:
    """``hpcfed join`` (`args` parsed from `argv` by `hpcfed.cli.join`): one site of a federation
    served by `hpcfed serve`."""
    cfg = prepare_config(args.config, args.overrides)
    per = cfg.federation.ranks_per_site
    want = cfg.federation.num_clients if isinstance(per, int) else len(per)
    if args.site < 0 or (want is not None and args.site >= want):
        raise ConfigError(f"--site {args.site}: the config has {want} sites (client ids 0..{(want or 1) - 1})")
    ranks = site_size(cfg, args.site)
    out = Path(args.out or Path("runs") / f"{cfg.name}-site{args.site}")
    from hpcfed.comm.rendezvous import NoPortFile, read_server

    with contextlib.suppress(NoPortFile):  # the server may start later: the site waits for its port file
        read_server(args.server)  # a garbled --server fails here, before any launch
    if not under_mpi():
        return _relaunch("join", argv, ranks)
    from hpcfed.comm.port import network_env

    os.environ.update(network_env(None, args.iface))  # before MPI starts: libfabric reads them once
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    out.mkdir(parents=True, exist_ok=True)
    local = world.Get_rank()
    _setup_logging(args.site + 1, out, (want or 0) + 1, f"rank{args.site + 1}.{local}" if local else "")
    return _contained(lambda: _site_job(cfg, args, out, world, ranks))


def _site_job(cfg: Config, args: argparse.Namespace, out: Path, world: Any, ranks: int) -> int:
    """One rank of a site's job: its leader (rank 0) joins the federation, the others follow it."""
    from hpcfed.launch.device import check_node_gpus, select_device
    from hpcfed.launch.site_group import follow_site_leader, join_group

    check_site_job(ranks, world.Get_size(), args.site)
    check_node_gpus(world, cfg.device, rank0_trains=True)  # collective over the site's job, before any may fail
    group = join_group(world, cfg.federation.ranks_per_site, args.site, cfg.federation.num_clients or args.site + 1)
    device = select_device(args.site + 1, cfg.device, uses_torch=registry.uses_torch(cfg))  # by local rank
    if group.local_rank == 0:
        return _Joined(cfg, args, out, group, device).run()
    signal.signal(HALT_SIGNAL, signal.SIG_IGN)  # the server's to decide, through the leader
    from hpcfed.client import faults

    follow_site_leader(cfg, group, out, device, before=lambda: faults.non_leader_knocks(
        cfg, args.server, args.site, group.world_rank, out / "logs"))
    return 0


class _ServerGone(BaseException):
    """Raised in a site's main thread when its server's lifeline closed: it knocks again. (Not an
    Exception: nothing on the way out may take it for an error of its own.)"""


_GONE_SIGNAL = signal.SIGUSR1  # the lifelines' thread interrupts the main thread with it


class _Joined:
    """A site job: knock, connect, then `Client.run` over its one spoke; when the server's job
    goes away, knock again (a resumed server rewrites its port file) and resume from its checkpoint."""

    def __init__(self, cfg: Config, args: argparse.Namespace, out: Path, group: Any, device: str) -> None:
        self.cfg, self.args, self.out, self.group, self.device = cfg, args, out, group, device
        self.ranks: Any = None  # the site's torch.distributed group when it has many ranks
        self.rank = args.site + 1
        self.keys = RankKeys(cfg.security, self.rank)  # this site's keys, read once for every attempt
        self.finishing = threading.Event()
        self.gone: str | None = None  # why the server went away, until the main thread has heard it
        self.recovering = threading.Event()  # the main thread has left the lost federation
        self.transport: Any = None
        self.lifelines: Any = None

    def _server_gone(self, rank: int, reason: str) -> None:
        """From the lifelines' thread: stop sending to the server and make the main thread knock again."""
        if self.transport is not None:
            self.transport.mark_lost(0)
        if self.finishing.is_set():
            return
        if self.group.parallel:
            # Its other ranks may be inside a collective with it: the job ends, and its next one (a
            # requeue of join.sbatch, or hpcfed join --resume) rejoins from the site's shard.
            log.error("the server is gone: %s; site %d's job of %d ranks ends (start it again, or let Slurm "
                      "requeue it: it rejoins from its newest shard)", reason, self.args.site, self.group.size)
            _end_now(3)
        log.error("the server is gone: %s; site %d knocks again for up to %g s (federation.setup_timeout_s): "
                  "restart it with `hpcfed serve ... --resume`", reason, self.args.site,
                  self.cfg.federation.setup_timeout_s)
        self.recovering.clear()
        self.gone = reason
        threading.Thread(target=self._signal_until_heard, name="hpcfed-server-gone", daemon=True).start()
        timer = threading.Timer(SERVER_GONE_GRACE_S, self._stuck)
        timer.daemon = True
        timer.start()

    def _signal_until_heard(self) -> None:
        """Interrupt the main thread until it has left the lost federation: an interrupt that lands
        where Python ignores exceptions (a weakref callback, a __del__) is lost, so it is sent again."""
        deadline = time.monotonic() + SERVER_GONE_GRACE_S
        while not (self.recovering.is_set() or self.finishing.is_set()) and time.monotonic() < deadline:
            signal.pthread_kill(threading.main_thread().ident or 0, _GONE_SIGNAL)
            self.recovering.wait(_RESIGNAL_S)

    def _interrupt(self, signum: int, frame: Any) -> None:
        if self.gone is not None and not self.recovering.is_set() and not self.finishing.is_set():
            if _importing(frame):  # cut short, a module stays half made (torch's lazy imports): the next one
                return
            raise _ServerGone()

    def _stuck(self) -> None:
        if not self.recovering.is_set() and not self.finishing.is_set():
            log.error("site %d: still inside MPI %g s after its server went away; ending", self.args.site,
                      SERVER_GONE_GRACE_S)
            _end_now(3)

    def run(self) -> int:
        signal.signal(_GONE_SIGNAL, self._interrupt)
        if self.group.parallel:  # the site's ranks start training together before its leader knocks
            from hpcfed.launch.site_group import init_site_torch, site_timeout

            self.ranks = init_site_torch(self.group, self.device, site_timeout(self.cfg))
        resume = self.args.resume
        while True:
            try:
                try:
                    return self._attempt(resume)
                except _ServerGone:
                    self.recovering.set()
            except _ServerGone:  # sent again before the first was heard: it landed here
                self.recovering.set()
            self.gone = None
            self.lifelines.close()
            resume = True  # the resumed server continues from its checkpoint, and so does this site

    def _attempt(self, resume: bool) -> int:
        from hpcfed.comm import port as mpiport
        from hpcfed.comm.lifeline import Lifelines
        from hpcfed.comm.rendezvous import await_go
        from hpcfed.comm.spokes import SpokeTransport
        cred = self.keys.credentials()
        fed = self.cfg.federation
        prepared = self._prepare()  # before the knock: once let in, the site is ready for that round
        welcome, where = _knock_until(self.args.server, cred, self.args.site, fed.setup_timeout_s)
        # A late joiner is let in at the server's next round: at most a round's deadline away.
        await_go(welcome.sock, fed.setup_timeout_s + fed.round_deadline_s)
        _fault("HPCFED_FAULT_KILL_AFTER_GO", self.rank)  # (tests: a site that dies between GO and its Connect)
        try:
            comm = mpiport.connect(welcome.port, CONNECT_S)
        except mpiport.PortError as exc:
            log.error("site %d: %s", self.args.site, exc)
            _end_now(1)  # the Connect is stuck inside MPI: no clean way out of this process
        self.transport = SpokeTransport(welcome.rank, welcome.size, {0: mpiport.intercomm_transport(comm)})
        self.lifelines = Lifelines(self._server_gone, timeout=self.args.lifeline_timeout)
        self.lifelines.add(0, welcome.sock)
        log.info("site %d joined the server at %s as rank %d of %d", self.args.site, where, welcome.rank,
                 welcome.size)
        self._federate(cred, welcome.job_id, resume, prepared)
        self.finishing.set()
        if not mpiport.disconnect_all([comm], DISCONNECT_S):
            log.warning("site %d: the server did not disconnect within %g s; ending without it", self.args.site,
                        DISCONNECT_S)
        self.lifelines.close()  # after the Disconnect: the server disconnects only sites it still sees alive
        return 0

    def _prepare(self) -> Any:
        """The site's slow part, done before each knock (`hpcfed.client.prepared`): torch, its data, its
        model, its SETUP payload and its newest shard, read afresh for every attempt; None when the
        config does not say how many sites there are (then its `Client` builds it once let in)."""
        from hpcfed.client.config import ClientConfig
        from hpcfed.client.prepared import prepare
        from hpcfed.launch.device import set_torch_threads

        set_torch_threads(self.cfg.threads_per_rank, registry.uses_torch(self.cfg))
        per = self.cfg.federation.ranks_per_site
        num_clients = self.cfg.federation.num_clients if isinstance(per, int) else len(per)
        if num_clients is None:
            return None
        t0 = time.monotonic()
        prepared = prepare(ClientConfig.from_config(self.cfg), self.args.site, num_clients, self.out, self.device,
                           self.keys, self.ranks)
        log.info("site %d ready in %.1f s (data, model, %d shard(s) held): knocking", self.args.site,
                 time.monotonic() - t0, len(prepared.shards))
        return prepared

    def _federate(self, cred: Any, job_id: bytes, resume: bool, prepared: Any) -> None:
        from hpcfed import protocol
        from hpcfed.client.client import Client
        from hpcfed.comm.channel import SecureChannel

        channel = SecureChannel(self.transport, cred, job_id, log=logging.getLogger("hpcfed.comm").warning,
                                **channel_settings(self.cfg))
        _fault("HPCFED_FAULT_KILL_IN_HANDSHAKE", self.rank)  # (tests: a site that dies in its secure handshake)
        # A site let in while the server still gathers the others waits for the server's handshake
        # until the gathering ends (`hpcfed serve --start-deadline`, which may be longer than
        # setup_timeout_s); a server that dies meanwhile is seen by the lifeline, not by this wait.
        channel.connect([0], timeout=max(self.cfg.federation.setup_timeout_s, GATHER_WAIT_S))
        channel.expect({0: protocol.SERVER_KINDS})
        signal.signal(HALT_SIGNAL, signal.SIG_IGN)  # the server decides when to stop
        from hpcfed.client.config import ClientConfig
        from hpcfed.client.site_ranks import stop_site

        client = Client(ClientConfig.from_config(self.cfg), channel, self.out, device=self.device, resume=resume,
                        keys=self.keys, ranks=self.ranks, prepared=prepared)
        client.run()
        self.finishing.set()
        stop_site(client.task)  # the site's other ranks leave
        channel.close()


def _importing(frame: Any) -> bool:
    """Whether the interrupted main thread is inside an import (importlib's frames on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _fault(name: str, rank: int) -> None:
    """Fault injection for the tests: SIGKILL this site's job here when the environment names its rank."""
    if os.environ.get(name) == str(rank):
        log.error("fault injection (%s): killing rank %d", name, rank)
        logging.shutdown()
        os.killpg(os.getpgid(0), signal.SIGKILL)  # the whole job: mpiexec and its proxy too


def _knock_until(spec: str, cred: Any, site: int, wait: float) -> tuple[Any, str]:
    """Knock until the server answers, with a back-off, for at most `wait` s: it may start later
    than this site, or be resuming (it rewrites its port file, read again at every try), or not have
    seen this site's last job end yet (refusal code "still_present", retried for up to
    `STILL_PRESENT_RETRY_S`), or find this site's knocks too fast ("rate_limited"), or be too busy to
    answer (letting another site in: `NO_ANSWER`, as when nothing listens). Any other refusal,
    or a garbled port file, ends the wait at once, with the reason. Returns (welcome, where)."""
    from hpcfed.comm.rendezvous import (
        NO_ANSWER,
        RATE_LIMITED,
        STILL_PRESENT,
        NoPortFile,
        RendezvousError,
        knock,
        read_server,
    )

    deadline = time.monotonic() + wait
    delay, last, where = 0.5, "", f"--server {spec}"
    present_since = 0.0  # when the server first said this site is still present
    while True:
        pause = None  # the back-off, unless set
        try:
            address, where = read_server(spec)
            return knock(address, cred, site, timeout=min(10.0, max(1.0, deadline - time.monotonic()))), where
        except NoPortFile as exc:
            last, pause = str(exc), PORT_FILE_POLL_S  # a file read: the site knocks as soon as the server is up
        except OSError as exc:  # nothing listens (yet), unreachable, timed out
            last = f"nothing answered at {address[0]}:{address[1]} ({exc.strerror or exc or type(exc).__name__})"
        except RendezvousError as exc:
            if exc.code == STILL_PRESENT:
                present_since = present_since or time.monotonic()
                if time.monotonic() - present_since > STILL_PRESENT_RETRY_S:
                    raise  # another job of this site is alive: not a race with the end of this site's last job
            elif exc.code not in (RATE_LIMITED, NO_ANSWER):
                raise
            last = str(exc)  # not declared lost yet, or knocking too fast: knock again in a moment
        if pause is None:
            pause, delay = delay, min(2 * delay, 10.0)
        if time.monotonic() + pause > deadline:
            raise FederationError(
                f"site {site}: no server within {wait:g} s (federation.setup_timeout_s) from {where}; last: {last}. "
                f"The server is not running, the port file is stale (the server rewrites it at every start), "
                f"or a firewall blocks the port (see docs/cluster.md, 'Across clusters')")
        time.sleep(pause)
