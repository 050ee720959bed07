"""What a tensor-parallel linear adds around its GEMM, shared by the plain-tensor layers
(``fo_kernels.layers``) and the styles' forward (``fo_kernels.parallel_forward``): the replicated
input's GEMM whose backward sums the input's gradient over the group (fused, ``gemm_all_reduce``),
the bias of a dim-0 shard whose gradient is summed over the group, and the bias in the output's
dtype (fp8: its gradient refused).
"""

from __future__ import annotations

import torch

from fo_kernels.collectives import summed
from fo_kernels.ops import call_op
from fo_kernels.quantize import Fp8Refused


class ReplicatedInputMatmul(torch.autograd.Function):
    """``a @ b`` with ``a`` the same on every rank: the backward sums ``a``'s gradient over the
    group, fused with its GEMM (``gemm_all_reduce(dy, b.T)``); Megatron-LM's copy to the
    tensor-parallel region and the column-parallel GEMM in one."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a, b = ctx.saved_tensors
        da = call_op("all_reduce", dy.contiguous(), b.t(), ctx.name) if ctx.needs_input_grad[0] else None
        db = a.t() @ dy if ctx.needs_input_grad[1] else None
        return da, db, None


class ShardBias(torch.autograd.Function):
    """``y + bias`` where ``y`` is this rank's dim-0 shard: the bias gradient is summed over the
    group, so every rank holds the full model's (Megatron-LM reduces it with the optimizer)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return y + bias

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, summed(dy.reshape(-1, dy.shape[-1]).sum(0), ctx.name), None


def add_bias(y: torch.Tensor, bias: torch.Tensor | None, fp8: bool) -> torch.Tensor:
    """``y + bias`` in ``y``'s dtype (an fp8 layer's output is in its input's, not the bias').
    ``fp8``: where the bias needs a gradient the sum's backward raises ``Fp8TrainingError`` (the
    scaled ops' output needs none where the input needs none: the bias alone would train)."""
    if bias is None:
        return y
    bias = bias.to(y.dtype)
    return Fp8Refused.apply(y, bias, True) if fp8 and needs_grad(y, bias) else y + bias


def add_bias_to_shard(y: torch.Tensor, bias: torch.Tensor | None, fp8: bool, name: str) -> torch.Tensor:
    """``add_bias`` for ``y``, this rank's dim-0 shard of a ReduceScatter's output: a bias that
    trains (not fp8) goes through ``ShardBias``, its gradient summed over group ``name``."""
    if bias is not None and not fp8 and needs_grad(y, bias):
        return ShardBias.apply(y, bias.to(y.dtype), name)
    return add_bias(y, bias, fp8)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
