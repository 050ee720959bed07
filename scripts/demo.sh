#!/usr/bin/env bash
# The main job on a fresh machine: install fo-tune into .venv and run the runtime demo, which checks
# the three ops (GEMM + AllReduce, GEMM + ReduceScatter, AllGather + GEMM) against matmul and the
# collective on local processes: two ranks with NCCL, one GPU each, where there are two GPUs; one
# rank on a one-GPU machine; two ranks on gloo and Triton's CPU interpreter without GPUs. Its first
# line says which.
# Extra arguments go to `fo-tune demo` (see `fo-tune demo --help`; --backend gloo forces the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv
exec .venv/bin/fo-tune demo "$@"
