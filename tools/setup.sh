#!/usr/bin/env bash
# Install hpcfed and everything it needs into the current Python environment.
# torch goes first: a bare `pip install torch` on a CPU-only machine would pull GBs of CUDA wheels.
#   TORCH_SPEC   torch requirement to install first (default torch==2.13.0; set e.g. "torch" on a GPU node)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "$TORCH_SPEC"
"$PY" -m pip install -q -e ".[test,mpich,model,lora,multilingual,report]"
"$PY" -m pip check >/dev/null 2>&1 || true
command -v mpiexec >/dev/null || { echo "setup: no mpiexec on PATH after installing mpich" >&2; exit 1; }
echo "hpcfed installed: $("$PY" -c 'import hpcfed, torch, mpi4py; print(hpcfed.__version__, "torch", torch.__version__, "mpi4py", mpi4py.__version__)')"
