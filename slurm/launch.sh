# shellcheck shell=bash
# Shared by slurm/*.sbatch (sourced, not run): environment, MPI launcher choice, world-size check,
# and running one federation with signals forwarded. See docs/cluster.md.
#
# Knobs (environment variables, set before `sbatch` or with `sbatch --export=ALL,NAME=value`):
#   HPCFED_MODULES    modules to `module load` first, e.g. "gcc/12 openmpi/4.1 cuda/12.4"
#   HPCFED_VENV       a virtualenv to activate (its bin/activate), e.g. $HOME/venvs/hpcfed
#   HPCFED_PYTHON     python executable (default: python3 on PATH after the two above)
#   HPCFED_LAUNCHER   auto (default: srun --mpi=pmi2, else mpiexec) | srun | mpiexec
#   HPCFED_SRUN_MPI   the srun MPI plugin (default pmi2; pmix for a site MPI built with PMIx)
#   HPCFED_SRUN_ARGS / HPCFED_MPIEXEC_ARGS   extra launcher arguments
#   HPCFED_PSK        pre-shared key (64 hex digits). When unset, hpcfed_job_key takes the run's key
#                     from ~/.hpcfed/keys/<run id> (as `hpcfed run --np` does): a fresh one for a new
#                     run, the stored one for --resume, so a requeued attempt can verify the
#                     checkpoints the earlier attempt signed.

hpcfed_log() { echo "[hpcfed-slurm $(date -u +%H:%M:%S)] $*" >&2; }
hpcfed_die() { hpcfed_log "error: $*"; exit 2; }

hpcfed_env() {
  if [ -n "${HPCFED_MODULES:-}" ]; then
    command -v module >/dev/null 2>&1 || hpcfed_die "HPCFED_MODULES is set but there is no 'module' command on this node"
    # shellcheck disable=SC2086
    module load $HPCFED_MODULES || hpcfed_die "module load $HPCFED_MODULES failed"
  fi
  if [ -n "${HPCFED_VENV:-}" ]; then
    [ -f "$HPCFED_VENV/bin/activate" ] || hpcfed_die "HPCFED_VENV=$HPCFED_VENV has no bin/activate"
    # shellcheck disable=SC1091
    source "$HPCFED_VENV/bin/activate"
  fi
  HPCFED_PYTHON=${HPCFED_PYTHON:-$(command -v python3 || command -v python || true)}
  [ -n "$HPCFED_PYTHON" ] || hpcfed_die "no python3 on PATH; set HPCFED_VENV or HPCFED_PYTHON"
  "$HPCFED_PYTHON" -c "import hpcfed, mpi4py" 2>/dev/null \
    || hpcfed_die "$HPCFED_PYTHON cannot import hpcfed and mpi4py; install hpcfed in it (tools/setup.sh) or set HPCFED_VENV"
  : "${SLURM_NTASKS:?not inside a Slurm allocation (SLURM_NTASKS is unset): submit with sbatch}"
  [ "$SLURM_NTASKS" -ge 2 ] || hpcfed_die "a federation needs >= 2 tasks (1 server + clients); submit with --ntasks=3 or more"
  # One thread per rank unless the job asked for more CPUs per task: ranks share nodes.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
  export PYTHONUNBUFFERED=1
}

# hpcfed_job_key OUTDIR RESUME(0|1): export HPCFED_PSK for the run in OUTDIR unless the user set one.
# Checkpoints are signed with this key, so every attempt of a run must use the same one.
hpcfed_job_key() {
  [ -n "${HPCFED_PSK:-}" ] && return 0
  HPCFED_PSK=$("$HPCFED_PYTHON" -c 'import sys; from pathlib import Path; from hpcfed.credentials import job_psk
print(job_psk(Path(sys.argv[1]), sys.argv[2] == "1"))' "$1" "$2") || hpcfed_die "could not make or read the job key for $1"
  export HPCFED_PSK
}

# Print the MPI world size a launcher gives (rank 0's view), or nothing when the launch failed.
_hpcfed_world_size() {
  local probe='from mpi4py import MPI
c = MPI.COMM_WORLD
if c.Get_rank() == 0: print("HPCFED_WORLD", c.Get_size(), flush=True)'
  # Plain `srun` (no PMI) starts N one-rank programs: each prints "HPCFED_WORLD 1", so count lines too.
  local out
  out=$("$@" "$HPCFED_PYTHON" -c "$probe" 2>/dev/null | grep '^HPCFED_WORLD' || true)
  if [ "$(printf '%s\n' "$out" | grep -c HPCFED_WORLD)" = 1 ]; then
    printf '%s\n' "$out" | awk '{print $2}'
  else
    printf '%s\n' "$out" | awk '{print $2}' | sort -u | paste -sd, -
  fi
}

# Sets HPCFED_LAUNCH (an array): the command prefix that starts SLURM_NTASKS ranks in ONE MPI world.
hpcfed_pick_launcher() {
  local want=${HPCFED_LAUNCHER:-auto} size
  local -a srun_cmd mpiexec_cmd
  # shellcheck disable=SC2206
  srun_cmd=(srun --mpi="${HPCFED_SRUN_MPI:-pmi2}" -n "$SLURM_NTASKS" ${HPCFED_SRUN_ARGS:-})
  # shellcheck disable=SC2206
  mpiexec_cmd=(mpiexec -n "$SLURM_NTASKS" ${HPCFED_MPIEXEC_ARGS:-})
  case $want in
    auto | srun)
      size=$(_hpcfed_world_size "${srun_cmd[@]}")
      if [ "$size" = "$SLURM_NTASKS" ]; then HPCFED_LAUNCH=("${srun_cmd[@]}"); return 0; fi
      [ "$want" = srun ] && hpcfed_die "'${srun_cmd[*]}' gave MPI world size '${size:-none}', not SLURM_NTASKS=$SLURM_NTASKS; \
try HPCFED_SRUN_MPI=pmix (srun --mpi=list shows what this cluster has) or HPCFED_LAUNCHER=mpiexec"
      hpcfed_log "srun --mpi=${HPCFED_SRUN_MPI:-pmi2} gave world size '${size:-none}' (want $SLURM_NTASKS); trying mpiexec"
      ;& # fall through
    mpiexec)
      command -v mpiexec >/dev/null || hpcfed_die "no mpiexec on PATH (load your MPI module: HPCFED_MODULES)"
      size=$(_hpcfed_world_size "${mpiexec_cmd[@]}")
      if [ "$size" = "$SLURM_NTASKS" ]; then HPCFED_LAUNCH=("${mpiexec_cmd[@]}"); return 0; fi
      hpcfed_die "'${mpiexec_cmd[*]}' gave MPI world size '${size:-none}', not SLURM_NTASKS=$SLURM_NTASKS: mpi4py is \
probably built against a different MPI than this launcher (see docs/cluster.md, 'Site MPI')"
      ;;
    *) hpcfed_die "HPCFED_LAUNCHER=$want: choose auto, srun or mpiexec" ;;
  esac
}

# Newest checkpoint file in OUTDIR (may be corrupt: the runtime verifies and falls back), or nothing.
hpcfed_newest_checkpoint() {
  ls -1 "$1"/checkpoints/ckpt-*.h5 2>/dev/null | sort | tail -n 1
}

# hpcfed_run CONFIG OUTDIR [hpcfed run args...]: run one federation in the background and wait for
# it, so that a trap set by the caller (SIGTERM, SIGUSR1) runs at once instead of after the job.
HPCFED_CHILD=
hpcfed_run() {
  local config=$1 out=$2
  shift 2
  if [ "${HPCFED_LAUNCH[0]}" = srun ] && [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    # A requeued job numbers its steps from 0 again, and MPICH names its shared-memory segment after
    # the PMI job id "<job>.<step>": a step killed in the previous attempt left that segment in
    # /dev/shm, and a new step with the same id attaches to it and spins forever in MPI_Init. Burn one
    # (empty) step id per restart so that this attempt's federation step has an id never used before.
    for _ in $(seq 1 "$SLURM_RESTART_COUNT"); do srun -n 1 --mpi=none true >/dev/null 2>&1 || true; done
  fi
  hpcfed_log "job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname): ${HPCFED_LAUNCH[*]} \
$HPCFED_PYTHON -m hpcfed run $config $* --out $out"
  # Overrides go before --out: argparse does not take positionals after an option's value.
  "${HPCFED_LAUNCH[@]}" "$HPCFED_PYTHON" -m hpcfed run "$config" "$@" --out "$out" &
  HPCFED_CHILD=$!
  local rc=0
  while :; do
    wait "$HPCFED_CHILD" && rc=0 || rc=$?
    # `wait` returns early (>128) when a trapped signal arrives; keep waiting for the real exit status.
    if [ "$rc" -gt 128 ] && kill -0 "$HPCFED_CHILD" 2>/dev/null; then continue; fi
    break
  done
  HPCFED_CHILD=
  return "$rc"
}

# Forward a signal to the running federation (srun passes it on to every rank).
hpcfed_forward() {
  [ -n "$HPCFED_CHILD" ] && kill "-$1" "$HPCFED_CHILD" 2>/dev/null
  return 0
}
