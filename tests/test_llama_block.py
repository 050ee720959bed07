"""A real model: ``examples/tp_block.py`` shards a small ``transformers`` Llama decoder (random
weights, no download) with fo-tune's tensor-parallel styles on 2 gloo CPU ranks and compares logits,
loss and every gradient with the unsharded model; this runs it and checks what it reports.
transformers is a dev dependency (pyproject.toml): the test fails, never skips, without it."""

from __future__ import annotations

from pathlib import Path

from cli_checks import run_example_on_gloo

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tp_block.py"
CHECKS = {"logits", "loss", "other parameters", "column-parallel weights", "row-parallel weights"}


def test_llama_decoder_matches_unsharded(tmp_path):
    result, done = run_example_on_gloo(EXAMPLE, tmp_path)
    assert set(result["errors"]) == CHECKS, result
    assert all(err < 1e-4 for err in result["errors"].values()), result
    assert "ColwiseParallel" in done.stdout and "RowwiseParallel" in done.stdout
