"""The ways to run GEMM + collective that the bench compares, each built as a call on one rank.

For all_reduce and reduce_scatter the op is ``collective(a @ b)``; for all_gather it is
``all_gather(a) @ b`` with ``a`` this rank's (M/w, K) shard and M the gathered rows.

    gemm         the full (M, N, K) GEMM alone (all_gather: the gathered A @ b)
    collective   the collective alone, default group: all_reduce / reduce_scatter of the (M, N)
                 GEMM result, all_gather of the (M/w, K) shard into (M, K)
    sequential   GEMM, then the collective (all_gather: the gather, then the GEMM)
    chunked      M split into C row chunks on two streams. all_reduce: GEMM chunk j on the
                 caller's stream, an event, its collective on the high-priority stream after it.
                 reduce_scatter: chunk j holds rows j*S/C..(j+1)*S/C of every shard (S = M/w),
                 GEMMed by one strided batched GEMM, so rank r still gets rows [r*S, (r+1)*S).
                 all_gather, the other way round: the gather of rows j*S/C..(j+1)*S/C of every
                 shard on the high-priority stream, an event, then one strided batched GEMM of
                 those rows into their places in the (M, N) output on the caller's stream
    async_tp     torch.ops.symm_mem.fused_matmul_reduce_scatter (reduce_scatter; fp8:
                 fused_scaled_matmul_reduce_scatter)
    torch_fused  torch.ops.symm_mem.fused_all_gather_matmul (all_gather; fp8:
                 fused_all_gather_scaled_matmul)
    fo_tune      fo_kernels.gemm_all_reduce / gemm_reduce_scatter / all_gather_gemm, schedule=None
                 (the table row for the shape, else overlap: false)

Buffers a call writes into are made once, full of NaN: a call that leaves part of its output
unwritten fails its check. On the CPU (gloo) there is no second stream: the chunks run one after
the other.

fp8 (``kw``: the operands' scales, ``fo_tune.ranks.scaled``): every GEMM is ``torch._scaled_mm``
(the chunks' GEMMs one per chunk and shard: torch has no batched scaled GEMM), its output
bfloat16; gathers move the fp8 bytes.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fo_kernels.collectives import all_gather_tensor, reduce_scatter_tensor
from fo_kernels.errors import EnvironmentMismatchError, FoTuneError, HeuristicScheduleWarning
from fo_kernels.runtime import runtime_for
from fo_kernels.scaling import wire
from fo_kernels.table import MISS_SOURCE
from fo_tune.bench.operands import collective_of
from fo_tune.ranks.pool import RankContext
from fo_tune.ranks.scaled import library_mm, out_dtype

Call = Callable[[], torch.Tensor]


def reason(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 160 characters): why a variant cannot run."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}".rstrip(": ")


def splits(total: int, parts: int) -> list[int]:
    """``parts + 1`` row boundaries splitting ``total`` rows as evenly as integers allow."""
    return [i * total // parts for i in range(parts + 1)]


def poisoned(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A buffer of ``shape`` in ``dtype`` (default ``like``'s) on ``like``'s device, full of NaN
    (bytes: 0xff, an fp8 NaN)."""
    dtype = dtype or like.dtype
    if not dtype.is_floating_point:
        return torch.full(shape, 255, dtype=dtype, device=like.device)
    return torch.full(shape, math.nan, dtype=torch.float32, device=like.device).to(dtype)


def _rows_kw(kw: dict[str, Any], r0: int, r1: int) -> dict[str, Any]:
    """``kw``'s scales of A's rows [r0, r1) ({} stays {})."""
    return {**kw, "scale_a": kw["scale_a"][r0:r1]} if kw else kw


def collective_alone(collective: str, src: torch.Tensor) -> Call:
    """The collective of ``src`` (``CaseOperands.comm_in``), on buffers made once."""
    if collective == "all_reduce":
        full = src.clone()  # summed in place, call after call
        return lambda: collective_of(collective, full)
    w = dist.get_world_size()
    rows = src.shape[0] * w if collective == "all_gather" else src.shape[0] // w
    out = poisoned((rows, src.shape[1]), src)
    return lambda: collective_of(collective, src, None, out)


def sequential(collective: str, a: torch.Tensor, b: torch.Tensor, kw: dict[str, Any] | None = None) -> Call:
    """cuBLAS (fp8: ``torch._scaled_mm`` with ``kw``'s scales) into a preallocated (M, N) buffer,
    then the collective; for all_gather the gather into a preallocated (M, K) buffer, then cuBLAS."""
    w, n, kw = dist.get_world_size(), b.shape[1], kw or {}
    if collective == "all_gather":
        gathered = poisoned((a.shape[0] * w, a.shape[1]), a)
        product = poisoned((a.shape[0] * w, n), a, out_dtype(a))
        gathered_kw = {**kw, "scale_a": kw["scale_a"].repeat(w, 1)} if kw else kw

        def gather_then_gemm() -> torch.Tensor:
            collective_of(collective, wire(a), None, wire(gathered))
            return library_mm(gathered, b, gathered_kw, out=product)

        return gather_then_gemm
    full = poisoned((a.shape[0], n), a, out_dtype(a))
    out = poisoned((a.shape[0] // w, n), full)

    def gemm_then_collective() -> torch.Tensor:
        library_mm(a, b, kw, out=full)
        return collective_of(collective, full, None, out)

    return gemm_then_collective


def chunked(
    collective: str,
    ctx: RankContext,
    a: torch.Tensor,
    b: torch.Tensor,
    c: int,
    kw: dict[str, Any] | None = None,
) -> Call:
    """``c`` chunks on two streams: a GEMM chunk, an event, its collective on the high-priority
    stream (all_gather: a chunk's gather there, an event, its GEMM on the caller's stream).

    The collectives use the runtime's high-priority NCCL group with NCCL's default CTA count
    (``OverlapRuntime.comm_group(0)``, as the overlapped ops do); gloo's default group on the CPU.
    """
    rt = runtime_for(ctx.device, None)
    side = rt.comm_stream
    gemms, comms, result = _chunk_calls(collective, a, b, c, rt.comm_group(0), ctx.world_size, kw or {})
    gather_first = collective == "all_gather"
    if side is None:  # the CPU: one after the other

        def serial() -> torch.Tensor:
            for gemm, comm in zip(gemms, comms, strict=True):
                first, then = (comm, gemm) if gather_first else (gemm, comm)
                first()
                then()
            return result

        return serial
    events = [torch.cuda.Event() for _ in range(c)]

    def overlapped() -> torch.Tensor:
        main = torch.cuda.current_stream(ctx.device)
        side.wait_stream(main)  # the buffers are free: the previous call's readers are done
        for gemm, comm, event in zip(gemms, comms, events, strict=True):
            if gather_first:  # the gathers queue on the side stream, each GEMM waits for its own
                with torch.cuda.stream(side):
                    comm()
                event.record(side)
                main.wait_event(event)
                gemm()
                continue
            gemm()
            event.record(main)
            with torch.cuda.stream(side):
                side.wait_event(event)
                comm()
        main.wait_stream(side)
        return result

    return overlapped


def _chunk_calls(
    collective: str, a: torch.Tensor, b: torch.Tensor, c: int, group: Any, w: int, kw: dict[str, Any]
) -> tuple[list[Callable[[], Any]], list[Callable[[], Any]], torch.Tensor]:
    """Per chunk: its GEMM and its collective (on views made once), and the output."""
    (m, k), n = a.shape, b.shape[1]
    if collective == "all_reduce":  # chunk j = rows bounds[j]..bounds[j+1] of the output
        bounds = splits(m, c)
        full = poisoned((m, n), a, out_dtype(a))
        parts = [(r0, r1, full[r0:r1]) for r0, r1 in itertools.pairwise(bounds)]
        gemms = [
            functools.partial(library_mm, a[r0:r1], b, _rows_kw(kw, r0, r1), out=oi) for r0, r1, oi in parts
        ]
        comms = [functools.partial(dist.all_reduce, oi, group=group) for _, _, oi in parts]
        return gemms, comms, full
    if kw:  # fp8: torch has no batched scaled GEMM
        return _scaled_chunk_calls(collective, a, b, c, group, w, kw)
    gemms, comms = [], []
    if collective == "all_gather":
        # chunk j = rows bounds[j]..bounds[j+1] of every shard (a is this rank's (S, K) shard):
        # gathered shard after shard, then GEMMed into those rows of every shard's output block
        shard = m
        out = poisoned((w * shard, n), a)
        out3, b3 = out.view(w, shard, n), b.expand(w, k, n)  # b3: batch stride 0, no copy
        for s0, s1 in itertools.pairwise(splits(shard, c)):
            buf = poisoned((w, s1 - s0, k), a)
            comms.append(functools.partial(all_gather_tensor, buf.view(-1, k), a[s0:s1], group=group))
            gemms.append(functools.partial(torch.bmm, buf, b3, out=out3[:, s0:s1]))
        return gemms, comms, out
    # chunk j = rows bounds[j]..bounds[j+1] of every shard, laid out shard after shard: one
    # strided batched GEMM writes it, and its reduce_scatter gives rank r those rows of shard r
    shard = m // w
    a3, b3 = a.view(w, shard, k), b.expand(w, k, n)
    result = poisoned((shard, n), a)
    for s0, s1 in itertools.pairwise(splits(shard, c)):
        buf = poisoned((w, s1 - s0, n), a)
        gemms.append(functools.partial(torch.bmm, a3[:, s0:s1], b3, out=buf))
        comms.append(functools.partial(reduce_scatter_tensor, result[s0:s1], buf.view(-1, n), group=group))
    return gemms, comms, result


def _scaled_chunk_calls(
    collective: str, a: torch.Tensor, b: torch.Tensor, c: int, group: Any, w: int, kw: dict[str, Any]
) -> tuple[list[Callable[[], Any]], list[Callable[[], Any]], torch.Tensor]:
    """``_chunk_calls`` of reduce_scatter and all_gather in fp8: the chunks as the batched GEMMs
    cut them, each chunk's GEMM one scaled GEMM a shard."""
    (m, k), n = a.shape, b.shape[1]
    gemms, comms = [], []

    def each(calls: list[Callable[[], Any]]) -> Callable[[], None]:
        def run() -> None:
            for call in calls:
                call()

        return run

    if collective == "all_gather":  # a is this rank's (S, K) shard, every shard's scales alike
        shard = m
        out = poisoned((w * shard, n), a, out_dtype(a))
        for s0, s1 in itertools.pairwise(splits(shard, c)):
            buf = poisoned((w, s1 - s0, k), a)
            comms.append(
                functools.partial(all_gather_tensor, wire(buf).view(-1, k), wire(a[s0:s1]), group=group)
            )
            rows = _rows_kw(kw, s0, s1)
            gemms.append(each([
                functools.partial(library_mm, buf[q], b, rows, out=out[q * shard + s0 : q * shard + s1])
                for q in range(w)
            ]))  # fmt: skip
        return gemms, comms, out
    shard = m // w
    result = poisoned((shard, n), a, out_dtype(a))
    for s0, s1 in itertools.pairwise(splits(shard, c)):
        buf = poisoned((w, s1 - s0, n), a, out_dtype(a))
        gemms.append(each([
            functools.partial(library_mm, a[q * shard + s0 : q * shard + s1], b,
                              _rows_kw(kw, q * shard + s0, q * shard + s1), out=buf[q])
            for q in range(w)
        ]))  # fmt: skip
        comms.append(functools.partial(reduce_scatter_tensor, result[s0:s1], buf.view(-1, n), group=group))
    return gemms, comms, result


def _symm_mem_group(ctx: RankContext) -> str:
    """The default group's name, enabled for symmetric memory; ``EnvironmentMismatchError`` off
    CUDA and NCCL."""
    if ctx.device.type != "cuda" or ctx.backend != "nccl":
        raise EnvironmentMismatchError(f"needs CUDA GPUs and NCCL, this run uses {ctx.backend} on the CPU")
    from torch.distributed import _symmetric_memory as symm_mem

    name = dist.group.WORLD.group_name
    with warnings.catch_warnings():  # deprecated (a no-op) from torch 2.11, needed before
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(name)
    return name


def async_tp(ctx: RankContext, a: torch.Tensor, b: torch.Tensor, kw: dict[str, Any] | None = None) -> Call:
    """PyTorch async-TP: ``fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0, group_name)``
    (fp8: ``fused_scaled_matmul_reduce_scatter`` with ``kw``'s scales, bfloat16 out); raises
    ``EnvironmentMismatchError`` off CUDA and NCCL."""
    name = _symm_mem_group(ctx)
    if kw:
        op = torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter
        sa, sb, shape = kw["scale_a"], kw["scale_b"], [a.shape[0], b.shape[1]]
        # A, B, A_scale, B_scale, reduce_op, orig_scatter_dim, scatter_dim_after_maybe_reshape,
        # group_name, output_shape
        return lambda: op(a, b, sa, sb, "sum", 0, 0, name, shape, out_dtype=out_dtype(a))
    op = torch.ops.symm_mem.fused_matmul_reduce_scatter
    return lambda: op(a, b, "sum", 0, name)  # reduce_op, scatter_dim, group_name


def torch_fused(ctx: RankContext, a: torch.Tensor, b: torch.Tensor, kw: dict[str, Any] | None = None) -> Call:
    """PyTorch's fused AllGather + GEMM: ``fused_all_gather_matmul(a, [b], gather_dim=0,
    group_name)``, which returns (gathered A, [product]) as async-TP's column-parallel layers
    use it (fp8: ``fused_all_gather_scaled_matmul`` with ``kw``'s scales, bfloat16 out); raises
    ``EnvironmentMismatchError`` off CUDA and NCCL."""
    name = _symm_mem_group(ctx)
    if kw:
        op = torch.ops.symm_mem.fused_all_gather_scaled_matmul
        sa, sb, dtype = kw["scale_a"], kw["scale_b"], out_dtype(a)
        # A_shard, Bs, A_scale, B_scales, gather_dim, group_name, biases, result_scales, out_dtypes,
        # use_fast_accum
        return lambda: op(a, [b], sa, [sb], 0, name, [None], [None], [dtype], [False])[1][0]
    op = torch.ops.symm_mem.fused_all_gather_matmul
    return lambda: op(a, [b], 0, name)[1][0]  # A_shard, Bs, gather_dim, group_name


def fo_tune_schedule(
    collective: str, m: int, n: int, k: int, dtype: str, ctx: RankContext
) -> tuple[str, str]:
    """(source, detail) of the schedule ``fo_tune`` runs for the problem (m, n, k) (all_gather: m
    the gathered M): ``table``, or the lookup's own source where no row matched (``MISS_SOURCE``:
    overlap: false), and its description; ("", why) when the lookup refuses (e.g. a table for
    other hardware)."""
    from fo_kernels import lookup_schedule

    with warnings.catch_warnings():  # the source is recorded instead
        warnings.simplefilter("ignore", HeuristicScheduleWarning)
        try:
            schedule = lookup_schedule(collective, m, n, k, dtype=dtype, world_size=ctx.world_size,
                                       device=ctx.device)  # fmt: skip
        except FoTuneError as exc:  # the same on every rank
            return "", reason(exc)
    source = MISS_SOURCE if schedule.provenance.get("source") == MISS_SOURCE else "table"
    return source, schedule.describe()


def fo_tune(collective: str, a: torch.Tensor, b: torch.Tensor, kw: dict[str, Any] | None = None) -> Call:
    """The runtime's op with ``schedule=None`` (the caller ignores its ``HeuristicScheduleWarning``:
    the row records the schedule's source); ``kw``: fp8 scales."""
    import fo_kernels

    op = {
        "all_reduce": fo_kernels.gemm_all_reduce,
        "reduce_scatter": fo_kernels.gemm_reduce_scatter,
        "all_gather": fo_kernels.all_gather_gemm,
    }[collective]
    kw = kw or {}
    return lambda: op(a, b, schedule=None, **kw)
