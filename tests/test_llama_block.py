"""A real model: ``examples/tp_block.py`` shards a small ``transformers`` Llama decoder (random
weights, no download) with fo-tune's tensor-parallel styles on 2 gloo CPU ranks and compares logits,
loss and every gradient with the unsharded model; this runs it and checks what it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tp_block.py"
CHECKS = {"logits", "loss", "other parameters", "column-parallel weights", "row-parallel weights"}


def test_llama_decoder_matches_unsharded(tmp_path):
    env = {
        **os.environ,
        "FO_TUNE_TABLE_DIR": str(tmp_path / "tables"),  # no table: the heuristic schedules
        "XDG_DATA_HOME": str(tmp_path / "xdg"),
        "TRITON_INTERPRET": "1",
    }
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--world-size", "2", "--backend", "gloo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["ok"] and result["world_size"] == 2, result
    assert set(result["errors"]) == CHECKS, result
    assert all(err < 1e-4 for err in result["errors"].values()), result
    assert "ColwiseParallel" in done.stdout and "RowwiseParallel" in done.stdout
