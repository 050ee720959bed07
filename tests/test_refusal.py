"""Bad arguments under torch.compile (``fo_kernels.refusal``): every public entry point that takes
tensors (the three ops, torch's fused-op signatures, the layers, the parallel styles' forward, the
expert-parallel FFN and its module), called with an argument its eager call refuses, raises under
``torch.compile(fullgraph=True)`` the eager call's error type with its message, not Dynamo's
``Unsupported`` or another torch error; so does each call before ``init_process_group``. One
table, one gloo rank in this process; each case compiled with the "eager" backend (the refusal is
Dynamo's trace, not a backend's)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from fo_kernels import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_gather_gemm,
    gemm_all_reduce,
    gemm_reduce_scatter,
    symm_mem,
)
from fo_kernels.engines.triton import executor
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.errors import (
    ArgumentError,
    FoTuneError,
    GroupError,
    NotInitializedError,
    ScaleError,
    ScheduleError,
    ShapeError,
    SignatureError,
)
from fo_kernels.moe.ffn import expert_parallel_ffn
from fo_kernels.moe.module import ExpertParallelExperts
from fo_kernels.parallel import ColwiseParallel, RowwiseParallel
from fo_kernels.plan import MAX_GROUPS
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.tile import Tile

FP8 = torch.float8_e4m3fn
DENSE_OPS = {"ar": gemm_all_reduce, "rs": gemm_reduce_scatter, "ag": all_gather_gemm}
# A case: (the call, its arguments), made once the one-rank group exists (DTensors, styles).
Build = Callable[[], tuple[Callable[..., object], tuple]]


def _mesh():
    return init_device_mesh("cpu", (1,))


def _dtensor(t: torch.Tensor) -> DTensor:
    return distribute_tensor(t, _mesh(), [Replicate()])


def _ab() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 16), torch.randn(16, 32)


def _fp8_ab() -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _ab()
    return a.to(FP8), b.to(FP8)


def _dense_cases() -> dict[str, tuple[Build, type[FoTuneError]]]:
    """Each dense op's operands that are no local tensor, and its fp8 scales' problems."""
    one = torch.tensor(1.0)
    cases: dict[str, tuple[Build, type[FoTuneError]]] = {}
    for short, op in DENSE_OPS.items():
        cases |= {
            f"{short}: a list as a": (lambda op=op: (lambda b: op([[1.0]], b), (_ab()[1],)), ShapeError),
            f"{short}: an int as b": (lambda op=op: (lambda a: op(a, 3), (_ab()[0],)), ShapeError),
            f"{short}: a DTensor a": (lambda op=op: (op, (_dtensor(_ab()[0]), _ab()[1])), ShapeError),
            f"{short}: a DTensor b": (lambda op=op: (op, (_ab()[0], _dtensor(_ab()[1]))), ShapeError),
            f"{short}: a DTensor scale": (
                lambda op=op: (lambda a, b, s: op(a, b, scale_a=s, scale_b=one), (*_fp8_ab(), _dtensor(one))),
                ShapeError,
            ),
            f"{short}: a meta scale": (
                lambda op=op: (
                    lambda a, b, s: op(a, b, scale_a=one, scale_b=s),
                    (*_fp8_ab(), torch.ones((), device="meta")),
                ),
                ScaleError,
            ),
            f"{short}: a list as a scale": (
                lambda op=op: (lambda a, b: op(a, b, scale_a=[1.0], scale_b=one), _fp8_ab()),
                ScaleError,
            ),
            f"{short}: rowwise scales of other rows": (
                lambda op=op: (
                    lambda a, b: op(a, b, scale_a=torch.ones(3, 1), scale_b=torch.ones(1, 32)),
                    _fp8_ab(),
                ),
                ScaleError,
            ),
            f"{short}: an int group": (lambda op=op: (lambda a, b: op(a, b, group=3), _ab()), GroupError),
        }
    return cases | {
        "ag: the shard twice": (lambda: (lambda a, b: all_gather_gemm(a, b, a=a), _ab()), SignatureError),
        "ag: no shard": (lambda: (lambda b: all_gather_gemm(b=b), (_ab()[1],)), SignatureError),
        "ag: no b": (lambda: (lambda a: all_gather_gemm(a), (_ab()[0],)), SignatureError),
        "ag: a list as a=": (lambda: (lambda b: all_gather_gemm(a=[1.0], b=b), (_ab()[1],)), ShapeError),
    }


def _gather(A: object, Bs: object, gather_dim: object = 0, group: object = "", return_a: object = True):
    return symm_mem.fused_all_gather_matmul(A, Bs, gather_dim, group, return_A=return_a)


def _scatter(A: object, B: object, reduce_op: object = "sum", scatter_dim: object = 0, group: object = ""):
    return symm_mem.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group)


def _a3() -> torch.Tensor:
    return torch.randn(2, 4, 8)


def _b() -> torch.Tensor:
    return torch.randn(8, 6)


def _fused_cases() -> dict[str, tuple[Build, type[FoTuneError]]]:
    """torch's fused-op signatures: A no tensor or of < 2 dims, DTensors, bad Bs, dims, flags,
    groups."""
    return {
        "fag: A a list": (lambda: (lambda B: _gather([[1.0]], [B]), (_b(),)), ShapeError),
        "fag: A an int": (lambda: (lambda B: _gather(3, [B]), (_b(),)), ShapeError),
        "fag: A 1-D": (lambda: (lambda A, B: _gather(A, [B]), (torch.randn(8), _b())), ShapeError),
        "fag: A a DTensor": (lambda: (lambda A, B: _gather(A, [B]), (_dtensor(_a3()), _b())), ShapeError),
        "fag: a DTensor in Bs": (lambda: (lambda A, B: _gather(A, [B]), (_a3(), _dtensor(_b()))), ShapeError),
        "fag: Bs a tensor": (lambda: (lambda A, B: _gather(A, B), (_a3(), _b())), ShapeError),
        "fag: an int in Bs": (lambda: (lambda A, B: _gather(A, [B, 3]), (_a3(), _b())), ShapeError),
        "fag: gather_dim a str": (lambda: (lambda A, B: _gather(A, [B], "0"), (_a3(), _b())), ShapeError),
        "fag: gather_dim a bool": (lambda: (lambda A, B: _gather(A, [B], True), (_a3(), _b())), ShapeError),
        "fag: return_A None": (
            lambda: (lambda A, B: _gather(A, [B], 0, "", None), (_a3(), _b())),
            ArgumentError,
        ),
        "fag: fp8 operands": (
            lambda: (lambda A, B: _gather(A.to(FP8), [B.to(FP8)]), (_a3(), _b())),
            ScaleError,
        ),
        "fag: a non-member group": (
            lambda: (lambda A, B: _gather(A, [B], 0, dist.GroupMember.NON_GROUP_MEMBER), (_a3(), _b())),
            GroupError,
        ),
        "fmrs: A a list": (lambda: (lambda B: _scatter([[1.0]], B), (_b(),)), ShapeError),
        "fmrs: A 1-D": (lambda: (lambda A, B: _scatter(A, B), (torch.randn(8), _b())), ShapeError),
        "fmrs: A a DTensor": (lambda: (lambda A, B: _scatter(A, B), (_dtensor(_a3()), _b())), ShapeError),
        "fmrs: B a DTensor": (lambda: (lambda A, B: _scatter(A, B), (_a3(), _dtensor(_b()))), ShapeError),
        "fmrs: B a list": (lambda: (lambda A, B: _scatter(A, [B]), (_a3(), _b())), ShapeError),
        "fmrs: reduce_op an int": (lambda: (lambda A, B: _scatter(A, B, 3), (_a3(), _b())), ArgumentError),
        "fmrs: a DeviceMesh group": (
            lambda: _with_mesh(lambda A, B, mesh: _scatter(A, B, "sum", 0, mesh), (_a3(), _b())),
            GroupError,
        ),
    }


def _with_mesh(call: Callable[..., object], args: tuple) -> tuple[Callable[..., object], tuple]:
    """``call`` with a one-rank DeviceMesh as its last argument, outside the compiled arguments."""
    mesh = _mesh()
    return (lambda *ts: call(*ts, mesh)), args


def _styled(style: object, features: tuple[int, int] = (8, 6)) -> nn.Linear:
    module = nn.Linear(*features)
    parallelize_module(module, _mesh(), style)
    return module


def _then(module: nn.Module, after: Callable[[object], object]) -> tuple[Callable[..., object], tuple]:
    """``module`` on an input of 7 features, its output then given to ``after``."""
    return (lambda x: after(module(x))), (torch.randn(3, 7),)


def _layer_cases() -> dict[str, tuple[Build, type[FoTuneError]]]:
    """The layers' and the parallel styles' inputs: features that do not match the weight, a
    0-dim input, a list or a DTensor where the layer takes its plain rows, an fp8 module's input
    that only torch's path (which has no fp8 GEMM) could take."""
    x7 = lambda: torch.randn(3, 7)  # one feature short of the 8 every module takes
    return {
        "column layer: a list": (lambda: (ColumnParallelLinear(8, 6), ([1.0],)), ShapeError),
        "column layer: a DTensor": (
            lambda: (ColumnParallelLinear(8, 6), (_dtensor(torch.randn(3, 8)),)),
            ShapeError,
        ),
        "row layer (sequence parallel): a DTensor": (
            lambda: (RowParallelLinear(8, 6, sequence_parallel=True), (_dtensor(torch.randn(4, 8)),)),
            ShapeError,
        ),
        "fp8 column layer: float64": (
            lambda: (ColumnParallelLinear(16, 32, fp8="rowwise"), (torch.randn(3, 16).double(),)),
            ShapeError,
        ),
        "colwise: features": (lambda: (_styled(ColwiseParallel()), (x7(),)), ShapeError),
        "colwise Shard(0) input: features": (
            lambda: (_styled(ColwiseParallel(input_layouts=Shard(0))), (x7(),)),
            ShapeError,
        ),
        "colwise: a DTensor's features": (
            lambda: (_styled(ColwiseParallel()), (_dtensor(x7()),)),
            ShapeError,
        ),
        # (a style whose output is a DTensor: what follows the call traces on the refused output)
        "colwise DTensor output: features": (
            lambda: _then(_styled(ColwiseParallel(use_local_output=False)), lambda y: y.to_local() * 2),
            ShapeError,
        ),
        "rowwise DTensor output: features": (
            lambda: _then(_styled(RowwiseParallel(use_local_output=False)), lambda y: y.full_tensor()),
            ShapeError,
        ),
        "colwise: a list": (lambda: (_styled(ColwiseParallel()), ([[1.0] * 8],)), ShapeError),
        "rowwise: a list": (lambda: (_styled(RowwiseParallel()), ([[1.0] * 8],)), ShapeError),
        "colwise: 0-dim": (lambda: (_styled(ColwiseParallel()), (torch.tensor(1.0),)), ShapeError),
        "rowwise: features": (lambda: (_styled(RowwiseParallel()), (x7(),)), ShapeError),
        "rowwise Shard(0) output: features": (
            lambda: (_styled(RowwiseParallel(output_layouts=Shard(0))), (x7(),)),
            ShapeError,
        ),
        "rowwise: 0-dim": (lambda: (_styled(RowwiseParallel()), (torch.tensor(1.0),)), ShapeError),
        "fp8 colwise: features": (
            lambda: (_styled(ColwiseParallel(fp8="rowwise"), (16, 32)), (torch.randn(3, 15),)),
            ShapeError,
        ),
        "fp8 colwise: float64": (
            lambda: (_styled(ColwiseParallel(fp8="rowwise"), (16, 32)), (torch.randn(3, 16).double(),)),
            ShapeError,
        ),
        "fp8 rowwise: float64": (
            lambda: (_styled(RowwiseParallel(fp8="tensorwise"), (16, 32)), (torch.randn(3, 16).double(),)),
            ShapeError,
        ),
    }


def _ffn_args() -> tuple[torch.Tensor, ...]:
    """x (3, 8), topk_ids and topk_weights (3, 2), w13 (2, 8, 6) and w2 (2, 3, 8): 2 experts."""
    ids = torch.tensor([[0, 1], [1, 1], [0, 0]])
    return torch.randn(3, 8), ids, torch.rand(3, 2), torch.randn(2, 8, 6), torch.randn(2, 3, 8)


def _ffn_with(**bad: Callable[[torch.Tensor], object]) -> tuple[Callable[..., object], tuple]:
    """``expert_parallel_ffn`` with the arguments ``bad`` names replaced by ``bad[name](arg)``."""
    names = ("x", "topk_ids", "topk_weights", "w13", "w2")
    args = tuple(bad[n](t) if n in bad else t for n, t in zip(names, _ffn_args(), strict=True))
    tensors = tuple(t for t in args if isinstance(t, torch.Tensor))
    given = [isinstance(t, torch.Tensor) for t in args]

    def call(*ts: torch.Tensor) -> object:
        it = iter(ts)
        full = [next(it) if g else a for g, a in zip(given, args, strict=True)]
        return expert_parallel_ffn(*full)

    return call, tensors


def _moe_cases() -> dict[str, tuple[Build, type[FoTuneError]]]:
    """The expert-parallel FFN's ids, weights and operands."""
    return {
        "ffn: x a list": (lambda: _ffn_with(x=lambda t: t.tolist()), ShapeError),
        "ffn: x a DTensor": (lambda: _ffn_with(x=_dtensor), ShapeError),
        "ffn: w13 a DTensor": (lambda: _ffn_with(w13=_dtensor), ShapeError),
        "ffn: a DTensor x beside an int group": (
            lambda: (
                lambda *ts: expert_parallel_ffn(*ts, group=3),
                (_dtensor(_ffn_args()[0]), *_ffn_args()[1:]),
            ),
            ShapeError,
        ),
        "ffn: float ids": (lambda: _ffn_with(topk_ids=lambda t: t.float()), ShapeError),
        "ffn: ids past the experts": (lambda: _ffn_with(topk_ids=lambda t: t + 5), ShapeError),
        "ffn: negative ids": (lambda: _ffn_with(topk_ids=lambda t: t - 1), ShapeError),
        "ffn: 1-D ids": (lambda: _ffn_with(topk_ids=lambda t: t[:, 0]), ShapeError),
        "ffn: ids of other tokens": (lambda: _ffn_with(topk_ids=lambda t: t[:2]), ShapeError),
        "ffn: int weights": (lambda: _ffn_with(topk_weights=lambda t: t.int()), ShapeError),
        "ffn: float64 w2": (lambda: _ffn_with(w2=lambda t: t.double()), ShapeError),
        "ffn: an int group": (
            lambda: (lambda *ts: expert_parallel_ffn(*ts, group=3), _ffn_args()),
            GroupError,
        ),
        "ffn: a str schedule": (
            lambda: (lambda *ts: expert_parallel_ffn(*ts, schedule="{}"), _ffn_args()),
            ScheduleError,
        ),
        "experts module: hidden_states a list": (
            lambda: _hidden_list(_experts()),
            ShapeError,
        ),
        "experts module: 0-dim hidden_states": (
            lambda: (_experts(), (torch.tensor(1.0), *_routing())),
            ShapeError,
        ),
        "experts module: a routing of other tokens": (
            lambda: (_experts(), (torch.randn(2, 3, 8), *(t[:1] for t in _routing()))),
            ShapeError,
        ),
    }


def _experts() -> ExpertParallelExperts:
    """Both experts of ``_ffn_args`` on the one rank."""
    _, _, _, w13, w2 = _ffn_args()
    return ExpertParallelExperts(w13, w2, num_experts=2)


def _hidden_list(ep: ExpertParallelExperts) -> tuple[Callable[..., object], tuple]:
    """``ep`` called with a list as its hidden states."""
    return (lambda ids, w: ep([1.0], ids, w)), _routing()


def _routing() -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_index and top_k_weights (2, 3, 2) of (2, 3, 8) hidden states."""
    return torch.zeros(2, 3, 2, dtype=torch.int64), torch.rand(2, 3, 2)


CASES = _dense_cases() | _fused_cases() | _layer_cases() | _moe_cases()
# Cases whose messages name sizes, compiled with dynamic shapes too: a message that formats a
# symbolic size is no constant the refused op can take (``fo_kernels.refusal.shape_text``).
DYNAMIC = (
    "fag: A 1-D",
    "fmrs: A 1-D",
    "colwise: features",
    "rowwise Shard(0) output: features",
    "experts module: a routing of other tokens",
)


def _raised(fn: Callable[..., object], args: tuple) -> BaseException | None:
    try:
        fn(*args)
    except Exception as exc:  # the test compares what each call raises
        return exc
    return None


@pytest.mark.parametrize(
    ("name", "dynamic"), [(name, False) for name in CASES] + [(name, True) for name in DYNAMIC]
)
def test_compiled_bad_arguments_raise_the_eager_calls_error(quiet_one_rank, name, dynamic):
    """The eager call raises the case's error; compiled (fullgraph), the same type and message."""
    build, error = CASES[name]
    fn, args = build()
    eager = _raised(fn, args)
    assert type(eager) is error, (name, eager)
    torch._dynamo.reset()  # (each case a compile of its own: the recompile limit is not the test's)
    compiled = _raised(torch.compile(fn, fullgraph=True, backend="eager", dynamic=dynamic), args)
    assert type(compiled) is error and str(compiled) == str(eager), (name, repr(compiled)[:2000])


def test_compiled_calls_before_init_process_group_raise_the_eager_calls_error():
    """Before torch.distributed.init_process_group every entry point that takes only tensors and a
    group name raises ``NotInitializedError``, compiled as eagerly (the fused ops read the default
    group's name as they are traced, which is None until then)."""
    assert not dist.is_initialized()
    a, b = _ab()
    calls: dict[str, tuple[Callable[..., object], tuple]] = {
        **{short: (op, (a, b)) for short, op in DENSE_OPS.items()},
        "fag": (lambda A, B: _gather(A, [B]), (_a3(), _b())),
        "fmrs": (lambda A, B: _scatter(A, B), (_a3(), _b())),
        "ffn": (expert_parallel_ffn, _ffn_args()),
    }
    try:
        for name, (fn, args) in calls.items():
            eager = _raised(fn, args)
            assert type(eager) is NotInitializedError, (name, eager)
            torch._dynamo.reset()
            compiled = _raised(torch.compile(fn, fullgraph=True, backend="eager"), args)
            assert type(compiled) is NotInitializedError and str(compiled) == str(eager), (name, compiled)
    finally:
        torch._dynamo.reset()


def test_a_dtensor_operand_is_told_to_pass_its_local_tensor_and_where_the_styles_fit(quiet_one_rank):
    """A DTensor operand's message names ``.to_local()``; fo_kernels.parallel's styles only where
    they are a way in (the dense ops, the fused ops, the layers), not for the MoE FFN's operands."""
    a, b = _ab()
    dense = _raised(gemm_all_reduce, (_dtensor(a), b))
    ffn_call, ffn_args = _ffn_with(x=_dtensor)
    moe = _raised(ffn_call, ffn_args)
    assert isinstance(dense, ShapeError) and "a.to_local()" in str(dense) and "styles" in str(dense)
    assert isinstance(moe, ShapeError) and "x.to_local()" in str(moe) and "styles" not in str(moe), moe


def _traced_output_shapes(fn: Callable[..., object], args: tuple) -> list[tuple[int, ...]]:
    """The shapes of the outputs of ``fn``'s graph as torch.compile(fullgraph=True) traces it; the
    graph's run then raises the call's refusal, a ValueError subclass (the input is bad)."""
    shapes: list[tuple[int, ...]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., object]:
        (out,) = (node for node in gm.graph.nodes if node.op == "output")
        nodes = torch.utils._pytree.tree_leaves(out.args[0])
        shapes.extend(tuple(node.meta["example_value"].shape) for node in nodes)
        return gm.forward

    with pytest.raises(FoTuneError) as refused:
        torch.compile(fn, fullgraph=True, backend=backend)(*args)
    torch._dynamo.reset()
    assert isinstance(refused.value, ValueError), refused.value  # bad input: a ValueError subclass
    return shapes


def test_compiled_refused_outputs_have_the_eager_calls_shapes_on_two_ranks(quiet_one_rank, monkeypatch):
    """A refused call's output has the shape its eager call gives on 2 ranks (the gathered or
    scattered dim times or over 2), so code after it traces: one rank's group read as 2 ranks
    through the world size a refused call reads (``ops.traced_world_size``, a layer's
    ``world_size``)."""
    from fo_kernels import ops

    monkeypatch.setattr(ops, "traced_world_size", lambda name: 2)
    a, bad_b = torch.randn(2, 4, 8), torch.randn(7, 6)  # bad_b: 7 rows, not A's 8 features
    column = ColumnParallelLinear(8, 6, sequence_parallel=True)
    row = RowParallelLinear(8, 6, sequence_parallel=True)
    monkeypatch.setattr(column, "world_size", 2)
    monkeypatch.setattr(row, "world_size", 2)
    x7, x7_flat = torch.randn(4, 3, 7), torch.randn(3, 2, 7)  # 7 features of 8: refused
    fp8_ab, list_scale = (
        (a[0].to(FP8), torch.randn(8, 6).to(FP8)),
        {"scale_a": [1.0], "scale_b": torch.tensor(1.0)},
    )
    cases = {
        "fag dim 1": (lambda A, B: _gather(A, [B], 1), (a, bad_b), [(2, 8, 8), (2, 8, 6)]),
        "fag features": (lambda A, B: _gather(A, [B], 2), (a, bad_b), [(2, 4, 16), (2, 4, 6)]),
        "fmrs dim 1": (lambda A, B: _scatter(A, B, "sum", 1), (a, bad_b), [(2, 2, 6)]),
        "fmrs features": (lambda A, B: _scatter(A, B, "sum", 2), (a, bad_b), [(2, 4, 3)]),
        "ag: a list as a scale": (lambda A, B: all_gather_gemm(A, B, **list_scale), fp8_ab, [(8, 6)]),
        "rs: a list as a scale": (lambda A, B: gemm_reduce_scatter(A, B, **list_scale), fp8_ab, [(2, 6)]),
        "column layer": (column, (x7,), [(8, 3, 6)]),
        "row layer": (row, (x7,), [(2, 3, 6)]),
        "row layer, the flat shard": (row, (x7_flat,), [(3, 6)]),
    }
    for name, (fn, args, want) in cases.items():
        assert _traced_output_shapes(fn, args) == want, name


@pytest.mark.timeout(60)  # (a call that waits for the refused call's tiles spins forever)
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_a_tile_over_the_gpus_limits_is_a_schedule_error_and_the_next_call_runs(
    quiet_one_rank, over_limits, collective
):
    """A Triton-engine tile whose kernel needs more shared memory than the GPU has (Triton's
    OutOfResources as it loads the kernel; a 256x128x64 4-stage tile in float32 on Hopper) is a
    ScheduleError naming the tile, and the call leaves nothing behind: the next call of the same
    schedule waits for its own GEMM's signals, not for tiles of the refused one (it would spin
    forever), and is right. The load's failure is stood in for here: the interpreter has no limit."""
    m, n, k = over_limits.shape
    schedule = over_limits.schedule(collective)
    op = {"all_reduce": gemm_all_reduce, "reduce_scatter": gemm_reduce_scatter}[collective]
    a, b = torch.randn(m, k, dtype=torch.float64), torch.randn(k, n, dtype=torch.float64)
    refused = pytest.raises(ScheduleError, match=r"tile 32x16x16 .*327704 bytes of shared memory.*232448")
    with over_limits.failing(), refused:
        op(a.float(), b.float(), schedule=schedule)
    got = op(a.float(), b.float(), schedule=schedule)
    assert torch.allclose(got.double(), a @ b, rtol=1e-4, atol=1e-4)


def test_a_schedule_of_more_groups_than_the_counters_is_refused_before_its_gemm(quiet_one_rank, monkeypatch):
    """A Triton schedule whose plan has more groups than the runtime has counters (MAX_GROUPS) is a
    ScheduleError before the signalled GEMM launches: the GEMM adds to counter g of every group g,
    past the counters' end for such a plan."""

    def launched(*args, **kwargs):
        raise AssertionError("the signalled GEMM was launched")

    monkeypatch.setattr(executor, "signalled_gemm", launched)
    tiles_m, tiles_n = 33, 32  # 1056 tiles of 16x16, one a signal unit: up to 1056 groups
    m, n, k = 16 * tiles_m, 16 * tiles_n, 16
    groups = (1,) * MAX_GROUPS + (tiles_m * tiles_n - MAX_GROUPS,)
    tile = Tile(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=1)
    schedule = Schedule(
        collective="all_reduce",
        dtype="float32",
        world_size=1,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=tile, groups=groups, signal_tiles=1, layout="tile_major", wait_mode="spin"
        ),
    )
    with pytest.raises(
        ScheduleError, match=rf"^groups: at most {MAX_GROUPS} groups per call .*got {MAX_GROUPS + 1}"
    ):
        gemm_all_reduce(torch.randn(m, k), torch.randn(k, n), schedule=schedule)
