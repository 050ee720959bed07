"""transformers' ``tp_plan`` names registered to fo-tune: ``examples/transformers_tp_plan.py`` loads a
small Llama (random weights, saved locally) with ``tp_plan="auto"`` on 2 gloo CPU ranks after
registering fo-tune's forward for "colwise" and "rowwise", and compares logits, loss and the sharded
weights' gradients with the unsharded model; this runs it and checks what it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformers_tp_plan.py"
CHECKS = {"logits", "loss", "colwise weights", "rowwise weights"}
# q/k/v, o, gate, up and down projections of each of the example's 2 layers
FO_TUNE_MODULES = 2 * 7


def test_tp_plan_names_run_on_fo_tune(tmp_path):
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
    assert all(err < 1e-5 for err in result["errors"].values()), result
    assert result["fo_tune_modules"] == FO_TUNE_MODULES, result
    # no progress bars, and no semaphore of theirs left behind by a rank's os._exit
    assert "Loading weights" not in done.stderr and "leaked semaphore" not in done.stderr, done.stderr


def test_the_tiny_llama_gives_every_rank_vocabulary_rows(tmp_path):
    """transformers shards the embedding by vocabulary: at any world size the example's model has a
    vocabulary the ranks split evenly (a fixed 64 left rank 8 of 9 no rows, and its lookup failed)."""
    import importlib.util

    from moe_cases import import_transformers

    import_transformers()  # before the example's first transformers import: the kernels name clash
    spec = importlib.util.spec_from_file_location("transformers_tp_plan", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for world in (9,):
        example.save_tiny_llama(str(tmp_path / str(world)), world)
        vocab = json.loads((tmp_path / str(world) / "config.json").read_text())["vocab_size"]
        assert vocab % world == 0 and vocab >= world, (world, vocab)
