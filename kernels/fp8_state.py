"""An fp8 weight and its scale through ``load_state_dict``: the layers' and the styles' load rule.

A module's state holds ``weight`` and, for an fp8 module, ``weight_scale``: the codes mean nothing
without their scale. Before torch copies a checkpoint's tensors into the module
(``nn.Module._load_from_state_dict``), ``prepare_weight_state`` makes the checkpoint's entries what
the module holds, in both strict modes:

    module fp8,     checkpoint high-precision weight, no scale   quantized on load (a fresh scale)
    module fp8,     checkpoint fp8 weight with its scale         loaded as it is
    module fp8,     checkpoint fp8 of the other scaling          dequantized, then quantized as the
                    (its scale of another shape than the         module scales (a fresh scale)
                    module's)
    module not fp8, checkpoint fp8 weight with its scale         dequantized on load (codes * scale)
    an fp8 weight without its scale, a high-precision one with a scale, or a scale of neither
    scaling's shape: ``ScaleError`` naming the key (a stale scale would give wrong results, silently)

A weight of another shape than the module's, or none, is left to torch's own report.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch

from fo_kernels.errors import ScaleError
from fo_kernels.scaling import is_fp8

# The state_dict key of an fp8 module's scale, beside its ``weight``.
SCALE_KEY = "weight_scale"

# (codes, scale) of a module's high-precision weight in checkpoint form.
Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# The module's high-precision weight of (codes, scale) in checkpoint form.
Dequantize = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def prepare_weight_state(
    state_dict: MutableMapping[str, torch.Tensor],
    prefix: str,
    weight: torch.Tensor,
    quantize: Quantize,
    dequantize: Dequantize,
    scale: torch.Tensor | None = None,
) -> None:
    """Make ``state_dict``'s ``prefix``-ed weight (and scale) what a module whose weight is
    ``weight`` and, fp8, whose scale is ``scale`` holds (the table above), in place: ``quantize``
    for an fp8 module, ``dequantize`` for another one (and for an fp8 module's checkpoint of the
    other scaling first: ``dequantize`` (codes, scale, dtype) then gives a float32 weight to
    quantize; for a module that is not fp8, one in its weight's dtype)."""
    w_key, s_key = prefix + "weight", prefix + SCALE_KEY
    loaded = state_dict.get(w_key)
    if loaded is None or tuple(loaded.shape) != tuple(weight.shape):
        return
    has_scale = s_key in state_dict
    if is_fp8(loaded.dtype) and not has_scale:
        raise ScaleError(
            f"{w_key} is {loaded.dtype} codes but the checkpoint has no {s_key}: save and load the fp8 "
            "module's whole state_dict, or load its high-precision weight (quantized on load)"
        )
    if is_fp8(loaded.dtype):
        _check_scale_shape(s_key, state_dict[s_key], rows=loaded.shape[0])
    if is_fp8(weight.dtype):
        if not is_fp8(loaded.dtype):
            if has_scale:
                raise ScaleError(
                    f"{w_key} is {loaded.dtype}, not fp8 codes, but the checkpoint also has {s_key}: "
                    "a high-precision weight is quantized on load with a fresh scale; drop the scale"
                )
            state_dict[w_key], state_dict[s_key] = quantize(loaded)
        elif scale is not None and tuple(state_dict[s_key].shape) != tuple(scale.shape):
            high = dequantize(loaded, state_dict[s_key], torch.float32)
            state_dict[w_key], state_dict[s_key] = quantize(high)
    elif is_fp8(loaded.dtype):
        state_dict[w_key] = dequantize(loaded, state_dict.pop(s_key), weight.dtype)


def _check_scale_shape(key: str, scale: torch.Tensor, *, rows: int) -> None:
    """``ScaleError`` unless the checkpoint's ``scale`` fits fp8 codes of ``rows`` output rows: one
    element (tensorwise) or one per row ((1, N), (N, 1) or (N,): rowwise), the shapes
    ``dequantize_weight`` reads; another, broadcast, would scale the wrong rows or fail in torch."""
    shape = tuple(scale.shape)
    if scale.numel() == 1 or shape in ((1, rows), (rows, 1), (rows,)):
        return
    raise ScaleError(
        f"{key} has shape {shape}: fp8 codes of {rows} rows take a scale of one element (tensorwise) "
        f"or one per row ((1, {rows}), ({rows}, 1) or ({rows},): rowwise); load the scale saved with them"
    )
