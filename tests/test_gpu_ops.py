"""GPU tests of the custom ops at world size 1 (one NCCL rank in this process; skipped without a GPU):
they trace under torch.compile(fullgraph=True) with inductor, forward and backward, and they capture
in CUDA graphs, both a caller's ``torch.cuda.graph`` of eager calls and torch.compile's
``mode="reduce-overhead"``.

Run on a GPU machine with: TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_gpu_ops.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from fo_kernels import Problem, Schedule, all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.plan import cdiv
from fo_kernels.tile import Tile
from fo_tune.engines.triton.defaults import split_decreasing

M, K, N = 512, 384, 640
TILE = Tile(block_m=64, block_n=64, block_k=32, group_m=2, num_warps=4, num_stages=3)
# bf16 against a float32 reference of the same math (three chained GEMMs)
BF16_TOL = 2e-2
# float32 with TF32 tensor-core products (10-bit mantissa) at K of a few hundred
FP32_TF32_TOL = 1e-2
# float32 on cuBLAS without TF32 against float64: rounding of sums of a few hundred products
FP32_EXACT_TOL = 1e-5


@pytest.fixture(autouse=True)
def _isolated_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(tmp_path / "tables"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))


def _triton(collective: str, m: int, n: int, k: int) -> Schedule:
    """A Triton-engine schedule of 2-3 row-band groups at world size 1."""
    tiles_n = cdiv(n, TILE.block_n)
    unit = TILE.group_m * tiles_n
    units = cdiv(cdiv(m, TILE.block_m) * tiles_n, unit)
    return Schedule(
        collective=collective,
        dtype="bfloat16",
        world_size=1,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=TILE, sms_free=8, signal_tiles=unit, groups=split_decreasing(units, 3), layout="row_band"
        ),
    )


def _off(collective: str, m: int, n: int, k: int) -> Schedule:
    return Schedule(collective=collective, dtype="bfloat16", world_size=1, problem=Problem(m=m, n=n, k=k))


# name -> schedules of (all_gather, reduce_scatter, all_reduce) in ``_block``; None: looked up
VARIANTS = {
    "lookup": (None, None, None),
    "overlap_false": (
        _off("all_gather", M, N, K),
        _off("reduce_scatter", M, K, N),
        _off("all_reduce", M, N, K),
    ),
    "triton_gather": (
        _triton("all_gather", M, N, K),
        _off("reduce_scatter", M, K, N),
        _off("all_reduce", M, N, K),
    ),
    "triton": (
        _triton("all_gather", M, N, K),
        _triton("reduce_scatter", M, K, N),
        _triton("all_reduce", M, N, K),
    ),
}
# The Triton engine's AllReduce and ReduceScatter wait on counters against targets the host keeps,
# which a replayed graph does not advance: those schedules are traced, not captured.
CAPTURABLE = ("lookup", "overlap_false", "triton_gather")


def _block(schedules):
    s_ag, s_rs, s_ar = schedules

    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = all_gather_gemm(x, w1.t(), schedule=s_ag)  # (M, N)
        y = gemm_reduce_scatter(h.relu(), w2.t(), schedule=s_rs)  # (M, K)
        return gemm_all_reduce(y, w1.t(), schedule=s_ar)  # (M, N)

    return block


def _reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    x, w1, w2 = x.float(), w1.float(), w2.float()
    return ((x @ w1.t()).relu() @ w2.t()) @ w1.t()


def _operands(seed: int, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(M, K), (N, K), (K, N)]
    return tuple(
        (torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) / s[1] ** 0.5).requires_grad_(
            requires_grad
        )
        for s in shapes
    )


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_ops_compile_with_inductor(nccl_one_rank, variant):
    """torch.compile(fullgraph=True) with inductor: forward and every gradient equal eager's."""
    block = _block(VARIANTS[variant])
    x, w1, w2 = _operands(1, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        for t in (x, w1, w2):
            t.grad = None
        y = fn(x, w1, w2)
        (y * dy).sum().backward()
        results.append([y.detach(), x.grad, w1.grad, w2.grad])
    assert _rel(results[0][0], _reference(x.detach(), w1.detach(), w2.detach())) < BF16_TOL
    for name, got, want in zip(("y", "dx", "dw1", "dw2"), results[1], results[0], strict=True):
        assert _rel(got, want) < BF16_TOL, f"{variant}: {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", CAPTURABLE)
def test_eager_ops_capture_in_a_cuda_graph(nccl_one_rank, variant):
    """A caller's CUDA graph of eager op calls replays on new inputs copied into the captured ones."""
    block = _block(VARIANTS[variant])
    x, w1, w2 = _operands(2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):  # warm-up: communicators, kernels, the fallback's own graphs
            block(x, w1, w2)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = block(x, w1, w2)
    for step in range(3):
        new = _operands(10 + step)
        for dst, src in zip((x, w1, w2), new, strict=True):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"{variant} step {step}"
        assert _rel(out, _reference(*new)) < BF16_TOL, f"{variant} step {step}"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", CAPTURABLE)
def test_compiled_ops_in_reduce_overhead_mode(nccl_one_rank, variant):
    """torch.compile(mode="reduce-overhead"): inductor's CUDA graphs hold the ops; every call on new
    inputs is right."""
    compiled = torch.compile(_block(VARIANTS[variant]), mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for step in range(5):
            ops = _operands(20 + step)
            got = compiled(*ops).clone()  # the graph's output memory is reused by the next replay
            torch.cuda.synchronize()
            assert _rel(got, _reference(*ops)) < BF16_TOL, f"{variant} step {step}"


@pytest.mark.gpu
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_float32_calls_inside_cuda_autocast_stay_float32(nccl_one_rank, collective):
    """Inside ``torch.autocast("cuda", bfloat16)`` a float32 call's output and both gradients stay
    float32 at float32's precision: the no-overlap path's cuBLAS GEMM and the backward GEMMs run with
    autocast off. (cuBLAS float32 without TF32, torch's default, is within FP32_EXACT_TOL of float64;
    a bfloat16 product at this K is off by ~3e-3.)"""
    assert not torch.backends.cuda.matmul.allow_tf32
    gen = torch.Generator(device="cuda").manual_seed(5)
    a0 = torch.randn(M, K, device="cuda", generator=gen)
    b0 = torch.randn(N, K, device="cuda", generator=gen).t()
    dy = torch.randn(M, N, device="cuda", generator=gen)
    op = {"all_reduce": gemm_all_reduce, "reduce_scatter": gemm_reduce_scatter, "all_gather": all_gather_gemm}
    schedule = Schedule(collective=collective, dtype="float32", world_size=1, problem=Problem(m=M, n=N, k=K))
    a, b = a0.clone().requires_grad_(), b0.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = op[collective](a, b, schedule=schedule)
        (y * dy).sum().backward()
    a64, b64, dy64 = a0.double(), b0.double(), dy.double()
    wants = {"y": a64 @ b64, "da": dy64 @ b64.t(), "db": a64.t() @ dy64}
    for name, got in (("y", y), ("da", a.grad), ("db", b.grad)):
        want = wants[name]
        assert got.dtype == torch.float32, (name, got.dtype)
        assert _rel(got, want) < FP32_EXACT_TOL, (name, _rel(got, want))


@pytest.mark.gpu
def test_parallelize_linears_moves_cpu_weights_to_an_nccl_groups_device(nccl_one_rank):
    """A model built on the cpu and sharded over an nccl group lands on cuda, as torch's styles move
    weights to their mesh's device; its forward and backward there match the unsharded model."""
    from torch.distributed.tensor import DTensor

    from fo_kernels import parallelize_linears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(K, N), torch.nn.GELU(), torch.nn.Linear(N, K))
    reference = copy.deepcopy(model).cuda()
    parallelize_linears(model, {"0": "column", "2": "row"})
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device.type == "cuda", name
    x = torch.randn(M, K, device="cuda", requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, want = model(x), reference(x_ref)
    out.sum().backward()
    want.sum().backward()
    # float32 GEMMs on tensor cores (TF32 where Triton or cuBLAS choose it) against cuBLAS
    assert _rel(out, want) < FP32_TF32_TOL
    assert _rel(x.grad, x_ref.grad) < FP32_TF32_TOL


@pytest.mark.gpu
@pytest.mark.timeout(300)  # (a call that waits for a refused call's tiles never returns)
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_a_tile_over_the_gpus_shared_memory_is_a_schedule_error(nccl_one_rank, collective):
    """A 256x128x64 4-stage tile fits Hopper's shared memory in bfloat16 but not in float32: the
    float32 call is a ScheduleError naming the tile and the bytes, and the same call with a tile
    that fits then runs and is right (nothing of the refused call is waited for)."""
    from fo_kernels.errors import ScheduleError

    big = Tile(block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)
    m, n, k = 1024, 512, 256
    a = torch.randn(m, k, device="cuda", dtype=torch.float32)
    b = torch.randn(k, n, device="cuda", dtype=torch.float32)
    op = {"all_reduce": gemm_all_reduce, "reduce_scatter": gemm_reduce_scatter, "all_gather": all_gather_gemm}
    for tile, refused in ((big, True), (TILE, False)):
        tiles_n = cdiv(n, tile.block_n)
        unit = tile.group_m * tiles_n
        units = cdiv(cdiv(m, tile.block_m) * tiles_n, unit)
        settings = TritonSettings(
            tile=tile, sms_free=8, signal_tiles=unit, groups=split_decreasing(units, 2), layout="row_band"
        )
        schedule = Schedule(
            collective=collective,
            dtype="float32",
            world_size=1,
            problem=Problem(m=m, n=n, k=k),
            settings=settings,
        )
        if refused:
            with pytest.raises(ScheduleError, match=r"tile 256x128x64 .* bytes of shared memory"):
                op[collective](a, b, schedule=schedule)
            continue
        got = op[collective](a, b, schedule=schedule)
        torch.cuda.synchronize()
        assert _rel(got, a.double() @ b.double()) < FP32_TF32_TOL


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_release_group_frees_an_nccl_groups_runtime_and_a_later_op_is_right(nccl_one_rank):
    """On an NCCL subgroup: the block's ops (Triton engine, then the graphed no-overlap fallback)
    are right, ``release_group`` frees the group's runtime (its capped communicators destroyed,
    graphs and buffers dropped), the same ops then run again, right, and the group is destroyed
    after without a hang."""
    import torch.distributed as dist

    from fo_kernels import release_group

    group = dist.new_group([0], backend="nccl")
    x, w1, w2 = _operands(7)
    want = _reference(x, w1, w2)

    def block(schedules) -> torch.Tensor:
        s_ag, s_rs, s_ar = schedules
        h = all_gather_gemm(x, w1.t(), schedule=s_ag, group=group)
        y = gemm_reduce_scatter(h.relu(), w2.t(), schedule=s_rs, group=group)
        return gemm_all_reduce(y, w1.t(), schedule=s_ar, group=group)

    try:
        for round_ in range(2):
            for name in ("triton", "overlap_false", "overlap_false"):  # (the fallback graphs on its 2nd call)
                got = block(VARIANTS[name])
                torch.cuda.synchronize()
                assert _rel(got, want) < BF16_TOL, (round_, name)
            assert release_group(group) == 1
            assert release_group(group) == 0
    finally:
        release_group(group)
        dist.destroy_process_group(group)
