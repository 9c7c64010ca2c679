"""From a command line to running ranks.

Outside MPI, ``hpcfed run --np K`` relaunches itself under ``mpiexec -n K`` (creating a pre-shared
key for the job if none is set). Inside MPI every rank loads the same config, the ranks agree on a
job id, run the secure handshake, and rank 0 becomes the server while ranks 1..K become clients.
Any uncaught failure on any rank is logged with the rank and ends the whole job (MPI Abort), so a
job never hangs on a dead peer.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcfed.config import Config, ConfigError, check_resume_compatible, load
from hpcfed.errors import FederationError
from hpcfed.launch import jobwatch
from hpcfed.launch.jobwatch import HALT_FILE

_ABORT_GRACE_S = 15  # a rank whose MPI_Abort has not ended it by then ends itself

# Environment variables set by MPI launchers (MPICH/Hydra, Open MPI, Slurm PMI2, PMIx).
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALRANKID")


def under_mpi() -> bool:
    return any(v in os.environ for v in _MPI_ENV)


def prepare_config(path: str, overrides: list[str]) -> Config:
    """Load the config and resolve it (method preset, components, mode; identical on every rank)."""
    from hpcfed.registry import resolve

    cfg = load(path, overrides)
    resolve(cfg)  # validate the components' options here, once, before any rank is started
    return cfg


def run_command(config: str, overrides: list[str], *, np: int | None, out: str | None, resume: bool,
                mpiexec: str | None = None, force: bool = False) -> int:
    if under_mpi():
        # From the start: a peer that dies while this rank still loads would otherwise end it too
        # (SIGUSR1's default action), and a halt before the server is up is dropped.
        signal.signal(signal.SIGUSR1, lambda *_: _peer_lost())
        signal.signal(HALT_SIGNAL, signal.SIG_IGN)
    cfg = prepare_config(config, overrides)  # validate before spending a launch
    out_dir = Path(out or Path("runs") / cfg.name)
    if not under_mpi():
        if np is None:
            np = (cfg.federation.num_clients + 1) if cfg.federation.num_clients else None
        if np is None:
            raise ConfigError("not running under MPI: pass --np K (server + K-1 clients) or start with mpiexec -n K")
        prepare_out_dir(out_dir, cfg, resume=resume, force=force)
        return relaunch(config, overrides, np=np, out=out_dir, resume=resume, mpiexec=mpiexec, cfg=cfg)
    return run_rank(cfg, out_dir, resume, force=force)


# What `hpcfed run` writes into OUT: a folder holding any of these holds a run's results.
RESULT_FILES = ("summary.json", "metrics.jsonl")
RESULT_DIRS = ("checkpoints", "embeddings")
# ... and what `--force` removes before starting over (never anything else of the folder).
RUN_OUTPUTS = (*RESULT_FILES, *RESULT_DIRS, "logs", "report", "report.md", "tensorboard")


def prepare_out_dir(out: Path, cfg: Config, *, resume: bool, force: bool, keep_logs: bool = False) -> None:
    """Check `--out` before anything is launched: it must be a folder (made here if missing); a
    folder that holds a run's results is only continued with --resume (from a checkpoint made
    with a compatible config) or overwritten with --force, never silently."""
    if resume and force:
        raise ConfigError("--resume continues the run in --out and --force overwrites it: choose one")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; choose another --out (e.g. runs/{cfg.name})")
    found = existing_results(out)
    if force and found:
        for name in RUN_OUTPUTS:
            if keep_logs and name == "logs":
                continue  # under MPI every rank has already opened its log there
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        print(f"hpcfed: --force: removed the earlier run's {', '.join(found)} from {out}", file=sys.stderr)
    elif found and not resume:
        raise ConfigError(f"--out {out} already holds a run ({', '.join(found)}); continue it with --resume, "
                          f"overwrite it with --force, or choose another --out")
    elif resume:
        # The one resume-compatibility check (the server does not repeat it): here it stops a
        # wrong config with a one-line error before mpiexec starts (and on rank 0 under a bare
        # mpiexec, which runs this too). Checking the newest checkpoint is checking the one the
        # server loads: every checkpoint in OUT has the same resume-critical config, since a run
        # only writes into an OUT with results when resuming it with a matching config, and
        # --force removes them first.
        saved = saved_config(out)
        if saved is not None:
            check_resume_compatible(saved[1], cfg, where=str(saved[0]))
        elif found and not any(name.startswith("checkpoints") for name in found):
            raise ConfigError(f"--resume: {out} holds a run ({', '.join(found)}) but no checkpoint to continue it "
                              f"from; start over with --force, or choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create the folder ({exc.strerror}); choose another --out") from None
    if (out / HALT_FILE).exists():  # left by an earlier attempt that stopped before its server saw it
        (out / HALT_FILE).unlink(missing_ok=True)
        print(f"hpcfed: removed {out / HALT_FILE} left from an earlier attempt (a halt request)", file=sys.stderr)


def existing_results(out: Path) -> list[str]:
    """The results of an earlier run in `out` (empty when there are none or only logs)."""
    found = []
    for name in RESULT_FILES:
        path = out / name
        if path.is_file() and path.stat().st_size > 0:
            found.append(name)
    for name in RESULT_DIRS:
        path = out / name
        if path.is_dir() and any(p.is_file() for p in path.rglob("*")):
            found.append(f"{name}/")
    return found


def saved_config(out: Path) -> tuple[Path, dict] | None:
    """(file, config) stored in the newest checkpoint in `out` that has one, read without verifying
    the whole file (the server verifies it when it loads it); None when there is none."""
    import h5py

    from hpcfed.store.checkpoint import list_checkpoints

    for path in list_checkpoints(out / "checkpoints"):
        try:
            with h5py.File(path, "r") as f:
                saved = json.loads(f.attrs["config"])
        except (OSError, KeyError, ValueError, TypeError):
            continue  # corrupt or half-written: the server skips it too, with a warning
        if isinstance(saved, dict):
            return path, saved
    return None


def relaunch(config: str, overrides: list[str], *, np: int, out: Path, resume: bool, mpiexec: str | None,
             cfg: Config) -> int:
    if np < 2:
        raise ConfigError(f"--np {np}: a federation needs at least 2 ranks (one server and one client)")
    exe = mpiexec or shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise ConfigError("no mpiexec on PATH; install an MPI (`pip install mpich`) or use your site's module")
    env = dict(os.environ)
    if cfg.security.mode == "psk" and not env.get(cfg.security.psk_env) and not cfg.security.psk_file:
        from hpcfed.credentials import job_psk

        # fresh key per run, kept outside the run directory so that --resume can verify its files
        env[cfg.security.psk_env] = job_psk(out, resume)
    cmd = [exe, "-n", str(np)]
    if cfg.federation.on_client_failure == "continue" and _is_hydra(exe):
        # Let the server outlive a dead client: hydra must not clean up, and each rank runs under a
        # guard, since hydra's proxy kills a node's ranks when one of them ends by a signal.
        cmd += ["-disable-auto-cleanup", sys.executable, "-m", "hpcfed.launch.rank_guard"]
    cmd += [sys.executable, "-m", "hpcfed", "run", config, *overrides, "--out", str(out)]
    if resume:
        cmd.append("--resume")
    log_dir = out / "logs"
    jobwatch.clear(log_dir)
    launched = time.time()
    # SIGUSR2 to `hpcfed run` halts the federation the way it does on rank 0 (through OUT/HALT, which
    # the server looks for every second: mpiexec forwards no SIGUSR2).
    signal.signal(HALT_SIGNAL, lambda *_: (out / HALT_FILE).touch())
    watch = jobwatch.RankWatch(log_dir, np)
    env.update(watch.open_lifelines())
    # No rank reads stdin: mpiexec has nothing to forward (and leaves the terminal alone).
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError:
        watch.close()
        raise
    code = jobwatch.follow(proc, watch, finished=lambda: _dropped_clients(out, launched))
    if code == 0:
        return 0
    dropped = _dropped_clients(out, launched)
    failed = [r for r in range(1, np) if jobwatch.exit_status(log_dir, r) != 0]
    if dropped is None and cfg.federation.on_client_failure == "continue" and jobwatch.exit_status(log_dir, 0) == 0:
        dropped = failed  # the server ended well (a halt writes no summary): it went on without them
    if dropped is not None and set(failed) <= set(dropped):
        # The results are written; only clients the federation went on without ended badly
        # (federation.on_client_failure=continue), or the server after its summary.
        gone = f" without {_rank_names(failed)}, dropped during the run" if failed else ""
        done = f"finished{gone}; results in {out}/summary.json" if (out / "summary.json").exists() else \
            f"halted{gone}; continue it with --resume"
        print(f"hpcfed: the federation {done}", file=sys.stderr)
        return 0
    print(failure_diagnosis(code, out, np, watch), file=sys.stderr)
    return code


def failure_diagnosis(code: int, out: Path, np: int, watch: jobwatch.RankWatch) -> str:
    """The launcher's last line for a failed job, after all of mpiexec's output: the cause first --
    a rank that ended without recording an error (killed, crashed) before any rank recorded one, or
    else the first rank that failed by itself, with its reason (ranks that MPI_Abort took down
    with it record nothing) -- then the last checkpoint and the log to read."""
    from hpcfed.store.checkpoint import list_checkpoints

    log_dir = out / "logs"
    ckpts = list_checkpoints(out / "checkpoints")
    last = f"last checkpoint: {ckpts[0] if ckpts else 'none'}"
    failed = jobwatch.failures(log_dir, np)
    causes = [f for f in failed if not f.secondary]
    first = watch.first_dead()
    parts = []
    if first is not None and jobwatch.exit_status(log_dir, first) is None:
        seen = watch.ended_at(first)
        if not causes or seen is None or seen < causes[0].when:
            parts.append(f"{_rank_names([first])} ended first (killed or crashed: it recorded no error)")
    shown = (causes or failed)[:1] if not parts else []
    for f in shown:
        parts.append(f"{_rank_names([f.rank])} failed: {f.reason or 'no reason recorded'}")
    others = [f.rank for f in failed if f not in shown]
    if others:
        parts.append(f"then {_rank_names(others)} failed too" if parts else f"{_rank_names(others)} failed")
    logs = f"log: {log_dir / f'rank{shown[0].rank}.log'}" if shown and len(parts) == 1 else f"see {log_dir}/rank*.log"
    return f"hpcfed: the federation failed (exit {code}): {'; '.join([*parts, last, logs])}"


def _rank_names(ranks: list[int]) -> str:
    return ", ".join(f"rank {r} ({'the server' if r == 0 else f'client {r - 1}'})" for r in ranks)


def _dropped_clients(out: Path, since: float) -> list[int] | None:
    """None until this launch's federation has written its summary; then the ranks of the
    clients it went on without."""
    path = out / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return None
        return [int(c) + 1 for c in json.loads(path.read_text()).get("dropped_clients", [])]
    except (OSError, ValueError, TypeError):
        return None  # not there yet, or half-written: look again


def _is_hydra(exe: str) -> bool:
    try:
        text = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in text.upper()


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
    try:
        _check_world(cfg, size)
        if rank == 0:
            # Under `hpcfed run --np` the launcher has checked OUT already (this finds it as left).
            prepare_out_dir(out_dir, cfg, resume=resume, force=force, keep_logs=True)
            (out_dir / "embeddings").mkdir(exist_ok=True)
        comm.Barrier()
        channel = _open_channel(cfg, comm, out_dir)
        device = _device(cfg, rank)
        log.info("rank %d on %s uses %s", rank, socket.gethostname(), device)
        if rank == 0:
            from hpcfed.server.server import Server

            server = Server(cfg, channel, out_dir, resume=resume)
            # SIGUSR2 (Slurm's warning signal, see slurm/requeue.sbatch) or OUT/HALT: checkpoint
            # after this round and stop. SIGUSR1 is hydra's word that some rank has ended.
            signal.signal(HALT_SIGNAL, lambda *_: server.request_halt())
            signal.signal(signal.SIGUSR1, lambda *_: _peer_lost(server.peer_ended))
            if _PEER_LOST:  # a rank ended while this one was starting: find which
                server.peer_ended()
            summary = server.run()
            for line in closing_lines(summary, out_dir, cfg):
                log.info("%s", line)
        else:
            import torch

            signal.signal(HALT_SIGNAL, signal.SIG_IGN)  # the server decides when to stop
            signal.signal(signal.SIGUSR1, lambda *_: _peer_lost())
            torch.set_num_threads(max(1, cfg.threads_per_rank))
            from hpcfed.client.client import Client

            Client(cfg, channel, out_dir, device=device, resume=resume).run()
        channel.close()
        jobwatch.write_exit(out_dir / "logs", rank, 0)
        if _PEER_LOST:
            _leave_without_finalize(log)
        return 0
    except Exception as exc:
        secondary = _is_mpi_error(exc)
        if secondary:  # a peer ended under us (killed, aborted): that peer is the story, not this rank
            reason = f"MPI error talking to another rank (did it end?): {_mpi_brief(exc)}"
            log.error("rank %d failed: %s", rank, reason)
        elif _expected(exc):
            log.error("rank %d failed: %s", rank, exc)
            reason = str(exc)
        else:
            log.error("rank %d failed: %s: %s\n%s", rank, type(exc).__name__, exc, traceback.format_exc())
            reason = f"{type(exc).__name__}: {exc} (a bug: the traceback is in the log)"
        _abort(comm, out_dir, rank, 2 if isinstance(exc, ConfigError) else 1, reason, secondary=secondary)
    except BaseException as exc:
        log.error("rank %d stopped: %s", rank, type(exc).__name__)
        _abort(comm, out_dir, rank, 1, f"stopped by {type(exc).__name__}")
    return 1


# The signal that halts a federation cleanly (checkpoint after the current round, stop): SIGUSR1 is
# taken by MPICH's hydra, which sends it to every rank when one ends (-disable-auto-cleanup).
HALT_SIGNAL = signal.SIGUSR2
_PEER_LOST: list[int] = []  # non-empty once hydra has said that a rank of this job ended


def _peer_lost(then: Callable[[], None] | None = None) -> None:
    """SIGUSR1: a rank of this job ended (this one leaves without MPI_Finalize); the server finds which."""
    _PEER_LOST.append(1)
    if then is not None:
        then()


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
    comm.Abort(code)  # type: ignore[attr-defined]


def _check_world(cfg: Config, size: int) -> None:
    ntasks = os.environ.get("SLURM_NTASKS")
    if size == 1 and ntasks and int(ntasks) > 1:
        raise ConfigError(f"this rank sees an MPI world of 1 but Slurm started {ntasks} tasks: plain `srun` "
                          f"started separate programs; use `srun --mpi=pmi2` or `mpiexec -n $SLURM_NTASKS`")
    if size < 2:
        raise ConfigError("the MPI world has 1 rank; a federation needs a server and at least one client "
                          "(mpiexec -n 3)")
    want = cfg.federation.num_clients
    if want is not None and want != size - 1:
        raise ConfigError(f"{cfg.source}: federation.num_clients={want} but the job has {size - 1} client ranks "
                          f"(world size {size}); start it with -n {want + 1} or drop the key")


def _open_channel(cfg: Config, comm: object, out_dir: Path):
    """This rank's secure channel of the job's star (see `hpcfed.comm.star`), set up from `cfg`.
    With on_client_failure=continue the server does not wait for a site that ended during the
    handshake: the setup exchange drops it (`hpcfed.server.setup`)."""
    from hpcfed.comm.star import draw_job_id, open_star
    from hpcfed.comm.transport import MPITransport
    from hpcfed.credentials import load_credentials

    transport = MPITransport(comm)
    job_id = draw_job_id(transport, os.environ.get("SLURM_JOB_ID", "").encode() + b":")
    credentials = load_credentials(cfg.security, transport.rank)
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


def _device(cfg: Config, rank: int) -> str:
    from hpcfed.launch.device import select_device

    return select_device(rank, cfg.device)


def _setup_logging(rank: int, out_dir: Path, size: int) -> None:
    fmt = logging.Formatter(f"[hpcfed r{rank}/{size} %(asctime)s] %(levelname)s %(message)s", "%H:%M:%S")
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
        fileh = logging.FileHandler(out_dir / "logs" / f"rank{rank}.log")
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
        from hpcfed.registry import task_class

        task_cls: object = task_class(cfg.task.name, cfg.source)
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
