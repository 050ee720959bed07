"""GPU tests of the expert-parallel FFN on one GPU in this process (skipped without a GPU): the
whole FFN at world size 1 (one NCCL rank) against float64, eager and compiled with inductor, both
paths; the grouped GEMM kernels compiled for the GPU against float64; the signalled grouped GEMM's
counters as another stream reads them.

Run on a GPU machine with: TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_gpu_moe.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fo_kernels import MoeProblem, MoeSchedule, expert_parallel_ffn
from fo_kernels.moe.kernels import grouped_gemm, swiglu_gemm
from fo_kernels.tile import Tile
from moe_cases import ffn_by_expert, reference_ffn, rel_err

# A tile the GPU runs well and a small one (masked edges, many tiles)
TILES = {
    "128x128": Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    "64x64": Tile(block_m=64, block_n=64, block_k=32, group_m=4, num_warps=4, num_stages=3),
}
# against float64 of the same (rounded) operands
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
H, I, E, K_TOP = 512, 384, 8, 4
# Repetitions of the visibility check (poisoned output each time)
VISIBILITY_REPS = 100


def _schedule(engine: str | None, dtype: torch.dtype, tokens: int, tile: Tile | None = None) -> MoeSchedule:
    problem = MoeProblem(hidden=H, intermediate=I, experts=E, top_k=K_TOP, tokens_max=max(tokens, 1))
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    return MoeSchedule(dtype=name, world_size=1, problem=problem, engine=engine, tile=tile)


def _inputs(tokens: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=gen, dtype=torch.float64)
    logits = torch.randn(tokens, E, device="cuda", generator=gen, dtype=torch.float64)
    w, ids = logits.softmax(-1).topk(K_TOP, dim=-1)
    w13 = torch.randn(E, H, 2 * I, device="cuda", generator=gen, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, I, H, device="cuda", generator=gen, dtype=torch.float64) / I**0.5
    g = torch.randn(tokens, H, device="cuda", generator=gen, dtype=torch.float64)
    return x, ids, w, w13, w2, g


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("engine", [None, "triton"])
@pytest.mark.parametrize("compiled", [False, True])
def test_ffn_at_world_size_one_matches_float64(nccl_one_rank, dtype, engine, compiled):
    """y and every gradient against the float64 formula (autograd through a loop of experts), at
    2000 tokens and at 0; the Triton engine's kernels compiled for this GPU."""
    for tokens in (2000, 0):
        x, ids, w, w13, w2, g = _inputs(tokens, dtype, seed=tokens + 1)
        schedule = _schedule(engine, dtype, tokens, TILES["128x128"] if engine else None)
        leaves = [t.to(dtype).requires_grad_() for t in (x, w13, w2)]
        wf = w.float().requires_grad_()

        def call(x_, w_, w13_, w2_, ids_=ids, schedule_=schedule):
            return expert_parallel_ffn(x_, ids_, w_, w13_, w2_, schedule=schedule_)

        fn = torch.compile(call, fullgraph=True) if compiled else call
        y = fn(leaves[0], wf, leaves[1], leaves[2])
        assert y.dtype == dtype and y.shape == x.shape
        (y.double() * g).sum().backward()
        ref_leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
        ref = ffn_by_expert(ref_leaves[0], ids, *ref_leaves[1:])
        (ref * g).sum().backward()
        if tokens:
            assert rel_err(y.cpu(), ref.detach().cpu()) < TOL[dtype]
            got = (leaves[0].grad, wf.grad, leaves[1].grad, leaves[2].grad)
            for name, a, b in zip(("dx", "dw", "dw13", "dw2"), got, ref_leaves, strict=True):
                assert rel_err(a.cpu(), b.grad.cpu()) < TOL[dtype], name
        else:
            assert y.numel() == 0 and leaves[1].grad.abs().max() == 0


# Other expert shapes and routings than the cases above: (hidden, intermediate, experts, top_k,
# tokens, dtype): many small experts with k = 8 (Qwen3-MoE's routing), k = 1 (Switch-style), one
# token, fp16, and widths that are not multiples of any tile; the Triton engine with a tile that
# leaves masked edges, and the table's choice (None).
OTHER_SHAPES = [
    (1024, 384, 64, 8, 1500, torch.bfloat16),
    (768, 1000, 4, 1, 999, torch.bfloat16),
    (520, 200, 16, 2, 1, torch.float16),
    (2048, 1408, 8, 6, 700, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", OTHER_SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + "-" + str(s[5])[6:])
@pytest.mark.parametrize("engine", [None, "triton"])
def test_ffn_other_shapes_match_float64(nccl_one_rank, shape, engine):
    """y and dx, dw13 against float64 on expert shapes, routings and dtypes the cases above do
    not use, with one expert that no token picks."""
    hidden, inter, experts, top_k, tokens, dtype = shape
    gen = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen, dtype=torch.float64)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen, dtype=torch.float64)
    logits[:, 0] = -1e9  # expert 0 gets no token
    w, ids = logits.softmax(-1).topk(top_k, dim=-1)
    w13 = torch.randn(experts, hidden, 2 * inter, device="cuda", generator=gen, dtype=torch.float64)
    w13 /= hidden**0.5
    w2 = torch.randn(experts, inter, hidden, device="cuda", generator=gen, dtype=torch.float64) / inter**0.5
    g = torch.randn(tokens, hidden, device="cuda", generator=gen, dtype=torch.float64)
    problem = MoeProblem(hidden=hidden, intermediate=inter, experts=experts, top_k=top_k, tokens_max=tokens)
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    schedule = MoeSchedule(
        dtype=name, world_size=1, problem=problem, engine=engine, tile=TILES["128x128"] if engine else None
    )
    leaves = [t.to(dtype).requires_grad_() for t in (x, w13, w2)]
    y = expert_parallel_ffn(leaves[0], ids, w.to(dtype), leaves[1], leaves[2], schedule=schedule)
    assert y.dtype == dtype and y.shape == x.shape
    (y.double() * g).sum().backward()
    ref_leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    ref = ffn_by_expert(ref_leaves[0], ids, *ref_leaves[1:])
    (ref * g).sum().backward()
    assert rel_err(y.cpu(), ref.detach().cpu()) < TOL[torch.bfloat16]
    for name_, got, want in (("dx", leaves[0], ref_leaves[0]), ("dw13", leaves[1], ref_leaves[2])):
        assert rel_err(got.grad.cpu(), want.grad.cpu()) < TOL[torch.bfloat16], name_
    assert leaves[1].grad[0].abs().max() == 0  # (the expert no token picked)


@pytest.mark.gpu
def test_reference_loop_and_gpu_reference_agree():
    """The per-expert reference (``ffn_by_expert``, float64 on the GPU) is the CPU tests' term-by-term
    loop (``reference_ffn``)."""
    x, ids, w, w13, w2, _ = _inputs(40, torch.float64, seed=3)
    want = reference_ffn(*(t.cpu() for t in (x, ids, w, w13, w2)))
    assert rel_err(ffn_by_expert(x, ids, w, w13, w2).cpu(), want) < 1e-12


# ----------------------------------------------------------------------------- kernels
def _segments(counts: list[int], slots: int) -> list[tuple[int, int, int, int]]:
    """Segments of ``slots`` slots, each with ``counts`` rows per expert (slot-major)."""
    out, at = [], 0
    for s in range(slots):
        for e, c in enumerate(counts):
            out.append((at, c, e, s))
            at += c
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(TILES))
@pytest.mark.parametrize("use_tma", [None, False])
def test_grouped_kernels_on_gpu(tile, use_tma):
    """Both kernels against float64 (bf16, uneven experts and an empty one), the output poisoned;
    each slot's counter advanced by its tiles."""
    counts = [700, 0, 129, 1, 513, 64, 300, 95]
    segs = _segments(counts, 3)
    rows, k, n = 3 * sum(counts), 1024, 768
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(len(counts), k, n, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(3, dtype=torch.int32, device="cuda")
    t = TILES[tile]
    grouped_gemm(a, w, out, segs, t, grid=120, counters=counters, use_tma=use_tma)
    want = torch.cat([a[r0 : r0 + c].double() @ w[e].double() for r0, c, e, _ in segs])
    assert rel_err(out, want) < TOL[torch.bfloat16]
    per_slot = sum(-(-c // t.block_m) * -(-n // t.block_n) for c in counts)
    assert counters.tolist() == [per_slot] * 3
    h = torch.full((rows, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    swiglu_gemm(a, w, h, segs, t, grid=120, use_tma=use_tma)
    act = torch.cat(
        [(lambda gu: F.silu(gu[:, : n // 2]) * gu[:, n // 2 :])(a[r0 : r0 + c].double() @ w[e].double())
         for r0, c, e, _ in segs]
    )  # fmt: skip
    assert rel_err(h, act) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("backward", [False, True])
def test_phases_issue_no_host_synchronization(backward):
    """A Phase runs behind waits on the peers' rows: a host synchronization there would hold the
    host until they land. A stage's phases (two pieces, so its rows are reordered by expert), its
    finish and the Triton engine's SwiGLU grouped GEMM run under torch's sync debug mode "error"
    (after a first round that loads the kernels); the result is finite."""
    from fo_kernels.moe.exchange import Layout
    from fo_kernels.moe.routing import check_call, route
    from fo_kernels.moe.stages import BackwardStage, ForwardStage

    x, ids, w, w13, w2, g = _inputs(300, torch.bfloat16, seed=7)
    x, w13, w2, g, w = x.bfloat16(), w13.bfloat16(), w2.bfloat16(), g.bfloat16(), w.float()
    shape = check_call(x, ids, w, w13, w2, 1)
    routing = route(ids, shape)
    layout = Layout(0, routing.host_counts, routing.host_counts, (shape.tokens,))
    pieces = [(0, 0, E // 2), (0, E // 2, E)]
    segs = _segments(list(routing.host_counts[0]), 1)
    for mode in ("default", "error"):
        common = (shape, routing, layout, w13, w2)
        stage = BackwardStage(g, x, w, *common) if backward else ForwardStage(x, w, *common)
        rows = stage.outgoing()
        h = torch.empty((rows.shape[0], I), device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            stage.first(pieces, rows)
            got = stage.finish(stage.second(pieces))
            swiglu_gemm(x[routing.tokens], w13, h, segs, TILES["64x64"], grid=64)
            if mode == "error":  # (the mode does catch a host list copied to the GPU)
                with pytest.raises(RuntimeError, match="synchronizing"):
                    torch.tensor([1, 2], device="cuda")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    out = stage.grads() if backward else (got,)
    assert all(t.isfinite().all() for t in (*out, h))


@triton.jit
def _acquire_then_copy(counter, target, src, dst, n, BLOCK: tl.constexpr):
    """Spin until ``counter`` reaches ``target`` (acquire), then copy src[:n] to dst from L2."""
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen - target < 0:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n, cache_modifier=".cg"), mask=offs < n)


@pytest.mark.gpu
def test_a_slot_is_visible_to_another_stream_once_its_counter_shows_it():
    """The signalled grouped GEMM's guarantee, as the dense kernel's (tests/test_gpu.py): a reader
    on another stream that acquires a slot's counter at its target reads all of its rows."""
    counts = [300, 17, 0, 260, 128]
    slots = 4
    segs = _segments(counts, slots)
    rows, k, n = slots * sum(counts), 512, 1024
    gen = torch.Generator(device="cuda").manual_seed(9)
    a = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(len(counts), k, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = torch.empty((rows, n), device="cuda", dtype=torch.bfloat16)
    snap = torch.empty_like(out)
    counters = torch.zeros(slots, dtype=torch.int32, device="cuda")
    tile = TILES["128x128"]
    per_slot = sum(-(-c // tile.block_m) * -(-n // tile.block_n) for c in counts)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    reader = torch.cuda.Stream(priority=-1)
    bad = 0
    for rep in range(VISIBILITY_REPS):
        out.fill_(float("nan"))
        snap.fill_(float("nan"))
        reader.wait_stream(torch.cuda.current_stream())
        grouped_gemm(a, w, out, segs, tile, grid=sms - 8, counters=counters)
        with torch.cuda.stream(reader):
            for s in range(slots):
                r0, r1 = s * sum(counts), (s + 1) * sum(counts)
                _acquire_then_copy[(4,)](
                    counters[s:], per_slot * (rep + 1), out[r0:], snap[r0:], (r1 - r0) * n, BLOCK=1024
                )
        torch.cuda.current_stream().wait_stream(reader)
        bad += not torch.equal(snap, out)
    assert not out.isnan().any()
    assert bad == 0, f"{bad} of {VISIBILITY_REPS} repetitions read a slot before its rows landed"


@pytest.mark.multigpu
def test_two_gpus_every_path_matches_float64():
    """Two NCCL ranks, one GPU each: the no-overlap path, the Triton engine (NCCL point-to-point
    ring, the signalled grouped GEMM) and the copy engine (pushes into the peers' symmetric
    slots), uneven tokens and a rank without any, forward and backward, against float64."""
    from fo_tune.ranks.launch import run_ranks
    from moe_cases import TOL as CASE_TOL
    from moe_cases import MoeCase, run_cases

    cases = []
    runs = [
        (None, "bfloat16", (700, 0)),
        ("triton", "bfloat16", (333, 900)),
        ("copy_engine", "bfloat16", (0, 512)),
        ("copy_engine", "float32", (257, 31)),
        ("triton", "float32", (64, 1)),
    ]
    for i, (engine, dtype, tokens) in enumerate(runs):
        problem = dict(hidden=256, intermediate=192, experts=4, top_k=4, tokens_max=1024)
        schedule = dict(dtype=dtype, world_size=2, problem=problem, engine=engine)
        if engine == "triton":
            schedule["tile"] = dict(block_m=64, block_n=64, block_k=32, group_m=4, num_warps=4, num_stages=3)
        if engine == "copy_engine":
            schedule["chunks"] = 2
        cases.append(MoeCase(tokens=tokens, hidden=256, inter=192, experts=4, top_k=4, dtype=dtype,
                             routing="distinct", seed=i, schedule=schedule))  # fmt: skip
    for per_rank in run_ranks(run_cases, 2, cases, backend="nccl"):
        for case, errs in zip(cases, per_rank, strict=True):
            assert errs.pop("y_dtype") == 0
            assert max(errs.values()) < CASE_TOL[case.dtype], (case.schedule["engine"], errs)
