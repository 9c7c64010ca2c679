#!/usr/bin/env bash
# Install hpcfed and everything it needs into the current Python environment.
# torch goes first: on a machine without a GPU it comes from PyTorch's CPU wheel index, because the
# ordinary index's Linux wheel pulls gigabytes of CUDA libraries.
#   TORCH_SPEC    torch requirement to install first (default torch==2.13.0)
#   TORCH_INDEX   index for it on machines without an NVIDIA GPU (default PyTorch's CPU wheels;
#                 empty = the ordinary index). With a GPU (nvidia-smi lists one) the ordinary index is used.
#   PYTHON        interpreter to install into (default python3)
# `bash tools/setup.sh --print-torch-install` prints the torch install command it would run, and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

# Reachable within a few seconds? (Where only a mirror of the ordinary index is reachable, the name
# does not resolve and this fails at once.)
reachable() {
  "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5)' \
    "$1" >/dev/null 2>&1
}

# The pip arguments that install torch here, one per line.
torch_install() {
  if [ -n "$TORCH_INDEX" ] && ! has_gpu; then
    if reachable "$TORCH_INDEX"; then
      printf '%s\n' install -q --index-url "$TORCH_INDEX" "$TORCH_SPEC"
      return
    fi
    echo "setup: $TORCH_INDEX is unreachable; installing $TORCH_SPEC from the ordinary index" >&2
  fi
  printf '%s\n' install -q "$TORCH_SPEC"
}

if [ "${1:-}" = "--print-torch-install" ]; then
  mapfile -t args < <(torch_install)
  echo "$PY -m pip ${args[*]}"
  exit 0
fi

"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$PY" -c "import torch" 2>/dev/null; then
  mapfile -t args < <(torch_install)
  "$PY" -m pip "${args[@]}"
fi
"$PY" -m pip install -q -e ".[test,check,mpich,model,lora,multilingual,report,tracking,browser,docs]"
"$PY" -m pip check >/dev/null 2>&1 || true
command -v mpiexec >/dev/null || { echo "setup: no mpiexec on PATH after installing mpich" >&2; exit 1; }
echo "hpcfed installed: $("$PY" -c 'import hpcfed, torch, mpi4py; print(hpcfed.__version__, "torch", torch.__version__, "mpi4py", mpi4py.__version__)')"
