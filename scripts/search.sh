#!/usr/bin/env bash
# The main job on a fresh machine: install fo-tune into .venv and tune schedules for two suite shapes,
# both collectives. Without GPUs this is the offline search (--mode predict): the cost model with the
# packaged H200 x2 calibration plans an H200 TP=2 deployment in seconds. With 2 GPUs it searches
# this machine (hybrid when it has a calibration, else measured). The rows go into the table the
# runtime reads (~/.local/share/fo-tune/tables, or $FO_TUNE_TABLE_DIR), the report into a folder of
# this run under ~/.local/share/fo-tune/search/. Extra arguments go to `fo-tune search` (see
# `fo-tune search --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv
.venv/bin/fo-tune search --shape 4096x8192x4096 --shape 16384x8192x4096 -c all_reduce,reduce_scatter "$@"
