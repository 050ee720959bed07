"""transformers' ``tp_plan`` names registered to fo-tune: ``examples/transformers_tp_plan.py`` loads a
small Llama (random weights, saved locally) with ``tp_plan="auto"`` on 2 gloo CPU ranks after
registering fo-tune's forward for "colwise" and "rowwise", and compares logits, loss and the sharded
weights' gradients with the unsharded model; this runs it and checks what it reports."""

from __future__ import annotations

import json
from pathlib import Path

from cli_checks import load_example, run_example_on_gloo

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformers_tp_plan.py"
CHECKS = {"logits", "loss", "colwise weights", "rowwise weights"}
# q/k/v, o, gate, up and down projections of each of the example's 2 layers
FO_TUNE_MODULES = 2 * 7


def test_tp_plan_names_run_on_fo_tune(tmp_path):
    result, done = run_example_on_gloo(EXAMPLE, tmp_path)
    assert set(result["errors"]) == CHECKS, result
    assert all(err < 1e-5 for err in result["errors"].values()), result
    assert result["fo_tune_modules"] == FO_TUNE_MODULES, result
    # no progress bars, and no semaphore of theirs left behind by a rank's os._exit
    assert "Loading weights" not in done.stderr and "leaked semaphore" not in done.stderr, done.stderr


def test_the_tiny_llama_gives_every_rank_vocabulary_rows(tmp_path):
    """transformers shards the embedding by vocabulary: at any world size the example's model has a
    vocabulary the ranks split evenly (a fixed 64 left rank 8 of 9 no rows, and its lookup failed)."""
    from moe_cases import import_transformers

    import_transformers()  # before the example's first transformers import: the kernels name clash
    example = load_example(EXAMPLE)
    for world in (9,):
        example.save_tiny_llama(str(tmp_path / str(world)), world)
        vocab = json.loads((tmp_path / str(world) / "config.json").read_text())["vocab_size"]
        assert vocab % world == 0 and vocab >= world, (world, vocab)
