"""The signalled persistent GEMM against torch.matmul: odd shapes, layouts, granularities, B layouts.

Outputs are poisoned with NaN before every launch; every shard is reassembled the way the
collectives would see it (chunk -> this rank's part -> restore), and the counters must equal the
number of tiles of each group.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.gemm import (
    DEFAULT_OPTIONS,
    BOperand,
    KernelOptions,
    restore_tile_major,
    signalled_gemm,
    tma_usable,
)
from fo_kernels.gemm.tail import _sk_step
from fo_kernels.plan import (
    SPLIT_MIN_MACS,
    STREAM_K_MAX_PARTS,
    STREAM_K_MIN_SAVED_BLOCKS,
    TailPlan,
    cdiv,
    make_plan,
    stream_k_split,
    tail_plan,
    tail_split,
)
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.tile import Tile
from fo_tune.engines.triton.defaults import split_decreasing

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}
TILE = Tile(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)


def _schedule(collective, world, m, n, k, layout, unit_mult, num_groups, tile=TILE):
    shards = world if collective == "reduce_scatter" else 1
    mt, nt = cdiv(m // shards, tile.block_m), cdiv(n, tile.block_n)
    unit = shards * unit_mult * (tile.group_m * nt if layout == "row_band" else 1)
    groups = split_decreasing(cdiv(shards * mt * nt, unit), num_groups)
    return Schedule(
        collective=collective,
        dtype="float32",
        world_size=world,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(tile=tile, signal_tiles=unit, groups=groups, layout=layout, wait_mode="spin"),
    )


def _operands(m, n, k, dtype, kmajor, gen):
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = (
        torch.randn(n, k, generator=gen).to(dtype).t()
        if kmajor
        else torch.randn(k, n, generator=gen).to(dtype)
    )
    return a, b


def run_and_reassemble(schedule, a, b, options=DEFAULT_OPTIONS, tile=TILE, sm_count=3):
    m, k = a.shape
    n = b.shape[1]
    plan = make_plan(schedule, m, n, k, sm_count=sm_count)
    buf = torch.full((plan.buffer_numel(),), float("nan"), dtype=a.dtype)
    counters = torch.zeros(64, dtype=torch.int32)
    ug = torch.tensor(plan.unit_group(), dtype=torch.int32)
    gi = torch.tensor([x for p in plan.group_info() for x in p], dtype=torch.int32)
    signalled_gemm(
        a, BOperand.of(b), buf, plan, tile, counters=counters, unit_group=ug, group_info=gi, options=options
    )
    assert counters[: plan.num_groups].tolist() == [plan.group_tiles(g) for g in range(plan.num_groups)]
    assert not counters[plan.num_groups :].any()
    shards = []
    for s in range(plan.shards):
        out = torch.full((plan.rows_per_shard, n), float("nan"), dtype=a.dtype)
        part = (
            torch.full((plan.tiles_per_shard * tile.block_m * tile.block_n,), float("nan"), dtype=a.dtype)
            if plan.layout == "tile_major"
            else out.view(-1)
        )
        for g in range(plan.num_groups):
            (c0, c1), (p0, p1) = plan.chunk_range(g), plan.part_range(g)
            part[p0:p1] = buf[c0:c1][s * (p1 - p0) : (s + 1) * (p1 - p0)]
        if plan.layout == "tile_major":
            restore_tile_major(part, out, plan, tile)
        shards.append(out)
    return torch.cat(shards)


# On 3 programs with TILE (16x32x16, GROUP_M 2): one tile, smaller than the block every way; one
# tile row in a partial second wave (masked loads, K past its last whole block); 5 tile rows (a
# partial band) in whole waves, with TMA loads clipped at M and N where B is a weight's transpose
# and masked loads where B is row-major (N unaligned); whole tiles, TMA loads; masked loads (odd
# K) over a partial band, a partial last wave, partial last tile row and column and several K
# blocks. (258, 130, 70) and (130, 66, 40), 85 and 27 tiles and most of this test's time, took
# no path that (70, 40, 37) and (66, 66, 40) do not.
SHAPES = [(1, 1, 1), (2, 7, 5), (7, 130, 33), (66, 66, 40), (64, 64, 64), (70, 40, 37)]


@pytest.mark.parametrize(
    "collective, layout",
    list(itertools.product(["all_reduce", "reduce_scatter"], ["row_band", "tile_major"])),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kmajor", [False, True], ids=["b_row_major", "b_weight_t"])
def test_gemm_matches_matmul(collective, layout, dtype, kmajor):
    gen = torch.Generator().manual_seed(hash((collective, layout, str(dtype), kmajor)) % 2**31)
    world = 2
    for m, n, k in SHAPES:
        if collective == "reduce_scatter":
            m *= world
        a, b = _operands(m, n, k, dtype, kmajor, gen)
        for unit_mult, num_groups in ((1, 3), (2, 1)):
            got = run_and_reassemble(
                _schedule(collective, world, m, n, k, layout, unit_mult, num_groups), a, b
            )
            ref = a.double() @ b.double()
            assert not got.isnan().any(), f"unwritten output at {m}x{n}x{k}"
            err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            assert err < TOL[dtype], f"{m}x{n}x{k}: relative error {err:.2e}"


NARROW = Tile(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)


@pytest.mark.parametrize(
    "options, tile",
    [
        (KernelOptions(stream_k=True), TILE),
        (KernelOptions(stream_k=False, split_tail=False), TILE),
        (DEFAULT_OPTIONS, NARROW),
    ],
    ids=["stream_k", "whole_last_wave", "one_epilogue_piece"],
)
def test_tails_and_epilogues_match_matmul(options, tile):
    """Forced stream-K, the last partial wave left whole, and a tile too narrow to store in two
    column pieces, on both layouts and collectives (fp32, TMA-aligned: the flattened loop)."""
    gen = torch.Generator().manual_seed(3)
    for collective, layout in itertools.product(["all_reduce", "reduce_scatter"], ["row_band", "tile_major"]):
        m, n, k = (250, 60, 48) if collective == "reduce_scatter" else (115, 60, 48)
        a, b = _operands(m, n, k, torch.float32, True, gen)
        assert tma_usable(a, BOperand.of(b))
        s = _schedule(collective, 2, m, n, k, layout, 1, 3, tile)
        plan = make_plan(s, m, n, k, sm_count=3)
        assert plan.num_tiles % plan.grid  # a last partial wave
        got = run_and_reassemble(s, a, b, options, tile=tile)
        ref = a.double() @ b.double()
        assert not got.isnan().any()
        assert ((got.double() - ref).norm() / ref.norm()).item() < TOL[torch.float32]


@pytest.mark.parametrize(
    "collective, layout",
    list(itertools.product(["all_reduce", "reduce_scatter"], ["row_band", "tile_major"])),
)
@pytest.mark.parametrize(
    "block_m, want, fused",
    [(16, (1, 2), True), (32, (2, 2), True), (32, (1, 2), False)],
    ids=["halves_fused", "quarters_fused", "halves_own_launch"],
)
def test_split_tail_matches_matmul(collective, layout, block_m, want, fused):
    """The last partial wave cut into pieces (``KernelOptions(split_tail=True)``): 16x32 tiles into
    two 16x16 halves (TMA loads), 32x32 tiles into four 16x16 quarters or two 32x16 halves (masked
    pointer loads: B's rows of 98 floats are not 16-byte aligned), on odd shapes (rows and columns
    past the edge), both layouts, in the whole waves' launch where the pieces fit the grid, else
    (a forced split's halves outnumbering the programs) in a launch of their own; each group's
    counter ends at its tile count (one signal a tile, sent by its last piece)."""
    tile = Tile(block_m=block_m, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
    gen = torch.Generator().manual_seed(block_m)
    m, n, k = (260, 98, 40) if collective == "reduce_scatter" else (130, 98, 40)
    a, b = _operands(m, n, k, torch.float32, block_m == 16, gen)  # 32 rows: B's rows unaligned
    assert tma_usable(a, BOperand.of(b)) == (block_m == 16)
    s = _schedule(collective, 2, m, n, k, layout, 1, 3, tile)
    pieces = want[0] * want[1]
    sms = next(
        c
        for c in range(3, 64)
        if tail_split(num := make_plan(s, m, n, k, sm_count=c).num_tiles, c, tile, True) == want
        and (num % c * pieces <= c) == fused
    )
    plan = make_plan(s, m, n, k, sm_count=sms)
    assert plan.num_tiles % plan.grid and plan.num_tiles > plan.grid  # a partial last wave
    options = KernelOptions(split_tail=True)
    got = run_and_reassemble(s, a, b, options, tile=tile, sm_count=sms)
    ref = a.double() @ b.double()
    assert not got.isnan().any()
    assert ((got.double() - ref).norm() / ref.norm()).item() < TOL[torch.float32]


@triton.jit
def _sk_steps_kernel(out, sk_iters, tail_iters, k_tiles):
    """Every program's two stream-K steps as the tail kernel takes them (``_sk_step``), 7 ints each."""
    pid = tl.program_id(0)
    for j in tl.static_range(2):
        step = _sk_step(pid, j, sk_iters, tail_iters, k_tiles)
        for f in tl.static_range(7):
            tl.store(out + (pid * 2 + j) * 7 + f, step[f].to(tl.int32))


def _sk_runs(tail: int, k_tiles: int, share: int) -> list[list[tuple[int, int, int]]]:
    """Per program, its K blocks in the order it reads them: (tail tile, K block, slot)."""
    programs = cdiv(tail * k_tiles, share)
    got = torch.full((programs * 2 * 7,), -1, dtype=torch.int32)
    _sk_steps_kernel[(programs,)](got, share, tail * k_tiles, k_tiles)
    runs = []
    for p in range(programs):
        run = []
        for j in range(2):
            valid, tile, slot, k0, k1, k2, k3 = got[(p * 2 + j) * 7 : (p * 2 + j + 1) * 7].tolist()
            if valid:
                run += [(tile, kk, slot) for kk in [*range(k0, k1), *range(k2, k3)]]
        runs.append(run)
    return runs


@pytest.mark.parametrize(
    "tail, k_tiles, share", [(3, 10, 6), (84, 108, 69), (100, 64, 49), (8, 64, 16), (5, 7, 7), (3, 12, 9)]
)
def test_stream_k_runs_cover_the_tail_once(tail, k_tiles, share):
    """The stream-K tail reads every tail tile's K blocks once, each program's run of ``share``
    blocks within at most two tiles, its part of its first tile in slot 0 and of the next in slot
    1 (where the last of a tile's programs finds them). In its aligned order, where a tile has at
    most two parts, a program reads at step tau K block tau, tau + k_tiles - share or tau + share
    of its tile: three offsets for all programs, against one a program were each run read in
    order from where it starts."""
    runs = _sk_runs(tail, k_tiles, share)
    blocks = sorted((tile, kk) for run in runs for tile, kk, _slot in run)
    assert blocks == [(i, kk) for i in range(tail) for kk in range(k_tiles)]
    for p, run in enumerate(runs):
        assert len(run) == min(share, tail * k_tiles - p * share)
        first = p * share // k_tiles
        assert all(tile == first + slot for tile, _kk, slot in run)
        in_order = {(i // k_tiles, i % k_tiles) for i in range(p * share, p * share + len(run))}
        assert {(tile, kk) for tile, kk, _slot in run} == in_order  # the same blocks, reordered
    whole = [run for run in runs if len(run) == share]  # (the last program's run may be shorter)
    aligned = {(kk - tau) % k_tiles for run in whole for tau, (_t, kk, _s) in enumerate(run)}
    in_order = {p * share % k_tiles for p, run in enumerate(runs) if len(run) == share}
    if 2 * share >= k_tiles:
        assert aligned <= {0, k_tiles - share, share}
    assert len(aligned) <= len(in_order)


def test_stream_k_tail_with_stretches_inside_a_tile():
    """The stream-K tail where a program's run lies inside a tile and is read in two runs: 8 tiles
    of 16x32 on 5 programs leave 3 tail tiles of 10 K blocks, 6 per program (program 2 reads
    blocks 6-7, then 2-5 of tail tile 1); odd K (masked pointer loads) and TMA-aligned."""
    for k, kmajor in ((160, True), (150, False)):
        gen = torch.Generator().manual_seed(k)
        a, b = _operands(64, 64, k, torch.float32, kmajor, gen)
        s = _schedule("all_reduce", 2, 64, 64, k, "tile_major", 1, 3)
        plan = make_plan(s, 64, 64, k, sm_count=5)
        assert (plan.num_tiles, plan.grid) == (8, 5) and stream_k_split(8, 5, 10, force=True) == (5, 6)
        assert _sk_runs(3, 10, 6)[2][:2] == [(1, 6, 0), (1, 7, 0)]
        ref = a.double() @ b.double()
        got = run_and_reassemble(s, a, b, KernelOptions(stream_k=True), sm_count=5)
        assert not got.isnan().any()
        assert ((got.double() - ref).norm() / ref.norm()).item() < TOL[torch.float32]


def test_tail_split_rule():
    """Quarters where four pieces a tail tile fit in the grid, halves (across the longer side) where
    two do, nothing for a tail of more than half the grid, whole waves, a single wave or a call of
    fewer than SPLIT_MIN_MACS multiply-adds; pieces are at least SPLIT_MIN_BLOCK (64: a 64x64 tile
    is not cut) unless forced."""
    big = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4)
    wide = Tile(block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)
    small = Tile(block_m=64, block_n=64, block_k=64, group_m=2, num_warps=4, num_stages=3)
    assert tail_split(256, 124, big, macs=SPLIT_MIN_MACS - 1) == (1, 1)  # too short a call to pay
    assert tail_split(256, 124, big, True, SPLIT_MIN_MACS - 1) == (2, 2)
    assert tail_split(256, 124, big) == (2, 2)  # 8 tail tiles, 32 quarters
    assert tail_split(256, 116, big) == (2, 2)  # 24 tail tiles, 96 quarters
    assert tail_split(1024, 124, big) == (1, 2)  # 32 tail tiles: 128 quarters would not fit
    assert tail_split(1024, 124, wide) == (2, 1)
    assert tail_split(896, 120, big) == (1, 2)  # 56 tail tiles on 120
    assert tail_split(1024, 132, big) == (1, 1)  # 100 tail tiles: more than half the grid
    assert tail_split(1024, 132, big, force=True) == (1, 2)
    assert tail_split(1024, 128, big) == (1, 1) and tail_split(100, 132, big) == (1, 1)
    assert tail_split(256, 124, small) == (1, 1) and tail_split(256, 124, small, force=True) == (2, 2)


def test_tail_plan_takes_the_split_first_unless_stream_k_is_forced():
    """The launcher's and the model's choice of tail: the split where its rule (or ``split_tail``)
    cuts, else stream-K by its rule (or forced); ``stream_k=True`` wins over the split and
    ``stream_k=False`` leaves whole waves."""
    big = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4)
    large, small = SPLIT_MIN_MACS, SPLIT_MIN_MACS - 1
    assert tail_plan(1024, 124, big, 14336, large) == TailPlan((1, 2), 992, 0)  # 32 tail tiles in halves
    assert tail_plan(1024, 124, big, 14336, large, stream_k=True) == TailPlan((1, 1), 992, 58)
    assert tail_plan(1024, 124, big, 14336, large, split_tail=False) == TailPlan((1, 1), 992, 58)
    assert tail_plan(1024, 124, big, 14336, small) == TailPlan((1, 1), 992, 58)  # stream-K's rule
    assert tail_plan(1024, 124, big, 4096, small) == TailPlan((1, 1), 1024, 0)  # K too short for it
    assert tail_plan(1024, 124, big, 4096, small, split_tail=True) == TailPlan((1, 2), 992, 0)
    assert tail_plan(1024, 124, big, 14336, small, stream_k=False) == TailPlan((1, 1), 1024, 0)


def test_stream_k_split():
    """The measured rule: a last, partial wave is shared out only when that saves each program at
    least STREAM_K_MIN_SAVED_BLOCKS of a whole tile's K blocks, (1 - tail / grid) x K blocks
    (``force`` shares out any partial wave); no tail tile is cut into more than STREAM_K_MAX_PARTS
    parts."""
    assert stream_k_split(1024, 128, 224) == (1024, 0)  # whole waves
    assert stream_k_split(100, 132, 224) == (100, 0)  # fewer tiles than programs: no wave to finish
    assert stream_k_split(1024, 124, 224) == (992, 58)  # 32 tail tiles x 224 K blocks over 124
    assert stream_k_split(1024, 120, 224) == (960, 120)  # a tail of 64 on 120 saves 105 blocks
    assert stream_k_split(1024, 124, 64) == (1024, 0)  # K too short to pay
    assert stream_k_split(1024, 120, 112) == (1024, 0)  # saves 52 blocks
    assert stream_k_split(1024, 132, 224) == (1024, 0)  # a tail of 100 on 132 saves 54
    assert stream_k_split(1024, 132, 64, force=True) == (924, 49)
    k = 2 * STREAM_K_MIN_SAVED_BLOCKS  # a tail of half the grid saves exactly the minimum
    assert stream_k_split(120 + 60, 120, k)[1] > 0 and stream_k_split(120 + 61, 120, k)[1] == 0
    assert stream_k_split(2048, 120, 128) == (2040, 128 // STREAM_K_MAX_PARTS)  # 8 tail tiles: not 15 parts


def test_both_load_paths_are_exercised():
    """Aligned operands take the TMA-descriptor path, odd strides the masked-pointer path."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    assert tma_usable(a, BOperand.of(b))
    a, b = torch.randn(7, 5), torch.randn(5, 7)
    assert not tma_usable(a, BOperand.of(b))


def test_counters_keep_counting_across_calls():
    """No reset between calls: a second launch adds the same counts on top (epoch targets)."""
    s = _schedule("all_reduce", 2, 64, 64, 32, "tile_major", 1, 2)
    plan = make_plan(s, 64, 64, 32, sm_count=3)
    counters = torch.zeros(8, dtype=torch.int32)
    ug = torch.tensor(plan.unit_group(), dtype=torch.int32)
    gi = torch.tensor([x for p in plan.group_info() for x in p], dtype=torch.int32)
    a, b = torch.randn(64, 32), torch.randn(32, 64)
    buf = torch.empty(plan.buffer_numel())
    for _ in range(2):
        signalled_gemm(a, BOperand.of(b), buf, plan, TILE, counters=counters, unit_group=ug, group_info=gi)
    assert counters[:2].tolist() == [2 * plan.group_tiles(0), 2 * plan.group_tiles(1)]


def test_b_layout_detection():
    w = torch.randn(8, 4)
    assert BOperand.of(w.t()).kmajor and not BOperand.of(w.t().contiguous()).kmajor
    assert BOperand.of(torch.randn(8, 8)[:, ::2]) is None


def _rows_gemm_check(dtype_name: str, kmajor: bool) -> None:
    """Both phases of the copy engine's tiled mode (``rows_gemm``, LAYOUT_ROWS): phase 1 writes
    a @ b row-major and counts each tile row group's tiles; phase 2 (ready flags already set) adds
    what is in the destination and stores the sum twice. Odd rows and columns, groups of uneven
    tile rows. Run in a process of its own by the test below."""
    from fo_kernels.engines.copy_engine import tile_row_bounds
    from fo_kernels.gemm import rows_gemm

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(7)
    rows, n, k = 70, 50, 40  # 5 tile rows of 16, 2 tile columns of 32 (the last ones partial)
    a = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = w.t() if kmajor else w.t().contiguous()
    assert tile_row_bounds(rows, (2, 1), TILE.block_m) == [0, 48, 70]
    row_group = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)
    counters = torch.zeros(2, dtype=torch.int32)
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    rows_gemm(a, BOperand.of(b), out, TILE, grid=3, row_group=row_group, counters=counters)
    ref = a.float() @ b.float()
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max() / ref.abs().max() < TOL[dtype]
    assert counters.tolist() == [3 * 2, 2 * 2]  # tile rows x tile columns per group
    pulled = torch.randn(rows, n, generator=gen).to(dtype)  # what the copy engine put there
    dst, copy = pulled.clone(), torch.full((rows, n), float("nan"), dtype=dtype)
    ready = torch.ones(2, dtype=torch.int32)
    rows_gemm(a, BOperand.of(b), dst, TILE, grid=4, row_group=row_group, ready=ready, out2=copy)
    want = ref + pulled.float()
    assert (dst.float() - want).abs().max() / want.abs().max() < TOL[dtype]
    assert torch.equal(dst, copy)


# (dtype, B is a weight's transpose) of ``_rows_gemm_check``: both dtypes, both B layouts
ROWS_GEMM_CASES = [(dtype, kmajor) for dtype in ("float32", "bfloat16") for kmajor in (False, True)]


def test_rows_gemm_signals_accumulates_and_copies():
    """``_rows_gemm_check`` for each of ``ROWS_GEMM_CASES``, in one Python process of its own (its
    import of torch and Triton is most of the time), under the interpreter. Run inside the test
    process, these launches left its memory corrupted: fresh-clone CI died with a segfault in
    Python's garbage collector a few test files later (seen in three CI runs; the root cause, in the
    interpreter, was not found). Run apart, a corruption here fails this test or nothing. Each case
    runs even when an earlier one fails; the process prints one line per case."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = (
        "import test_gemm\n"
        f"for dtype, kmajor in {ROWS_GEMM_CASES!r}:\n"
        "    try:\n"
        "        test_gemm._rows_gemm_check(dtype, kmajor)\n"
        "        print(dtype, kmajor, 'ok')\n"
        "    except Exception as exc:\n"
        "        print(dtype, kmajor, repr(exc))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True, timeout=300
    )
    want = [f"{dtype} {kmajor} ok" for dtype, kmajor in ROWS_GEMM_CASES]
    assert done.returncode == 0 and done.stdout.splitlines() == want, done.stdout + done.stderr
