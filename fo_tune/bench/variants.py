"""The ways to run GEMM + collective that the bench compares, each built as a call on one rank.

    gemm        a @ b (no collective)
    collective  the collective alone on the full (M, N) buffer, default group
    sequential  GEMM, then the collective
    chunked     M split into C row chunks: GEMM chunk j on the caller's stream, an event, the
                collective of chunk j on the high-priority stream after it; for ReduceScatter chunk
                j holds rows j*S/C..(j+1)*S/C of every shard (S = M/w), GEMMed by one strided
                batched GEMM, so rank r still gets rows [r*S, (r+1)*S)
    async_tp    torch.ops.symm_mem.fused_matmul_reduce_scatter (ReduceScatter, CUDA and NCCL only)
    fo_tune     fo_kernels.gemm_all_reduce / gemm_reduce_scatter, schedule=None (the table row for
                the shape, else overlap: false)

On the CPU (gloo) there is no second stream: the chunks run one after the other.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fo_kernels.errors import EnvironmentMismatchError, FoTuneError, HeuristicScheduleWarning
from fo_kernels.runtime import reduce_scatter_tensor, runtime_for
from fo_kernels.schedule import torch_dtype

from ..launch import RankContext

Call = Callable[[], torch.Tensor]


def reason(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 160 characters): why a variant cannot run."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}".rstrip(": ")


def splits(total: int, parts: int) -> list[int]:
    """``parts + 1`` row boundaries splitting ``total`` rows as evenly as integers allow."""
    return [i * total // parts for i in range(parts + 1)]


def collective_of(
    collective: str, full: torch.Tensor, group: Any = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The collective of the (M, N) buffer ``full``: in place (all_reduce) or into ``out``."""
    if collective == "all_reduce":
        dist.all_reduce(full, group=group)
        return full
    if out is None:
        rows = full.shape[0] // dist.get_world_size()
        out = torch.empty((rows, full.shape[1]), dtype=full.dtype, device=full.device)
    reduce_scatter_tensor(out, full, group=group)
    return out


def collective_alone(collective: str, dtype: str, local: torch.Tensor) -> Call:
    """The collective on the reference GEMM result in ``dtype`` (so its check means something)."""
    full = local.to(torch_dtype(dtype))
    out = torch.empty((full.shape[0] // dist.get_world_size(), full.shape[1]), dtype=full.dtype,
                      device=full.device)  # fmt: skip
    return lambda: collective_of(collective, full, None, out)


def sequential(collective: str, a: torch.Tensor, b: torch.Tensor) -> Call:
    """cuBLAS into a preallocated (M, N) buffer, then the collective."""
    m, n = a.shape[0], b.shape[1]
    full = torch.empty((m, n), dtype=a.dtype, device=a.device)
    out = torch.empty((m // dist.get_world_size(), n), dtype=a.dtype, device=a.device)

    def run() -> torch.Tensor:
        torch.mm(a, b, out=full)
        return collective_of(collective, full, None, out)

    return run


def chunked(collective: str, ctx: RankContext, a: torch.Tensor, b: torch.Tensor, c: int) -> Call:
    """GEMM chunk j on the caller's stream, an event, its collective on the high-priority stream.

    The collectives use the runtime's high-priority NCCL group with NCCL's default CTA count
    (``OverlapRuntime.comm_group(0)``, as the overlapped ops do); gloo's default group on the CPU.
    """
    rt = runtime_for(ctx.device, None)
    side = rt.comm_stream
    gemms, comms, result = _chunk_calls(collective, a, b, c, rt.comm_group(0), ctx.world_size)
    if side is None:  # the CPU: one after the other

        def serial() -> torch.Tensor:
            for gemm, comm in zip(gemms, comms, strict=True):
                gemm()
                comm()
            return result

        return serial
    events = [torch.cuda.Event() for _ in range(c)]

    def overlapped() -> torch.Tensor:
        main = torch.cuda.current_stream(ctx.device)
        side.wait_stream(main)  # the buffers are free: the previous call's readers are done
        for gemm, comm, event in zip(gemms, comms, events, strict=True):
            gemm()
            event.record(main)
            with torch.cuda.stream(side):
                side.wait_event(event)
                comm()
        main.wait_stream(side)
        return result

    return overlapped


def _chunk_calls(
    collective: str, a: torch.Tensor, b: torch.Tensor, c: int, group: Any, w: int
) -> tuple[list[Callable[[], Any]], list[Callable[[], Any]], torch.Tensor]:
    """Per chunk: its GEMM and its collective (on views made once), and the output."""
    (m, k), n = a.shape, b.shape[1]
    if collective == "all_reduce":  # chunk j = rows bounds[j]..bounds[j+1] of the output
        bounds = splits(m, c)
        full = torch.empty((m, n), dtype=a.dtype, device=a.device)
        parts = [(a[r0:r1], full[r0:r1]) for r0, r1 in itertools.pairwise(bounds)]
        gemms = [functools.partial(torch.mm, ai, b, out=oi) for ai, oi in parts]
        comms = [functools.partial(dist.all_reduce, oi, group=group) for _, oi in parts]
        return gemms, comms, full
    # chunk j = rows bounds[j]..bounds[j+1] of every shard, laid out shard after shard: one
    # strided batched GEMM writes it, and its reduce_scatter gives rank r those rows of shard r
    shard = m // w
    bounds = splits(shard, c)
    a3, b3 = a.view(w, shard, k), b.expand(w, k, n)  # b3: batch stride 0, no copy
    result = torch.empty((shard, n), dtype=a.dtype, device=a.device)
    gemms, comms = [], []
    for s0, s1 in itertools.pairwise(bounds):
        buf = torch.empty((w, s1 - s0, n), dtype=a.dtype, device=a.device)
        gemms.append(functools.partial(torch.bmm, a3[:, s0:s1], b3, out=buf))
        comms.append(functools.partial(reduce_scatter_tensor, result[s0:s1], buf.view(-1, n), group=group))
    return gemms, comms, result


def async_tp(ctx: RankContext, a: torch.Tensor, b: torch.Tensor) -> Call:
    """PyTorch async-TP: ``fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0, group_name)``;
    raises ``EnvironmentMismatchError`` off CUDA and NCCL."""
    if ctx.device.type != "cuda" or ctx.backend != "nccl":
        raise EnvironmentMismatchError(f"needs CUDA GPUs and NCCL, this run uses {ctx.backend} on the CPU")
    from torch.distributed import _symmetric_memory as symm_mem

    op = torch.ops.symm_mem.fused_matmul_reduce_scatter
    name = dist.group.WORLD.group_name
    with warnings.catch_warnings():  # deprecated (a no-op) from torch 2.11, needed before
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(name)
    return lambda: op(a, b, "sum", 0, name)  # reduce_op, scatter_dim, group_name


def fo_tune_schedule(
    collective: str, m: int, n: int, k: int, dtype: str, ctx: RankContext
) -> tuple[str, str]:
    """(source, detail) of the schedule ``fo_tune`` runs: ``table``, or ``no table row`` (the runtime
    then runs overlap: false), and its description; ("", why) when the lookup refuses (e.g. a table
    for other hardware)."""
    from fo_kernels import lookup_schedule
    from fo_kernels.table import MISS_SOURCE

    with warnings.catch_warnings():  # the source is recorded instead
        warnings.simplefilter("ignore", HeuristicScheduleWarning)
        try:
            schedule = lookup_schedule(collective, m, n, k, dtype=dtype, world_size=ctx.world_size,
                                       device=ctx.device)  # fmt: skip
        except FoTuneError as exc:  # the same on every rank
            return "", reason(exc)
    source = MISS_SOURCE if schedule.provenance.get("source") == MISS_SOURCE else "table"
    return source, schedule.describe()


def fo_tune(collective: str, a: torch.Tensor, b: torch.Tensor) -> Call:
    """The runtime's op with ``schedule=None`` (the caller ignores its ``HeuristicScheduleWarning``:
    the row records the schedule's source)."""
    from fo_kernels import gemm_all_reduce, gemm_reduce_scatter

    op = gemm_all_reduce if collective == "all_reduce" else gemm_reduce_scatter
    return lambda: op(a, b, schedule=None)
