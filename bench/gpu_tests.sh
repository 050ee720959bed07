#!/usr/bin/env bash
# The GPU tests: every test of tests/ marked gpu or multigpu, the kernels compiled for the GPU.
#
#   bash bench/gpu_tests.sh OUT_DIR [PYTEST_ARGS...]
#   FO_WORLD_SIZE=8 bash bench/gpu_tests.sh OUT_DIR     (a TP=8 machine; 4 for TP=4)
#
# On one GPU the gpu tests run and the multigpu ones skip themselves; on two both run (tests/
# conftest.py). FO_WORLD_SIZE (bench/env.sh, default 2) is the ranks of tests/test_gpu_world.py
# (handed to it as FO_TEST_WORLD_SIZE: every engine and collective on that many GPUs); the other
# multigpu tests take two of them. Set, it needs that many GPUs: fewer is exit 2 before pytest;
# unset, a machine without a GPU is exit 2 too (every test would skip itself). PYTEST_ARGS go to pytest: test files or -k EXPR to narrow the run, or -n N with
# pytest-xdist installed; with -n, run the signal-visibility test (-k visible) on its own first,
# since its reader needs SMs that another worker's kernels would take.
#
# Writes OUT_DIR/pytest-gpu.xml (JUnit) and OUT_DIR/pytest-gpu.log; the exit code is pytest's.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
fo_help "$0" "${1-}"
if [ -z "${FO_WORLD_SIZE-}" ]; then
  fo_need_gpu "bash bench/gpu_tests.sh"
fi
out_dir="$(fo_out_dir "$1")"
shift
cd "$FO_REPO"
if [ -n "${FO_WORLD_SIZE-}" ]; then
  fo_world_size
  fo_need_gpus "$FO_WORLD_SIZE" "FO_WORLD_SIZE=$FO_WORLD_SIZE bash bench/gpu_tests.sh"
fi
fo_world_size
export FO_TEST_WORLD_SIZE="$FO_WORLD_SIZE"

echo "GPUs: $(fo_gpu_count), world size of tests/test_gpu_world.py: $FO_TEST_WORLD_SIZE" | tee "$out_dir/pytest-gpu.log"
"$PYTHON" -m pytest -m "gpu or multigpu" --durations=10 --junitxml="$out_dir/pytest-gpu.xml" "$@" 2>&1 |
  tee -a "$out_dir/pytest-gpu.log"
