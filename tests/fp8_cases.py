"""Rank functions of the fp8 tests (spawned processes import this module by name).

Every rank draws every rank's float8_e4m3fn operands and scales from seeds all ranks share, so it
builds the float64 reference of the dequantized operands itself:

    all_reduce       sum_r (a_r * sa_r) @ (b_r * sb_r)
    reduce_scatter   its rows of that sum
    all_gather       cat_r(a_r * sa_r) @ (b_me * sb_me)   (tensorwise: one scale_a on every rank)

Each output is poisoned (NaN left in the allocator) before the call, and a NaN fails the check.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fo_kernels import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter
from fo_kernels.errors import EnvironmentMismatchError, FoTuneError, Fp8TrainingError, ShapeError
from fo_kernels.schedule import Schedule

FP8 = torch.float8_e4m3fn
OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The bounds: bf16 out within 2e-2 relative, fp32 within 1e-5 (fp16: its rounding, 5e-3).
TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-5}
OPS = {"all_reduce": gemm_all_reduce, "reduce_scatter": gemm_reduce_scatter, "all_gather": all_gather_gemm}


@dataclass(frozen=True)
class Fp8Case:
    """One fp8 call: ``m`` rows of the problem (all_gather: of the gathered A)."""

    collective: str
    m: int
    n: int
    k: int
    rowwise: bool
    out_dtype: str | None  # None: the default (bfloat16)
    kmajor: bool  # b as the transposed view of an (N, K) weight
    schedule: dict | None  # Schedule.to_dict(), or None to look one up
    seed: int


def operands(case: Fp8Case, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(a, b, scale_a, scale_b) of ``rank``: fp8 operands, float32 scales."""
    gen = torch.Generator().manual_seed(case.seed * 1009 + rank)
    rows = case.m // world if case.collective == "all_gather" else case.m
    a = (torch.randn(rows, case.k, generator=gen) * 3).to(FP8)
    if case.kmajor:
        b = torch.randn(case.n, case.k, generator=gen).to(FP8).t()
    else:
        b = torch.randn(case.k, case.n, generator=gen).to(FP8)
    if case.rowwise:
        sa = torch.rand(rows, 1, generator=gen) + 0.25
        sb = torch.rand(1, case.n, generator=gen) + 0.25
    else:
        shared = torch.Generator().manual_seed(case.seed)  # one scale_a on every rank (all_gather)
        sa = torch.rand((), generator=shared) + 0.25
        sb = torch.rand((), generator=gen) + 0.25
    return a.to(device), b.to(device), sa.to(device), sb.to(device)


def reference(case: Fp8Case, rank: int, world: int) -> torch.Tensor:
    cpu = torch.device("cpu")
    parts = [operands(case, r, world, cpu) for r in range(world)]
    deq = [(a.double() * sa.double(), b.double() * sb.double()) for a, b, sa, sb in parts]
    if case.collective == "all_gather":
        return torch.cat([a for a, _ in deq]) @ deq[rank][1]
    total = sum(a @ b for a, b in deq)
    if case.collective == "reduce_scatter":
        rows = case.m // world
        total = total[rank * rows : (rank + 1) * rows]
    return total


def _call(case: Fp8Case, a, b, sa, sb, group=None) -> torch.Tensor:
    schedule = Schedule.from_dict(case.schedule) if case.schedule is not None else None
    kw = dict(scale_a=sa, scale_b=sb, schedule=schedule, group=group)
    if case.out_dtype is not None:
        kw["out_dtype"] = OUT_DTYPES[case.out_dtype]
    return OPS[case.collective](a, b, **kw)


def run_fp8_cases(ctx, cases: list[Fp8Case]) -> list[dict]:
    """Each case called once on poisoned memory; its error against float64, NaN, shape and dtype."""
    return [fp8_case(case, ctx.rank, ctx.world_size, ctx.device) for case in cases]


def fp8_case(case: Fp8Case, rank: int, world: int, device: torch.device, group=None) -> dict:
    """``case`` on ``rank`` of ``group`` (of ``world`` ranks; None: the default group), called once
    on poisoned memory: its error against float64, NaN, shape and dtype."""
    a, b, sa, sb = operands(case, rank, world, device)
    want_dtype = OUT_DTYPES[case.out_dtype or "bfloat16"]
    junk = torch.full((case.m * case.n * 2,), float("nan"), dtype=torch.float32, device=device)
    del junk  # (NaN left in the allocator for the output to reuse)
    got = _call(case, a, b, sa, sb, group)
    ref = reference(case, rank, world)
    err = ((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return dict(
        case=case,
        err=err,
        nan=bool(got.isnan().any()),
        shape_ok=tuple(got.shape) == tuple(ref.shape),
        dtype=str(got.dtype),
        dtype_ok=got.dtype == want_dtype,
    )


def fp8_on_subgroup(ctx, ranks: tuple[int, ...], cases: list[Fp8Case]) -> list[dict]:
    """``cases`` (made for ``len(ranks)`` ranks) on a process group of ``ranks``, by its ranks
    (``fp8_case``); a rank outside it gets ``[]``."""
    group = dist.new_group(list(ranks))
    if ctx.rank not in ranks:
        return []
    return [fp8_case(c, ranks.index(ctx.rank), len(ranks), ctx.device, group) for c in cases]


def _copy_engine_row(world: int, *, m: int, n: int, k: int) -> Schedule:
    """An fp8 ``engine: copy_engine`` all_gather table row (gathered M of ``m`` rows)."""
    problem = dict(m=m, n=n, k=k)
    settings = dict(mode="ring", weights=[1, 1])
    return Schedule.from_dict(
        dict(collective="all_gather", dtype="float8_e4m3fn", world_size=world, problem=problem,
             engine="copy_engine", settings=settings)
    )  # fmt: skip


def bad_fp8_calls(ctx, _payload) -> dict[str, str]:
    """Each bad fp8 call must raise a ValueError subclass before any collective (a copy_engine row
    off CUDA peers: EnvironmentMismatchError); name -> "ErrorType: message". (A collective started
    on one rank only would hang the other: the ranks call in step.)"""
    dev, w = ctx.device, ctx.world_size
    a = torch.randn(4 * w, 32, device=dev).to(FP8)
    b = torch.randn(32, 16, device=dev).to(FP8)
    one = torch.tensor(1.0, device=dev)
    f32, w32 = torch.randn(4 * w, 32, device=dev), torch.randn(32, 16, device=dev)
    calls = {
        "scales_on_fp32": lambda: gemm_all_reduce(f32, w32, scale_a=one, scale_b=one),
        "out_dtype_on_fp32": lambda: gemm_all_reduce(f32, w32, out_dtype=torch.bfloat16),
        "no_scales": lambda: gemm_all_reduce(a, b),
        "one_scale": lambda: gemm_all_reduce(a, b, scale_a=one),
        "mixed_dtypes": lambda: gemm_all_reduce(a, b.float(), scale_a=one, scale_b=one),
        "e5m2": lambda: gemm_all_reduce(
            a.to(torch.float8_e5m2), b.to(torch.float8_e5m2), scale_a=one, scale_b=one
        ),
        "scale_f16": lambda: gemm_all_reduce(a, b, scale_a=one.half(), scale_b=one),
        "scale_a_1d": lambda: gemm_all_reduce(a, b, scale_a=torch.ones(4 * w, device=dev), scale_b=one),
        "scale_b_wrong": lambda: gemm_all_reduce(
            a, b, scale_a=torch.ones(4 * w, 1, device=dev), scale_b=torch.ones(16, 1, device=dev)
        ),
        "mixed_modes": lambda: gemm_all_reduce(a, b, scale_a=torch.ones(4 * w, 1, device=dev), scale_b=one),
        "gather_full_rows": lambda: all_gather_gemm(
            a, b, scale_a=torch.ones(4 * w * w, 1, device=dev), scale_b=torch.ones(1, 16, device=dev)
        ),
        "out_int": lambda: gemm_all_reduce(a, b, scale_a=one, scale_b=one, out_dtype=torch.int32),
        "n_not_16": lambda: gemm_reduce_scatter(
            a, torch.randn(32, 24, device=dev).to(FP8), scale_a=one, scale_b=one
        ),
        "copy_engine_row": lambda: all_gather_gemm(
            a,
            b,
            scale_a=torch.ones(4 * w, 1, device=dev),
            scale_b=torch.ones(1, 16, device=dev),
            schedule=_copy_engine_row(w, m=4 * w * w, n=16, k=32),
        ),
        "k_not_16": lambda: gemm_all_reduce(
            torch.randn(4, 24, device=dev).to(FP8),
            torch.randn(24, 16, device=dev).to(FP8),
            scale_a=one,
            scale_b=one,
        ),
    }
    msgs = {}
    for name, call in calls.items():
        try:
            call()
        except (ValueError, EnvironmentMismatchError) as exc:
            assert isinstance(exc, FoTuneError), (name, type(exc))
            msgs[name] = f"{type(exc).__name__}: {exc}"
        else:
            msgs[name] = "NO ERROR"
    return msgs


def fp8_backward(ctx, _payload) -> str:
    """The error a backward through an fp8 op gives (the forward runs)."""
    dev = ctx.device
    a = torch.randn(8, 32, device=dev).to(FP8)
    b = torch.randn(32, 16, device=dev).to(FP8)
    sa = torch.tensor(0.5, device=dev, requires_grad=True)
    sb = torch.tensor(2.0, device=dev)
    y = gemm_all_reduce(a, b, scale_a=sa, scale_b=sb)
    try:
        y.float().sum().backward()
    except Fp8TrainingError as exc:
        return str(exc)
    return "NO ERROR"


def replaced(case: Fp8Case, **changes) -> Fp8Case:
    return dataclasses.replace(case, **changes)


def fp8_layers(ctx, _payload) -> dict[str, float | str]:
    """fp8 column- and row-parallel layers (both scalings, with and without sequence parallelism)
    from one full bf16-sized ``nn.Linear`` pair on every rank, against the full float64 MLP:
    name -> relative error (fp8 quantization of weight and activation, ~1e-2), plus the error a
    backward through one gives."""
    from fo_kernels import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(4321)  # the same full layers and input on every rank
    w, feat, hidden, batch = ctx.world_size, 32, 64, 6
    up, down = torch.nn.Linear(feat, hidden), torch.nn.Linear(hidden, feat)
    x = torch.randn(batch * w, feat)
    want = down(up(x)).double()
    out: dict[str, float | str] = {}
    for scaling in ("tensorwise", "rowwise"):
        for sp in (False, True):
            col = ColumnParallelLinear.from_linear(up, sequence_parallel=sp, fp8=scaling)
            row = RowParallelLinear.from_linear(down, sequence_parallel=sp, fp8=scaling)
            assert col.weight.dtype == FP8 and not col.weight.requires_grad
            rows = batch * w // w
            mine = x[ctx.rank * rows : (ctx.rank + 1) * rows] if sp else x
            with torch.no_grad():
                got = row(col(mine))
            ref = want[ctx.rank * rows : (ctx.rank + 1) * rows] if sp else want
            assert got.dtype == x.dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
            out[f"{scaling}-sp{int(sp)}"] = ((got.double() - ref).norm() / ref.norm()).item()
    # the model cast to bf16 after quantization: the layers keep their fp8 codes and float32 scales
    col = ColumnParallelLinear.from_linear(up, fp8="tensorwise").to(torch.bfloat16)
    row = RowParallelLinear.from_linear(down, fp8="rowwise").half().to(torch.bfloat16)
    assert (col.weight.dtype, row.weight_scale.dtype) == (FP8, torch.float32), (col.weight, row.weight_scale)
    with torch.no_grad():
        got = row(col(x.to(torch.bfloat16)))
    out["cast-bf16"] = ((got.double() - want).norm() / want.norm()).item()
    col = ColumnParallelLinear.from_linear(up, fp8="rowwise")
    y = col(x.requires_grad_(True))
    try:
        y.sum().backward()
        out["backward"] = "NO ERROR"
    except Fp8TrainingError as exc:
        out["backward"] = str(exc)
    # an input the scaled GEMM cannot give its output in (float64) or quantize (an integer one)
    for name, bad in (("float64 input", x.detach().double()), ("int input", x.detach().long())):
        try:
            col(bad)
            out[name] = "NO ERROR"
        except ShapeError as exc:
            out[name] = str(exc)
    return out


def _recast(model: torch.nn.Module, x: torch.Tensor, before: torch.Tensor) -> float:
    """``model`` (parallelized with fp8 styles) cast to other dtypes and back, then deep-copied and
    saved whole and loaded again (each cast once more): every fp8 weight stays fp8 codes and its
    scale float32, and the largest difference of an output from ``before`` (the uncast model's on
    ``x``) is returned. A device move (to meta, a CPU rank's other device) still moves them."""
    import copy
    import io

    fp8_modules = sum(hasattr(sub, "weight_scale") for sub in model.modules())
    assert fp8_modules, "the model holds no fp8 module, so no cast of one is checked"

    def check(m: torch.nn.Module, device: str = "cpu") -> None:
        scaled = [sub for sub in m.modules() if hasattr(sub, "weight_scale")]
        assert len(scaled) == fp8_modules, (len(scaled), fp8_modules, m)  # every module keeps its scale
        for sub in scaled:
            scale, local = sub.weight_scale, sub.weight.to_local()
            assert (local.dtype, scale.dtype) == (FP8, torch.float32), (sub, local.dtype, scale.dtype)
            assert local.device.type == scale.device.type == device, (sub, local.device, scale.device)

    cast = copy.deepcopy(model).float().half().to(torch.bfloat16)
    check(cast)
    saved = io.BytesIO()
    torch.save(cast, saved)
    saved.seek(0)
    copies = (cast, copy.deepcopy(cast).float(), torch.load(saved, weights_only=False).half())
    for m in copies[1:]:
        check(m)
    check(copy.deepcopy(cast).to("meta"), "meta")
    with torch.no_grad():
        return max((m(x) - before).abs().max().item() for m in copies)


def fp8_styles(ctx, checkpoint_dir: str) -> dict[str, float | str]:
    """fo_kernels.parallel's styles with ``fp8=`` on an MLP (colwise then rowwise, both scalings,
    replicated and dim-0 sequence-parallel activations, a bf16 model) against the full float64 MLP:
    name -> relative error; plus the backward's error, an fp8 style's refusal of a layout fo-tune
    cannot run (torch's style has no fp8 GEMM) and ``parallelize_linears(fp8=...)``; "... cast":
    each model's largest difference from itself after casts of its dtype (``_recast``)."""
    import copy
    import warnings

    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from fo_kernels.errors import NotOverlappedWarning, PlanError
    from fo_kernels.parallel import ColwiseParallel, RowwiseParallel, parallelize_linears, plan_of

    w, feat, hidden = ctx.world_size, 32, 64
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    torch.manual_seed(4321)  # the same full model and input on every rank
    full = nn.Sequential(nn.Linear(feat, hidden), nn.Linear(hidden, feat)).to(torch.bfloat16)
    x = torch.randn(2 * w, 3, feat, dtype=torch.bfloat16)
    want = copy.deepcopy(full).double()(x.double())
    out: dict[str, float | str] = {}
    for scaling in ("tensorwise", "rowwise"):
        for sp in (False, True):
            model = copy.deepcopy(full)
            act = Shard(0) if sp else None
            plan = {
                "0": ColwiseParallel(input_layouts=act, fp8=scaling),
                "1": RowwiseParallel(output_layouts=act, fp8=scaling),
            }
            with warnings.catch_warnings():
                warnings.simplefilter("error", NotOverlappedWarning)  # fp8 never runs as torch's
                parallelize_module(model, mesh, plan)
            up = model[0]
            assert up.weight.dtype == FP8 and not up.weight.requires_grad and plan_of(up).fp8 == scaling
            assert up.weight_scale.dtype == torch.float32
            mine = x.chunk(w)[ctx.rank] if sp else x
            ref = want.chunk(w)[ctx.rank] if sp else want
            with torch.no_grad():
                got = model(mine)
            assert got.dtype == x.dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
            out[f"{scaling}-sp{int(sp)}"] = ((got.double() - ref).norm() / ref.norm()).item()
            out[f"{scaling}-sp{int(sp)} cast"] = _recast(model, mine, got)
    # under autocast the weight stays fp8 codes (cast to bf16 they would lose their scale)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(mine.float())
    out["autocast"] = ((got.double() - ref).norm() / ref.norm()).item()
    copied = copy.deepcopy(model)  # the copy keeps the fp8 plan
    assert plan_of(copied[0]).fp8 == plan_of(model[0]).fp8 == "rowwise"
    with torch.no_grad():
        got = copied(mine)
    out["deepcopy"] = ((got.double() - ref).norm() / ref.norm()).item()
    try:
        model(mine.clone().requires_grad_(True)).float().sum().backward()
        out["backward"] = "NO ERROR"
    except Fp8TrainingError as exc:
        out["backward"] = str(exc)
    try:  # a colwise input sharded on its features: torch's style, which has no fp8 GEMM
        parallelize_module(
            copy.deepcopy(full), mesh, {"0": ColwiseParallel(input_layouts=Shard(-1), fp8="rowwise")}
        )
        out["refused"] = "NO ERROR"
    except PlanError as exc:
        out["refused"] = str(exc)
    codes = copy.deepcopy(full[0]).requires_grad_(False).to(FP8)  # an nn.Linear of fp8 codes already
    try:  # (no scale to run the codes by: the option quantizes a high-precision weight itself)
        parallelize_module(codes, mesh, ColwiseParallel(fp8="tensorwise"))
        out["refused codes"] = "NO ERROR"
    except PlanError as exc:
        out["refused codes"] = str(exc)
    model = parallelize_linears(copy.deepcopy(full), {"0": "column", "1": "row"}, fp8="rowwise")
    with torch.no_grad():
        got = model(x)
    out["parallelize_linears"] = ((got.double() - want).norm() / want.norm()).item()
    out["parallelize_linears cast"] = _recast(model, x, got)
    out.update(_loss_parallel_fp8(mesh, w))
    out.update(_style_loads(full, mesh, x, want, checkpoint_dir))
    return out


def _loss_parallel_fp8(mesh, w: int) -> dict[str, float]:
    """torchtitan's plan with loss parallelism in fp8 (``parallel_cases.LossParallelLM``: the
    embedding on torch's style, the colwise layers fed a SequenceParallel norm's ``Shard(1)``
    DTensor, the output a ``Shard(-1)`` DTensor) against the full float64 model, each scaling."""
    import copy

    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor import parallel as torch_tp

    from fo_kernels.parallel import ColwiseParallel, RowwiseParallel
    from parallel_cases import LossParallelLM

    torch.manual_seed(99)
    full = LossParallelLM(16 * w, 32, 16 * w, bias=True)
    tokens = torch.randint(0, 16 * w, (2, 2 * w))
    want = copy.deepcopy(full).double()(tokens)
    out = {}
    for scaling in ("tensorwise", "rowwise"):
        plan = {
            "tok": torch_tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": torch_tp.SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1), fp8=scaling),
            "down": RowwiseParallel(output_layouts=Shard(1), fp8=scaling),
            "final_norm": torch_tp.SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False, fp8=scaling
            ),
        }
        model = torch_tp.parallelize_module(copy.deepcopy(full), mesh, plan)
        with torch.no_grad():
            got = model(tokens)
        assert isinstance(got, DTensor) and got.placements == (Shard(2),), got
        got = got.full_tensor().double()
        out[f"loss_parallel-{scaling}"] = ((got - want).norm() / want.norm()).item()
    return out


def _style_loads(full, mesh, x: torch.Tensor, want: torch.Tensor, checkpoint_dir: str) -> dict[str, object]:
    """fp8 styles through ``load_state_dict`` and a distributed checkpoint, both scalings: "... load"
    (the largest difference from the fp8 model made from ``full``, 0 when bitwise equal) of a fresh
    fp8 model of other weights loading the high-precision parallelized model's DTensor state_dict
    (bf16 and fp32, strict and not), the fp8 model's own, and its DCP checkpoint, and a model built
    on the meta device then loading the high-precision state_dict; "... plain": a
    model of plain styles loading the fp8 state_dict (dequantized), its error against ``want``;
    "... no scale": the error of fp8 codes without their scale."""
    import copy
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor.parallel import parallelize_module

    from fo_kernels.errors import ScaleError
    from fo_kernels.parallel import ColwiseParallel, RowwiseParallel

    def styled(scaling: str | None, scale: float = 1.0) -> torch.nn.Module:
        model = copy.deepcopy(full)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        plan = {"0": ColwiseParallel(fp8=scaling), "1": RowwiseParallel(fp8=scaling)}
        return parallelize_module(model, mesh, plan)

    def diff(model: torch.nn.Module, ref: torch.nn.Module) -> float:
        with torch.no_grad():
            return (model(x).float() - ref(x).float()).abs().max().item()

    out: dict[str, object] = {}
    high = styled(None).state_dict()
    for scaling in ("tensorwise", "rowwise"):
        fp8 = styled(scaling)
        for dtype, strict in itertools.product((torch.bfloat16, torch.float32), (True, False)):
            model = styled(scaling, -0.5)  # other weights and scales beforehand
            model.load_state_dict({k: v.to(dtype) for k, v in high.items()}, strict=strict)
            out[f"{scaling} {dtype} strict={strict} load"] = diff(model, fp8)
        model = styled(scaling, -0.5)
        model.load_state_dict(fp8.state_dict())
        out[f"{scaling} state_dict load"] = diff(model, fp8)
        where = os.path.join(checkpoint_dir, scaling)
        dcp.save(fp8.state_dict(), checkpoint_id=where)
        model = styled(scaling, -0.5)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=where)
        model.load_state_dict(state)
        out[f"{scaling} dcp load"] = diff(model, fp8)
        with torch.device("meta"):  # built before its weights are loaded, as torchtitan does
            model = copy.deepcopy(full).to("meta")
        model = parallelize_module(
            model, mesh, {"0": ColwiseParallel(fp8=scaling), "1": RowwiseParallel(fp8=scaling)}
        )
        model.to_empty(device="cpu").load_state_dict(high)
        out[f"{scaling} meta load"] = diff(model, fp8)
        plain = styled(None, -0.5)
        plain.load_state_dict(fp8.state_dict(), strict=False)
        with torch.no_grad():
            out[f"{scaling} plain"] = ((plain(x).double() - want).norm() / want.norm()).item()
        codes = {k: v for k, v in fp8.state_dict().items() if not k.endswith("weight_scale")}
        try:
            styled(scaling).load_state_dict(codes, strict=False)
            out[f"{scaling} no scale"] = "NO ERROR"
        except ScaleError as exc:
            out[f"{scaling} no scale"] = str(exc)
    return out
