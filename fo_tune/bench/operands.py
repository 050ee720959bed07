"""What one bench case runs on: each rank's operands, the plain collectives, and the float32
references every variant is checked against.

    all_reduce, reduce_scatter    a (M, K), b (K, N) per rank; local = a.float() @ b.float()
        gemm: local    collective: collective(local)    the op: collective(local)
    all_gather                    a (M/w, K): this rank's shard; b (K, N) per rank; M the gathered M
        A = all_gather(a.float())  (rank r's shard at rows [r*M/w, (r+1)*M/w): a copy, exact)
        gemm: A @ b.float()    collective: A    the op: A @ b.float()

The collective alone takes what it would take inside the op: the GEMM's result in the operand
dtype (all_reduce, reduce_scatter) or the shard (all_gather).

fp8 (float8_e4m3fn): the operands come with the tuner's scales (``kw``, ``fo_tune.ranks.scaled``;
``gemm_kw`` those of the gathered A), the references take the dequantized operands, the GEMM's
result is bfloat16 and an AllGather moves the shard's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fo_kernels.collectives import all_gather_tensor, reduce_scatter_tensor
from fo_kernels.scaling import wire
from fo_tune.ranks.gemm import gemm_operands
from fo_tune.ranks.scaled import dequantized, out_dtype, scale_kwargs


def collective_of(
    collective: str, src: torch.Tensor, group: Any = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``collective`` of ``src`` over ``group``: all_reduce in place in the (M, N) ``src``;
    reduce_scatter of the (M, N) ``src`` and all_gather of the (M/w, K) shard ``src`` into ``out``
    (allocated when None)."""
    if collective == "all_reduce":
        dist.all_reduce(src, group=group)
        return src
    w = dist.get_world_size(group)
    if collective == "all_gather":
        if out is None:
            out = src.new_empty((src.shape[0] * w, src.shape[1]))
        all_gather_tensor(out, src, group=group)
        return out
    if out is None:
        out = src.new_empty((src.shape[0] // w, src.shape[1]))
    reduce_scatter_tensor(out, src, group=group)
    return out


@dataclass(frozen=True, slots=True)
class CaseOperands:
    """One rank's operands of a case and the references of its variants (module docstring)."""

    a: torch.Tensor  # the op's A: (M, K), or this rank's (M/w, K) shard for all_gather
    b: torch.Tensor  # (K, N): the transposed view of an (N, K) weight
    gemm_a: torch.Tensor  # the full GEMM's A: ``a``, or the gathered (M, K) A
    gemm_ref: torch.Tensor  # gemm_a @ b in float32
    comm_in: torch.Tensor  # what the collective alone takes
    comm_ref: torch.Tensor  # its result in float32
    ref: torch.Tensor  # the op's result in float32
    kw: dict[str, Any]  # the op's fp8 scales ({} for other dtypes)
    gemm_kw: dict[str, Any]  # the full GEMM's: ``kw``, or the gathered A's rows' scales


def case_operands(
    collective: str, m: int, n: int, k: int, dtype: str, device: torch.device, seed: int
) -> CaseOperands:
    """Random operands (never zero, ``seed`` differs per rank) and their references; every rank
    calls this at once (the references take a collective)."""
    if collective == "all_gather":
        w = dist.get_world_size()
        a, b = gemm_operands(m // w, n, k, dtype, device, seed=seed)
        kw = scale_kwargs(a, b)
        a32, b32 = dequantized(a, b, kw)
        gathered = collective_of("all_gather", a32)
        ref = gathered @ b32
        codes = collective_of("all_gather", wire(a))  # (a copy: exact)
        gemm_kw = {**kw, "scale_a": kw["scale_a"].repeat(w, 1)} if kw else kw
        return CaseOperands(a=a, b=b, gemm_a=codes.view(a.dtype), gemm_ref=ref, comm_in=wire(a),
                            comm_ref=codes.float(), ref=ref, kw=kw, gemm_kw=gemm_kw)  # fmt: skip
    a, b = gemm_operands(m, n, k, dtype, device, seed=seed)
    kw = scale_kwargs(a, b)
    a32, b32 = dequantized(a, b, kw)
    local = a32 @ b32
    ref = collective_of(collective, local.clone())
    return CaseOperands(a=a, b=b, gemm_a=a, gemm_ref=local, comm_in=local.to(out_dtype(a)), comm_ref=ref,
                        ref=ref, kw=kw, gemm_kw=kw)  # fmt: skip
