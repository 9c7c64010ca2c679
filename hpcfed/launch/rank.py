"""The body of one MPI rank of ``hpcfed run`` (the parent process that starts them under mpiexec
is `hpcfed.launch.parent`).

Inside MPI every rank loads the same config, the ranks agree on a job id, run the secure handshake,
and rank 0 becomes the server while ranks 1..K become clients. Any uncaught failure on any rank is
logged with the rank and ends the whole job (MPI Abort), so a job never hangs on a dead peer.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcfed import registry
from hpcfed.config import Config, ConfigError
from hpcfed.credentials import RankKeys
from hpcfed.errors import FederationError
from hpcfed.launch import jobwatch
from hpcfed.launch.out_dir import prepare_out_dir
from hpcfed.launch.site_group import (
    LeadersOnlyTransport,
    SiteGroup,
    follow_site_leader,
    init_site_torch,
    site_timeout,
    split_world,
)
from hpcfed.schema import InvalidValue, locate
from hpcfed.site_layout import SiteLayout, layout_for, world_size_for

_ABORT_GRACE_S = 15  # a rank whose MPI_Abort has not ended it by then ends itself


def run_rank(cfg: Config, out_dir: Path, resume: bool, force: bool = False) -> int:
    """Body of one MPI rank. Returns the exit code; aborts the job on failure."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    _setup_logging(rank, out_dir, size)
    log = logging.getLogger("hpcfed")
    log.debug("rank %d pid %d on %s", rank, os.getpid(), socket.gethostname())
    jobwatch.write_pid(out_dir / "logs", rank)
    jobwatch.hold_lifeline(rank)
    group = None
    try:
        layout = _check_world(cfg, size)
        group = split_world(comm, layout)  # collective: every rank, before anything can fail apart
        if rank == 0:
            # Under `hpcfed run --np` the launcher has checked OUT already (this finds it as left).
            prepare_out_dir(out_dir, cfg, resume=resume, force=force, keep_logs=True)
            (out_dir / "embeddings").mkdir(exist_ok=True)
        comm.Barrier()
        device = _device(cfg, rank, comm)
        if group.star_comm is None:  # a site's non-leader: no channel, it trains with its leader
            from hpcfed.client import faults

            signal.signal(HALT_SIGNAL, signal.SIG_IGN)  # the server decides when to stop
            signal.signal(signal.SIGUSR1, lambda *_: peer_lost())
            follow_site_leader(cfg, group, out_dir, device, before=lambda: faults.non_leader_sends(rank))
            jobwatch.write_exit(out_dir / "logs", rank, 0)
            return _leave(log)
        star_rank = group.star_comm.Get_rank()
        keys = RankKeys(cfg.security, star_rank)  # this rank's keys, read once and passed down
        channel = _open_channel(cfg, group.star_comm, out_dir, keys, group)
        log.info("rank %d on %s uses %s", rank, socket.gethostname(), device)
        if rank == 0:
            from hpcfed.server.server import Server

            server = Server(cfg, channel, out_dir, resume=resume, keys=keys)
            # SIGUSR2 (Slurm's warning signal, see slurm/requeue.sbatch) or OUT/HALT: checkpoint
            # after this round and stop. SIGUSR1 is hydra's word that some rank has ended.
            signal.signal(HALT_SIGNAL, lambda *_: server.request_halt())
            signal.signal(signal.SIGUSR1, lambda *_: peer_lost(server.peer_ended))
            if _PEER_LOST:  # a rank ended while this one was starting: find which
                server.peer_ended()
            summary = server.run()
            for line in closing_lines(summary, out_dir, cfg):
                log.info("%s", line)
        else:
            _run_client(cfg, channel, out_dir, device, resume, keys, group)
        channel.close()
        jobwatch.write_exit(out_dir / "logs", rank, 0)
        if rank == 0:
            _end_with_the_run(comm, out_dir, size, log)
        return _leave(log)
    except Exception as exc:
        secondary = _is_mpi_error(exc)
        lost = _site_rank_lost(out_dir, group) if group is not None and group.parallel else None
        if lost is not None:  # a rank of this site ended: the collective that failed is the symptom
            secondary, reason = True, f"{lost}; its site ends with it"
            log.error("rank %d failed: %s", rank, reason)
        elif secondary:  # a peer ended under us (killed, aborted): that peer is the story, not this rank
            reason = f"MPI error talking to another rank (did it end?): {_mpi_brief(exc)}"
            log.error("rank %d failed: %s", rank, reason)
        elif _expected(exc):
            log.error("rank %d failed: %s", rank, exc)
            reason = str(exc)
        else:
            log.error("rank %d failed: %s: %s\n%s", rank, type(exc).__name__, exc, traceback.format_exc())
            reason = f"{type(exc).__name__}: {exc} (a bug: the traceback is in the log)"
        code = 2 if isinstance(exc, ConfigError) else 1
        if group is not None and group.parallel and cfg.federation.on_client_failure == "continue":
            _end_site(out_dir, group, code, reason, secondary)  # the site ends, not the federation
        _abort(comm, out_dir, rank, code, reason, secondary=secondary)
    except BaseException as exc:
        log.error("rank %d stopped: %s", rank, type(exc).__name__)
        _abort(comm, out_dir, rank, 1, f"stopped by {type(exc).__name__}")
    return 1


# The signal that halts a federation cleanly (checkpoint after the current round, stop): SIGUSR1 is
# taken by MPICH's hydra, which sends it to every rank when one ends (-disable-auto-cleanup).
HALT_SIGNAL = signal.SIGUSR2
_PEER_LOST: list[int] = []  # non-empty once hydra has said that a rank of this job ended


def peer_lost(then: Callable[[], None] | None = None) -> None:
    """SIGUSR1: a rank of this job ended (this one leaves without MPI_Finalize); the server finds which."""
    _PEER_LOST.append(1)
    if then is not None:
        then()


_STOP_GRACE_S = 10.0  # how long rank 0 waits, after the run, for every other rank to leave


def _end_with_the_run(comm: object, out_dir: Path, size: int, log: logging.Logger) -> None:
    """Rank 0, the run over (summary.json or the halt's checkpoint written, every rank told STOP):
    a rank still running `_STOP_GRACE_S` later (a hostile one that ignores STOP, an evicted one
    that stays) must not keep the job alive. MPI_Abort with status 0 ends every rank; mpiexec then
    exits 0 (MPICH hydra 5.0.2, with and without -disable-auto-cleanup): the run succeeded."""
    log_dir = out_dir / "logs"
    deadline = time.monotonic() + _STOP_GRACE_S
    while lingering := [r for r in range(1, size) if jobwatch.rank_ended(log_dir, r) is None]:
        if time.monotonic() >= deadline:
            log.warning("rank(s) %s still running %g s after the run ended (told to stop): ending the job "
                        "(MPI_Abort with status 0; the results are written)",
                        ", ".join(map(str, lingering)), _STOP_GRACE_S)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            comm.Abort(0)  # type: ignore[attr-defined]  # mpi4py's Comm, imported inside run_rank
        time.sleep(0.2)


def _leave(log: logging.Logger) -> int:
    """A rank's normal end: 0, or straight out when a rank of the job has ended (`_leave_without_finalize`)."""
    if _PEER_LOST:
        _leave_without_finalize(log)
    return 0


def _run_client(cfg: Config, channel: object, out_dir: Path, device: str, resume: bool, keys: RankKeys,
                group: SiteGroup) -> None:
    """A site's leader (or a site of one rank): the client loop; a site of many ranks first starts
    its torch.distributed group, and tells its other ranks to leave at the end."""
    signal.signal(HALT_SIGNAL, signal.SIG_IGN)  # the server decides when to stop
    signal.signal(signal.SIGUSR1, lambda *_: peer_lost())
    from hpcfed.client.client import Client
    from hpcfed.client.config import ClientConfig
    from hpcfed.client.site_ranks import stop_site
    from hpcfed.launch.device import set_torch_threads

    set_torch_threads(cfg.threads_per_rank, registry.uses_torch(cfg))
    ranks = init_site_torch(group, device, site_timeout(cfg)) if group.parallel else None
    client = Client(ClientConfig.from_config(cfg), channel, out_dir, device=device, resume=resume,  # type: ignore[arg-type]  # a SecureChannel is a Channel
                    keys=keys, ranks=ranks)
    client.run()
    stop_site(client.task)


def _site_rank_lost(out_dir: Path, group: SiteGroup, wait_s: float = 3.0) -> str | None:
    """Which other rank of this rank's site has ended, and how (it may take a moment to be seen)."""
    others = [r for r in group.layout.world_ranks(group.site or 0) if r != group.world_rank]
    deadline = time.monotonic() + wait_s
    while True:
        for r in others:
            if how := jobwatch.rank_ended(out_dir / "logs", r):
                return f"{group.layout.describe(r)} {how}"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def _end_site(out_dir: Path, group: SiteGroup, code: int, reason: str, secondary: bool) -> None:
    """A rank of a site of many ranks failed (or saw a rank of its site end) under
    on_client_failure=continue: record it and exit, without MPI_Abort, which would end the whole
    job. The site's other ranks fail their next collective and leave too; rank 0 drops the site."""
    jobwatch.write_exit(out_dir / "logs", group.world_rank, code, reason, secondary=secondary)
    logging.getLogger("hpcfed").error("site %s ends: %s", group.site, reason)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_without_finalize(log: logging.Logger) -> None:
    """Exit now, skipping MPI_Finalize: with a rank of the job gone it never returns (hydra 5.0.2)."""
    log.info("a rank of this job has ended: leaving without MPI_Finalize")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _expected(exc: BaseException) -> bool:
    """Failures with a plain-words message (bad config, data, peers): no traceback needed."""
    from hpcfed.comm.channel import ChannelError

    return isinstance(exc, (ValueError, FileNotFoundError, FederationError, ChannelError))


def _is_mpi_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("mpi4py")


def _mpi_brief(exc: BaseException) -> str:
    """MPICH's error stacks span many lines; the first and the last say what happened."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip().strip(":")]
    return lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"


def _abort(comm: object, out_dir: Path, rank: int, code: int, reason: str, secondary: bool = False) -> None:
    jobwatch.write_exit(out_dir / "logs", rank, code, reason, secondary=secondary)
    logging.shutdown()
    sys.stderr.flush()
    # MPI_Abort can hang when the peer that should carry it out is gone (a killed server, a dead
    # proxy): SIGALRM's default action ends this process regardless.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(_ABORT_GRACE_S)
    comm.Abort(code)  # type: ignore[attr-defined]  # mpi4py's Comm, imported inside run_rank


def _check_world(cfg: Config, size: int) -> SiteLayout:
    """The job's sites (ConfigError when the world cannot hold them)."""
    ntasks = os.environ.get("SLURM_NTASKS")
    if size == 1 and ntasks and int(ntasks) > 1:
        raise ConfigError(f"this rank sees an MPI world of 1 but Slurm started {ntasks} tasks: plain `srun` "
                          f"started separate programs; use `srun --mpi=pmi2` or `mpiexec -n $SLURM_NTASKS`")
    if size < 2:
        raise ConfigError("the MPI world has 1 rank; a federation needs a server and at least one client "
                          "(mpiexec -n 3)")
    layout = layout_for(cfg.federation.ranks_per_site, size, str(cfg.source))
    want = cfg.federation.num_clients
    if want is not None and want != layout.num_sites:
        per = "" if layout.single_rank else f" of {cfg.federation.ranks_per_site} rank(s) each"
        fix = world_size_for(cfg.federation.ranks_per_site, want)
        raise ConfigError(f"{cfg.source}: federation.num_clients={want} but the job has {layout.num_sites} sites{per} "
                          f"(world size {size}); start it with -n {fix} or drop the key")
    try:
        cfg.federation.check_buffer(layout.num_sites)
    except InvalidValue as exc:
        raise ConfigError(f"{locate(cfg.source, 'federation.' + exc.key)} {exc.problem}") from None
    return layout


def _open_channel(cfg: Config, comm: object, out_dir: Path, keys: RankKeys, group: SiteGroup):
    """This rank's secure channel of the job's star (see `hpcfed.comm.star`), set up from `cfg`.
    With on_client_failure=continue the server does not wait for a site that ended during the
    handshake: the setup exchange drops it (`hpcfed.server.setup`)."""
    from hpcfed.comm.star import draw_job_id, open_star
    from hpcfed.comm.transport import MPITransport

    transport: Any = MPITransport(comm)
    if transport.rank == 0 and not group.layout.single_rank:  # non-leaders' frames: read and refused
        from mpi4py import MPI

        transport = LeadersOnlyTransport(transport, MPI.COMM_WORLD, group.layout)
    job_id = draw_job_id(transport, os.environ.get("SLURM_JOB_ID", "").encode() + b":")
    credentials = keys.credentials()
    log = logging.getLogger("hpcfed.comm")
    if os.environ.get("HPCFED_FAULT_KILL_IN_HANDSHAKE") == str(transport.rank):
        log.error("fault injection: killing rank %d before the secure handshake", transport.rank)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
    ended = None
    if transport.rank == 0 and cfg.federation.on_client_failure == "continue":
        ended = functools.partial(jobwatch.rank_ended, out_dir / "logs")
    channel = open_star(transport, credentials, job_id, timeout=cfg.federation.setup_timeout_s, log=log.warning,
                        ended=ended, **channel_settings(cfg))
    if transport.rank == 0 and cfg.security.mode == "keys":
        for rank in channel.peers:  # who is who, for the record
            log.info("rank %d authenticated as site key %s", rank, channel.identity(rank))
    if transport.rank != 0:  # a client takes the server's kinds from the server, nothing from anyone else
        from hpcfed import protocol

        channel.expect({0: protocol.SERVER_KINDS})
    return channel


def channel_settings(cfg: Config) -> dict[str, Any]:
    """The secure channel's settings from the config's `comm:`, `security:` and `federation:`."""
    from hpcfed.comm.wire import WireLimits

    limits = WireLimits(max_tensors=cfg.comm.max_tensors, max_total_bytes=cfg.comm.max_message_bytes)
    return dict(chunk_bytes=cfg.comm.chunk_bytes, limits=limits, shared_memory=cfg.comm.shared_memory,
                crypto_threads=cfg.comm.crypto_threads, max_message_bytes=cfg.comm.max_message_bytes,
                backoff_max_s=cfg.comm.backoff_max_s, max_rejects=cfg.security.max_rejects,
                send_timeout_s=min(cfg.federation.round_deadline_s, cfg.federation.client_timeout_s))


def _device(cfg: Config, rank: int, comm: Any) -> str:
    from hpcfed.launch.device import check_node_gpus, select_device

    check_node_gpus(comm, cfg.device)  # collective over the world: every rank, before any may fail alone
    return select_device(rank, cfg.device, uses_torch=registry.uses_torch(cfg))


def _setup_logging(rank: int, out_dir: Path, size: int, name: str = "") -> None:
    """Log to stderr and OUT/logs/<name or rankN>.log (a joined site's other ranks: rankN.L)."""
    fmt = logging.Formatter(f"[hpcfed r{name[4:] or rank}/{size} %(asctime)s] %(levelname)s %(message)s", "%H:%M:%S")
    root = logging.getLogger("hpcfed")
    root.handlers.clear()
    root.setLevel(logging.INFO)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    stream.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.addHandler(stream)
    root.propagate = False
    try:
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        fileh = logging.FileHandler(out_dir / "logs" / f"{name or f'rank{rank}'}.log")
        fileh.setFormatter(fmt)
        root.addHandler(fileh)
    except OSError:
        pass


def closing_lines(summary: dict, out_dir: Path, cfg: Config) -> list[str]:
    """What the run ends with on the console: its final figures, what they were measured on, and
    where everything it wrote is."""
    if "halted_after_round" in summary:
        return [f"halted after round {summary['halted_after_round']} (halt_after_round, SIGUSR2 or OUT/HALT); "
                f"continue with --resume "
                f"from {summary.get('last_checkpoint')}"]
    if "stopped" in summary:
        return [f"stopped: {summary['stopped']}"]
    warn = [f"warning: evicted client {e['client']} (rank {e['rank']}): {e['reason']}"
            for e in summary.get("evicted", [])]
    mean = summary.get("mean", {})
    figures = ", ".join(f"{k}={v:.4f}" for k, v in mean.items() if isinstance(v, float)) or "no metrics"
    clients = len(summary.get("clients", {}))
    try:
        task_cls: object = registry.task_class(cfg.task.name, cfg.source)
    except ValueError:
        task_cls = None
    note = getattr(task_cls, "evaluation_note", "")  # what the task's splits mean
    # a task without a test split (doc2vec) says what its final figures are measured on
    measured_on = getattr(task_cls, "final_figures_on", "")
    kind, on = ("", measured_on) if measured_on else (" test", "each site's test split")
    lines = [f"done: final{kind} metrics, mean over {clients} site{'s' if clients != 1 else ''}: {figures} (on {on})"]
    lines += getattr(task_cls, "summary_lines", lambda _: [])(summary)  # e.g. DAMe: personalised vs Local
    note = note or "the val_* figures of the round lines are on each site's validation split"
    lines.append(f"note: {note}")
    step = "round" if cfg.mode == "sync" else "accepted update"
    where = [f"{out_dir / 'summary.json'} (final metrics per site)", f"{out_dir / 'metrics.jsonl'} (per {step})"]
    exports = sorted((out_dir / "embeddings").glob("*.h5"))
    if exports:
        where.append(f"{out_dir / 'embeddings'}/ ({len(exports)} site export{'s' if len(exports) != 1 else ''})")
    if summary.get("last_checkpoint"):
        where.append(f"{summary['last_checkpoint']} (newest checkpoint)")
    lines.append(f"results: {', '.join(where)}; plots: hpcfed report {out_dir}")
    return lines + warn
