#!/usr/bin/env bash
# The tuning runs behind what results/ ships: calibration, search and the hybrid-vs-exhaustive
# check, through the fo-tune command line; the same for TP=4 and TP=8 machines.
#
#   bash bench/tune.sh OUT_DIR [STAGE...]
#   FO_WORLD_SIZE=8 bash bench/tune.sh OUT_DIR [STAGE...]     (a TP=8 machine; 4 for TP=4)
#
# FO_WORLD_SIZE (bench/env.sh, default 2) is the ranks of every stage but calibrate-w1 and needs
# that many GPUs (fewer: exit 2 before anything runs; plan offline with the plan stage instead).
# At 2 the stages run as results/ was made; at any other size they take the TP=4/8 shapes
# (suites/tp48_profile.yaml) and all three collectives; at 3, 5, 6 or 7, which its Ms (and the mrange
# stage's 512..16384) do not divide, the suite, mrange and plan stages are exit 2. Stages, in this order by default with
# FO_WORLD_SIZE GPUs (H200 x2 for results/; calibrate-w1 by default on one GPU at world size 2):
#
#   calibrate     fo-tune calibrate, both row-parallel collectives (and all_gather at world sizes
#                 other than 2), every tile of the space -> OUT_DIR/calibration/
#                 (results/calibration/<device-key>/tp<W>/; docs/design.md#cost-model)
#   compare       hybrid against exhaustive search on search_spaces/bench/h200_small.yaml, AllReduce
#                 4096x8192x4096 and 16384x8192x4096: every point measured, then the model's top 7,
#                 then both bests timed again side by side (bench/hybrid_vs_exhaustive.py)
#                 -> OUT_DIR/hybrid-vs-exhaustive/ (results/search/<device-key>/hybrid-vs-exhaustive/;
#                 docs/design.md#search)
#   suite         hybrid search of the suite's shapes (suites/h200_tp.yaml; suites/tp48_profile.yaml
#                 at other world sizes), with the space's copy-engine candidates -> OUT_DIR/tables/,
#                 OUT_DIR/suite/report/ (results/tables/<device-key>/, results/search/<device-key>/*-hybrid/)
#   mrange        M-range rows, M 512..16384 for the suite's (N, K), both row-parallel collectives,
#                 the copy engine's ring cut into 1, 2 or 4 equal chunks only (the suite's searches
#                 never gained from 3 or 6 chunks or light last chunks by more than noise,
#                 docs/design.md#search) -> OUT_DIR/tables/, OUT_DIR/mrange/report/
#                 (results/search/<device-key>/*-hybrid-mrange/)
#   calibrate-w1  one GPU: fo-tune calibrate --world-size 1 --only copy_engine,moe_host (the MoE
#                 path's host times) into a copy of the H200 x2 calibration (OUT_DIR/calibration/calibration.yaml when the calibrate stage
#                 wrote one, else the shipped one), then fo-tune model check with it
#                 -> OUT_DIR/calibration-w1ce.yaml, OUT_DIR/model-check.log
#                 (docs/perf-notes.md#the-copy-engines-one-gpu-calibration)
#   plan          no GPU: the offline plan of the suite at FO_WORLD_SIZE, the collectives the
#                 other stages take (fo-tune search --mode predict; above 2 from the packaged TP=2
#                 calibration extrapolated, all_gather from its reduce_scatter curve,
#                 docs/design.md#offline-plans-for-tp4-and-tp8; at 2 no all_gather: the packaged
#                 calibration has no all_gather curve) -> OUT_DIR/plan/
#                 (docs/perf-notes.md#tp4-and-tp8-predicted); never run by default
#
# The searches read OUT_DIR/calibration/calibration.yaml when the calibrate stage wrote one, else
# fo-tune's default, this machine's calibration under results/calibration/<device-key>/tp<W>/ (a
# hybrid search refuses to run without one: run the calibrate stage first). The suite and mrange
# stages merge their rows into OUT_DIR/tables/, the tables to commit into results/tables/;
# `FO_TUNE_TABLE_DIR=OUT_DIR/tables bash bench/bench.sh ...` benches them.
# Each stage's log is OUT_DIR/<stage>.log.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
fo_help "$0" "${1-}"
out_dir="$(fo_out_dir "$1")"
shift
cd "$FO_REPO"
explicit_world="${FO_WORLD_SIZE-}"
fo_world_size
w="$FO_WORLD_SIZE"

shipped_calibration=results/calibration/nvidia-h200-cc90-132sm-w2-nvlink18/tp2/calibration.yaml
if [ "$w" -eq 2 ]; then
  suite=suites/h200_tp.yaml
  collectives=all_reduce,reduce_scatter
else
  suite=suites/tp48_profile.yaml
  collectives=all_reduce,reduce_scatter,all_gather
fi

# reduce_scatter and all_gather split M over the ranks: the suite's Ms (4096 and 8192, checked by
# tests/test_bench.py) and the mrange stage's 512..16384 divide by the world sizes that divide 512
# (2, 4, 8), not by 3, 5, 6 or 7, where the suite, mrange and plan stages are refused up front.
suite_fits=1
if ((512 % w)); then
  suite_fits=0
fi
own_plan="fo-tune search --mode predict --world-size $w --shape MxNxK (M divisible by $w for reduce_scatter and all_gather)"

# --calibration for the searches: this run's calibration once the calibrate stage wrote it.
calibration_args() {
  if [ -f "$out_dir/calibration/calibration.yaml" ]; then
    echo "--calibration"
    echo "$out_dir/calibration/calibration.yaml"
  fi
}

calibrate() {
  fo_tune calibrate --world-size "$w" --backend nccl -c "$collectives" --out "$out_dir/calibration"
}

compare() {
  local c="$out_dir/hybrid-vs-exhaustive" cal
  local shapes=(--shape 4096x8192x4096 --shape 16384x8192x4096)
  local space=search_spaces/bench/h200_small.yaml
  mapfile -t cal < <(calibration_args)
  echo "exhaustive: every point of $space measured"
  fo_tune search --mode measure --exhaustive --world-size "$w" --space "$space" "${cal[@]}" "${shapes[@]}" \
    --out "$c/exhaustive-search"
  echo "hybrid: the model's top 7 measured"
  fo_tune search --mode hybrid --top-k 7 --world-size "$w" --space "$space" "${cal[@]}" "${shapes[@]}" \
    --out "$c/hybrid-search"
  rm -rf "$c/exhaustive" "$c/hybrid-top7"
  # (each --out holds one run: its report is the one run folder under the report's name)
  cp -r "$c/exhaustive-search/report/all_reduce-w$w-bfloat16-measure"/*/ "$c/exhaustive"
  cp -r "$c/hybrid-search/report/all_reduce-w$w-bfloat16-hybrid"/*/ "$c/hybrid-top7"
  echo "both bests timed again side by side"
  "$PYTHON" bench/hybrid_vs_exhaustive.py "$c/exhaustive/summary.yaml" "$c/hybrid-top7/summary.yaml" --out "$c"
}

suite() {
  local cal
  mapfile -t cal < <(calibration_args)
  fo_tune search --mode hybrid --top-k 4 --world-size "$w" "${cal[@]}" --shapes "$suite" -c "$collectives" \
    --out "$out_dir/suite" --table-dir "$out_dir/tables"
}

mrange() {
  local cal space="$out_dir/mrange/space.yaml"
  mapfile -t cal < <(calibration_args)
  "$PYTHON" -m fo_tune.bench.script_inputs space search_spaces/hopper.yaml "$space" --ring-chunks 1,2,4
  fo_tune search --mode hybrid --top-k 1 --world-size "$w" "${cal[@]}" --space "$space" \
    --shapes "$suite" --m-range 512:16384 -c all_reduce,reduce_scatter --out "$out_dir/mrange" \
    --table-dir "$out_dir/tables"
}

calibrate_w1() {
  local into="$out_dir/calibration-w1ce.yaml"
  if [ -f "$out_dir/calibration/calibration.yaml" ]; then
    cp "$out_dir/calibration/calibration.yaml" "$into"
  else
    cp "$shipped_calibration" "$into"
  fi
  fo_tune calibrate --world-size 1 --only copy_engine,moe_host --into "$into"
  fo_tune model check --calibration "$into" 2>&1 | tee "$out_dir/model-check.log"
}

plan() {
  fo_tune search --mode predict --world-size "$w" --shapes "$suite" -c "$collectives" --out "$out_dir/plan"
}

stages=("$@")
# what a refusal for want of GPUs offers instead: the offline plan of the same shapes
offline="; without them, plan offline: FO_WORLD_SIZE=$w bash bench/tune.sh OUT_DIR plan"
if [ "$suite_fits" -eq 0 ]; then
  offline="; without them, plan offline: $own_plan"
fi
if [ "${#stages[@]}" -eq 0 ]; then
  if [ "$(fo_gpu_count)" -ge "$w" ]; then
    stages=(calibrate compare suite mrange)
  elif [ -z "$explicit_world" ]; then
    stages=(calibrate-w1)
  else
    fo_need_gpus "$w" "FO_WORLD_SIZE=$w bash bench/tune.sh" "$offline"
  fi
fi
for stage in "${stages[@]}"; do
  if [ "$suite_fits" -eq 0 ] && [[ "$stage" =~ ^(suite|mrange|plan)$ ]]; then
    echo "stage $stage at FO_WORLD_SIZE=$w: its reduce_scatter and all_gather searches need every M" \
      "divisible by $w, and $suite's Ms (4096, 8192; the mrange stage's 512..16384) take 2, 4 or 8;" \
      "run the calibrate and compare stages by name, or plan your shapes: $own_plan" >&2
    exit 2
  fi
  case "$stage" in
    calibrate | compare | suite | mrange) fo_need_gpus "$w" "stage $stage" "$offline" ;;
    calibrate-w1) fo_need_gpu "stage calibrate-w1" "$offline" ;;
    plan) ;;
    *)
      echo "unknown stage $stage: calibrate, compare, suite, mrange, calibrate-w1 or plan" >&2
      exit 2
      ;;
  esac
done
for stage in "${stages[@]}"; do
  echo "== $stage ($(date -u +%FT%TZ))"
  "${stage//-/_}" 2>&1 | tee "$out_dir/$stage.log"
done
