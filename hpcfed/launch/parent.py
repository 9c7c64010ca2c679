"""The parent process of ``hpcfed run``: from a command line to a job under mpiexec.

Outside MPI, ``hpcfed run --np K`` checks the config and ``--out``, makes a pre-shared key for the
job if none is set (`hpcfed.credentials.job_psk`), relaunches itself under ``mpiexec -n K`` and
watches the ranks (`hpcfed.launch.jobwatch`); its last line says how the job ended, and why. Under
MPI the same command runs the rank's body (`hpcfed.launch.rank`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcfed.config import Config, ConfigError, load
from hpcfed.launch import jobwatch
from hpcfed.launch.out_dir import prepare_out_dir
from hpcfed.launch.rank import HALT_SIGNAL, peer_lost, run_rank
from hpcfed.site_layout import SiteLayout, layout_for, world_size_for
from hpcfed.store.rank_records import HALT_FILE

# Environment variables set by MPI launchers (MPICH/Hydra, Open MPI, Slurm PMI2, PMIx).
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALRANKID")


def under_mpi() -> bool:
    """Whether this process was started by an MPI launcher (it is a rank, not the parent)."""
    return any(v in os.environ for v in _MPI_ENV)


def prepare_config(path: str, overrides: list[str]) -> Config:
    """Load the config and resolve it (method preset, components, mode; identical on every rank)."""
    from hpcfed.registry import resolve

    cfg = load(path, overrides)
    resolve(cfg)  # validate the components' options here, once, before any rank is started
    return cfg


def run_command(config: str, overrides: list[str], *, np: int | None, out: str | None, resume: bool,
                mpiexec: str | None = None, force: bool = False) -> int:
    """`hpcfed run`: outside MPI, check and relaunch under mpiexec; under MPI, run this rank."""
    if under_mpi():
        # From the start: a peer that dies while this rank still loads would otherwise end it too
        # (SIGUSR1's default action), and a halt before the server is up is dropped.
        signal.signal(signal.SIGUSR1, lambda *_: peer_lost())
        signal.signal(HALT_SIGNAL, signal.SIG_IGN)
    cfg = prepare_config(config, overrides)  # validate before spending a launch
    out_dir = Path(out or Path("runs") / cfg.name)
    if not under_mpi():
        if np is None:
            np = world_size_for(cfg.federation.ranks_per_site, cfg.federation.num_clients)
        if np is None:
            raise ConfigError("not running under MPI: pass --np K (server + K-1 clients) or start with mpiexec -n K")
        if np >= 2:
            layout_for(cfg.federation.ranks_per_site, np, cfg.source)  # whole sites, before spending a launch
        prepare_out_dir(out_dir, cfg, resume=resume, force=force)
        return relaunch(config, overrides, np=np, out=out_dir, resume=resume, mpiexec=mpiexec, cfg=cfg)
    return run_rank(cfg, out_dir, resume, force=force)


def relaunch(config: str, overrides: list[str], *, np: int, out: Path, resume: bool, mpiexec: str | None,
             cfg: Config) -> int:
    """Start the job under ``mpiexec -n NP`` (with a fresh job key if none is set), follow its ranks,
    and return its exit status, with the cause of a failure as the last line."""
    if np < 2:
        raise ConfigError(f"--np {np}: a federation needs at least 2 ranks (one server and one client)")
    layout = layout_for(cfg.federation.ranks_per_site, np, cfg.source)
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
    code = jobwatch.follow(proc, watch, finished=lambda: _dropped_clients(out, launched, layout))
    if code == 0:
        return 0
    dropped = _dropped_clients(out, launched, layout)
    failed = [r for r in range(1, np) if jobwatch.exit_status(log_dir, r) != 0]
    if dropped is None and cfg.federation.on_client_failure == "continue" and jobwatch.exit_status(log_dir, 0) == 0:
        dropped = failed  # the server ended well (a halt writes no summary): it went on without them
    if dropped is not None and set(failed) <= set(dropped):
        # The results are written; only clients the federation went on without ended badly
        # (federation.on_client_failure=continue), or the server after its summary.
        gone = f" without {_rank_names(failed, layout)}, dropped during the run" if failed else ""
        done = f"finished{gone}; results in {out}/summary.json" if (out / "summary.json").exists() else \
            f"halted{gone}; continue it with --resume"
        print(f"hpcfed: the federation {done}", file=sys.stderr)
        return 0
    print(failure_diagnosis(code, out, np, watch, layout), file=sys.stderr)
    return code


def failure_diagnosis(code: int, out: Path, np: int, watch: jobwatch.RankWatch,
                      layout: SiteLayout | None = None) -> str:
    """The launcher's last line for a failed job, after all of mpiexec's output: the cause first --
    a rank that ended without recording an error (killed, crashed) before any rank recorded one, or
    else the first rank that failed by itself, with its reason (ranks that MPI_Abort took down
    with it record nothing) -- then the last checkpoint and the log to read."""
    from hpcfed.store.checkpoint import list_checkpoints

    layout = layout or SiteLayout((1,) * (np - 1))
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
            parts.append(f"{_rank_names([first], layout)} ended first (killed or crashed: it recorded no error)")
    shown = (causes or failed)[:1] if not parts else []
    for f in shown:
        parts.append(f"{_rank_names([f.rank], layout)} failed: {f.reason or 'no reason recorded'}")
    others = [f.rank for f in failed if f not in shown]
    if others:
        named = _rank_names(others, layout)
        parts.append(f"then {named} failed too" if parts else f"{named} failed")
    logs = f"log: {log_dir / f'rank{shown[0].rank}.log'}" if shown and len(parts) == 1 else f"see {log_dir}/rank*.log"
    return f"hpcfed: the federation failed (exit {code}): {'; '.join([*parts, last, logs])}"


def _rank_names(ranks: list[int], layout: SiteLayout) -> str:
    return ", ".join(layout.describe(r) for r in ranks)


def _dropped_clients(out: Path, since: float, layout: SiteLayout) -> list[int] | None:
    """None until this launch's federation has written its summary; then the world ranks of the
    clients it went on without (every rank of a dropped site)."""
    path = out / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return None
        dropped = [int(c) for c in json.loads(path.read_text()).get("dropped_clients", [])]
        return [r for c in dropped if 0 <= c < layout.num_sites for r in layout.world_ranks(c)]
    except (OSError, ValueError, TypeError):
        return None  # not there yet, or half-written: look again


def _is_hydra(exe: str) -> bool:
    try:
        text = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in text.upper()
