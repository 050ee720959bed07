# shellcheck shell=bash
# The environment the benchmark scripts of bench/ share; sourced by them, not run:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
#
# Variables:
#   FO_REPO     this checkout (the folder above bench/); the scripts run their commands from there.
#   PYTHON      the interpreter, python3 unless set (PYTHON=.venv/bin/python bash bench/...). It
#               needs torch, triton, pyyaml and fo-tune's `tune` extra (optuna, typer, rich, ...).
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
#               NVLink multicast off, as on the shared H200 hosts every number in results/ was
#               measured on (docs/design.md#the-card).
#   TRITON_INTERPRET=0
#               the kernels compiled for the GPU; a shell left with the CPU tests' 1 would run
#               them in Triton's interpreter.
#   PYTHONUNBUFFERED=1 FO_TUNE_DEBUG=1
#               logs written as the lines come, and a failure's traceback in them.
#   PYTHONPATH  this checkout's code first, installed or not: build/pythonpath/ holds the links
#               fo_kernels -> kernels and fo_results -> results (the names the packages install
#               under), and the checkout itself gives fo_tune and cli.
#   FO_WORLD_SIZE
#               the ranks of the multi-GPU stages of tune.sh, bench.sh and gpu_tests.sh: 2 unless
#               set (the H200 x2 runs behind results/); 4 or 8 on a TP=4 or TP=8 machine. Checked
#               by fo_world_size.
# Functions:
#   fo_tune ARGS...         this checkout's fo-tune command line (cli.py).
#   fo_help SCRIPT [ARG]    ARG -h or --help: SCRIPT's header comment (its usage) on stdout, exit
#                           0; no ARG: the same on stderr, exit 2; else nothing.
#   fo_out_dir DIR          creates DIR and prints its absolute path (before the script's cd).
#   fo_gpu_count            the GPUs nvidia-smi lists (0 without it).
#   fo_world_size           sets FO_WORLD_SIZE to 2 when unset and exports it; anything but an
#                           integer >= 2: one line on stderr, exit 2.
#   fo_need_gpu WHAT [ELSE] no GPU listed: one line naming WHAT (and ELSE, what runs without
#                           one) on stderr, exit 2 (the one-GPU scripts and stages).
#   fo_need_gpus N WHAT [ELSE]
#                           fewer than N GPUs listed: one line naming WHAT (and ELSE, what runs
#                           without them) on stderr, exit 2.

FO_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 FO_TUNE_DEBUG=1

mkdir -p "$FO_REPO/build/pythonpath"
ln -sfn "$FO_REPO/kernels" "$FO_REPO/build/pythonpath/fo_kernels"
ln -sfn "$FO_REPO/results" "$FO_REPO/build/pythonpath/fo_results"
export PYTHONPATH="$FO_REPO/build/pythonpath:$FO_REPO${PYTHONPATH:+:$PYTHONPATH}"

fo_tune() {
  "$PYTHON" "$FO_REPO/cli.py" "$@"
}

fo_usage() {
  awk 'NR == 1 && /^#!/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$1"
}

fo_help() {
  case "${2-}" in
    -h | --help)
      fo_usage "$1"
      exit 0
      ;;
    "")
      fo_usage "$1" >&2
      exit 2
      ;;
  esac
}

fo_out_dir() {
  mkdir -p "$1"
  (cd "$1" && pwd)
}

fo_gpu_count() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L | grep -c '^GPU' || true
  else
    echo 0
  fi
}

fo_world_size() {
  FO_WORLD_SIZE="${FO_WORLD_SIZE:-2}"
  if ! [[ "$FO_WORLD_SIZE" =~ ^[0-9]+$ ]] || [ "$FO_WORLD_SIZE" -lt 2 ]; then
    echo "FO_WORLD_SIZE=$FO_WORLD_SIZE: expected an integer >= 2 (the ranks of the multi-GPU stages)" >&2
    exit 2
  fi
  export FO_WORLD_SIZE
}

fo_need_gpu() {
  if [ "$(fo_gpu_count)" -lt 1 ]; then
    echo "$1 needs a CUDA GPU, none visible (nvidia-smi lists none): run it on a machine with one${2-}" >&2
    exit 2
  fi
}

fo_need_gpus() {
  local gpus
  gpus="$(fo_gpu_count)"
  if [ "$gpus" -lt "$1" ]; then
    echo "$2 needs $1 GPUs (FO_WORLD_SIZE=$1), $gpus visible: run it on a machine with $1 GPUs${3-}" >&2
    exit 2
  fi
}
