"""The tensor-parallel layers (``fo_kernels.layers``): a column- then row-parallel MLP equals the
unsharded one forward and backward on gloo CPU ranks (2 and 3), eagerly and under
torch.compile(fullgraph=True), with and without sequence parallelism; their shards, the plan
helper and bad input at world size 1 and on those ranks."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fo_kernels import ColumnParallelLinear, GroupError, RowParallelLinear, parallelize_linears
from fo_kernels import ops as ops_mod
from fo_tune.ranks.launch import run_ranks
from tp_cases import MLP, SUBGROUP, suite

# float32 against the unsharded float32 model (the bound).
LAYER_TOL = 1e-4
# bfloat16 (torch.autocast) against the unsharded model under the same autocast.
AUTOCAST_TOL = 2e-2


@pytest.fixture(autouse=True)
def _isolated_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(tmp_path / "tables"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))


def test_plan_shards_linears_with_the_styles(one_rank):
    """``parallelize_linears`` shards the named nn.Linear modules (patterns too) with
    ``fo_kernels.parallel``'s styles: they stay nn.Linear modules whose parameters are DTensors with
    torch's placements; the model computes the same thing."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch.manual_seed(0)
    model = nn.Sequential(MLP(12, 20), MLP(12, 20))
    x = torch.randn(3, 12)
    want = model(x).detach()
    parallelize_linears(model, {"*.up": "column", "1.down": "row", "0.down": "row"}, sequence_parallel=False)
    assert all(type(m) is nn.Linear for mlp in model for m in (mlp.up, mlp.down))
    up, down = model[0].up, model[1].down
    assert isinstance(up.weight, DTensor) and up.weight.placements == (Shard(0),)
    assert up.bias.placements == (Shard(0),) and up.weight.to_local().shape == (20, 12)
    assert down.weight.placements == (Shard(1),) and down.bias.placements == (Replicate(),)
    torch.testing.assert_close(model(x), want)


def test_empty_plan_leaves_the_model_as_it_is(one_rank):
    """An empty plan shards nothing (as ``parallelize_module``'s does): the same model back, its
    parameters plain tensors."""
    model = MLP(4, 8)
    assert parallelize_linears(model, {}) is model
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_a_layer_saved_whole_finds_its_group_by_name(one_rank):
    """A layer over a process group, saved whole (torch.save of the model: a ProcessGroup does
    not pickle), keeps the group by name: torch.load where that group exists runs on it; where it
    does not, a GroupError says what to make first. A layer compiled in place (``Module.compile``)
    saves as nn.Module saves it, without its compiled code."""
    group = dist.new_group([0])
    layer = ColumnParallelLinear(8, 4, group=group)
    layer.compile(backend="eager")
    buffer = io.BytesIO()
    torch.save(nn.Sequential(layer), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False)[0].group is group
    dist.destroy_process_group(group)
    buffer.seek(0)
    with pytest.raises(GroupError, match=r"which this process does not have; before loading it, init"):
        torch.load(buffer, weights_only=False)


def test_no_grad_forward_skips_the_dispatcher(one_rank, monkeypatch):
    """Inference (no gradient to record) runs the ops' bodies directly, as before the custom ops."""

    def no_dispatch(collective):
        raise AssertionError(f"{collective} went through the dispatcher")

    torch.manual_seed(1)
    full = MLP(8, 16)
    for sp in (False, True):
        layers = nn.Sequential(
            ColumnParallelLinear.from_linear(full.up, sequence_parallel=sp),
            RowParallelLinear.from_linear(full.down, sequence_parallel=sp),
        )
        x = torch.randn(2, 3, 8)
        with monkeypatch.context() as m, torch.no_grad():
            m.setattr(ops_mod, "op", no_dispatch)
            torch.testing.assert_close(layers(x), full.down(full.up(x)))


# (sequence_parallel, torch.compile backend or None for eager). aot_eager traces and compiles the
# same graphs as inductor (Dynamo, AOTAutograd, the ops' fake implementations) without inductor's
# C++ code generation, which costs ~30 s of CPU for this MLP with a cold cache (as CI has);
# inductor's lowering of the ops, forward and backward, is checked on the GPU
# (tests/test_gpu_ops.py) and on the CPU by tests/test_ops.py's compiled bad inputs.
RUNS = [(sp, backend) for backend in (None, "aot_eager") for sp in (False, True)]
# mlp_cases' payload on a process group of tp_cases.SUBGROUP's 2 ranks of 3: eager, and compiled
# with Dynamo alone (its backend "eager": the trace without AOTAutograd's, about a second).
SUBGROUP_MLP = {
    "batch": 4,
    "seq": 3,
    "hidden": 24,
    "inner": 32,
    "runs": [(False, None), (True, None), (True, "eager")],
}


@pytest.mark.parametrize("world", [2, 3])
def test_mlp_matches_unsharded_model(world):
    """Column- then row-parallel MLP vs the unsharded float32 one: the output, the input's
    gradient and both layers' weight and bias gradients within 1e-4 relative (this rank's
    shards of them), eager and compiled, with and without sequence parallelism; bad layer input
    raises a ValueError subclass before any collective; an input with no rows gives nn.Linear's
    empty output and zero gradients (the ops refuse empty operands, so the layers skip them);
    inside torch.autocast the layers cast their operands as F.linear does (bf16 output, the
    autocast model's results within 2e-2); a deep copy over an explicit group, and the model saved
    whole with torch.save and loaded, run on that group. At 3
    ranks the MLP also runs over a process group of ranks 0 and 2 (``SUBGROUP``), eager and
    compiled, the layers built with that group."""
    payload = {"batch": 2 * world, "seq": 3, "hidden": 24, "inner": 16 * world, "runs": RUNS}
    parts = {
        "mlp": ("mlp_cases", payload),
        "bad": ("layer_bad_inputs", None),
        "empty": ("empty_inputs", None),
        "autocast": ("autocast_cases", None),
        "copied": ("copied_layers", None),
    }
    if world == 3:
        parts["subgroup"] = ("subgroup_mlp", SUBGROUP_MLP)
    results = run_ranks(suite, world, parts, backend="gloo")
    for rank, r in enumerate(results):
        assert [(c["sp"], c["backend"]) for c in r["mlp"]] == payload["runs"]
        on_subgroup = world == 3 and rank in SUBGROUP
        assert [(c["sp"], c["backend"]) for c in r.get("subgroup", [])] == (
            SUBGROUP_MLP["runs"] if on_subgroup else []
        )
        for c in r["mlp"] + r.get("subgroup", []):
            for name, err in c["errs"].items():
                assert err < LAYER_TOL, f"rank {rank} sp={c['sp']} {c['backend']}: {name} {err:.2e}"
        assert set(r["copied"]) == {"deepcopy", "saved"}, r["copied"]
        for copied in r["copied"].values():
            assert copied["same_group"] and copied["own_weights"] and copied["err"] == 0.0, copied
        msgs = r["bad"]
        assert "NO ERROR" not in msgs.values(), msgs
        assert "takes 8" in msgs["col_features"] and "takes 4" in msgs["row_features"], msgs
        assert "must divide" in msgs["row_sp_rows"], msgs
        for name in ("col_dtype", "col_dtype_int", "row_dtype"):
            assert msgs[name].startswith("ShapeError: input is torch."), msgs
        assert "not divisible by the world size" in msgs["col_not_divisible"], msgs
        assert "not divisible by the world size" in msgs["row_not_divisible"], msgs
        assert msgs["plan_unknown"].startswith("PlanError: plan: 'nope' names no submodule"), msgs
        assert "not an nn.Linear" in msgs["plan_not_linear"] and "diagonal" in msgs["plan_kind"], msgs
        assert msgs["plan_list"].startswith("PlanError: plan: expected a mapping of submodule"), msgs
        # construction refuses what the ops would refuse at the first call
        assert msgs["col_in_zero"] == "ShapeError: in_features: must be >= 1, got 0", msgs
        assert msgs["row_out_str"] == "ShapeError: out_features: expected an integer, got '6'", msgs
        assert msgs["col_schedule"].startswith("ScheduleError: schedule: expected a fo_kernels."), msgs
        assert msgs["row_param_dtype"].startswith("ShapeError: dtype: torch.float64 is not one of"), msgs
        assert msgs["col_param_dtype_name"].startswith("ShapeError: dtype: 'bfloat16' is not one of"), msgs
        assert msgs["col_schedule_unused"].startswith(
            "ScheduleError: schedule: a ColumnParallelLinear without sequence_parallel runs no "
            "collective in its forward"
        ), msgs
        assert msgs["row_schedule_collective"] == (
            f"ScheduleError: schedule: a RowParallelLinear on {world} ranks runs all_reduce on "
            f"{world} ranks, the schedule is for reduce_scatter on {world}"
        ), msgs
        assert "is for reduce_scatter on " + str(world + 1) in msgs["row_schedule_world"], msgs
        if rank == 2:
            assert "not a member" in msgs["group_not_member"], msgs
        empty = r["empty"]
        for sp in (False, True):
            for backend in (None, "aot_eager"):
                assert empty[f"sp={sp} {backend} (0, 3, 16)"] == ((0, 3, 16), (0, 3, 16), 0.0), empty
                # (a column-parallel layer gathers dim 0 with sequence parallelism, a row-parallel one
                # scatters it: the pair keeps the input's shape either way)
                shape = (2 * world, 0, 16)
                assert empty[f"sp={sp} {backend} {shape}"] == (shape, shape, 0.0), empty
        assert empty["fp8"] == ((0, 16), "torch.float32"), empty
        assert empty["fp8_backward"] == "Fp8TrainingError", empty
        for name, (dtype, err) in r["autocast"].items():
            assert dtype == "torch.bfloat16" and err < AUTOCAST_TOL, f"rank {rank} {name}: {dtype} {err:.2e}"
