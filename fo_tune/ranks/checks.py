"""A schedule's correctness check on the ranks, and the calls the search's tasks time.

The op of a schedule's collective on (M, N, K), M the GEMM's rows:

    all_reduce, reduce_scatter   a (M, K), b (K, N) per rank: collective(a @ b)
        reference: collective(a.float() @ b.float())
    all_gather                   a (M/w, K): this rank's shard; b (K, N) per rank: all_gather(a) @ b
        reference: all_gather(a.float()) @ b.float()   (rank r's shard at rows [r*M/w, (r+1)*M/w))

and GEMM then the collective (all_gather: the gather, then the GEMM) as the sequential baseline.
A schedule passes when no output holds a NaN and the relative error stays under ``GEMM_TOL`` on
every rank, on ``CHECK_INPUT_SETS`` input sets, each output poisoned with NaN once checked. fp8
operands come with the tuner's scales (``fo_tune.ranks.scaled.scale_kwargs``, passed to every
call), the references take the dequantized operands, the baseline's GEMM is ``torch._scaled_mm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from fo_kernels.collectives import all_gather_tensor, reduce_scatter_tensor
from fo_kernels.scaling import wire
from fo_kernels.schedule import Schedule
from fo_tune.ranks.gemm import gemm_operands, operand_seed, rel_err
from fo_tune.ranks.pool import RankContext
from fo_tune.ranks.scaled import dequantized, library_mm, scale_kwargs


def _collective_fp32(collective: str, full: torch.Tensor, world: int) -> torch.Tensor:
    """The float32 reference collective of a full (M, N) product (default process group)."""
    if collective == "all_reduce":
        dist.all_reduce(full)
        return full
    out = torch.empty((full.shape[0] // world, full.shape[1]), dtype=full.dtype, device=full.device)
    reduce_scatter_tensor(out, full)
    return out


def gathered_rows(shard: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's (rows, K) ``shard`` gathered on dim 0, rank r's at rows [r*rows, (r+1)*rows)
    (fp8 as its bytes, as the runtime gathers it)."""
    out = torch.empty((shard.shape[0] * world, shard.shape[1]), dtype=shard.dtype, device=shard.device)
    all_gather_tensor(wire(out), wire(shard.contiguous()))
    return out


def call_operands(
    collective: str, m: int, n: int, k: int, dtype: str, device: torch.device, seed: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's operands of one call on (m, n, k): A (M, K), or for all_gather this rank's
    (M/w, K) shard; B (K, N) (``gemm_operands``)."""
    return gemm_operands(m // world if collective == "all_gather" else m, n, k, dtype, device, seed)


def reference(collective: str, a: torch.Tensor, b: torch.Tensor, world: int) -> torch.Tensor:
    """The op's result in float32 (the module docstring; fp8: of the dequantized operands); every
    rank calls it at once."""
    a32, b32 = dequantized(a, b, scale_kwargs(a, b))
    if collective == "all_gather":
        return gathered_rows(a32, world) @ b32
    return _collective_fp32(collective, a32 @ b32, world)


# Operand sets each schedule is checked on before it is timed: the op allocates its output with
# torch.empty, which can hand back a block still holding the previous correct result; a second,
# different input set makes such a stale result fail the check.
CHECK_INPUT_SETS = 2


def op_of(collective: str) -> Callable[..., torch.Tensor]:
    """The fo_kernels op of ``collective``: ``gemm_all_reduce``, ``gemm_reduce_scatter`` or
    ``all_gather_gemm``."""
    from fo_kernels.overlap import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter

    ops = {
        "all_reduce": gemm_all_reduce,
        "reduce_scatter": gemm_reduce_scatter,
        "all_gather": all_gather_gemm,
    }
    return ops[collective]


def check_schedule(ctx: RankContext, s: Schedule, m: int, n: int, k: int, seed: int) -> float:
    """The worst relative error of ``s`` over ``CHECK_INPUT_SETS`` fresh inputs (inf on NaN),
    the max over ranks (every rank learns whether to time it). Each output is poisoned with NaN
    once checked: a later call handed the same block that writes nothing then reads NaN."""
    op = op_of(s.collective)
    worst = 0.0
    for i in range(CHECK_INPUT_SETS):
        a, b = call_operands(
            s.collective, m, n, k, s.dtype, ctx.device, operand_seed(seed, i, ctx.rank), ctx.world_size
        )
        out = op(a, b, schedule=s, **scale_kwargs(a, b))
        ref = reference(s.collective, a, b, ctx.world_size)
        worst = max(worst, math.inf if bool(out.isnan().any()) else rel_err(out, ref))
        out.fill_(math.nan)
        del out
    flag = torch.tensor([worst], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag.item())


def sequential_call(
    collective: str, a: torch.Tensor, b: torch.Tensor, world: int
) -> Callable[[], torch.Tensor]:
    """cuBLAS GEMM (fp8: ``torch._scaled_mm``), then the collective on NCCL's default communicator
    (all_gather: the gather of the shard ``a``, then the GEMM)."""
    m, n = a.shape[0], b.shape[1]
    kw = scale_kwargs(a, b)
    if collective == "all_gather":
        gathered_kw = {**kw, "scale_a": kw["scale_a"].repeat(world, 1)} if kw else kw
        return lambda: library_mm(gathered_rows(a, world), b, gathered_kw)

    def run() -> torch.Tensor:
        out = library_mm(a, b, kw)
        if collective == "all_reduce":
            dist.all_reduce(out)
            return out
        part = torch.empty((m // world, n), dtype=out.dtype, device=out.device)
        reduce_scatter_tensor(part, out)
        return part

    return run
