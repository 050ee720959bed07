"""The MoE copy engine's virtual ranks on the CPU, through the GPU issuer's own addresses and byte
counts (``copy_engine_fakes``: each operation done when issued, every wait already satisfied): every
rank's output and gradients against float64, for N = 2 .. 8, uneven tokens (a rank without any),
experts without rows, 1 or 3 pieces a slot, and calls of other token counts, row widths and
bounds into the same slots. The GPU runs the same code in ``tests/test_gpu_moe.py``."""

from __future__ import annotations

import pytest
from copy_engine_fakes import DRIVER, cpu_device

from fo_kernels.engines.copy_engine.moe_virtual import MoeVirtualRanks
from fo_kernels.errors import ScheduleError, ShapeError
from moe_cases import TOL, MoeCase, ffn_by_expert, inputs, reference_ffn, rel_err, virtual_errors


def _case(world: int, tokens: tuple[int, ...], chunks: int, tokens_max: int, **kw) -> MoeCase:
    experts, top_k = kw.pop("experts", 3), kw.pop("top_k", 2)
    problem = dict(hidden=8, intermediate=4, experts=experts, top_k=top_k, tokens_max=tokens_max)
    schedule = dict(dtype="float32", world_size=world, problem=problem, engine="copy_engine", chunks=chunks)
    return MoeCase(tokens=tokens, hidden=8, inter=4, experts=experts, top_k=top_k, schedule=schedule, **kw)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_virtual_moe_ranks_match_float64(world: int, monkeypatch: pytest.MonkeyPatch):
    """Three calls into the same slots: uneven tokens with one rank empty (1 piece a slot), then
    skewed routing in 3 pieces, then a larger bound (the slots grow) with k = 1."""
    ranks = MoeVirtualRanks(world, cpu_device(monkeypatch))
    tokens = tuple(0 if r == world // 2 else (3 * r + 2) % 7 + 1 for r in range(world))
    for case in (
        _case(world, tokens, 1, 8, seed=world),
        _case(world, tokens[::-1], 3, 8, routing="skewed", seed=world + 1),
        _case(world, tuple(t + 9 for t in tokens), 2, 20, top_k=1, seed=world + 2),
    ):
        errs = virtual_errors(ranks, case)
        assert max(errs.values()) < TOL["float32"], (case, errs)
    for q, flags in ranks.flags.items():  # the flags end as they began: the guards set, the rest clear
        assert int(flags.sum()) == 2 * (world - 1), q


def test_virtual_moe_ranks_catch_a_lost_flag(monkeypatch: pytest.MonkeyPatch):
    """The stand-in can fail: with every flag write dropped, the first wait on a landed cell fails."""
    ranks = MoeVirtualRanks(2, cpu_device(monkeypatch))
    monkeypatch.setattr(DRIVER, "cuStreamWriteValue32", lambda s, address, value, f: (0,))
    with pytest.raises(AssertionError, match="a wait issued before its writer"):
        virtual_errors(ranks, _case(2, (3, 4), 1, 4))


def test_virtual_moe_ranks_refuse_bad_calls(monkeypatch: pytest.MonkeyPatch):
    ranks = MoeVirtualRanks(2, cpu_device(monkeypatch))
    with pytest.raises(ScheduleError, match="tokens"):
        virtual_errors(ranks, _case(2, (3, 9), 1, 4))
    with pytest.raises(ScheduleError, match="engine: copy_engine"):
        case = _case(2, (3, 4), 1, 4)
        virtual_errors(ranks, MoeCase(**{**case.__dict__, "schedule": {**case.schedule, "engine": None}}))
    with pytest.raises(ShapeError, match="at least 2 ranks"):
        MoeVirtualRanks(1, cpu_device(monkeypatch))


def test_the_per_expert_reference_is_the_term_by_term_loop():
    """``virtual_errors``' reference (``ffn_by_expert``, one expert at a time) is the issue's formula
    term by term (``reference_ffn``), duplicates and experts without rows included."""
    case = _case(3, (5, 0, 7), 1, 8, routing="duplicates", seed=4)
    for r in range(3):
        d = inputs(case, r, 3)
        want = reference_ffn(d["x"], d["ids"], d["w"], d["w13"], d["w2"])
        assert rel_err(ffn_by_expert(d["x"], d["ids"], d["w"], d["w13"], d["w2"]), want) < 1e-12, r
    # a rank without tokens (rank 1): its output is still in the weights' graph, so a backward
    # through it (as the GPU test's at 0 tokens) gives zero gradients
    d = inputs(case, 1, 3)
    w13 = d["w13"].requires_grad_()
    ffn_by_expert(d["x"], d["ids"], d["w"], w13, d["w2"]).sum().backward()
    assert w13.grad is not None and not w13.grad.any()
