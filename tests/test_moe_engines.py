"""The MoE engines' pieces on the CPU: the Triton engine's grouped GEMM kernels (Triton's
interpreter) against torch, and the copy engine's MoE protocol run by its CPU executor on 2 .. 8
thread-ranks (random delays, every stream on one FIFO, fault injection) against float64."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F

from fo_kernels.engines.copy_engine.cpu import CpuOptions, ProtocolError, ProtocolTimeout
from fo_kernels.engines.copy_engine.layout import Rows
from fo_kernels.engines.copy_engine.moe_cpu import Slots, run_moe_ranks
from fo_kernels.engines.copy_engine.moe_protocol import (
    MoeCall,
    MoePlan,
    Phase,
    build,
    expert_ranges,
    slot_span,
)
from fo_kernels.engines.copy_engine.ops import SIDE, Signal, WaitEvent
from fo_kernels.moe.exchange import row_bytes
from fo_kernels.moe.grouped import grouped_mm, grouped_mm_t, weight_grad
from fo_kernels.moe.kernels import grouped_gemm, swiglu_gemm
from fo_kernels.tile import Tile
from moe_cases import TOL, MoeCase, reference, rel_err, thread_stage

TILE = Tile(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
# (row0, rows, expert, group): an empty segment, segments of 1 row and of several tile rows
SEGMENTS = [(0, 10, 2, 0), (10, 0, 1, 0), (10, 20, 0, 1), (30, 1, 2, 1), (31, 22, 1, 2)]
ROWS = 53
KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _segment_ref(a: torch.Tensor, w: torch.Tensor, fn=lambda y: y) -> torch.Tensor:
    return torch.cat([fn(a[r0 : r0 + n].double() @ w[e].double()) for r0, n, e, _ in SEGMENTS])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_tma", [False, None])
def test_grouped_kernels_match_torch(dtype, use_tma):
    """The signalled grouped GEMM (its per-group tile counts too) and the SwiGLU grouped GEMM,
    TMA descriptor loads (where the interpreter takes them) and masked pointer loads."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(ROWS, 32, generator=gen).to(dtype)
    w = torch.randn(3, 32, 40, generator=gen).to(dtype)
    out = torch.full((ROWS, 40), float("nan"), dtype=dtype)
    counters = torch.zeros(4, dtype=torch.int32)
    grouped_gemm(a, w, out, SEGMENTS, TILE, grid=3, counters=counters, use_tma=use_tma)
    assert rel_err(out, _segment_ref(a, w)) < KERNEL_TOL[dtype]
    # tiles: 1 row x 2 columns; 2 x 2 + 1 x 2; 2 x 2
    assert counters.tolist() == [2, 6, 4, 0]
    w13 = torch.randn(3, 32, 48, generator=gen).to(dtype)
    h = torch.full((ROWS, 24), float("nan"), dtype=dtype)
    swiglu_gemm(a, w13, h, SEGMENTS, TILE, grid=2, use_tma=use_tma)
    want = _segment_ref(a, w13, lambda gu: F.silu(gu[:, :24]) * gu[:, 24:])
    assert rel_err(h, want) < KERNEL_TOL[dtype]


def test_torch_grouped_gemms_loop_and_library_agree():
    """The loop of torch.mm per expert and torch._grouped_mm (on the CPU where this torch has it,
    with 16-byte aligned strides) give the same grouped products and weight gradients."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    gen = torch.Generator().manual_seed(2)
    counts = [5, 0, 11, 3]
    a = torch.randn(19, 16, generator=gen)
    w = torch.randn(4, 16, 8, generator=gen)
    g = torch.randn(19, 8, generator=gen)
    torch.testing.assert_close(
        grouped_mm(a, w, counts, library=True), grouped_mm(a, w, counts, library=False)
    )
    torch.testing.assert_close(
        grouped_mm_t(g, w, counts, library=True), grouped_mm_t(g, w, counts, library=False)
    )
    torch.testing.assert_close(
        weight_grad(a, g, counts, library=True), weight_grad(a, g, counts, library=False)
    )
    assert weight_grad(a, g, counts, library=False)[1].abs().max() == 0


@pytest.mark.parametrize("start", [0, 2])
def test_the_library_takes_a_row_cut_from_packed_rows(start: int):
    """One row of x cut from the backward's packed rows (x, dy, a float32 weight: 2H x 2 + 4 bytes
    a row), as ``unpack`` leaves it: a one-row view whose leading stride is the packed row's, at
    an offset of ``start`` bytes. torch._grouped_mm refuses that layout ("strides should be
    multiple of 16 bytes"); the grouped GEMMs copy it first, and agree with the loop."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    gen = torch.Generator().manual_seed(3)
    h, n = 16, 8
    width = 2 * h * 2 + 4
    packed = torch.randn(1, width // 2 + 8, generator=gen).to(torch.bfloat16).view(torch.uint8)
    x = packed.view(-1)[start : start + width].view(1, width)[:, : 2 * h].view(torch.bfloat16)
    assert x.shape == (1, h) and x.stride(0) * 2 == width
    w = torch.randn(2, h, n, generator=gen).to(torch.bfloat16)
    g = torch.randn(1, n, generator=gen).to(torch.bfloat16)
    counts = [0, 1]
    torch.testing.assert_close(
        grouped_mm(x, w, counts, library=True), grouped_mm(x, w, counts, library=False)
    )
    torch.testing.assert_close(
        weight_grad(x, g, counts, library=True), weight_grad(x, g, counts, library=False)
    )


# ----------------------------------------------------------------------------- the protocol
def _slots(case: MoeCase, world: int) -> Slots:
    """Slots for the backward's rows (x, dy and a float32 weight out; dx and dw back)."""
    h = case.hidden
    out = row_bytes(((torch.float32, h), (torch.float32, h), (torch.float32, 1)))
    return Slots(
        world, max(case.tokens) * case.top_k, out, row_bytes(((torch.float32, h), (torch.float32, 1)))
    )


def _protocol(
    case: MoeCase, world: int, chunks: int, options: CpuOptions, calls=(False, True, False), edit=None
):
    """Each rank's largest relative error over ``calls`` (forward / backward) made back to back;
    ``edit(plan)`` changes each plan before it runs."""

    def body(rank):
        r = rank.rank.rank
        out = []
        for backward in calls:
            stage = thread_stage(case, r, world, backward)
            call = MoeCall(r, stage.layout.send, stage.layout.recv, chunks, max(case.tokens) * case.top_k)
            plan = build(call) if edit is None else edit(build(call))
            result = rank.call(plan, stage)
            out.append(stage.grads() if backward else result)
        ref = reference(case, r, world)
        errs = []
        for backward, got in zip(calls, out, strict=True):
            if backward:
                errs += [rel_err(t, ref[n]) for t, n in zip(got, ("dx", "dw", "dw13", "dw2"), strict=True)]
            else:
                errs.append(rel_err(got, ref["y"]))
        return max(errs)

    return run_moe_ranks(_slots(case, world), body, options=options)


@pytest.mark.parametrize("world", range(2, 9))
def test_protocol_on_thread_ranks(world):
    """Forward, backward, forward back to back (the guards come back to 1), on 2 .. 8 ranks with
    uneven tokens (one rank without any), experts without rows and 1, 2 or 3 pieces a slot: with
    random delays; with every stream of a rank on one FIFO (pushes before waits); and with each
    rank's host blocked before every Phase until its streams are idle (a synchronizing torch op
    or a kernel's first load there cannot deadlock the ranks)."""
    tokens = tuple(0 if r == world // 2 else (3 * r + 2) % 7 + 1 for r in range(world))
    routing = "skewed" if world % 2 else "random"
    case = MoeCase(tokens=tokens, hidden=8, inter=4, experts=3, top_k=2, routing=routing, seed=world)
    for chunks, options in (
        (1, CpuOptions(timeout_s=10, delay_s=0.002, seed=world)),
        (3, CpuOptions(timeout_s=10, fifos={"main": "q", "side": "q", "local": "q"})),
        (2, CpuOptions(timeout_s=10, host_blocks=lambda op: isinstance(op, Phase))),
    ):
        errs = _protocol(case, world, chunks, options)
        assert max(errs) < TOL["float32"], (chunks, errs)


def test_pieces_cut_experts_alike_on_every_rank():
    assert expert_ranges(5, 2) == [(0, 2), (2, 5)]
    assert expert_ranges(2, 4) == [(0, 1), (1, 2)]
    assert expert_ranges(1, 1) == [(0, 1)]


def test_a_lost_flag_fails_in_time_naming_it():
    """Dropping rank 0's first signal (rank 1's landed flag) makes a wait time out within the
    timeout, naming the cell: rank 1's for the lost flag, or rank 0's for the rows rank 1 then
    never sends back, whichever times out first."""
    case = MoeCase(tokens=(4, 5), hidden=8, inter=4, experts=2, top_k=2, seed=3)
    dropped = []

    def drop(rank, index, op):
        if rank == 0 and isinstance(op, Signal) and not dropped:
            dropped.append(op)
            return True
        return False

    with pytest.raises(ProtocolTimeout, match=r"(landed|returned)\[.*a lost flag or a deadlock"):
        _protocol(case, 2, 1, CpuOptions(timeout_s=0.5, drop=drop), calls=(False,))


def _pushes_after_phase_one(plan: MoePlan) -> MoePlan:
    """The plan with its dispatch pushes (the side stream's operations before the first Phase)
    issued after its last phase 1 instead."""
    first = next(i for i, op in enumerate(plan.ops) if isinstance(op, Phase))
    last = max(i for i, op in enumerate(plan.ops) if isinstance(op, Phase) and op.phase == 1)
    pushes = [op for op in plan.ops[:first] if op.stream == SIDE and not isinstance(op, WaitEvent)]
    head = [op for op in plan.ops[: last + 1] if op not in pushes]
    return dataclasses.replace(plan, ops=(*head, *pushes, *plan.ops[last + 1 :]))


def test_a_host_that_blocks_before_the_pushes_deadlocks():
    """The host-blocking check can fail: with the pushes issued after phase 1, the lists still
    complete while hosts never block, and deadlock (caught in time) when they block at a Phase."""
    case = MoeCase(tokens=(4, 5), hidden=8, inter=4, experts=2, top_k=2, seed=3)
    late = _pushes_after_phase_one
    assert max(_protocol(case, 2, 1, CpuOptions(timeout_s=5), calls=(False,), edit=late)) < TOL["float32"]
    blocking = CpuOptions(timeout_s=0.5, host_blocks=lambda op: isinstance(op, Phase))
    start = time.monotonic()
    with pytest.raises(ProtocolTimeout, match="a lost flag or a deadlock"):
        _protocol(case, 2, 1, blocking, calls=(False,), edit=late)
    assert time.monotonic() - start < 5.0


def test_slots_stay_put_between_calls():
    """A slot's rows start at the same byte whatever the call's row width (a forward's narrower
    rows, a backward's wider ones), and a plan numbering slots of fewer rows than the slots hold
    (a call of a smaller bound or k) is refused: a guard frees one source's slot only, so a slot
    that moved could take a push over another source's rows of the previous call not read yet."""
    for width in (5, 12):
        assert slot_span(Rows("inbox", 1, 2 * 9 + 3, 2 * 9 + 5), 9, 12, width) == (
            2 * 9 * 12 + 3 * width,
            2 * 9 * 12 + 5 * width,
        )
    case = MoeCase(tokens=(3, 1, 2), hidden=8, inter=4, experts=1, top_k=2, seed=5)

    def body(rank):
        stage = thread_stage(case, rank.rank.rank, 3, False)
        call = MoeCall(rank.rank.rank, stage.layout.send, stage.layout.recv, 1, 2 * case.top_k)
        return rank.call(build(call), stage)

    with pytest.raises(ProtocolError, match="slots of 4 rows; the slots hold 6"):
        run_moe_ranks(_slots(case, 3), body, options=CpuOptions(timeout_s=2))


def test_a_plan_for_another_rank_is_refused():
    case = MoeCase(tokens=(2, 2), hidden=8, inter=4, experts=1, top_k=1, seed=4)

    def body(rank):
        stage = thread_stage(case, rank.rank.rank, 2, False)
        other = MoeCall(1 - rank.rank.rank, stage.layout.send, stage.layout.recv, 1, 2)
        return rank.call(build(other), stage)

    with pytest.raises(ProtocolError, match="plan of rank"):
        run_moe_ranks(_slots(case, 2), body, options=CpuOptions(timeout_s=2))
