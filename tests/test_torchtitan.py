"""A real client: torchtitan's Llama-3 (tiny config) parallelized by torchtitan's own tensor- and
sequence-parallel plan (``apply_tp``) with torch's styles, and again with fo-tune's styles swapped
in, gives the same loss, gradients and placements on 2 and 4 gloo ranks; fo-tune's ops run its
AllGather + GEMM (the output layer's sequence-parallel input) and GEMM + ReduceScatter (every
block's ``wo`` and ``w2``). The same ranks run torchtitan's DeepSeek-V3 (dense layers, low-rank
queries) through its own plan with loss parallelism: the same comparison, and one
``NotOverlappedWarning`` in all, the embedding's. The 4 ranks also run FSDP2 over fo-tune's styles
on a 2 x 2 (dp, tp) mesh against FSDP2 over torch's (the parameters' placements are torch's, so
FSDP2 composes), the styles alone on each dim of that mesh against torch's (the "dp" dim's groups,
ranks 0 and 2, 1 and 3, are not contiguous and run at once), and
torchtitan's training composition: a sequence-parallel plan, activation checkpointing, resharding
after forward or not, accumulated gradients clipped over the 2-D DTensors, AdamW steps, a
distributed checkpoint of torch's model loaded into fo-tune's, and eval-mode calls of changing
sequence lengths.
torchtitan is a dev dependency (pinned in pyproject.toml): the test fails, never skips, without it."""

from __future__ import annotations

import pytest

from fo_tune.ranks.launch import run_ranks
from torchtitan_cases import suite

# float32 against torch's styles on the same float32 model.
TOL = 1e-5


@pytest.fixture(autouse=True)
def _isolated_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(tmp_path / "tables"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))


@pytest.mark.parametrize("world", [2, 4])
def test_llama3_with_fo_tune_styles_matches_torchtitan(world, tmp_path):
    parts = {"llama3": ("llama3", None), "deepseek_v3": ("deepseek_v3", None)}
    if world == 4:  # the same 4 ranks: FSDP2 over the styles on a 2 x 2 (dp, tp) mesh
        parts["fsdp2"] = ("fsdp2_tp", str(tmp_path / "checkpoint"))
        parts["mesh_dims"] = ("styles_on_mesh_dims", None)
    results = run_ranks(suite, world, parts, backend="gloo")
    for rank, r in enumerate(results):
        run = r["llama3"]
        bad = {k: v for k, v in run["errs"].items() if not v < TOL}
        assert not bad, (rank, bad)
        assert len(run["errs"]) > 10, run["errs"]  # the loss and every parameter's gradient
        assert run["same_names"] and run["placements_equal"] and run["grad_placements_equal"], run
        assert run["ops"] == ["all_gather", "reduce_scatter"], run["ops"]
        ds = r["deepseek_v3"]
        bad = {k: v for k, v in ds["errs"].items() if not v < TOL}
        # the loss and the gradients of the embedding, the final norm, the output layer and each of
        # the 2 blocks' 12 parameters (attention's wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b and wo,
        # the two norms, the feed-forward's w1, w2 and w3)
        assert not bad and len(ds["errs"]) == 1 + 3 + 2 * 12, (rank, ds["errs"])
        assert ds["same_names"] and ds["placements_equal"] and ds["grad_placements_equal"], ds
        # AllGather + GEMM of the output layer, GEMM + ReduceScatter of each wo and w2; wq_b and
        # wkv_b take a replicated DTensor: a local GEMM whose gradient DTensor reduces
        assert ds["ops"] == ["all_gather", "reduce_scatter"], ds["ops"]
        (warned,) = ds["not_overlapped"]  # the embedding's, once (its output layer keeps Shard(-1))
        assert "Embedding" in warned, ds["not_overlapped"]
        if world == 4:
            fsdp = r["fsdp2"]
            bad = {k: v for k, v in fsdp["errs"].items() if not v < TOL}
            assert not bad and len(fsdp["errs"]) == 5, (rank, fsdp["errs"])
            assert fsdp["placements_equal"] and fsdp["ops"] == ["all_reduce"], fsdp
            train = fsdp["training"]
            bad = {k: v for k, v in train["errs"].items() if not v < TOL}
            # the losses and norms, 2 blocks' 5 parameters, 3 eval-mode outputs of the loaded model
            assert not bad and len(train["errs"]) == 1 + 10 + 3, (rank, train["errs"])
            assert train["ops"] == ["all_gather", "reduce_scatter"], train
            assert len(r["mesh_dims"]) == 4, r["mesh_dims"]
            for key, run in r["mesh_dims"].items():
                bad = {k: v for k, v in run["errs"].items() if not v < TOL}
                assert not bad and len(run["errs"]) == 6 and run["placements_equal"], (rank, key, run)
                sp = key.endswith("True")
                assert run["ops"] == (["all_gather", "reduce_scatter"] if sp else ["all_reduce"]), (key, run)
