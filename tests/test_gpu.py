"""GPU tests (skipped without CUDA): the compiled kernel on one GPU, both ops over NCCL on two.

Run on a GPU machine with: TRITON_INTERPRET=0 python -m pytest -m "gpu or multigpu" tests/test_gpu.py
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import triton
import triton.language as tl

from dist_cases import TOL, Case, run_cases
from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.gemm import BOperand, KernelOptions, restore_tile_major, rows_gemm, signalled_gemm, tma_usable
from fo_kernels.plan import cdiv, make_plan, tail_plan
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.tile import Tile
from fo_tune.engines.triton.defaults import split_decreasing

GPU_TILES = [
    Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    Tile(block_m=64, block_n=64, block_k=32, group_m=2, num_warps=4, num_stages=3),
    Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, warp_specialize=True),
    Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4, pingpong=True),
]
PINGPONG_TILES = [
    Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4, pingpong=True),
    Tile(block_m=64, block_n=256, block_k=64, group_m=8, num_warps=4, num_stages=4, pingpong=True),
]


def _schedule(collective, world, m, n, k, tile, layout, dtype="bfloat16"):
    shards = world if collective == "reduce_scatter" else 1
    mt, nt = cdiv(m // shards, tile.block_m), cdiv(n, tile.block_n)
    unit = shards * (tile.group_m * nt if layout == "row_band" else 1)
    groups = split_decreasing(cdiv(shards * mt * nt, unit), 3)
    return Schedule(
        collective=collective,
        dtype=dtype,
        world_size=world,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=tile, sms_free=20, nccl_max_ctas=16, signal_tiles=unit, groups=groups, layout=layout
        ),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 8, 8), (130, 257, 70), (1000, 3000, 1040), (2048, 4096, 4096)])
@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("tile", GPU_TILES, ids=["128x256", "64x64", "128x256ws", "128x128pp"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_gemm_matches_matmul(m, n, k, kmajor, tile, dtype):
    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    a = torch.randn(m, k, device="cuda", generator=gen, dtype=dtype)
    b = (
        torch.randn(n, k, device="cuda", generator=gen, dtype=dtype).t()
        if kmajor
        else torch.randn(k, n, device="cuda", generator=gen, dtype=dtype)
    )
    for layout in ("row_band", "tile_major"):
        s = _schedule("all_reduce", 1, m, n, k, tile, layout)
        plan = make_plan(s, m, n, k, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
        buf = torch.full((plan.buffer_numel(),), float("nan"), dtype=dtype, device="cuda")
        counters = torch.zeros(8, dtype=torch.int32, device="cuda")
        ug = torch.tensor(plan.unit_group(), dtype=torch.int32, device="cuda")
        gi = torch.tensor([x for p in plan.group_info() for x in p], dtype=torch.int32, device="cuda")
        signalled_gemm(a, BOperand.of(b), buf, plan, tile, counters=counters, unit_group=ug, group_info=gi)
        out = (
            buf.view(m, n)
            if layout == "row_band"
            else torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        )
        if layout == "tile_major":
            restore_tile_major(buf, out, plan, tile)
        torch.cuda.synchronize()
        ref = a.float() @ b.float()
        assert not out.isnan().any()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < TOL[str(dtype).split(".")[1]], err
        assert counters[: plan.num_groups].tolist() == [plan.group_tiles(g) for g in range(plan.num_groups)]
    aligned = (k * 2) % 16 == 0 and (n * 2 if not kmajor else k * 2) % 16 == 0
    assert tma_usable(a, BOperand.of(b)) == aligned


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [
        KernelOptions(stream_k=True),
        KernelOptions(stream_k=False, split_tail=False),
        KernelOptions(split_tail=True),
    ],
    ids=["stream_k", "whole_last_wave", "split_tail"],
)
def test_compiled_gemm_variants(options):
    """The last partial wave's forced choices (``KernelOptions``) on odd and aligned shapes, both
    layouts: stream-K, whole, cut into the split tail's pieces (in the whole waves' launch)."""
    tile = GPU_TILES[0]
    for (m, n, k), kmajor, layout in itertools.product(
        [(130, 257, 70), (1000, 3000, 1040), (2048, 4096, 4096)], [False, True], ["row_band", "tile_major"]
    ):
        gen = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        b = w.t() if kmajor else w.t().contiguous()
        out = _run_layout(a, b, tile, layout, options)
        ref = a.float() @ b.float()
        assert not out.isnan().any(), (m, n, k, kmajor, layout)
        assert ((out.float() - ref).norm() / ref.norm()).item() < TOL["bfloat16"], (m, n, k, kmajor, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", PINGPONG_TILES, ids=["128x128", "64x256"])
def test_pingpong_kernel_matches_the_plain_kernel(tile):
    """The ping-pong kernel (``fo_kernels.gemm.pingpong``) runs where it should and writes what the
    plain kernel writes: one shard and two (ReduceScatter's destination order), both layouts, odd M,
    N and K (TMA clips and pads), a reduced grid, the last partial wave split into pieces that the
    plain kernel runs after it or cut into K parts in the ping-pong kernel itself (its K-split tail);
    each group's counter counts its tiles. A call it cannot run
    (unaligned K, two shards of rows that are not whole tiles) runs the plain kernel."""
    from fo_kernels.gemm.pingpong import pingpong_blocker

    plain = dataclasses.replace(tile, pingpong=False, num_warps=8 if tile.block_m == 128 else 4)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split = KernelOptions(split_tail=True)  # the last partial wave's pieces in the plain kernel
    ksplit = KernelOptions(stream_k=True)  # the K-split tail (on 112 programs: 16-32 tail tiles)
    cases = [
        ("all_reduce", 1, 3000, 5120, 1000, "row_band", True, KernelOptions()),
        ("all_reduce", 1, 3000, 5120, 1000, "row_band", True, split),
        ("all_reduce", 1, 1000, 3000, 1040, "tile_major", True, split),
        ("reduce_scatter", 2, 4096, 2048, 1024, "row_band", True, split),
        ("reduce_scatter", 2, 4096, 2048, 1024, "tile_major", True, KernelOptions()),
        ("all_reduce", 1, 2900, 5120, 1000, "row_band", True, ksplit),  # 920 tiles: 24 in 4 parts
        ("all_reduce", 1, 1000, 2200, 1040, "tile_major", True, ksplit),  # 144 tiles: 32 in 3 parts
        ("reduce_scatter", 2, 4096, 2304, 1024, "row_band", True, ksplit),  # 576 tiles: 16 in 4 parts
        ("reduce_scatter", 2, 2000, 2048, 1024, "row_band", False, KernelOptions()),  # 1000 rows a shard
        ("all_reduce", 1, 1000, 3000, 1030, "row_band", False, KernelOptions()),  # K not 16-byte aligned
    ]
    for collective, world, m, n, k, layout, runs, options in cases:
        gen = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        b = BOperand.of(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16).t())
        s = _schedule(collective, world, m, n, k, tile, layout)
        plan = make_plan(s, m, n, k, sm_count=sms)
        ug = torch.tensor(plan.unit_group(), dtype=torch.int32, device="cuda")
        gi = torch.tensor([x for p in plan.group_info() for x in p], dtype=torch.int32, device="cuda")
        bufs = []
        for t in (tile, plain):
            buf = torch.full((plan.buffer_numel(),), float("nan"), dtype=torch.bfloat16, device="cuda")
            counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
            signalled_gemm(
                a, b, buf, plan, t, counters=counters, unit_group=ug, group_info=gi, options=options
            )
            torch.cuda.synchronize()
            want_counts = [plan.group_tiles(g) for g in range(plan.num_groups)]
            assert counters.tolist() == want_counts, (collective, m, t)
            bufs.append(buf)
        assert (pingpong_blocker(a, b, bufs[0], plan, tile) == "") == runs, (collective, m, n, k, layout)
        if options is ksplit:  # the case runs the K-split tail
            assert tail_plan(plan.num_tiles, plan.grid, tile, k, m * n * k, True).parts > 0, (m, n, k)
        # both in the plan's destination order; tile_major's edge tiles (one shard here) hold
        # padding that each kernel fills its own way, so those compare restored to (M, N)
        got, want = bufs[0][: m * n], bufs[1][: m * n]
        if layout == "tile_major":
            assert plan.shards == 1 or (m // world % tile.block_m, n % tile.block_n) == (0, 0)
            if plan.shards == 1:
                got, want = (_restored(x, plan, tile, m, n) for x in bufs)
        assert not got.isnan().any(), (collective, m, n, k, layout)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < TOL["bfloat16"]


def _run_layout(a, b, tile, layout, options):
    """The signalled GEMM into a NaN-poisoned buffer in ``layout``, restored to (M, N)."""
    m, k = a.shape
    n = b.shape[1]
    s = _schedule("all_reduce", 1, m, n, k, tile, layout)
    plan = make_plan(s, m, n, k, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    buf = torch.full((plan.buffer_numel(),), float("nan"), dtype=a.dtype, device="cuda")
    counters = torch.zeros(8, dtype=torch.int32, device="cuda")
    ug = torch.tensor(plan.unit_group(), dtype=torch.int32, device="cuda")
    gi = torch.tensor([x for p in plan.group_info() for x in p], dtype=torch.int32, device="cuda")
    signalled_gemm(
        a, BOperand.of(b), buf, plan, tile, counters=counters, unit_group=ug, group_info=gi, options=options
    )
    if layout == "row_band":
        return buf.view(m, n)
    out = torch.full((m, n), float("nan"), dtype=a.dtype, device="cuda")
    restore_tile_major(buf, out, plan, tile)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("tile", GPU_TILES[:2], ids=["128x256", "64x64"])
def test_compiled_rows_gemm(tile):
    """The copy engine's tiled mode kernel (``rows_gemm``) on one GPU: phase 1 writes and counts
    per row group; phase 2 (ready flags already set) adds what is there and stores it twice."""
    rows, n, k = 1000, 3000, 1040
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    b = BOperand.of(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16).t())
    tiles_m, tiles_n = cdiv(rows, tile.block_m), cdiv(n, tile.block_n)
    row_group = torch.tensor([0 if i < tiles_m // 2 else 1 for i in range(tiles_m)], dtype=torch.int32).cuda()
    counters = torch.zeros(2, dtype=torch.int32, device="cuda")
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    rows_gemm(a, b, out, tile, grid=100, row_group=row_group, counters=counters)
    ref = a.float() @ b.tensor.float()
    assert not out.isnan().any() and ((out.float() - ref).norm() / ref.norm()).item() < TOL["bfloat16"]
    assert counters.tolist() == [(tiles_m // 2) * tiles_n, (tiles_m - tiles_m // 2) * tiles_n]
    pulled = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16)
    dst, copy = pulled.clone(), torch.full_like(pulled, float("nan"))
    ready = torch.ones(2, dtype=torch.int32, device="cuda")
    rows_gemm(a, b, dst, tile, grid=100, row_group=row_group, ready=ready, out2=copy)
    want = ref + pulled.float()
    assert ((dst.float() - want).norm() / want.norm()).item() < TOL["bfloat16"] and torch.equal(dst, copy)


@triton.jit
def _acquire_then_copy(counter, target, src, dst, n, BLOCK: tl.constexpr):
    """Spin until ``counter`` reaches ``target`` (acquire, GPU scope), then copy src[:n] to dst
    from L2 (``.cg``), each program a strided share: another SM reading as soon as it may."""
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen - target < 0:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n, cache_modifier=".cg"), mask=offs < n)


# Repetitions of the visibility test: each poisons the output, runs the GEMM and reads every group
# the moment its counter shows it complete.
VISIBILITY_REPS = 300


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["row_band", "tile_major"])
@pytest.mark.parametrize(
    "options",
    [
        KernelOptions(),
        KernelOptions(stream_k=True),
        KernelOptions(split_tail=True),
        "pingpong",  # the ping-pong kernel (its own epilogue: TMA stores, the signal at once)
        "pingpong_split_tail",  # the same, its last partial wave split into the plain kernel's pieces
        "pingpong_k_split",  # the same, its last partial wave in K parts (48 tail tiles in halves)
    ],
    ids=[
        "whole_waves",
        "stream_k",
        "split_tail",
        "pingpong",
        "pingpong_split_tail",
        "pingpong_k_split",
    ],
)
def test_a_tile_is_visible_to_another_stream_once_its_counter_shows_it(layout, options):
    """The signal's guarantee: a reader on another stream that acquires a group's counter at its
    target reads every element of the group's tiles. The output is poisoned (NaN) before every
    repetition and two input sets alternate; the whole waves alone (each tile signalled at the
    next tile's epilogue), with the stream-K tail (its tiles finished by whichever program arrives
    last) or with the split tail (256 tiles on 116 programs: the last 24 cut into quarters, each
    tile signalled by its last piece), both tails in the whole waves' launch; each group (one tile
    row, or 8 tiles) is read by a spinning kernel on the SMs left free, so it reads within
    microseconds of the last tile's release. The ping-pong kernel signals each tile from the
    warpgroup that stored it, while the other warpgroup runs its main loop; a tile of its K-split
    tail from the warpgroup whose part arrived last, after adding the others' parts."""
    m, n, k = 2048, 4096, 1024
    tile = Tile(block_m=128, block_n=256, block_k=64, group_m=1, num_warps=8, num_stages=3)
    if not isinstance(options, KernelOptions):  # the ping-pong cases
        tile = dataclasses.replace(PINGPONG_TILES[0], group_m=1)
        options = {
            "pingpong": KernelOptions(stream_k=False, split_tail=False),
            "pingpong_split_tail": KernelOptions(split_tail=True),
            "pingpong_k_split": KernelOptions(stream_k=True),
        }[options]
    mt, nt = cdiv(m, tile.block_m), cdiv(n, tile.block_n)
    unit = nt if layout == "row_band" else 8
    s = Schedule(
        collective="all_reduce", dtype="bfloat16", world_size=1, problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=tile, sms_free=16, signal_tiles=unit, groups=(1,) * cdiv(mt * nt, unit), layout=layout
        ),
    )  # fmt: skip
    plan = make_plan(s, m, n, k, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    ug = torch.tensor(plan.unit_group(), dtype=torch.int32, device="cuda")
    gi = torch.tensor([x for p in plan.group_info() for x in p], dtype=torch.int32, device="cuda")
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
    buf = torch.empty(plan.buffer_numel(), dtype=torch.bfloat16, device="cuda")
    snap = torch.empty_like(buf)
    gen = torch.Generator(device="cuda").manual_seed(11)
    sets = []
    for _ in range(2):
        a = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        b = BOperand.of(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16).t())
        sets.append((a, b))

    def gemm(a, b):
        signalled_gemm(
            a, b, buf, plan, tile, counters=counters, unit_group=ug, group_info=gi, options=options
        )

    if tile.pingpong:  # the case tests the ping-pong kernel, not the plain one it falls back to
        from fo_kernels.gemm.pingpong import pingpong_blocker

        assert pingpong_blocker(*sets[0], buf, plan, tile) == ""

    targets = [0] * plan.num_groups
    reader = torch.cuda.Stream(priority=-1)
    bad = []
    for rep in range(VISIBILITY_REPS):
        a, b = sets[rep % 2]
        buf.fill_(float("nan"))
        snap.fill_(float("nan"))
        reader.wait_stream(torch.cuda.current_stream())
        gemm(a, b)
        with torch.cuda.stream(reader):
            for g in range(plan.num_groups):
                targets[g] += plan.group_tiles(g)
                c0, c1 = plan.chunk_range(g)
                _acquire_then_copy[(4,)](counters[g:], targets[g], buf[c0:], snap[c0:], c1 - c0, BLOCK=1024)
        torch.cuda.current_stream().wait_stream(reader)
        if not torch.equal(snap, buf):  # what the reader saw is what the GEMM left there
            bad.append(rep)
        if rep < len(sets):  # and that is the product (both input sets)
            ref = a.float() @ b.tensor.float()
            assert not buf.isnan().any()
            got = buf.view(m, n) if layout == "row_band" else _restored(buf, plan, tile, m, n)
            assert ((got.float() - ref).norm() / ref.norm()).item() < TOL["bfloat16"]
    assert not bad, f"{len(bad)} of {VISIBILITY_REPS} repetitions read a group before its data landed"


@pytest.mark.gpu
def test_profile_samples_replayed_from_cuda_graphs():
    """``fo-tune profile --timing graphs`` (``GemmGridsTask(graphs=True)``): the signalled GEMM is
    replayed from CUDA graphs with each kind of last wave the rules pick on a 132-SM H200 (whole
    waves, the fused split's arrival counts and fused stream-K's partial sums, both allocated in
    the graph's pool); each output, poisoned before the timed replays, is checked after them (a
    wrong one raises). The graphed time of a short call, whose eager calls the host can bound, is
    not above its eager time."""
    from fo_kernels.plan import tail_plan
    from fo_tune.ranks.gemm import GemmGridsTask
    from fo_tune.ranks.pool import RankContext

    tile = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4)
    ctx = RankContext(rank=0, world_size=1, device=torch.device("cuda"), backend="nccl")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kinds = set()
    for (m, n, k), frees in (
        ((2048, 4096, 4096), (0,)),
        ((4096, 8192, 4096), (0, 8)),
        ((4096, 8192, 14336), (12,)),
    ):
        configs = tuple((tile, r) for r in frees)
        graphed = GemmGridsTask(m, n, k, configs, "bfloat16", warmup=2, reps=4, graphs=True).run(ctx)
        for row in graphed["rows"]:
            assert row["rel_err"] < TOL["bfloat16"] and row["timing"].median_ms > 0, row
            tail = tail_plan(cdiv(m, 128) * cdiv(n, 256), row["grid"], tile, k, m * n * k)
            kinds.add("split" if tail.split != (1, 1) else "stream_k" if tail.share else "waves")
        if (m, n, k) == (2048, 4096, 4096):
            eager = GemmGridsTask(m, n, k, configs, "bfloat16", warmup=2, reps=4).run(ctx)
            ratio = graphed["rows"][0]["timing"].median_ms / eager["rows"][0]["timing"].median_ms
            assert ratio < 1.05, ratio  # the GPU's own time: no slower than the host-issued calls
    if sms == 132:
        assert kinds == {"waves", "split", "stream_k"}, kinds


def _restored(buf, plan, tile, m, n):
    out = torch.full((m, n), float("nan"), dtype=buf.dtype, device=buf.device)
    restore_tile_major(buf, out, plan, tile)
    return out


@pytest.mark.multigpu
def test_both_ops_over_nccl():
    from fo_tune.ranks.launch import run_ranks

    world, cases = 2, []
    for i, (collective, layout) in enumerate(
        [(c, lay) for c in ("all_reduce", "reduce_scatter") for lay in ("row_band", "tile_major")]
    ):
        for m, n, k in [(4096, 4096, 1024), (258, 250, 70)]:
            s = _schedule(collective, world, m, n, k, GPU_TILES[1], layout)
            cases.append(Case(collective, m, n, k, "bfloat16", i % 2 == 0, s.to_dict(), 10 * i + m % 7))
    results = run_ranks(run_cases, world, cases, backend="nccl", timeout_s=600)
    for per_rank in results:
        for r in per_rank:
            assert not r["nan"] and r["err"] < 1e-2, r


def _copy_engine(collective, m, n, k, chunks, dtype="bfloat16", tile=None):
    return Schedule(
        collective=collective,
        dtype=dtype,
        world_size=2,
        problem=Problem(m=m, n=n, k=k),
        settings=CopyEngineSettings(mode="tiled" if tile else "ring", weights=(1,) * chunks, tile=tile),
    ).to_dict()


@pytest.mark.multigpu
def test_copy_engine_ops():
    """engine copy_engine on two GPUs: both collectives, odd shapes, 1-6 chunks, three dtypes,
    both B layouts; the symmetric buffers grow (small, large, then small shapes again)."""
    from dist_cases import run_back_to_back
    from fo_tune.ranks.launch import run_ranks

    shapes = [(258, 250, 70), (2048, 4096, 4096), (1000, 3000, 1040), (4, 8, 8), (4096, 8192, 4096)]
    cases = []
    for i, ((m, n, k), collective, chunks) in enumerate(
        (s, c, ch) for s in shapes for c in ("all_reduce", "reduce_scatter") for ch in (1, 2, 3, 6)
    ):
        dtype = ("bfloat16", "float16", "float32")[i % 3]
        cases.append(
            Case(
                collective,
                m,
                n,
                k,
                dtype,
                i % 2 == 0,
                _copy_engine(collective, m, n, k, chunks, dtype),
                7 * i,
            )
        )
    odd = Case("all_reduce", 257, 130, 64, "bfloat16", True, _copy_engine("all_reduce", 257, 130, 64, 4), 5)
    once = run_ranks(run_cases, 2, [*cases, odd], backend="nccl", timeout_s=600)
    again = run_ranks(run_back_to_back, 2, [*cases, odd] * 2, backend="nccl", timeout_s=600)
    for per_rank in [*once, *again]:
        for r in per_rank:
            assert not r["nan"] and r["err"] < TOL[r["case"].dtype], r


def _engine_cases(specs, first_seed: int) -> list:
    """Cases with an ``engine: copy_engine`` schedule from (collective, m, n, k, dtype, B as an
    (N, K) weight's view, chunks[, tile: the tiled mode]) specs, seeded from ``first_seed`` on."""
    return [
        Case(c, m, n, k, dt, kmajor, _copy_engine(c, m, n, k, chunks, dt, *tile), seed)
        for seed, (c, m, n, k, dt, kmajor, chunks, *tile) in enumerate(specs, start=first_seed)
    ]


@pytest.mark.multigpu
def test_copy_engine_tiled_ops():
    """The copy engine's tiled mode (a persistent Triton GEMM per phase, signalled per chunk) on
    two GPUs: both collectives, odd shapes (rows, columns and chunks that end mid-tile), 1-3
    chunks, three dtypes, both B layouts, a small and a large tile; once, then every case twice
    back to back (the engine's own graphs replay by then)."""
    from dist_cases import run_back_to_back
    from fo_tune.ranks.launch import run_ranks

    shapes = [(258, 250, 70), (2048, 4096, 4096), (1000, 3000, 1040), (4, 8, 8), (4096, 8192, 4096)]
    specs = []
    for i, ((m, n, k), c, ch) in enumerate(
        (s, c, ch) for s in shapes for c in ("all_reduce", "reduce_scatter") for ch in (1, 2, 3)
    ):
        dtype = ("bfloat16", "float16", "float32")[i % 3]
        # float32 takes the small tile: 128x256x64 in 3 stages needs 288 KiB of shared memory
        tile = GPU_TILES[1] if dtype == "float32" or i % 2 else GPU_TILES[2]
        specs.append((c, m, n, k, dtype, i % 2 == 0, ch, tile))
    specs.append(("all_reduce", 257, 130, 64, "bfloat16", True, 4, GPU_TILES[1]))
    cases = _engine_cases(specs, first_seed=40)
    once = run_ranks(run_cases, 2, cases, backend="nccl", timeout_s=600)
    again = run_ranks(run_back_to_back, 2, cases * 2, backend="nccl", timeout_s=600)
    for per_rank in [*once, *again]:
        for r in per_rank:
            assert not r["nan"] and r["err"] < TOL[r["case"].dtype], r


@pytest.mark.multigpu
def test_copy_engine_all_gather():
    """The copy engine's AllGather + GEMM on two GPUs: odd shapes, 1-6 chunks, three dtypes; the
    gathered A equals every rank's shard, the product the float64 one, on every call (eager, then
    replayed from the engine's own graphs, which the last calls of each case use)."""
    from dist_cases import copy_engine_all_gather
    from fo_tune.ranks.launch import run_ranks

    shapes = [(258, 250, 70), (2048, 4096, 4096), (1000, 3000, 1040), (4, 8, 8)]
    cases = [
        (m, n, k, ("bfloat16", "float16", "float32")[i % 3], chunks, 70 + i)
        for i, ((m, n, k), chunks) in enumerate((s, ch) for s in shapes for ch in (1, 2, 3, 6))
    ]
    per_rank = run_ranks(copy_engine_all_gather, 2, cases, backend="nccl", timeout_s=300)
    for rows in per_rank:
        for r in rows:
            assert r["same"] and not r["nan"] and r["err"] < TOL[r["case"][3]], r
        assert all(r["replayed"] for r in rows if r["step"] == rows[-1]["step"]), rows


@pytest.mark.multigpu
def test_copy_engine_graphs_repeated_eager_calls():
    """Eager copy-engine calls whose addresses repeat are replayed from the engine's own graph
    (from the GRAPH_AFTER_CALLS-th call on), with every output right; a rank issuing eagerly and
    a rank replaying stay in step; growing the buffers drops the graphs and later calls are right."""
    from dist_cases import copy_engine_auto_graph
    from fo_kernels.engines.copy_engine import GRAPH_AFTER_CALLS
    from fo_tune.ranks.launch import run_ranks

    cases = _engine_cases(
        [
            ("all_reduce", 1024, 768, 512, "bfloat16", True, 2),
            ("reduce_scatter", 512, 640, 256, "float16", False, 3),
            ("all_reduce", 1024, 768, 512, "bfloat16", False, 2, GPU_TILES[1]),
        ],
        first_seed=11,
    )
    per_rank = run_ranks(copy_engine_auto_graph, 2, cases, backend="nccl", timeout_s=300)
    for rank, rows in enumerate(per_rank):
        assert len(rows) == (2 * len(cases) + 2) * (GRAPH_AFTER_CALLS + 3)
        for r in rows:
            assert not r["nan"] and r["err"] < TOL[r["case"].dtype], (rank, r)
        per_case = GRAPH_AFTER_CALLS + 3  # rows come case by case, in calls of one case
        for first in range(0, len(rows), per_case):
            phase = rows[first]["phase"]
            replays = [r["replayed"] for r in rows[first : first + per_case]]
            if phase == 1 and rank == 1:  # graph_after = 0: every call issued eagerly
                assert sum(replays) == 0, (rank, phase, replays)
            else:  # the operands' and (freed) output's blocks repeat: the last calls replay
                assert replays[0] == 0 or phase == 1, (rank, phase, replays)
                assert replays[-1] == 1, (rank, phase, replays)


@pytest.mark.multigpu
def test_fallback_graphs_repeated_calls():
    """``overlap: false`` calls whose addresses repeat are replayed from the runtime's own graphs
    (from the GRAPH_AFTER_CALLS-th call on), with every output right: beside a rank issuing
    eagerly, on another stream, after the ReduceScatter scratch grows, inside a caller's graph."""
    from dist_cases import fallback_auto_graph, fallback_cases
    from fo_kernels.graphs import GRAPH_AFTER_CALLS
    from fo_tune.ranks.launch import run_ranks

    cases = fallback_cases(first_seed=41)
    per_rank = run_ranks(fallback_auto_graph, 2, cases, backend="nccl", timeout_s=300)
    per_case = GRAPH_AFTER_CALLS + 3
    for rank, rows in enumerate(per_rank):
        for r in rows:
            assert not r["nan"] and r["err"] < TOL[r["case"].dtype], (rank, r)
        calls = [r for r in rows if r["phase"] < 5]
        assert len(calls) == (2 * len(cases) + 3) * per_case and len(rows) == len(calls) + 2
        for first in range(0, len(calls), per_case):
            phase = calls[first]["phase"]
            replays = [r["replayed"] for r in calls[first : first + per_case]]
            if phase == 1 and rank == 1:
                assert sum(replays) == 0, (rank, phase, replays)
            elif phase in (0, 3):  # new keys (phase 3: the scratch grew, the graphs were dropped)
                assert replays == [0] * (GRAPH_AFTER_CALLS - 1) + [1] * (per_case - GRAPH_AFTER_CALLS + 1), (
                    rank,
                    phase,
                    replays,
                )
            else:  # graphs of these keys exist (phase 4: its ReduceScatter's was dropped in phase 3)
                assert replays[-1] == 1, (rank, phase, replays)


@pytest.mark.multigpu
def test_copy_engine_in_a_cuda_graph():
    """The copy engine captured in a CUDA graph: replays on new operands, eager calls between them."""
    from dist_cases import copy_engine_graph
    from fo_tune.ranks.launch import run_ranks

    specs = [
        ("all_reduce", 1024, 768, 512, "bfloat16", True, 3),
        ("reduce_scatter", 512, 640, 256, "float16", False, 2),
        ("all_reduce", 257, 130, 64, "float32", False, 1),
        ("reduce_scatter", 1024, 768, 512, "bfloat16", True, 2, GPU_TILES[2]),
    ]
    cases = _engine_cases(specs, first_seed=3)
    per_rank = run_ranks(copy_engine_graph, 2, cases, backend="nccl", timeout_s=300)
    results = [r for rank in per_rank for r in rank]
    assert len(results) == 2 * len(cases) * 3 * 2
    for r in results:
        assert not r["nan"] and r["err"] < TOL[r["case"].dtype], r
