#!/usr/bin/env bash
# The main job on a fresh machine: install fo-tune into .venv and run the runtime demo, which checks
# both overlapped ops (GEMM + AllReduce, GEMM + ReduceScatter) against matmul + collective on two
# local processes: NCCL with one GPU each where there are two GPUs, else gloo and Triton's CPU
# interpreter. Extra arguments go to `fo-tune demo` (see `fo-tune demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/fo-tune ]; then
  if command -v nvidia-smi >/dev/null; then
    # A GPU machine: reuse its CUDA build of torch (and Triton) instead of downloading another.
    python3 -m venv --system-site-packages .venv
    .venv/bin/python -m pip install --quiet -e ".[tune,cuda]"
  else
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet "torch==2.13.0" "triton==3.7.1"  # the CPU wheel
    .venv/bin/python -m pip install --quiet -e ".[tune]"
  fi
fi
exec .venv/bin/fo-tune demo --world-size 2 "$@"
