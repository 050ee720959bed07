#!/usr/bin/env bash
# The signalled GEMM's profile on one GPU (the H200 one for results/profiles/): fo-tune profile of
# each shape of suites/h200_profile.yaml (the suite and five public TP=2 layer shapes), every tile
# of search_spaces/hopper.yaml at r = 0, 8, 12 and 16 free SMs, timed beside cuBLAS from CUDA
# graphs; then each grid's three fastest timed again side by side (docs/perf-notes.md, "The
# signalled GEMM at cuBLAS speed (one H200)").
#
#   bash bench/profile.sh OUT_DIR [MxNxK...]
#   FO_DTYPE=float8_e4m3fn bash bench/profile.sh OUT_DIR    (fp8: beside torch._scaled_mm)
#   FO_SCALING=tensorwise FO_DTYPE=float8_e4m3fn bash bench/profile.sh OUT_DIR
#
# Without a GPU: exit 2 and one line, before anything is written.
#
# MxNxK arguments profile those shapes instead of the suite's; FO_DTYPE is the operand dtype
# (default bfloat16); FO_SCALING the fp8 operands' scales (fo-tune profile --scaling): rowwise, the
# default and the tables' tuning, or tensorwise (fp8 only: refused with another dtype); FO_SMS_FREE
# the reduced grids' free SMs (default 0,8,12,16). Writes, per shape,
# OUT_DIR/profiles/<M>x<N>x<K>-<dtype>.csv (fp8 tensorwise: <M>x<N>x<K>-float8_e4m3fn-tensorwise.csv)
# and its -grids.csv (results/profiles/<device-key>/), the space profiled
# (OUT_DIR/profile-space.yaml), the log (OUT_DIR/profile.log) and, while it runs, the SM clock,
# power and temperature every 200 ms (OUT_DIR/smi.csv: a loop of GEMMs runs at the card's power
# limit, docs/design.md#power-limit).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
fo_help "$0" "${1-}"
fo_need_gpu "bash bench/profile.sh"
out_dir="$(fo_out_dir "$1")"
shift
cd "$FO_REPO"

dtype="${FO_DTYPE:-bfloat16}"
scaling="${FO_SCALING:-rowwise}"
# The profile's file name: the dtype, and the scaling where it is not the tables' (fo-tune profile's
# default name; it refuses a scaling other than rowwise for a dtype without scales).
name="$dtype"
if [ "$scaling" != rowwise ]; then name="$dtype-$scaling"; fi
space="$out_dir/profile-space.yaml"
"$PYTHON" -m fo_tune.bench.script_inputs space search_spaces/hopper.yaml "$space" --sms-free "${FO_SMS_FREE:-0,8,12,16}"
if [ "$#" -gt 0 ]; then
  shapes=("$@")
else
  suite_shapes="$("$PYTHON" -m fo_tune.bench.script_inputs shapes suites/h200_profile.yaml)"
  mapfile -t shapes <<<"$suite_shapes"
fi

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 \
    >"$out_dir/smi.csv" &
  smi_pid=$!
  trap 'kill "$smi_pid" 2>/dev/null || true' EXIT
fi

for shape in "${shapes[@]}"; do
  echo "== $shape ($(date -u +%FT%TZ))"
  fo_tune profile --shape "$shape" --space "$space" --dtype "$dtype" --scaling "$scaling" \
    --timing graphs --out "$out_dir/profiles/$shape-$name.csv"
done 2>&1 | tee "$out_dir/profile.log"
