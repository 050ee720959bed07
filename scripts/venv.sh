# Sourced by the main-job scripts (demo.sh, search.sh): create .venv with fo-tune installed, once.
# A GPU machine reuses its CUDA build of torch (and Triton) instead of downloading another; a
# CPU-only one installs torch==2.13.0: the CPU wheel where pip offers it (README, "Two commands").
ensure_venv() {
  if [ -x .venv/bin/fo-tune ]; then
    return
  fi
  if command -v nvidia-smi >/dev/null; then
    python3 -m venv --system-site-packages .venv
    .venv/bin/python -m pip install --quiet -e ".[tune,cuda]"
  else
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet "torch==2.13.0" "triton==3.7.1"  # the CPU wheel where pip offers it
    .venv/bin/python -m pip install --quiet -e ".[tune]"
  fi
}
