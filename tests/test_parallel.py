"""fo-tune's tensor-parallel styles (``fo_kernels.parallel``) and torch's fused-op signatures
(``fo_kernels.symm_mem``) on gloo CPU ranks (2 and 3).

Every style case parallelizes one model with torch's styles and with fo-tune's (the same plan)
and compares outputs, input and parameter gradients and placements, eagerly and under
torch.compile(fullgraph=True); the collectives fo-tune's ops ran are recorded, so a case that
silently fell back to torch's path fails. One start of the ranks per world size runs every part;
at 3 ranks the fused functions also run on a process group of ranks 1 and 2 (``SUBGROUP``, named
by its ``group_name``) against torch's reference on it, and rank 0, outside it, gets a GroupError."""

from __future__ import annotations

import pytest

from fo_tune.ranks.launch import run_ranks
from parallel_cases import CASES, suite

# float32 against torch's styles on the same float32 model.
TOL = 1e-5
# bfloat16 under torch.autocast against torch's styles under it: a few of bfloat16's 2^-8 steps
# (the partial sums are rounded at other points than DTensor's).
BF16_TOL = 2e-2
# The ranks of the 3-rank job's process group for the fused functions on a group other than the
# world: not starting at 0 (rank 0 is outside it).
SUBGROUP = (1, 2)
# The cases also run under torch.compile (aot_eager: Dynamo, AOTAutograd and the ops' fake
# implementations without inductor's C++ code generation, ~10 s of CPU a graph here; see
# test_layers.py), per world size: without and with sequence parallelism (dim 0 and 1, DTensor
# inputs), DTensor outputs, a run-time fallback to torch's path inside the graph and a colwise output
# DTensor redistributes (its warning decided in the forward).
COMPILED = {
    2: ("mlp", "mlp_sp", "mlp_sp_seq", "block", "dtensor_out", "uneven_rows", "col_out_seq"),
    3: ("mlp", "mlp_sp"),
}


@pytest.fixture(autouse=True)
def _isolated_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(tmp_path / "tables"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))


def _backends(world: int, name: str) -> list[str | None]:
    return [None, "aot_eager"] if name in COMPILED[world] else [None]


@pytest.mark.parametrize("world", [2, 3])
def test_styles_match_torch_styles_and_fused_ops_match_torch(world):
    payload = {name: _backends(world, name) for name in CASES}
    parts = {
        "styles": ("style_cases", payload),
        "fused": ("fused_ops", world == 2),
        "bad": ("bad_inputs", None),
        "copies": ("copies", None),
        "autocast": ("autocast", None),
        "meta": ("meta_linears", None),
        "unknown_dims": ("unknown_dims", None),
        "double_backward": ("double_backward", None),
        "bias_dtype": ("bias_of_another_dtype", None),
    }
    if world == 3:
        parts["subgroup"] = ("fused_on_subgroup", SUBGROUP)
    results = run_ranks(suite, world, parts, backend="gloo")
    for rank, r in enumerate(results):
        if world == 3 and rank not in SUBGROUP:
            for msg in r["subgroup"].values():
                assert msg.startswith("GroupError: group: this rank is not a member"), (rank, r["subgroup"])
        elif world == 3:
            bad = {k: v for k, v in r["subgroup"].items() if not v < TOL}
            assert not bad and len(r["subgroup"]) == 13, (rank, r["subgroup"])
        for name, c in r["styles"].items():
            case = CASES[name]
            where = f"rank {rank} {name}"
            assert c["placements_equal"] and c["params_equal"], where
            assert len(c["warnings"]) == case.warnings, (where, c["warnings"])
            assert [run["backend"] for run in c["runs"]] == payload[name], where
            for run in c["runs"]:
                bad = {k: v for k, v in run["errs"].items() if not v < TOL}
                assert not bad, (where, run["backend"], bad)
                assert run["same_placements"], (where, run["backend"])
                assert run["ops"] == case.ops, (where, run["backend"], run["ops"])
        bad = {k: v for k, v in r["fused"].items() if not v < TOL}
        assert not bad and len(r["fused"]) > 40, (rank, bad)
        edges = {"ag empty rows", "rs empty features", "ag no Bs", "ag group", "rs group"}
        assert edges <= r["fused"].keys(), r["fused"]
        assert ("compiled" in r["fused"]) == (world == 2), r["fused"]
        bad = {k: v for k, v in r["meta"].items() if not v < TOL}
        assert not bad and len(r["meta"]) == 4, (rank, r["meta"])
        for copied in r["copies"].values():
            assert copied["err"] < TOL and copied["planned"] and copied["own_params"], copied
            assert copied["ops"] == ["all_reduce"], copied
        for name, run in r["autocast"].items():
            assert run["dtypes"] == ("torch.bfloat16", "torch.bfloat16"), (rank, name, run)
            bad = {k: v for k, v in run["errs"].items() if not v < BF16_TOL}
            assert not bad and run["grad_dtypes_equal"], (rank, name, bad, run)
        assert r["autocast"]["replicated"]["ops"] == ["all_reduce"], r["autocast"]
        assert r["autocast"]["sequence"]["ops"] == ["all_gather", "reduce_scatter"], r["autocast"]
        bad = {k: v for k, v in r["double_backward"].items() if not v < TOL}
        assert not bad and len(r["double_backward"]) == 8, (rank, r["double_backward"])
        # torch's error alone, not another dim's result nor a result of what F.linear refuses
        for key, got in {**r["unknown_dims"], **r["bias_dtype"]}.items():
            assert got["torch"] != "ran" and got["fo"] == got["torch"], (rank, key, got)
            assert got["fo warnings"] == 0, (rank, key, got)
        msgs = r["bad"]
        assert "NO ERROR" not in msgs.values(), msgs
        assert (
            msgs["col_features"].startswith("ShapeError") and "got an input of (3, 9)" in msgs["col_features"]
        )
        assert "takes 2 input features" in msgs["row_features"], msgs
        assert "K mismatch" in msgs["ag_k"] and "got Tensor" in msgs["ag_bs_tensor"], msgs
        assert "gather_dim 2" in msgs["ag_dim"] and "at least 2 dims" in msgs["ag_vector"], msgs
        assert msgs["rs_op"].startswith("ArgumentError: reduce_op 'max'"), msgs
        assert "not divisible by the world size" in msgs["rs_rows"] and "scatter_dim -3" in msgs["rs_dim"], (
            msgs
        )
        assert msgs["rs_group"].startswith("GroupError"), msgs
        for key in ("col_assigned", "row_assigned"):
            assert msgs[key].startswith("PlanError") and "assign=True" in msgs[key], msgs
        for key in ("twice", "twice_after_torch"):  # (a RuntimeError too, as torch's styles raise)
            assert msgs[key].startswith("AlreadyParallelizedError") and "already distributed" in msgs[key], (
                msgs
            )
        assert "Bs[1] is torch.bfloat16" in msgs["ag_dtype"] and "B is torch.float64" in msgs["rs_dtype"], (
            msgs
        )
        assert msgs["ag_group_type"].startswith("GroupError: group_name: expected"), msgs
        assert msgs["ag_fp8"].startswith("ScaleError: fused_all_gather_matmul has no scales"), msgs
        assert "call fo_kernels.all_gather_gemm with float8_e4m3fn operands" in msgs["ag_fp8"], msgs
        assert "float8_e5m2 operands" in msgs["rs_e5m2"] and "gemm_reduce_scatter" in msgs["rs_e5m2"], msgs
        assert "names no submodule" in msgs["plan_unknown"] and "diagonal" in msgs["plan_kind"], msgs
        assert "not a DTensor sharded on dim 0" in msgs["install_plain"], msgs
        assert msgs["install_style"].startswith("PlanError: style: expected"), msgs
        assert "Embedding is not an nn.Linear" in msgs["install_embedding"], msgs


def test_fused_ops_are_importable_beside_the_styles():
    """A caller of torch's async-TP switches the styles and the fused ops by one import."""
    from fo_kernels import parallel, symm_mem

    for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        assert getattr(parallel, name) is getattr(symm_mem, name), name
        assert name in parallel.__all__, name


def test_fused_ops_take_the_arguments_torchs_op_schemas_name():
    """Each fused function's parameters are its torch op's schema arguments (names, order,
    keyword-only ``return_A`` and its default), so a call by keyword switches by import too."""
    import inspect

    import torch
    from torch.distributed import _symmetric_memory  # noqa: F401 (defines torch.ops.symm_mem)

    from fo_kernels import symm_mem

    for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        schema = getattr(torch.ops.symm_mem, name).default._schema
        want = [
            (a.name, a.kwarg_only, a.default_value if a.has_default_value() else None)
            for a in schema.arguments
        ]
        params = inspect.signature(getattr(symm_mem, name)).parameters.values()
        got = [
            (
                p.name,
                p.kind is inspect.Parameter.KEYWORD_ONLY,
                None if p.default is inspect.Parameter.empty else p.default,
            )
            for p in params
        ]
        assert got == want, (name, got, want)


def test_styles_show_torchs_constructor_arguments_and_fp8():
    """``inspect.signature`` (``help()``, editors, a checker of the drop-in API) shows torch's own
    keyword arguments, kinds, defaults and annotations, then ``fp8``: not ``**torch_args``."""
    import inspect

    from torch.distributed.tensor import parallel as torch_tp

    from fo_kernels import parallel as fo_tp

    for ours, theirs in (
        (fo_tp.ColwiseParallel, torch_tp.ColwiseParallel),
        (fo_tp.RowwiseParallel, torch_tp.RowwiseParallel),
    ):
        want = list(inspect.signature(theirs).parameters.values())
        got = list(inspect.signature(ours).parameters.values())
        assert got[: len(want)] == want, (ours, got)
        assert [(p.name, p.kind, p.default) for p in got[len(want) :]] == [
            ("fp8", inspect.Parameter.KEYWORD_ONLY, None)
        ], got
        defaults = {p.name: p.default for p in want}
        assert repr(ours(**defaults)) == repr(theirs(**defaults)), ours
        with pytest.raises(TypeError, match="input_layout"):
            ours(input_layout=None)


def test_a_module_torchs_styles_refuse_raises_torchs_error_without_a_fallback_warning(one_rank):
    """A style on a module neither nn.Linear nor nn.Embedding (a plan's wildcard that reaches a
    norm) raises torch's NotImplementedError, as torch's style does, with no warning that it
    "runs as torch's style" (under -W error that warning replaced torch's error)."""
    import warnings

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fo_kernels import parallel as fo_tp

    mesh = init_device_mesh("cpu", (1,))
    for style in (fo_tp.ColwiseParallel(), fo_tp.RowwiseParallel()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(NotImplementedError, match=r"only support nn\.Linear and nn\.Embedding"):
                parallelize_module(nn.LayerNorm(4), mesh, style)


def test_a_module_first_called_compiled_warns_once_where_it_runs_as_torchs_style(one_rank):
    """A module whose first call is compiled (fullgraph) and runs as torch's style (an empty
    input) gives its one NotOverlappedWarning as torch.compile traces it, none after; the
    output is torch's style's. (It gave none: Dynamo traces no warnings.warn.)"""
    import warnings

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as torch_tp

    from fo_kernels import NotOverlappedWarning
    from fo_kernels import parallel as fo_tp

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 6), nn.Linear(4, 6)
    theirs.load_state_dict(ours.state_dict())
    torch_tp.parallelize_module(ours, mesh, fo_tp.ColwiseParallel())
    torch_tp.parallelize_module(theirs, mesh, torch_tp.ColwiseParallel())
    x = torch.randn(0, 4)
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    got, texts = [], []
    for call in (compiled, compiled, ours):  # (the eager call after: no second warning)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got.append(call(x))
        texts.append([str(w.message) for w in seen if issubclass(w.category, NotOverlappedWarning)])
    assert [len(t) for t in texts] == [1, 0, 0] and "runs as torch's style does" in texts[0][0], texts
    want = theirs(x)
    assert all(g.shape == want.shape == (0, 6) for g in got)


def test_a_compiled_fused_call_that_runs_as_torchs_reference_warns(one_rank):
    """A fused call torch.compile traces (fullgraph) that runs as torch's reference (a gather of
    the features) warns as it is traced, where it gave no warning at all; its result is the
    reference's."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as torch_symm

    from fo_kernels import NotOverlappedWarning, symm_mem

    name = dist.group.WORLD.group_name
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda a, b: symm_mem.fused_all_gather_matmul(a, [b], -1, name)[1][0],
        fullgraph=True,
        backend="aot_eager",
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = compiled(a, b)
    texts = [str(w.message) for w in seen if issubclass(w.category, NotOverlappedWarning)]
    assert len(texts) == 1 and "runs as torch's reference" in texts[0], texts
    want = torch_symm._fused_all_gather_matmul_fallback(a, [b], -1, name)[1][0]
    torch.testing.assert_close(got, want)


def test_parallelize_linears_refuses_a_module_two_patterns_give_other_kinds():
    """A module matched by a "column" and a "row" pattern is a PlanError naming both patterns,
    raised before any module is sharded (no process group needed to see it)."""
    from torch import nn

    from fo_kernels import PlanError
    from fo_kernels.parallel import parallelize_linears

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    with pytest.raises(PlanError, match=r"1 is matched by '\*' \(column\) and by '1' \(row\)"):
        parallelize_linears(model, {"*": "column", "1": "row"})
    assert not any(hasattr(m, "_distribute_module_applied") for m in model.modules())


def test_a_plan_key_that_is_no_name_and_from_linear_of_no_linear_are_plan_errors():
    """A plan keyed by something other than a name says which key; ``from_linear`` of a module
    that is no nn.Linear is a PlanError naming its type (not an AttributeError)."""
    from torch import nn

    from fo_kernels import ColumnParallelLinear, PlanError, RowParallelLinear
    from fo_kernels.parallel import parallelize_linears

    with pytest.raises(PlanError, match=r"key 0 \(int\) is not a name"):
        parallelize_linears(nn.Sequential(nn.Linear(4, 4)), {0: "column"})
    for layer in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(PlanError, match=r"from_linear takes an nn\.Linear, got Conv1d"):
            layer.from_linear(nn.Conv1d(4, 4, 1))


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_sequence_parallel_that_is_not_a_bool_is_refused(flag):
    """``sequence_parallel="no"`` (or 1, None) is an ArgumentError naming the option, from the
    layers and from parallelize_linears, before any process group is needed: Python would read
    "no" as true."""
    from torch import nn

    from fo_kernels import ArgumentError, ColumnParallelLinear, RowParallelLinear
    from fo_kernels.parallel import parallelize_linears

    want = rf"sequence_parallel: expected True or False, got {flag!r}"
    with pytest.raises(ArgumentError, match=want):
        parallelize_linears(nn.Sequential(nn.Linear(4, 4)), {"0": "column"}, sequence_parallel=flag)
    for layer in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(ArgumentError, match=want):
            layer(4, 4, sequence_parallel=flag)
        with pytest.raises(ArgumentError, match=want):
            layer.from_linear(nn.Linear(4, 4), sequence_parallel=flag)
