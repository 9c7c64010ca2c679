"""A run's output folder (``--out``): what a run writes there, and the checks before one starts.

A folder that holds a run's results is only continued with ``--resume`` (from a checkpoint made with
a compatible config) or overwritten with ``--force``, never silently. The parent process
(`hpcfed.launch.parent`), rank 0 (`hpcfed.launch.rank`) and ``hpcfed serve`` check it the same way.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from hpcfed.config import Config, ConfigError, check_resume_compatible
from hpcfed.store.rank_records import HALT_FILE

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
