"""GPU tests of fp8 on one GPU (skipped without one): the signalled fp8 GEMM (Hopper's fp8 tensor
cores, scales in the epilogue) against the float64 product of the dequantized operands on many
shapes, both scalings, three output dtypes and both B layouts, at full and reduced grids; the three
ops at world size 1 (one NCCL rank: the fallback's torch._scaled_mm, the Triton engine, the custom
ops, a caller's CUDA graph) and the fp8 layers; and the signalled GEMM timed beside
torch._scaled_mm on the suite's shapes (ratios printed; the bar is measured by ``fo-tune profile``).

Every output is poisoned with NaN first and checked after a second call; NaN never passes.

Run on a GPU machine with: TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_gpu_fp8.py -s
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist

from fo_kernels import (
    ColumnParallelLinear,
    Problem,
    RowParallelLinear,
    Schedule,
    TileStagesWarning,
    all_gather_gemm,
    gemm_all_reduce,
    gemm_reduce_scatter,
)
from fo_kernels.engines.triton.executor import kmajor_fp8
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.gemm import BOperand, signalled_gemm
from fo_kernels.plan import cdiv, make_plan
from fo_kernels.scaling import check_scales, scaled_mm
from fo_kernels.tile import Tile
from fo_tune.engines.triton.defaults import split_decreasing

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
OUT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Bounds against float64: bf16 out within 2e-2, fp16 its rounding plus the accumulation's. fp32
# out: 5e-3, since the signalled GEMM accumulates fp8 as torch._scaled_mm(use_fast_accum=True)
# does, in the wgmma's reduced-precision accumulator (1.3e-3 read at K = 4096 on one H100;
# kernels/gemm/tiles.py). The CPU's gloo tests hold fp32 out to 1e-5.
TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 5e-3}
# The Triton engine's bf16 default tile (docs/design.md#default-schedule), its fp8 default (a
# 128-deep K block: fp8 halves a K block's bytes; search_spaces/hopper.yaml dtype_tiles) and the
# square deep tile.
TILES = (
    Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    Tile(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4),
    Tile(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=3),
)
# (M, N, K): M = 1, M not a multiple of any tile, small N, and the suite's and layers' shapes.
SHAPES = [
    (1, 4096, 4096),
    (37, 1024, 512),
    (1000, 2048, 1024),
    (2048, 4096, 4096),
    (3000, 5120, 6912),
    (8192, 4096, 2048),
]


def _operands(m: int, n: int, k: int, rowwise: bool, kmajor: bool, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 2).to(FP8)
    if kmajor:
        b = torch.randn(n, k, device="cuda", generator=gen).to(FP8).t()
    else:
        b = torch.randn(k, n, device="cuda", generator=gen).to(FP8)
    if rowwise:
        sa = torch.rand(m, 1, device="cuda", generator=gen) + 0.25
        sb = torch.rand(1, n, device="cuda", generator=gen) + 0.25
    else:
        sa = torch.rand((), device="cuda", generator=gen) + 0.25
        sb = torch.rand((), device="cuda", generator=gen) + 0.25
    return a, b, sa, sb


def _reference(a, b, sa, sb) -> torch.Tensor:
    return (a.double() * sa.double()) @ (b.double() * sb.double())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    return err if math.isfinite(err) else math.inf  # NaN never passes


def _schedule(
    collective: str, m: int, n: int, k: int, tile: Tile, sms_free: int, groups: int = 3
) -> Schedule:
    """A Triton-engine row_band schedule at world size 1."""
    tiles_n = cdiv(n, tile.block_n)
    unit = tile.group_m * tiles_n
    units = cdiv(cdiv(m, tile.block_m) * tiles_n, unit)
    return Schedule(
        collective=collective,
        dtype="float8_e4m3fn",
        world_size=1,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=tile,
            sms_free=sms_free,
            signal_tiles=unit,
            groups=split_decreasing(units, min(groups, units)),
            layout="row_band",
        ),
    )


def _signalled(a, b, scales, tile: Tile, sms_free: int):
    """(run, out) of the signalled fp8 GEMM alone (one group, private counters), as the profile's
    ``fo_tune.ranks.gemm.gemm_runner``."""
    m, k = a.shape
    n = b.shape[1]
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    schedule = Schedule(
        collective="all_reduce",
        dtype="float8_e4m3fn",
        world_size=1,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=tile, sms_free=sms_free, signal_tiles=tiles, groups=(1,), layout="row_band"
        ),
    )
    plan = make_plan(schedule, m, n, k, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    counters = torch.zeros(4, dtype=torch.int32, device="cuda")
    unit_group = torch.zeros(1, dtype=torch.int32, device="cuda")
    group_info = torch.tensor([0, m], dtype=torch.int32, device="cuda")
    out = torch.empty(m * n, dtype=scales.out_dtype, device="cuda")
    operand = kmajor_fp8(BOperand.of(b))  # (as the engine: a row-major fp8 B made K-major)

    def run() -> torch.Tensor:
        signalled_gemm(
            a,
            operand,
            out,
            plan,
            tile,
            counters=counters,
            unit_group=unit_group,
            group_info=group_info,
            scales=scales,
        )
        return out.view(m, n)

    return run, out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_signalled_fp8_gemm_matches_float64(shape, rowwise):
    m, n, k = shape
    want = None
    for i, (tile, out_name, kmajor, sms_free) in enumerate(
        [(TILES[0], "bfloat16", True, 0), (TILES[1], "float32", False, 16), (TILES[2], "float16", False, 8)]
    ):
        a, b, sa, sb = _operands(m, n, k, rowwise, kmajor, seed=sum(shape) + i)
        want = _reference(a, b, sa, sb)
        scales = check_scales("all_reduce", a, b, sa, sb, OUT[out_name])
        run, out = _signalled(a, b, scales, tile, sms_free)
        for call in range(2):
            out.fill_(float("nan"))
            got = run()
            torch.cuda.synchronize()
            err = _rel(got, want)
            assert err < TOL[out_name], (
                f"{shape} {tile.label()} r={sms_free} {out_name} call {call}: {err:.2e}"
            )
        library = scaled_mm(a, b, scales)  # torch._scaled_mm, the same math
        assert _rel(library, want) < TOL[out_name]


OPS = {"all_reduce": gemm_all_reduce, "reduce_scatter": gemm_reduce_scatter, "all_gather": all_gather_gemm}


@pytest.mark.parametrize("collective", sorted(OPS))
@pytest.mark.parametrize("engine", ["lookup", "triton"])
def test_fp8_ops_at_world_size_one(nccl_one_rank, collective, engine):
    """Each op (the fallback's torch._scaled_mm where no row matches, the Triton engine) on odd and
    round shapes (N and K down to 16), both scalings, three out dtypes and both B layouts; eagerly,
    through the custom op (a scale that requires grad) and replayed from a caller's CUDA graph (the
    fallback's)."""
    op = OPS[collective]
    for i, ((m, n, k), rowwise, out_name, kmajor) in enumerate(
        [
            ((37, 1024, 512), False, "bfloat16", True),
            ((1000, 2048, 1024), True, "float32", False),
            ((2048, 4096, 4096), True, "float16", True),
            ((1, 4096, 4096), False, "bfloat16", False),
            ((17, 48, 80), True, "bfloat16", True),  # N and K multiples of 16 below every tile
            ((100, 272, 16), False, "float32", False),
        ]
    ):
        a, b, sa, sb = _operands(m, n, k, rowwise, kmajor, seed=100 + i)
        schedule = None if engine == "lookup" else _schedule(collective, m, n, k, TILES[2], 16)
        kw = dict(scale_a=sa, scale_b=sb, out_dtype=OUT[out_name], schedule=schedule)
        want = _reference(a, b, sa, sb)
        got = op(a, b, **kw)
        assert got.dtype == OUT[out_name] and _rel(got, want) < TOL[out_name], (m, n, k, rowwise, out_name)
        traced = op(a, b, **{**kw, "scale_a": sa.clone().requires_grad_(True)})  # (the custom op)
        assert _rel(traced.detach(), want) < TOL[out_name]
    if engine == "triton" and collective != "all_gather":
        return  # (counters against host targets: a replayed graph does not advance them)
    a, b, sa, sb = _operands(2048, 4096, 4096, True, True, seed=7)
    for _ in range(3):  # eager warm-up: the communicator, the kernels, the fallback's own graphs
        op(a, b, scale_a=sa, scale_b=sb)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(a, b, scale_a=sa, scale_b=sb)
    for step in range(2):
        fresh = _operands(2048, 4096, 4096, True, True, seed=8 + step)
        for dst, src in zip((a, b, sa, sb), fresh, strict=True):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, _reference(*fresh)) < TOL["bfloat16"], f"replay {step}"


# fp8's 128x256x128 tile with 4 stages: 262,176 bytes of shared memory with a float32 output, over
# a Hopper GPU's 232,448 per block; it loads with a bfloat16 one (docs/design.md, life of a call).
DEEP_TILE = Tile(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=4)


def test_a_float32_out_runs_a_tile_that_does_not_load_with_fewer_stages(nccl_one_rank):
    """A table row's tile that loads with the bfloat16 output it was tuned for but not with float32:
    the three ops run it with fewer stages, right, warning once (Hopper) for the first call; later
    calls, of any op and scaling, start from the tile that loaded, silently."""
    warned = 0
    for i, collective in enumerate(sorted(OPS)):
        for rowwise in (False, True):
            m, n, k = (77, 6016, 16) if i == 0 else (1000, 2048, 1024)
            a, b, sa, sb = _operands(m, n, k, rowwise, kmajor=True, seed=300 + i)
            want = _reference(a, b, sa, sb)
            for out_name in ("float32", "bfloat16", "float32"):
                schedule = _schedule(collective, m, n, k, DEEP_TILE, 4, groups=1)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = OPS[collective](
                        a, b, scale_a=sa, scale_b=sb, out_dtype=OUT[out_name], schedule=schedule
                    )
                torch.cuda.synchronize()
                retries = [w for w in caught if issubclass(w.category, TileStagesWarning)]
                assert not retries or out_name == "float32", (collective, out_name)
                warned += len(retries)
                err = _rel(got, want)
                assert got.dtype == OUT[out_name], (collective, out_name)
                assert err < TOL[out_name], (collective, rowwise, out_name, err)
    if torch.cuda.get_device_capability() == (9, 0):
        assert warned == 1
    assert warned <= 1


def test_fp8_layers_at_world_size_one(nccl_one_rank):
    """fp8 column- then row-parallel layers (both scalings) within fp8's quantization error of the
    full bf16 MLP."""
    torch.manual_seed(0)
    up = torch.nn.Linear(1024, 4096, device="cuda", dtype=torch.bfloat16)
    down = torch.nn.Linear(4096, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = down(up(x))
        for scaling in ("tensorwise", "rowwise"):
            col = ColumnParallelLinear.from_linear(up, fp8=scaling)
            row = RowParallelLinear.from_linear(down, fp8=scaling)
            got = row(col(x))
            assert got.dtype == torch.bfloat16 and _rel(got, want) < 0.1, scaling


def test_fp8_styles_at_world_size_one(nccl_one_rank):
    """fo_kernels.parallel's styles with ``fp8=`` in torch's parallelize_module on a one-rank mesh
    (replicated and sequence-parallel activations, both scalings, and under bf16 autocast from a
    float32 input): fp8 weight shards, within fp8's quantization error of the full bf16 MLP."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from fo_kernels.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024))
    full = full.to("cuda", torch.bfloat16)
    x = torch.randn(2, 150, 1024, device="cuda", dtype=torch.bfloat16)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    with torch.no_grad():
        want = full(x)
        for scaling in ("tensorwise", "rowwise"):
            for act in (None, Shard(1)):
                model = parallelize_module(
                    copy.deepcopy(full),
                    mesh,
                    {
                        "0": ColwiseParallel(input_layouts=act, fp8=scaling),
                        "1": RowwiseParallel(output_layouts=act, fp8=scaling),
                    },
                )
                assert model[0].weight.dtype == FP8, scaling
                got = model(x)
                assert got.dtype == torch.bfloat16 and _rel(got, want) < 0.1, (scaling, act)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    got = model(x.float())
                assert got.dtype == torch.bfloat16 and _rel(got, want) < 0.1, (scaling, act, "autocast")


@pytest.mark.parametrize(
    "shape", [(2048, 4096, 4096), (4096, 8192, 4096), (8192, 8192, 8192)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_signalled_fp8_gemm_timed_beside_scaled_mm(shape, rowwise):
    """The signalled fp8 GEMM (both tiles, full grid) and torch._scaled_mm timed side by side from
    CUDA graphs: the ratios are printed (the >= 0.95x bar over the space's configs is
    ``FO_DTYPE=float8_e4m3fn bash bench/profile.sh``'s); both must be checked right after timing."""
    from fo_tune.ranks.timing import time_interleaved

    m, n, k = shape
    a, b, sa, sb = _operands(m, n, k, rowwise, True, seed=3)
    scales = check_scales("all_reduce", a, b, sa, sb, None)
    fns = {"scaled_mm": lambda: scaled_mm(a, b, scales)}
    outs = {}
    for tile in TILES:
        run, outs[tile.label()] = _signalled(a, b, scales, tile, 0)
        fns[tile.label()] = run
    timings = time_interleaved(fns, torch.device("cuda", 0), warmup=3, rounds=10, graphs=True)
    base = timings["scaled_mm"].median_ms
    want = _reference(a, b, sa, sb)
    for tile in TILES:
        label = tile.label()
        ratio = base / timings[label].median_ms
        kind = "rowwise" if rowwise else "tensorwise"
        ours = timings[label].median_ms
        print(f"fp8 {kind} {m}x{n}x{k} {label}: {ours:.3f} ms, torch._scaled_mm {base:.3f} ms, {ratio:.3f}x")
        assert math.isfinite(ratio) and _rel(outs[label].view(m, n), want) < TOL["bfloat16"], label
