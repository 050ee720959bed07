"""fp8 for inference on a module that ``fo_kernels.parallel``'s styles parallelized (a style's
``fp8="tensorwise"`` or ``"rowwise"``, ``LinearPlan.fp8``): its weight shard, its scale, its input's
rows.

As the layers' (``fo_kernels.layers``), the local weight shard is stored once as float8_e4m3fn
codes (a DTensor of the same placements, no gradient) with its scale in the module's
``weight_scale`` buffer (a DTensor: the full weight's scale, ``_scale_sharded``), and each call
quantizes its input's rows the same way (``fo_kernels.quantize``; tensorwise before an AllGather
with one scale over the group) for the scaled ops, the output in the input's dtype. The module's
own ``_apply`` keeps the codes and the float32 scale through a cast of its dtype
(``model.to(torch.bfloat16)``), as the layers' does; ``load_state_dict`` quantizes a
high-precision weight into it and dequantizes an fp8 one into a plain module (``load_hook``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fo_kernels.fp8_state import prepare_weight_state
from fo_kernels.parallel_plan import COLWISE, PLAN_ATTR
from fo_kernels.quantize import (
    dequantize_weight,
    fp8_operands,
    keeping_dtypes,
    local_fp8_matmul,
    quantize_weight,
)

if TYPE_CHECKING:
    from fo_kernels.parallel_plan import LinearPlan

# The buffer of an fp8 module that holds its weight shard's scale (scale_b), as the layers name it.
SCALE_ATTR = "weight_scale"


def _quantize_dtensor(weight: torch.Tensor, plan: LinearPlan, owner: str) -> tuple[DTensor, DTensor]:
    """(codes, scale) of a DTensor weight of a ``plan`` module, both DTensors on its mesh: the codes
    of the weight's placements, the scale the full weight's (``_scale_sharded``)."""
    local = weight.to_local()
    sharded = _scale_sharded(plan)
    codes, scale = quantize_weight(local, plan.fp8, owner, shared=not sharded, group=plan.group)
    codes = DTensor.from_local(
        codes, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
        stride=weight.stride(),
    )  # fmt: skip
    if sharded:  # (1, N) over the output features, split as the weight's rows are
        shape = (1, weight.shape[0])
        scale = DTensor.from_local(
            scale, weight.device_mesh, [Shard(1)], run_check=False, shape=shape, stride=(shape[1], 1)
        )
    else:
        scale = DTensor.from_local(scale, weight.device_mesh, [Replicate()], run_check=False)
    return codes, scale


def _scale_sharded(plan: LinearPlan) -> bool:
    """Whether the module's scale is split over the ranks: rowwise scaling of a colwise weight (one
    scale per output feature, and each rank holds whole rows). Every other scale is the full
    weight's, the same on every rank (the largest amax over the group), so a checkpoint holds one
    scale that a load at any world size finds (a distributed checkpoint saves a replicated tensor
    once)."""
    return plan.fp8 == "rowwise" and plan.kind == COLWISE


def quantize_module(module: nn.Linear, plan: LinearPlan) -> None:
    """Store ``module``'s weight as float8_e4m3fn codes (a DTensor of the weight's placements, no
    gradient) and its scale in the ``weight_scale`` buffer (a DTensor: ``_scale_sharded``), for
    inference, as ``plan.fp8`` scales it (one small all_reduce). The shard's (out, in) must be
    multiples of 16 (torch._scaled_mm's rule): ``ShapeError`` otherwise."""
    codes, scale = _quantize_dtensor(module.weight, plan, f"an fp8 {type(module).__name__}")
    module.weight = nn.Parameter(codes, requires_grad=False)
    module.register_buffer(SCALE_ATTR, scale)
    # the module is the user's nn.Linear, whose class's _apply casts every floating tensor: an
    # instance attribute shadows it for this module alone (model.to(torch.bfloat16) calls each
    # child's _apply), a partial as the forward is, so it deep-copies and pickles with the module
    module._apply = functools.partial(_fp8_apply, module)


def load_hook(module: nn.Linear, state_dict: dict, prefix: str, *_args) -> None:
    """A parallelized module's ``load_state_dict`` pre-hook (``prepare_weight_state``): a
    high-precision DTensor weight quantized into an fp8 module with the scale ``quantize_module``
    gives (one small all_reduce: every rank loads alike); an fp8 one (codes and scale DTensors)
    dequantized into another module. A plain tensor is left to torch, which refuses to copy it into
    a DTensor parameter as it does for torch's styles."""
    plan: LinearPlan = getattr(module, PLAN_ATTR)
    weight = module.weight
    if not isinstance(state_dict.get(prefix + "weight"), DTensor):
        return

    def quantize(loaded: torch.Tensor) -> tuple[DTensor, DTensor]:
        # (laid out as the module's weight first: its scale is split or shared by that layout)
        loaded = loaded.redistribute(weight.device_mesh, weight.placements)
        return _quantize_dtensor(loaded, plan, f"an fp8 {type(module).__name__}")

    def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        local = dequantize_weight(codes.to_local(), _local(scale), dtype)
        return DTensor.from_local(
            local, codes.device_mesh, codes.placements, run_check=False, shape=codes.shape,
            stride=codes.stride(),
        )  # fmt: skip

    prepare_weight_state(state_dict, prefix, weight, quantize, dequantize, getattr(module, SCALE_ATTR, None))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _fp8_apply(
    module: nn.Linear, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
) -> nn.Linear:
    """An fp8 module's ``_apply`` (``to``, ``half``, ``float``...): its class's, but the weight's
    fp8 codes and its float32 ``weight_scale`` keep their dtypes through a cast of the module's
    dtype, as the layers' do; a device move still moves them."""
    kept = (module.weight, getattr(module, SCALE_ATTR))
    return type(module)._apply(module, keeping_dtypes(fn, kept), recurse)


def fp8_rows(
    module: nn.Linear, plan: LinearPlan, rows: torch.Tensor, shared: bool = False
) -> tuple[torch.Tensor, dict]:
    """(rows, the op's fp8 keyword arguments): an fp8 module's rows quantized (``shared``: one
    tensorwise scale over the group, before an AllGather) and its scales; else the rows as they are."""
    if plan.fp8 is None:
        return rows, {}
    scale = _local(getattr(module, SCALE_ATTR))
    return fp8_operands(rows, plan.fp8, scale, shared=shared, group=plan.group)


def local_fp8(module: nn.Linear, plan: LinearPlan, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A colwise fp8 module's local GEMM of a replicated input: its rows quantized, the scaled GEMM."""
    codes, fp8 = fp8_rows(module, plan, x.reshape(-1, x.shape[-1]))
    return local_fp8_matmul(codes, weight.t(), fp8, plan.fp8).view(*x.shape[:-1], weight.shape[0])
