#!/usr/bin/env bash
# One device call on a 2-GPU machine: GPU tests, the runtime check + side-by-side timing, and a
# full `fo-tune calibrate` for TP=N. Everything lands in $OUT/results.tgz (the device tool returns
# at most 8 files), the short summaries on stdout.
#   bash bench/device_session.sh [WORLD_SIZE] [--quick]
set -uo pipefail
WORLD="${1:-2}"; QUICK="${2:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONWARNINGS=ignore
# The image's python has torch/triton but not this package: expose kernels/ as fo_kernels.
mkdir -p /tmp/fk && ln -sfn "$PWD/kernels" /tmp/fk/fo_kernels && ln -sfn "$PWD/results" /tmp/fk/fo_results
export PYTHONPATH="/tmp/fk:$PWD"
RES=/tmp/res; rm -rf "$RES"; mkdir -p "$RES"
nvidia-smi topo -m > "$RES/topo.txt" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" tests/test_gpu.py 2>&1 \
  | tee "$RES/pytest_gpu.log" | tail -3
timeout 330 torchrun --nproc-per-node "$WORLD" bench/gpu_runtime_check.py --out "$RES/check" 2>&1 \
  | tee "$RES/check.log" | grep -v "^  " | tail -25
timeout 420 python3 cli.py calibrate --world-size "$WORLD" $QUICK --backend nccl --out "$RES/calibration" 2>&1 \
  | tee "$RES/calibrate.log" | tail -45
tar czf "$OUT/results.tgz" -C "$RES" .
