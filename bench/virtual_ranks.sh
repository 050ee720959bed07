#!/usr/bin/env bash
# The copy engine at N peers on one GPU (docs/design.md#virtual-ranks), in a few minutes:
#
#   bash bench/virtual_ranks.sh OUT_DIR
#
# Without a GPU: exit 2 and one line, before anything is written.
#
# 1. the virtual-rank GPU tests (tests/test_gpu_virtual_ranks.py: every mode and collective at
#    N = 2, 3, 4, 8, eager and graphs, repeated, against float64; a hung test ends its pytest with
#    every thread's stack) -> OUT_DIR/pytest-virtual.xml, OUT_DIR/pytest-virtual.log
# 2. fo-tune calibrate --world-size 1 --only copy_engine_n: host times per rank at N = 2..8 with
#    virtual ranks, chunk GEMMs at TP=4/8 layer shapes -> merged into a copy of the packaged H200
#    TP=2 calibration (OUT_DIR/calibration.yaml; copy it over results/calibration/... to ship it)
#    when this GPU is of that model; when it is another model of the same die (the refusal names
#    --into-sibling: an H100), merged there with --into-sibling, each merged point recording this
#    GPU's device key (measured_on); else written alone into OUT_DIR/calibration-n/
#    -> OUT_DIR/calibrate.log
# 3. fo-tune demo --engine copy_engine --world-size 8 on one suite shape -> OUT_DIR/demo.log
#
# Every step runs under a time limit and the next runs even when one fails; the exit code is 1
# when any step failed. CUDA's lazy module loading stays on (CUDA_MODULE_LOADING is unset): the
# tests prove that each plan's kernels are loaded before its first flag wait.
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
fo_help "$0" "${1-}"
fo_need_gpu "bash bench/virtual_ranks.sh"
out_dir="$(fo_out_dir "$1")"
cd "$FO_REPO" || exit 2
unset CUDA_MODULE_LOADING

# Time limits per step (s), so a hung step cannot hold the GPU: the whole script ends within ~8.5
# minutes.
TESTS_S=270
CALIBRATE_S=180
DEMO_S=60
PACKAGED=results/calibration/nvidia-h200-cc90-132sm-w2-nvlink18/tp2/calibration.yaml

failed=0
step() {
  echo "[virtual_ranks $(date -u +%H:%M:%S)] $*"
}

step "GPUs: $(fo_gpu_count); 1/3 the virtual-rank GPU tests (limit ${TESTS_S}s)"
timeout "$TESTS_S" "$PYTHON" -m pytest -m gpu -p no:cacheprovider -q --durations=15 \
  --junitxml="$out_dir/pytest-virtual.xml" tests/test_gpu_virtual_ranks.py 2>&1 |
  tee "$out_dir/pytest-virtual.log" || failed=1
step "tests done (failed=$failed)"

step "2/3 fo-tune calibrate --world-size 1 --only copy_engine_n (limit ${CALIBRATE_S}s)"
cp "$PACKAGED" "$out_dir/calibration.yaml"
chmod u+w "$out_dir/calibration.yaml"
# calibrate_n [OPTION...]: the copy engine at N peers on this GPU, logged to calibrate.log.
calibrate_n() {
  timeout "$CALIBRATE_S" "$PYTHON" "$FO_REPO/cli.py" calibrate --world-size 1 --only copy_engine_n \
    "$@" 2>&1 | tee -a "$out_dir/calibrate.log"
}
: >"$out_dir/calibrate.log"
if calibrate_n --into "$out_dir/calibration.yaml"; then
  step "merged into $out_dir/calibration.yaml"
elif grep -q -- "or pass --into-sibling" "$out_dir/calibrate.log"; then
  step "another GPU model of the packaged calibration's die: merged with --into-sibling"
  if calibrate_n --into "$out_dir/calibration.yaml" --into-sibling; then
    step "merged into $out_dir/calibration.yaml (its new points record measured_on)"
  else
    failed=1
  fi
elif grep -q -- "--into: the calibration is for" "$out_dir/calibrate.log"; then
  rm -f "$out_dir/calibration.yaml"
  step "another GPU model than the packaged calibration's: written alone into $out_dir/calibration-n"
  calibrate_n --out "$out_dir/calibration-n" || failed=1
else
  failed=1
fi

step "3/3 fo-tune demo --engine copy_engine --world-size 8 (limit ${DEMO_S}s)"
timeout "$DEMO_S" "$PYTHON" "$FO_REPO/cli.py" demo --engine copy_engine --world-size 8 --reps 3 \
  --shape 4096x8192x4096 2>&1 | tee "$out_dir/demo.log" || failed=1

step "done (failed=$failed); files in $out_dir"
exit "$failed"
