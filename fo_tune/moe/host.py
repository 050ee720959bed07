"""The expert-parallel FFN's host times on one rank: what the MoE cost model's host terms read.

``fo-tune calibrate --only moe_host`` (``MoeHostTask`` -> the calibration's ``MoeHost`` record)
and ``bench/moe_host.py`` (``measure_shape``, one CSV row per shape and chunks) measure them with
this code. For one rank's experts (E / EP of them, bf16, tokens x k rows routed by a seeded top-k
over them), three host times, each the median over ``reps`` calls issued with the device idle
before each (``time.perf_counter`` around the call; the device's work is not waited for):

    phase1   Stage.first of one piece: unpack, the up grouped GEMM, SwiGLU (the copy engine's
             Phase 1, as its list issues it for each piece; ``chunks`` pieces of the experts)
    phase2   Stage.second of one piece: the down grouped GEMM, pack (its Phase 2)
    call     fo_kernels.expert_parallel_ffn at world size 1 (a group of one rank, no schedule:
             the no-overlap path): checks, routing, stages, both phases on every row, the
             weighted sum

The record holds the median of each over ``HOST_SHAPES`` (``QUICK_SHAPES`` with ``--quick``;
``CPU_SHAPES`` on the CPU, where the pipeline runs and the numbers describe the CPU). Host time
depends on the host CPU and the software, hardly on the GPU or the rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fo_tune.calibrate.section import MoeHost
from fo_tune.output import Reporter
from fo_tune.ranks.pool import Pool, RankContext

# Pieces the copy engine cuts a source's experts into (its search space's first two, as
# search_spaces/moe/hopper.yaml's copy_engine chunks begin).
CHUNKS = (1, 2)
# The dtype of the suite (suites/moe/experts.yaml) and of the constants the record replaces: the
# one whose grouped GEMMs run torch._grouped_mm on a GPU (fo_kernels.moe.grouped; others a loop).
HOST_DTYPE = "bfloat16"
# Calls per median (the bench's --reps default), fewer with --quick and on the CPU (the CPU's
# numbers only show the pipeline runs).
HOST_REPS = 30
QUICK_REPS = 10
CPU_REPS = 3
# The seed of a shape's inputs: EP x this + tokens (any fixed seed: the routing is the same run to
# run).
SEED_STRIDE = 7919


@dataclass(frozen=True, kw_only=True, slots=True)
class HostShape:
    """One rank's experts of ``model`` at expert parallelism ``ep`` with ``tokens`` tokens: its
    ``experts`` // ``ep`` experts of hidden size ``hidden`` and intermediate size ``intermediate``,
    ``top_k`` experts a token."""

    model: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    ep: int
    tokens: int

    @classmethod
    def of(cls, model: dict[str, Any], ep: int, tokens: int) -> HostShape:
        """The shape of a suites/moe/experts.yaml model at ``ep`` and ``tokens``."""
        keys = ("hidden", "intermediate", "experts", "top_k")
        return cls(model=model["name"], ep=ep, tokens=tokens, **{k: model[k] for k in keys})

    @property
    def local(self) -> int:
        """The rank's experts."""
        return self.experts // self.ep

    @property
    def seed(self) -> int:
        return self.ep * SEED_STRIDE + self.tokens

    def label(self) -> str:
        return f"{self.model} EP {self.ep} at {self.tokens} tokens"


# The calibration's shapes, from suites/moe/experts.yaml (a test checks they match it): three models
# whose ranks span the suite's experts a rank holds and experts a token, Llama-4-Maverick at EP 8
# (16 local experts, top 1), Mixtral-8x7B at EP 8 (one wide expert) and Qwen3-30B-A3B at EP 4
# (32 small ones, top 8), at decode-like and prefill-like tokens a rank (64 and 512, the
# bench's default). On one H100's host (results/bench/nvidia-h100-80gb-hbm3-cc90-132sm-w1-single/
# moe_host.csv) their medians, phase 1 0.125 ms, phase 2 0.086, a call 0.670, are within 1% of
# those of all six models at EP 4 and 8 (0.125, 0.086, 0.674), at a quarter of the shapes; the
# quick ones' (0.126, 0.088, 0.647) within 4%. The largest, Maverick's 16 experts, holds 4 GB.
HOST_SHAPES = tuple(
    HostShape(model=name, hidden=h, intermediate=i, experts=e, top_k=k, ep=ep, tokens=tokens)
    for name, h, i, e, k, ep in (
        ("Llama-4-Maverick", 5120, 8192, 128, 1, 8),
        ("Mixtral-8x7B", 4096, 14336, 8, 2, 8),
        ("Qwen3-30B-A3B", 2048, 768, 128, 8, 4),
    )
    for tokens in (64, 512)
)
# --quick: the decode-like tokens only.
QUICK_SHAPES = tuple(s for s in HOST_SHAPES if s.tokens == 64)
# The CPU (Triton's interpreter, gloo): a tiny experts block, two chunks of its 4 local experts.
CPU_SHAPES = (HostShape(model="cpu", hidden=32, intermediate=16, experts=4, top_k=2, ep=1, tokens=8),)


def _idle(device: torch.device) -> None:
    """Wait for ``device``'s work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_host_ms(
    fn: Callable[[], Any], reps: int, device: torch.device, setup: Callable[[], Any] = lambda: None
) -> float:
    """Median host ms of ``fn()`` over ``reps`` calls, each after ``setup()`` with the device idle;
    one call before them loads the kernels and allocates the memory."""
    setup()
    fn()
    times = []
    for _ in range(reps):
        setup()
        _idle(device)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    _idle(device)
    return statistics.median(times)


def rank_inputs(shape: HostShape, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One rank's tokens, routing over its local experts, and those experts' weights (bf16)."""
    gen = torch.Generator(device=device).manual_seed(shape.seed)
    h, inter, local = shape.hidden, shape.intermediate, shape.local
    kind = getattr(torch, HOST_DTYPE)
    x = torch.randn(shape.tokens, h, device=device, dtype=kind, generator=gen)
    logits = torch.randn(shape.tokens, local, device=device, generator=gen)
    w, ids = logits.softmax(-1).topk(min(shape.top_k, local), dim=-1)
    w13 = torch.randn(local, h, 2 * inter, device=device, dtype=kind, generator=gen) / h**0.5
    w2 = torch.randn(local, inter, h, device=device, dtype=kind, generator=gen) / inter**0.5
    return x, ids, w, w13, w2


def measure_shape(
    shape: HostShape, reps: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> list[dict[str, Any]]:
    """The host times of one shape, a row per ``CHUNKS`` count that leaves no piece empty:
    model, ep, tokens, experts_local, chunks, rows (the piece's), phase1_host_ms, phase2_host_ms,
    call_host_ms (see the module docstring). ``group``: a group of this rank alone (None: the
    default group, of world size 1)."""
    from fo_kernels import expert_parallel_ffn
    from fo_kernels.moe.exchange import Layout
    from fo_kernels.moe.routing import check_call, route
    from fo_kernels.moe.stages import ForwardStage

    x, ids, w, w13, w2 = rank_inputs(shape, device)
    ffn = check_call(x, ids, w, w13, w2, 1)
    routing = route(ids, ffn)
    layout = Layout(0, routing.host_counts, routing.host_counts, (ffn.tokens,))
    call = median_host_ms(lambda: expert_parallel_ffn(x, ids, w, w13, w2, group=group), reps, device)
    out = []
    for chunks in CHUNKS:
        if chunks > ffn.experts:
            continue
        piece = (0, 0, ffn.experts // chunks)  # the first of ``chunks`` pieces
        stage = ForwardStage(x, w, ffn, routing, layout, w13, w2)
        r0, r1 = stage.piece_rows(piece)
        rows = stage.outgoing()[r0:r1]
        phase1 = median_host_ms(lambda s=stage, p=piece, q=rows: s.first([p], q), reps, device)
        # (each phase 2 pops what a phase 1 kept: one runs, untimed, before each)
        phase2 = median_host_ms(
            lambda s=stage, p=piece: s.second([p]),
            reps,
            device,
            setup=lambda s=stage, p=piece, q=rows: s.first([p], q),
        )
        out.append(
            dict(
                model=shape.model,
                ep=shape.ep,
                tokens=shape.tokens,
                experts_local=ffn.experts,
                chunks=chunks,
                rows=r1 - r0,
                phase1_host_ms=phase1,
                phase2_host_ms=phase2,
                call_host_ms=call,
            )
        )
    return out


@dataclass(frozen=True)
class MoeHostTask:
    """The rows of ``measure_shape`` for every one of ``shapes``, measured by rank 0 alone on a
    group of its own (the other ranks make the group with it, then return None)."""

    shapes: tuple[HostShape, ...]
    reps: int

    def run(self, ctx: RankContext) -> list[dict[str, Any]] | None:
        # every rank of the pool takes part in making a group (torch's rule), rank 0 alone in it
        group = dist.new_group([0]) if ctx.world_size > 1 else None
        if ctx.rank != 0:
            return None
        try:
            rows = [r for shape in self.shapes for r in measure_shape(shape, self.reps, ctx.device, group)]
        finally:
            if group is not None:
                dist.destroy_process_group(group)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # (the experts' weights: gigabytes the next part may need)
        return rows


def host_record(rows: Sequence[dict[str, Any]], shapes: Sequence[HostShape], reps: int) -> MoeHost:
    """The record of ``MoeHostTask``'s rows: the median phase times over every row, the median
    call time over the shapes (each shape's rows repeat its call)."""
    calls = {(r["model"], r["ep"], r["tokens"]): r["call_host_ms"] for r in rows}
    return MoeHost(
        phase1_ms=statistics.median(r["phase1_host_ms"] for r in rows),
        phase2_ms=statistics.median(r["phase2_host_ms"] for r in rows),
        call_ms=statistics.median(calls.values()),
        shapes="; ".join(s.label() for s in shapes),
        reps=reps,
    )


def measure_moe_host(pool: Pool, quick: bool, cpu: bool, rep: Reporter) -> MoeHost:
    """``fo-tune calibrate``'s ``moe_host`` part on ``pool`` (see the module docstring)."""
    shapes = CPU_SHAPES if cpu else QUICK_SHAPES if quick else HOST_SHAPES
    reps = CPU_REPS if cpu else QUICK_REPS if quick else HOST_REPS
    rep.stage("MoE host times", 1)
    record = host_record(pool.run(MoeHostTask(shapes, reps))[0], shapes, reps)
    rep.step("MoE host times", f"{len(shapes)} shapes, {reps} calls a median")
    return record
