#!/usr/bin/env bash
# Create a fresh virtual environment and run every check CI runs: ruff, then the CPU test suite
# (Triton's interpreter for the kernels, gloo processes for the collectives). GPU tests are
# marked and skip themselves here; run them on a GPU machine with
#   TRITON_INTERPRET=0 python -m pytest -m "gpu or multigpu" tests/test_gpu.py
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FO_TUNE_TEST_VENV:-.ci-venv}"
rm -rf "$VENV"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
# Byte-code is written where Python imports a module (an environment that sets
# PYTHONDONTWRITEBYTECODE would recompile the package's modules in each of the hundreds of
# processes the tests start), so pip skips compiling every installed file up front: the tests
# import a fraction of torch, transformers and the rest, once each.
unset PYTHONDONTWRITEBYTECODE
"$PY" -m pip install --quiet --upgrade pip
# torch (the package itself does not pin it; the CPU wheel where pip offers it, README "Two
# commands") and the Triton that matches it.
"$PY" -m pip install --quiet --no-compile "torch==2.13.0" "triton==3.7.1"
"$PY" -m pip install --quiet --no-compile -e ".[dev]"
# A PostgreSQL server for tests/test_fleet.py (it starts a throwaway cluster): Debian's package,
# installed only when missing; where it cannot be installed those tests skip and say why.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql; } >/dev/null 2>&1 \
      || echo "note: could not install postgresql; tests/test_fleet.py's PostgreSQL test skips" >&2
  fi
fi
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# Two workers (pytest-xdist), one per core of the 2-core CI machine: every test still runs, each
# gloo test's ranks in files and on ports of its own (tmp_path, free ports). Arguments after
# these override them (e.g. -n 0 for one process).
"$PY" -m pytest -q -p no:cacheprovider -n 2 "$@"
