"""GEMM measurement tasks: the signalled GEMM of every tile config beside cuBLAS (profiles) and the
best reduced grids, each GEMM checked against ``torch.matmul`` before it is timed, the checks'
tolerances (``GEMM_TOL``) and the operands' seeds (``operand_seed``). fp8 operands (``--dtype
float8_e4m3fn``) come with the tuner's scales of the task's ``scaling`` (``fo_tune.ranks.scaled``;
rowwise unless named): the signalled GEMM beside ``torch._scaled_mm``, both given the same scales,
checked against the float32 product of the dequantized operands.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.gemm import BOperand, signalled_gemm
from fo_kernels.plan import cdiv, make_plan
from fo_kernels.runtime import runtime_for
from fo_kernels.schedule import Problem, Schedule, torch_dtype
from fo_kernels.tile import Tile
from fo_tune.ranks.pool import RankContext
from fo_tune.ranks.scaled import TUNE_SCALING, dequantized, library_mm, out_dtype, scale_kwargs, scales_of
from fo_tune.ranks.timing import comparison_sample_ms, time_interleaved

# The multiplier ``operand_seed`` folds each index in with: a prime above the indices folded in
# (input sets, shapes of a run, ranks), so each (seed, index, ..., rank) gets its own operands.
SEED_FOLD = 1009
# Relative error a checked GEMM must stay under, per dtype (fp32 accumulation; docs/design.md#timing;
# fp8's output is bfloat16, and its reference the product of the dequantized operands).
GEMM_TOL = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-4, "float8_e4m3fn": 1e-2}


def gemm_runner(
    a: torch.Tensor,
    b: torch.Tensor,
    tile: Tile,
    sms_free: int,
    sm_count: int,
    kw: dict[str, Any] | None = None,
) -> tuple[Callable[[], torch.Tensor], int]:
    """The signalled persistent GEMM alone (one group, private counters): (run, grid); fp8
    operands with ``kw``'s scales (``scale_kwargs``), ``TUNE_SCALING``'s when None, so a
    caller that times the library GEMM with ``kw`` gives both the same scales."""
    m, k = a.shape
    n = b.shape[1]
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    schedule = Schedule(
        collective="all_reduce",
        dtype="bfloat16",
        world_size=1,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=tile, sms_free=sms_free, signal_tiles=tiles, groups=(1,), layout="row_band"
        ),
    )
    plan = make_plan(schedule, m, n, k, sm_count=sm_count)
    counters = torch.zeros(4, dtype=torch.int32, device=a.device)
    unit_group = torch.zeros(1, dtype=torch.int32, device=a.device)
    group_info = torch.tensor([0, m], dtype=torch.int32, device=a.device)
    out = torch.empty(m * n, dtype=out_dtype(a), device=a.device)
    operand = BOperand.of(b)
    assert operand is not None
    scales = scales_of("all_reduce", a, b, scale_kwargs(a, b) if kw is None else kw)

    def run() -> torch.Tensor:
        signalled_gemm(
            a, operand, out, plan, tile, counters=counters, unit_group=unit_group, group_info=group_info,
            scales=scales,
        )  # fmt: skip
        return out.view(m, n)

    return run, plan.grid


def operand_seed(seed: int, *parts: int) -> int:
    """One generator seed for a run's ``seed`` and the indices of what it makes operands for (a
    shape, an input set, the rank): ``(seed * SEED_FOLD + parts[0]) * SEED_FOLD + ...``."""
    for part in parts:
        seed = seed * SEED_FOLD + part
    return seed


def gemm_operands(m: int, n: int, k: int, dtype: str, device: torch.device, seed: int) -> tuple:
    """Random (never zero) A (M, K) and B as the transposed view of an (N, K) weight."""
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: large shapes stay fast
    a = torch.randn(m, k, generator=gen, device=device).to(torch_dtype(dtype))
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(torch_dtype(dtype))
    return a, w.t()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``|got - ref| / |ref|`` (Frobenius norms); ``inf`` when ``got`` holds a NaN or an infinity,
    so that a max over ranks or runs can never hide it (Python's ``max`` skips a NaN that is not
    first: ``max(0.002, nan)`` is 0.002, which would pass one rank's NaN output)."""
    err = ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if math.isfinite(err) else math.inf


def worst_error(errors: Sequence[float]) -> float:
    """The largest of ``errors``, NaN if any is NaN (a check that did not run, or one computed
    without ``rel_err``): Python's ``max`` would return the first argument over a later NaN."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _gemm_problem(m: int, n: int, k: int, dtype: str, scaling: str, device: torch.device) -> tuple:
    """(SMs, A, B, the ops' keyword arguments, float32 reference A @ B, the library's GEMM) of one
    shape, the operands seeded by the shape, so that every task of a shape measures the same problem
    (fp8: ``scaling``'s scales in the keyword arguments, which the signalled GEMM takes too, the
    reference of the dequantized operands, ``torch._scaled_mm``)."""
    a, b = gemm_operands(m, n, k, dtype, device, seed=m + n + k)
    kw = scale_kwargs(a, b, scaling)
    a32, b32 = dequantized(a, b, kw)
    return runtime_for(device, None).sm_count, a, b, kw, a32 @ b32, lambda: library_mm(a, b, kw)


@dataclass(frozen=True)
class GemmProfileTask:
    """Every tile config at every grid for one shape, checked, then timed beside cuBLAS: each
    config and cuBLAS in alternating back-to-back samples (``time_interleaved``, the comparison
    sample length), so both run at the card's sustained (power-limited) clock and each row's
    ``cublas`` is its own paired baseline. ``graphs``: each sample replays a CUDA graph of its
    calls (``time_interleaved(graphs=True)``), so a call whose host time exceeds its GPU time is
    timed by the GPU's; the output the timed calls wrote is checked again (poisoned before).
    ``scaling``: fp8 operands' scales (``fo_tune.ranks.scaled.SCALINGS``); other dtypes ignore it."""

    m: int
    n: int
    k: int
    tiles: tuple[Tile, ...]
    sms_free: tuple[int, ...]
    dtype: str
    warmup: int = 3
    reps: int = 10
    graphs: bool = False
    scaling: str = TUNE_SCALING

    def run(self, ctx: RankContext) -> dict[str, Any]:
        sm_count, a, b, kw, ref, library = _gemm_problem(
            self.m, self.n, self.k, self.dtype, self.scaling, ctx.device
        )
        sample_ms = comparison_sample_ms(ctx.device.type == "cuda")
        cublas = time_interleaved(
            {"cublas": library}, ctx.device, warmup=self.warmup, rounds=self.reps, graphs=self.graphs
        )["cublas"]
        rows = []
        for tile in self.tiles:
            for r in self.sms_free:
                row: dict[str, Any] = dict(tile=tile, sms_free=r, grid=0, timing=None, rel_err=float("nan"))
                try:
                    if r >= sm_count:
                        raise ValueError(f"sms_free {r} leaves no SM of {sm_count}")
                    run, row["grid"] = gemm_runner(a, b, tile, r, sm_count, kw)
                    out, row["rel_err"] = _checked_run(run, ref, self.dtype)
                    paired = time_interleaved(
                        {"gemm": run, "cublas": library},
                        ctx.device,
                        warmup=self.warmup,
                        rounds=self.reps,
                        min_sample_ms=sample_ms,
                        graphs=self.graphs,
                        before_samples=lambda out=out: out.fill_(float("nan")),  # the timed calls write it
                    )
                    row["rel_err"] = max(row["rel_err"], _checked(out, ref, self.dtype))
                    row["timing"], row["cublas"] = paired["gemm"], paired["cublas"]
                    row["status"] = "ok"
                except Exception as exc:  # a config that fails to compile or launch is skipped, with why
                    row["status"] = f"skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                rows.append(row)
        return {"cublas": cublas, "rows": rows}


def _checked_run(
    run: Callable[[], torch.Tensor], ref: torch.Tensor, dtype: str, what: str = ""
) -> tuple[torch.Tensor, float]:
    """(the output of one call of ``run``, its relative error; ``_checked``), the output poisoned by
    a call before: a tile the checked call does not write fails the check."""
    run().fill_(float("nan"))
    out = run()
    return out, _checked(out, ref, dtype, what)


def _checked(out: torch.Tensor, ref: torch.Tensor, dtype: str, what: str = "") -> float:
    """``out``'s relative error against ``ref``; ValueError beyond the dtype's tolerance, its
    message led by ``what`` (the config and when)."""
    err = rel_err(out, ref)
    if not err < GEMM_TOL[dtype]:
        raise ValueError(f"{what}wrong result (relative error {err:.2e})")
    return err


@dataclass(frozen=True)
class GemmGridsTask:
    """A few (tile, sms_free) configs of one shape, each checked against a float32 matmul (output
    poisoned first), then all of them and cuBLAS timed in one interleaved run (``time_interleaved``,
    the comparison sample length), so their ratios share one clock: ``GemmProfileTask`` times each
    config beside cuBLAS only, and ratios across its timings move with the card's drift. The
    outputs the timed calls wrote are checked again; ``graphs`` and ``scaling`` as
    ``GemmProfileTask``'s."""

    m: int
    n: int
    k: int
    configs: tuple[tuple[Tile, int], ...]
    dtype: str
    warmup: int = 3
    reps: int = 10
    graphs: bool = False
    scaling: str = TUNE_SCALING

    def run(self, ctx: RankContext) -> dict[str, Any]:
        sm_count, a, b, kw, ref, library = _gemm_problem(
            self.m, self.n, self.k, self.dtype, self.scaling, ctx.device
        )
        fns: dict[str, Callable[[], Any]] = {"cublas": library}
        rows, outs = [], []
        for i, (tile, r) in enumerate(self.configs):
            run, grid = gemm_runner(a, b, tile, r, sm_count, kw)
            out, err = _checked_run(run, ref, self.dtype, f"{tile.label()} on {grid} programs: ")
            fns[str(i)] = run
            outs.append(out)
            rows.append(dict(tile=tile, sms_free=r, grid=grid, rel_err=err))
        sample_ms = comparison_sample_ms(ctx.device.type == "cuda")

        def poison() -> None:  # after the warm-up and sizing calls: the timed calls must write it all
            for out in outs:
                out.fill_(float("nan"))

        timings = time_interleaved(
            fns,
            ctx.device,
            warmup=self.warmup,
            rounds=self.reps,
            min_sample_ms=sample_ms,
            graphs=self.graphs,
            before_samples=poison,
        )
        for i, row in enumerate(rows):
            what = f"{row['tile'].label()} on {row['grid']} programs, after the timed calls: "
            row["rel_err"] = max(row["rel_err"], _checked(outs[i], ref, self.dtype, what))
            row["timing"] = timings[str(i)]
        return {"rows": rows, "cublas": timings["cublas"]}
