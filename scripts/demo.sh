#!/usr/bin/env bash
# The main job on a fresh machine: install fo-tune into .venv and run the runtime demo, which checks
# both overlapped ops (GEMM + AllReduce, GEMM + ReduceScatter) against matmul + collective on two
# local processes: NCCL with one GPU each where there are two GPUs, else gloo and Triton's CPU
# interpreter. Extra arguments go to `fo-tune demo` (see `fo-tune demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv
exec .venv/bin/fo-tune demo --world-size 2 "$@"
