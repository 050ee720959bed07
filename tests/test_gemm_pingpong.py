"""The ping-pong kernel's CPU side: its tiles' limits, when a call runs it, the tail it gets, the
plain kernel it falls back to, and its compiled code for sm_90a (built here without a GPU: the
release increments behind written TMA stores, no spills). Its results and the signal's visibility
are GPU tests (tests/test_gpu.py: ``pingpong``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.errors import ScheduleError
from fo_kernels.gemm import BOperand, KernelOptions, signalled_gemm
from fo_kernels.gemm.pingpong import pingpong_blocker
from fo_kernels.plan import (
    PINGPONG_MAX_PARTS,
    SPLIT_MIN_MACS,
    TailPlan,
    cdiv,
    make_plan,
    pingpong_parts,
    tail_plan,
)
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.tile import Tile

PP = Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4, pingpong=True)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_warps": 8}, "tile.num_warps: a pingpong tile has 4"),
        ({"block_n": 256}, "accumulator is at most 16384 elements"),
        ({"block_m": 32, "block_n": 256}, "at least 64 rows"),
        ({"num_stages": 6}, "use fewer stages"),
        ({"pingpong": "yes"}, "tile.pingpong: expected true or false"),
    ],
)
def test_a_pingpong_tile_outside_its_limits_is_refused(change, message):
    with pytest.raises(ScheduleError, match=message):
        dataclasses.replace(PP, **change)


def test_a_pingpong_tile_round_trips_and_names_itself():
    assert PP.label() == "128x128x64 gm8 w4 s4 pp"
    assert (
        PP.to_dict()["pingpong"] is True
        and "pingpong" not in dataclasses.replace(PP, pingpong=False).to_dict()
    )
    assert Tile.from_dict(PP.to_dict()) == PP
    assert dataclasses.replace(PP, block_m=64, block_n=256, num_stages=4).pingpong  # 229 KiB: fits


def test_a_pingpong_tiles_last_partial_wave_is_its_k_split_tail_where_the_parts_fit():
    """Its kernel runs the tail tiles' K blocks in parts, one program each, as many parts as fit
    the grid (at most PINGPONG_MAX_PARTS, and K blocks); stream_k=False or split_tail=True take
    the split tail's pieces instead, stream_k=True the parts in calls of any size; small calls,
    single waves and tails of more than half the grid run whole waves. Stream-K's K blocks a
    program (``share``) are the plain kernel's alone."""
    macs = SPLIT_MIN_MACS
    assert tail_plan(960, 132, PP, 6912, macs) == TailPlan((1, 1), 924, 0, 3)  # 36 tail tiles in thirds
    assert tail_plan(960, 132, PP, 6912, macs, stream_k=False) == TailPlan((1, 2), 924, 0)  # halves
    assert tail_plan(960, 132, PP, 6912, macs, split_tail=True) == TailPlan((1, 2), 924, 0)
    assert tail_plan(256, 124, PP, 4096, macs) == TailPlan((1, 1), 248, 0, PINGPONG_MAX_PARTS)  # 8 tiles
    assert tail_plan(256, 124, PP, 128, macs) == TailPlan((1, 1), 248, 0, 2)  # 2 K blocks: 2 parts
    assert tail_plan(2048, 120, PP, 2048, macs) == TailPlan((1, 1), 2040, 0, 4)  # 8 tail tiles
    assert tail_plan(960, 132, PP, 6912, macs - 1) == TailPlan((1, 1), 960, 0)  # a small call: whole
    assert tail_plan(960, 132, PP, 6912, macs - 1, stream_k=True).parts == 3  # unless forced
    assert tail_plan(2048, 132, PP, 14336, macs) == TailPlan((1, 1), 2048, 0)  # 68 tail tiles: > half
    assert tail_plan(100, 132, PP, 14336, macs, stream_k=True) == TailPlan((1, 1), 100, 0)  # one wave
    plain = dataclasses.replace(PP, pingpong=False)
    assert tail_plan(2048, 132, plain, 14336, macs).share > 0  # where the plain tile shares it out
    assert tail_plan(2048, 132, PP, 14336, macs, stream_k=True).share == 0


@pytest.mark.parametrize(
    "num_tiles, grid, k_tiles",
    [(960, 132, 108), (256, 124, 64), (512, 116, 16), (300, 132, 3), (7, 3, 5), (10, 4, 1)],
)
def test_pingpong_parts_put_one_part_on_a_program_and_cover_the_tail(num_tiles, grid, k_tiles):
    """The K-split tail fits one wave of parts (tail tiles x parts <= grid), and each tile's parts,
    the K ranges [p * K / parts, (p + 1) * K / parts) the kernel runs, cover its K blocks once,
    none of them empty."""
    parts = pingpong_parts(num_tiles, grid, k_tiles)
    tail = num_tiles % grid
    if parts == 0:
        assert tail == 0 or num_tiles < grid or 2 * tail > grid or k_tiles < 2
        return
    assert 2 <= parts <= PINGPONG_MAX_PARTS and tail * parts <= grid
    ranges = [(p * k_tiles // parts, (p + 1) * k_tiles // parts) for p in range(parts)]
    assert all(k0 < k1 for k0, k1 in ranges)
    assert [kk for k0, k1 in ranges for kk in range(k0, k1)] == list(range(k_tiles))


def _plan(m, n, k, tile, layout="row_band"):
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    s = Schedule(
        collective="all_reduce", dtype="bfloat16", world_size=1, problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(tile=tile, sms_free=0, signal_tiles=1, groups=(tiles,), layout=layout),
    )  # fmt: skip
    return make_plan(s, m, n, k, sm_count=4)


def test_off_a_hopper_gpu_a_pingpong_tile_runs_the_plain_kernel():
    """Here (the interpreter, CPU tensors) the blocker says why, and the call runs the plain kernel
    with the same tile: the product, each tile counted once in its group."""
    m, n, k = 200, 256, 96
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = BOperand.of(torch.randn(n, k, generator=gen).to(torch.bfloat16).t())
    plan = _plan(m, n, k, PP)
    out = torch.full((plan.buffer_numel(),), float("nan"), dtype=torch.bfloat16)
    assert "CUDA GPUs only" in pingpong_blocker(a, b, out, plan, PP)
    assert (
        pingpong_blocker(a, b, out, plan, dataclasses.replace(PP, pingpong=False))
        == "the tile does not ask for it"
    )
    counters = torch.zeros(1, dtype=torch.int32)
    ug = torch.tensor(plan.unit_group(), dtype=torch.int32)
    gi = torch.tensor([x for p in plan.group_info() for x in p], dtype=torch.int32)
    signalled_gemm(a, b, out, plan, PP, counters=counters, unit_group=ug, group_info=gi)
    ref = a.float() @ b.tensor.float()
    got = out.view(m, n).float()
    assert not got.isnan().any() and ((got - ref).norm() / ref.norm()).item() < 1e-2
    assert counters.tolist() == [plan.num_tiles]


def _gluon_hopper() -> bool:
    try:
        return importlib.util.find_spec("triton.experimental.gluon.language.nvidia.hopper") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _gluon_hopper(), reason="this Triton has no Gluon for Hopper")
@pytest.mark.parametrize(
    "bm, bn, stages, layout, signal, ksplit",
    [
        (128, 128, 4, 0, True, False),
        (64, 256, 4, 1, True, False),
        (128, 128, 5, 0, False, False),
        (128, 128, 5, 0, True, True),
        (128, 128, 4, 1, True, True),
    ],
    ids=["128x128_s4_row_band", "64x256_s4_tile_major", "128x128_s5_no_signal", "128x128_s5_k_split",
         "128x128_s4_tile_major_k_split"],
)  # fmt: skip
def test_the_compiled_kernel_signals_each_tile_after_its_stores_are_written(
    bm, bn, stages, layout, signal, ksplit
):
    """Compiled for sm_90a: with the signal, each consumer warpgroup has its release increment,
    after its last TMA store is written (``wait_group 0``, not ``.read``), the async-proxy fence
    and the partition's barrier (Triton's automatic warp specialization dropped this atomic);
    without it, none. With the K-split tail, each consumer also has the tail's epilogue (a second
    release increment, as ordered) and its arrival, after a barrier behind the part's stores;
    without it, no arrival is compiled. setmaxnreg splits the registers, nothing spills and the
    ring and both epilogue buffers fit Hopper's shared memory. (The K-split fix-up of a 64x256
    tile spills 88 bytes of its per-element offsets, outside the main loop; that tile is not in
    the search space.)"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    script = Path(__file__).with_name("pingpong_ptx.py")
    args = [str(x) for x in (bm, bn, 64, stages, layout, int(signal), int(ksplit))]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["release_atomics"] == [True] * (2 * (1 + ksplit) if signal else 0)
    assert facts["arrivals"] == ([True, True] if ksplit else [])
    assert facts["setmaxnreg"] > 0 and facts["spill_bytes"] == 0
    assert facts["shared_bytes"] <= 227 * 1024


def test_a_pingpong_calls_split_tail_runs_in_a_launch_of_its_own(monkeypatch):
    """Where the ping-pong kernel runs (here a stand-in: the plain kernel over every tile, recording
    how many tiles it was given), ``signalled_gemm`` gives it the whole waves and runs the split
    tail's pieces after it in a launch of their own: the tail tiles are written again,
    correctly, and signalled once more each."""
    import fo_kernels.gemm.waves as waves

    m, n, k = 640, 256, 64  # 10 tiles of 128x128 on 4 programs: 8 in whole waves, 2 in the tail
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = BOperand.of(torch.randn(n, k, generator=gen).to(torch.bfloat16).t())
    plan = _plan(m, n, k, PP)
    given = []

    def stand_in(
        a, b, out, plan, tile, *, counters, unit_group, group_info, signal, tiles, parts, arrive, partial
    ):
        given.append((tiles, parts))
        plain = dataclasses.replace(tile, pingpong=False)
        signalled_gemm(
            a, b, out, plan, plain, counters=counters, unit_group=unit_group, group_info=group_info,
            signal=signal, options=KernelOptions(split_tail=False),
        )  # fmt: skip

    # the launcher's module looks both up when it is called
    monkeypatch.setattr(waves, "pingpong_blocker", lambda *args: "")
    monkeypatch.setattr(waves, "pingpong_gemm", stand_in)
    out = torch.full((plan.buffer_numel(),), float("nan"), dtype=torch.bfloat16)
    counters = torch.zeros(1, dtype=torch.int32)
    ug = torch.tensor(plan.unit_group(), dtype=torch.int32)
    gi = torch.tensor([x for p in plan.group_info() for x in p], dtype=torch.int32)
    signalled_gemm(
        a, b, out, plan, PP, counters=counters, unit_group=ug, group_info=gi,
        options=KernelOptions(split_tail=True),
    )  # fmt: skip
    assert given == [(8, 0)]  # the whole waves, no K-split tail
    ref = a.float() @ b.tensor.float()
    got = out.view(m, n).float()
    assert not got.isnan().any() and ((got - ref).norm() / ref.norm()).item() < 1e-2
    assert counters.tolist() == [plan.num_tiles + 2]  # the stand-in's 10, the tail's 2 again
