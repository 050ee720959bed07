"""The caller's ``torch.autocast`` at fo-tune's custom ops: operands cast as ``F.linear``'s are,
and regions where an op's library GEMMs run with it off.

Autocast casts no custom op's arguments, so a layer or the MoE op casts its operands itself
(``autocast_operands``) and the op computes in their dtype; inside, the op's own GEMMs run with
autocast off (``autocast_off``), else a float32 call's product would be lowered to bfloat16.
"""

from __future__ import annotations

import contextlib

import torch


def _autocast_on(device: str) -> bool:
    # (torch has no autocast of the meta device: it raises for one asked about; a model built on
    # the meta device, or a backward on meta tensors, passes here for its shapes.
    # torch.amp.is_autocast_available would say so, but Dynamo cannot trace it in torch 2.11.)
    return device != "meta" and torch.is_autocast_enabled(device)


def autocast_operands(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` as ``F.linear`` takes its operands inside ``torch.autocast`` (of the first
    tensor's device type): each floating-point tensor cast to its dtype but a float64 one (torch's
    autocast leaves float64 as it is) and an fp8 one (an fp8 weight stays codes: its scaled GEMM
    takes them with their scale); ``None`` and the rest as they are; outside autocast, all as
    they are."""
    device = next(t for t in tensors if t is not None).device.type
    if not _autocast_on(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        # (a one-byte floating-point dtype is one of the fp8 variants)
        keep = t is None or not t.is_floating_point() or t.dtype == torch.float64 or t.dtype.itemsize == 1
        return t if keep else t.to(dtype)

    return tuple(cast(t) for t in tensors)


def autocast_off(device: str) -> contextlib.AbstractContextManager[object]:
    """A region with the caller's ``torch.autocast`` of ``device`` off, where one is on: the
    library GEMMs of an op run in its operands' dtype."""
    if not _autocast_on(device):
        return contextlib.nullcontext()
    return torch.autocast(device, enabled=False)
