"""The MoE engines' pieces on the CPU: the Triton engine's grouped GEMM kernels (Triton's
interpreter) against torch, and the copy engine's MoE protocol run by its CPU executor on 2 .. 8
thread-ranks (random delays, every stream on one FIFO, fault injection) against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fo_kernels.engines.copy_engine.cpu import CpuOptions, ProtocolError, ProtocolTimeout
from fo_kernels.engines.copy_engine.layout import Rows
from fo_kernels.engines.copy_engine.moe_cpu import Slots, run_moe_ranks
from fo_kernels.engines.copy_engine.moe_protocol import MoeCall, build, expert_ranges, slot_span
from fo_kernels.engines.copy_engine.ops import Signal
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


# ----------------------------------------------------------------------------- the protocol
def _slots(case: MoeCase, world: int) -> Slots:
    """Slots for the backward's rows (x, dy and a float32 weight out; dx and dw back)."""
    h = case.hidden
    out = row_bytes(((torch.float32, h), (torch.float32, h), (torch.float32, 1)))
    return Slots(
        world, max(case.tokens) * case.top_k, out, row_bytes(((torch.float32, h), (torch.float32, 1)))
    )


def _protocol(case: MoeCase, world: int, chunks: int, options: CpuOptions, calls=(False, True, False)):
    """Each rank's largest relative error over ``calls`` (forward / backward) made back to back."""

    def body(rank):
        r = rank.rank.rank
        out = []
        for backward in calls:
            stage = thread_stage(case, r, world, backward)
            call = MoeCall(r, stage.layout.send, stage.layout.recv, chunks, max(case.tokens) * case.top_k)
            result = rank.call(build(call), stage)
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
    uneven tokens (one rank without any), experts without rows and 1 or 3 pieces a slot: with
    random delays, and with every stream of a rank on one FIFO (pushes before waits)."""
    tokens = tuple(0 if r == world // 2 else (3 * r + 2) % 7 + 1 for r in range(world))
    routing = "skewed" if world % 2 else "random"
    case = MoeCase(tokens=tokens, hidden=8, inter=4, experts=3, top_k=2, routing=routing, seed=world)
    for chunks, options in (
        (1, CpuOptions(timeout_s=10, delay_s=0.002, seed=world)),
        (3, CpuOptions(timeout_s=10, fifos={"main": "q", "side": "q", "local": "q"})),
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


class _Stop(Exception):
    """Raised by a stand-in for the CUDA driver: what MoePeers does before it is all a test reads."""


def test_the_moe_copy_engine_asks_for_eager_module_loading(quiet_one_rank, monkeypatch):
    """The MoE copy engine's GPU path does not load its grouped GEMMs' kernels before its first flag
    wait, so it warns unless CUDA_MODULE_LOADING=EAGER (the kernel-loading rule); with it, not."""
    import warnings

    from fo_kernels.engines.copy_engine import moe_gpu

    def stop():
        raise _Stop

    monkeypatch.setattr(moe_gpu, "copy_engine_blocker", lambda device, world: "")
    monkeypatch.setattr(moe_gpu, "driver_module", stop)
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    with pytest.warns(RuntimeWarning, match="CUDA_MODULE_LOADING=EAGER"), pytest.raises(_Stop):
        moe_gpu.MoePeers(torch.device("cpu"), None)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(_Stop):
            moe_gpu.MoePeers(torch.device("cpu"), None)
