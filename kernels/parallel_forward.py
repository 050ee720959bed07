"""The forward that ``fo_kernels.parallel``'s styles install on an ``nn.Linear`` with DTensor parameters.

A style leaves the module's parameters as torch's styles make them (DTensors: colwise weight and
bias ``Shard(0)``, rowwise weight ``Shard(1)`` and bias ``Replicate()``) and replaces its forward by
one of the two below, which compute on the local shards with fo-tune's ops:

    colwise   input Replicate()           y = x @ W_r.T (+ b_r)       backward: dx = gemm_all_reduce(dy, W_r)
              input Shard(d), d leading   y = all_gather_gemm(x_r, W_r.T) (+ b_r), gathered on dim d
              output: this rank's features, Shard(-1); another output layout is redistributed
              from there through DTensor, as torch's style does, with one warning per module
    rowwise   input Shard(-1)             output Replicate(): y = gemm_all_reduce(x_r, W_r.T) + b
                                          output Shard(d), d leading: y = gemm_reduce_scatter (+ b,
                                          whose gradient is summed over the group)

A leading dim d > 0 is moved to the front for the op and back after (one copy each way), so a
``Shard(1)`` sequence dimension of (batch, seq, features) runs the same ops. A DTensor input is
taken by its own placements, as torch's styles take it: ``Replicate()`` is read with a ``Partial()``
gradient (DTensor sums it where the input came from), a leading ``Shard(d)`` as that shard.
Inside ``torch.autocast`` the operands are cast to its dtype first, as ``F.linear``'s are.

What these paths do not cover at run time (a DTensor input of another placement, an input dtype
the ops do not take or other than the weight's, a bias of another dtype (torch's ``F.linear``
refuses it), a sharded dim that does not divide by the world size, a plain replicated input that
needs a gradient where a colwise weight's shards are uneven) runs as torch's style runs it
(``torch_forward``), with one ``NotOverlappedWarning`` per module.
The gradient helpers are the layers' too (``fo_kernels.linear_autograd``): the fused all-reduce of a
replicated input's gradient and the bias of a dim-0 shard.

fp8 for inference (a style's ``fp8="tensorwise"`` or ``"rowwise"``, ``LinearPlan.fp8``): the
weight shard is stored as fp8 codes and each call quantizes its input's rows for the scaled ops
(``fo_kernels.parallel_fp8``). torch's style has no fp8 GEMM, so what would run as torch's style
raises ``ShapeError`` for an fp8 module instead; a backward raises ``Fp8TrainingError``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import style as torch_style
from torch.distributed.tensor.placement_types import Placement

from fo_kernels.autocast import autocast_operands
from fo_kernels.errors import NotOverlappedWarning, PlanError, ShapeError
from fo_kernels.linear_autograd import (
    ReplicatedInputMatmul,
    add_bias,
    add_bias_to_shard,
    needs_grad,
)
from fo_kernels.ops import warn_while_tracing
from fo_kernels.overlap import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter
from fo_kernels.parallel_fp8 import fp8_rows, load_hook, local_fp8, quantize_module
from fo_kernels.parallel_plan import COLWISE, PLAN_ATTR, ROWWISE, LinearPlan
from fo_kernels.refusal import refusal, refused, shape_of, shape_text
from fo_kernels.scaling import OUT_DTYPES
from fo_kernels.schedule import TORCH_DTYPES

# The attributes of the module that say whether it has warned of torch's path, and whether it has
# warned of a colwise output DTensor redistributes.
WARNED_ATTR = "_fo_parallel_warned"
REDISTRIBUTED_ATTR = "_fo_parallel_warned_output"
# The layouts each kind computes in (torch's desired layouts of a linear).
DESIRED_INPUT = {COLWISE: (Replicate(),), ROWWISE: (Shard(-1),)}
TORCH_STYLES = {COLWISE: torch_style.ColwiseParallel, ROWWISE: torch_style.RowwiseParallel}


def install_forward(module: nn.Linear, plan: LinearPlan) -> None:
    """Make ``module``'s forward the plan's (its parameters are already DTensors); an fp8 plan
    first quantizes the module's weight shard (``quantize_module``). Its ``load_state_dict`` takes
    a high-precision or an fp8 checkpoint alike (``fo_kernels.fp8_state``)."""
    if plan.fp8 is not None:
        quantize_module(module, plan)
    setattr(module, PLAN_ATTR, plan)
    forward = _colwise_forward if plan.kind == COLWISE else _rowwise_forward
    # a partial, not a bound method: it pickles by the function's name (torch.save of the whole
    # model loads again) and deep-copies with the module (a copy's forward is the copy's)
    module.forward = functools.partial(forward, module)
    # (a partial of a module-level function for the same reasons; torch keeps the module weakly)
    module.register_load_state_dict_pre_hook(load_hook)


def _shard_dim(placement: Placement, ndim: int) -> int | None:
    """The dim (counted from the front) of an ``ndim``-dim tensor that a ``Shard`` placement names,
    or None for another placement or a dim the tensor does not have (``Shard(2)`` of a 2-dim
    input), which torch's style refuses: not wrapped around to a dim it has."""
    if not isinstance(placement, Shard) or not -ndim <= placement.dim < ndim:
        return None
    return placement.dim % ndim


def _leading_dim(placement: Placement, ndim: int) -> int | None:
    """The dim a ``Shard`` placement names when it is not the last (the features); else None."""
    d = _shard_dim(placement, ndim)
    return d if d is not None and d < ndim - 1 else None


def _op_dtype_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: LinearPlan) -> bool:
    """Whether the ops take these operands' dtypes: one of theirs for the input, the weight and the
    bias alike (``F.linear`` refuses a bias of another dtype, which torch's path then raises)."""
    if plan.fp8 is not None:  # (the input is quantized per call; the output is in its dtype)
        return x.dtype in OUT_DTYPES
    same = x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype)
    return same and x.dtype in TORCH_DTYPES.values()


def _input_why(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    if x.numel() == 0:
        return f"an empty input {tuple(x.shape)}"
    of_bias = "" if bias is None else f", bias {bias.dtype}"
    return f"input {x.dtype}, weight {weight.dtype}{of_bias} (the ops take one of bfloat16, float16, float32)"


def _warn_once(module: nn.Linear, attr: str, message: Callable[[], str], traced: str) -> None:
    """One ``NotOverlappedWarning`` per module and ``attr`` (the module's flag that it was given):
    ``message()`` from an eager call (a callable, called once: it may format shapes), ``traced``
    (a constant text) from torch.compile's trace of a module whose first call is compiled."""
    if getattr(module, attr, False):
        return
    setattr(module, attr, True)
    if torch.compiler.is_compiling():
        warn_while_tracing(f"fo_kernels.parallel: {traced} (seen as torch.compile traced it)")
        return
    # (the frame that called the forward: past this function, its caller and the forward)
    warnings.warn(f"fo_kernels.parallel: {message()}", NotOverlappedWarning, stacklevel=4)


def torch_forward(
    module: nn.Linear, x: torch.Tensor, plan: LinearPlan, why: Callable[[], str]
) -> torch.Tensor:
    """The module's forward as torch's style runs it (its input and output hooks around
    ``F.linear`` on the DTensor parameters), with one ``NotOverlappedWarning`` per module saying
    ``why()`` (a callable: torch.compile traces no message), given once torch's path has run: a
    call torch's style refuses (a layout naming a dim the input does not have) raises torch's error
    alone, as the style's apply does. An fp8 module raises ``ShapeError`` instead: torch's style
    has no fp8 GEMM."""
    if plan.fp8 is not None:  # (traced: raised when the graph runs)
        return _refused_input(module, x, plan, lambda: _refuse_fp8(module, plan, why))
    style = TORCH_STYLES[plan.kind]
    x = style._prepare_input_fn(plan.input_layouts, DESIRED_INPUT[plan.kind], module, (x,), plan.mesh)
    y = F.linear(x, module.weight, module.bias)
    y = style._prepare_output_fn(plan.output_layouts, plan.use_local_output, module, y, plan.mesh)
    runs = f"a {plan.kind} {type(module).__name__} runs as torch's style does, not overlapped"
    _warn_once(module, WARNED_ATTR, lambda: f"{runs}: {why()}", runs)
    return y


def _check_parameters(module: nn.Linear, plan: LinearPlan) -> None:
    """Raise ``PlanError`` where a parameter the style distributed is a plain tensor again (a
    ``load_state_dict(..., assign=True)`` of an unsharded state dict puts the loaded tensors in
    their place): torch's style then fails inside ``F.linear`` on mixed tensors."""
    for name in ("weight", "bias"):
        param = getattr(module, name)
        if param is not None and not isinstance(param, DTensor):
            raise PlanError(
                f"a {plan.kind} {type(module).__name__}'s {name} is a plain {tuple(param.shape)} tensor, not "
                "the DTensor its style made (load_state_dict(..., assign=True) of an unsharded state dict "
                "replaces the parameters): load without assign=True, or parallelize the module again"
            )


def _refuse_type(x: object) -> None:
    raise ShapeError(f"input must be a torch.Tensor or a DTensor, got a {type(x).__name__}")


def _refuse_fp8(module: nn.Linear, plan: LinearPlan, why: Callable[[], str]) -> None:
    raise ShapeError(
        f"an fp8 {plan.kind} {type(module).__name__} runs on fo-tune's ops only (torch's style has "
        f"no fp8 GEMM), which cannot take {why()}"
    )


def _refused_input(
    module: nn.Linear, x: torch.Tensor, plan: LinearPlan, refuse: Callable[[], None]
) -> torch.Tensor:
    """The ``ShapeError`` ``refuse()`` raises for the input: eagerly raised; traced, an output of
    the local shape (a DTensor where the style gives one) whose op raises it as the graph runs."""
    _, why = refusal(refuse)
    features = module.weight.to_local().shape[0] if plan.kind == COLWISE else module.out_features
    y = refused(why, x, (*shape_of(x)[:-1], features))
    return y if plan.use_local_output else DTensor.from_local(y, plan.mesh, plan.output_layouts)


def _moved(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` with dim ``d`` first, contiguous (a view when d is 0)."""
    return x if d == 0 else x.movedim(d, 0).contiguous()


def _moved_back(y: torch.Tensor, d: int) -> torch.Tensor:
    return y if d == 0 else y.movedim(0, d).contiguous()


def _operands(
    module: nn.Linear, x: torch.Tensor, plan: LinearPlan
) -> tuple[torch.Tensor, Placement, bool, torch.Tensor, torch.Tensor | None]:
    """(input, its layout, whether it is a DTensor, this rank's weight, its bias or None): the
    input as it came, the parameters' local tensors, all three as ``F.linear`` takes them inside
    ``torch.autocast``."""
    weight = module.weight.to_local()
    bias = module.bias.to_local() if module.bias is not None else None
    is_dtensor = isinstance(x, DTensor)
    layout = x.placements[0] if is_dtensor else plan.input_layouts[0]
    x, weight, bias = autocast_operands(x, weight, bias)
    return x, layout, is_dtensor, weight, bias


def _features(x: torch.Tensor) -> int:
    """``x``'s last dim (the local one of a DTensor), 0 for a 0-dim input."""
    local = x.to_local() if isinstance(x, DTensor) else x
    return local.shape[-1] if local.dim() else 0


def _refuse_features(module: nn.Linear, x: torch.Tensor, weight: torch.Tensor, plan: LinearPlan) -> None:
    """Raise the ``ShapeError`` of an input whose features this rank's weight does not take."""
    local = x.to_local() if isinstance(x, DTensor) else x
    raise ShapeError(
        f"a {plan.kind} nn.Linear({module.in_features}, {module.out_features}) takes "
        f"{int(weight.shape[1])} input features on this rank, got an input of {shape_text(local)}"
    )


def _colwise_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    plan: LinearPlan = getattr(module, PLAN_ATTR)
    _check_parameters(module, plan)
    if not isinstance(x, torch.Tensor):  # (traced: raised when the graph runs)
        return _refused_input(module, x, plan, lambda: _refuse_type(x))
    x, layout, is_dtensor, weight, bias = _operands(module, x, plan)
    d = _leading_dim(layout, x.dim())
    if isinstance(layout, Shard) and d is None:  # (Shard(2) of a 3-dim input: its features)
        what = "its features" if _shard_dim(layout, x.dim()) is not None else f"no dim of {x.dim()}"
        return torch_forward(module, x, plan, lambda: f"an input laid out as {layout!r}, {what}")
    if _features(x) != weight.shape[1]:  # (traced: raised when the graph runs)
        return _refused_input(module, x, plan, lambda: _refuse_features(module, x, weight, plan))
    if not _op_dtype_ok(x, weight, bias, plan) or x.numel() == 0:
        return torch_forward(module, x, plan, lambda: _input_why(x, weight, bias))
    if isinstance(layout, Replicate):
        if plan.fp8 is not None:  # (inference only: no gradient for DTensor to reduce)
            y = local_fp8(module, plan, x.to_local() if is_dtensor else x, weight)
        elif is_dtensor:  # its gradient is a partial sum: DTensor reduces it where x came from
            x = x.to_local(grad_placements=[Partial()])
            y = x @ weight.t()
        elif needs_grad(x, weight):
            if needs_grad(x) and module.out_features % plan.world_size:
                # (the input's gradient, gemm_all_reduce(dy, W_r), would be a GEMM of another K on
                # each rank, an empty one where a rank holds no feature)
                why = functools.partial(_uneven_why, module.out_features, "output", plan)
                return torch_forward(module, x, plan, why)
            rows = x.reshape(-1, x.shape[-1])
            y = ReplicatedInputMatmul.apply(rows, weight.t(), plan.group_name)
            y = y.view(*x.shape[:-1], weight.shape[0])
        else:
            y = x @ weight.t()
    elif d is not None:
        if module.out_features % plan.world_size:
            return torch_forward(module, x, plan, lambda: _uneven_why(module.out_features, "output", plan))
        if is_dtensor:
            # DTensor shards a dim that does not divide by the world size unevenly (torch.chunk's
            # sizes), and all_gather_gemm gathers equal shards: DTensor gathers those
            if x.shape[d] % plan.world_size:
                return torch_forward(module, x, plan, lambda: _gather_why(layout, x, plan))
            x = x.to_local()
        xm = _moved(x, d)
        rows, fp8 = fp8_rows(module, plan, xm.reshape(-1, xm.shape[-1]), shared=True)
        rows = all_gather_gemm(rows, weight.t(), group=plan.group, **fp8)
        y = _moved_back(rows.view(xm.shape[0] * plan.world_size, *xm.shape[1:-1], weight.shape[0]), d)
    else:
        return torch_forward(module, x, plan, lambda: f"an input laid out as {layout!r} (DTensor gathers it)")
    y = add_bias(y, bias, plan.fp8 is not None)
    return _colwise_output(module, y, plan)


def _colwise_output(module: nn.Linear, y: torch.Tensor, plan: LinearPlan) -> torch.Tensor:
    """The local (..., N_r) result in the style's output layout, as torch's style returns it (the
    global shape given, since the features need not divide by the world size). A layout other than
    the features is redistributed by DTensor, with one warning per module; whether a ``Shard(d)``
    counted from the front is the features depends on the output's dims, seen here."""
    want = plan.output_layouts[0]
    is_features = _shard_dim(want, y.dim()) == y.dim() - 1
    if is_features and plan.use_local_output:
        return y
    shape = (*y.shape[:-1], module.out_features)
    out = DTensor.from_local(
        y, plan.mesh, [Shard(y.dim() - 1)], run_check=False, shape=shape, stride=_contiguous_strides(shape)
    )
    if not is_features:  # (warned once DTensor took the layout: one it refuses raises its error alone)
        out = out.redistribute(plan.mesh, plan.output_layouts)
        _warn_once(
            module,
            REDISTRIBUTED_ATTR,
            lambda: (
                f"a colwise {type(module).__name__}'s output_layouts={want!r} of a {y.dim()}-dim output "
                "is made from its features (Shard(-1)) by DTensor, as torch's style does"
            ),
            f"a colwise {type(module).__name__}'s output is made from its features (Shard(-1)) by DTensor, "
            "as torch's style does",
        )
    return out.to_local() if plan.use_local_output else out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _uneven_why(features: int, side: str, plan: LinearPlan) -> str:
    """Why uneven weight shards run torch's way: the ranks' local shapes differ, so each rank's
    schedule lookup (keyed by its local N and K) could pick another engine than its peers'."""
    return (
        f"{features} {side} features do not divide by the world size {plan.world_size} (each rank's "
        "shard, and the schedule its lookup picks, would differ)"
    )


def _gather_why(layout: Placement, x: DTensor, plan: LinearPlan) -> str:
    return (
        f"a DTensor input {tuple(x.shape)} laid out as {layout!r}: its sharded dim does not divide by "
        f"the world size {plan.world_size}, so its shards are uneven"
    )


def _rows_why(want: Placement, x: torch.Tensor, plan: LinearPlan) -> str:
    return (
        f"output_layouts={want!r} of an output of {tuple(x.shape[:-1])} rows: not a leading dim that "
        f"divides by the world size {plan.world_size}"
    )


def _rowwise_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    plan: LinearPlan = getattr(module, PLAN_ATTR)
    _check_parameters(module, plan)
    if not isinstance(x, torch.Tensor):  # (traced: raised when the graph runs)
        return _refused_input(module, x, plan, lambda: _refuse_type(x))
    x, layout, is_dtensor, weight, bias = _operands(module, x, plan)
    sharded = x.dim() >= 1 and _shard_dim(layout, x.dim()) == x.dim() - 1
    # (a 0-dim input has no features: refused, as a colwise one is; traced, when the graph runs)
    if (sharded or x.dim() == 0) and _features(x) != weight.shape[1]:
        return _refused_input(module, x, plan, lambda: _refuse_features(module, x, weight, plan))
    if not sharded:
        return torch_forward(module, x, plan, lambda: f"an input laid out as {layout!r}, not Shard(-1)")
    if not _op_dtype_ok(x, weight, bias, plan) or x.numel() == 0:
        return torch_forward(module, x, plan, lambda: _input_why(x, weight, bias))
    if module.in_features % plan.world_size:
        return torch_forward(module, x, plan, lambda: _uneven_why(module.in_features, "input", plan))
    want = plan.output_layouts[0]
    if isinstance(want, Replicate):
        local = x.to_local() if is_dtensor else x
        rows, fp8 = fp8_rows(module, plan, local.reshape(-1, local.shape[-1]))
        y = gemm_all_reduce(rows, weight.t(), group=plan.group, **fp8)
        y = add_bias(y.view(*local.shape[:-1], weight.shape[0]), bias, plan.fp8 is not None)
    else:
        d = _leading_dim(want, x.dim())
        if d is None or x.shape[d] % plan.world_size:
            return torch_forward(module, x, plan, lambda: _rows_why(want, x, plan))
        local = _moved(x.to_local() if is_dtensor else x, d)
        rows, fp8 = fp8_rows(module, plan, local.reshape(-1, local.shape[-1]))
        y = gemm_reduce_scatter(rows, weight.t(), group=plan.group, **fp8)
        y = y.view(local.shape[0] // plan.world_size, *local.shape[1:-1], weight.shape[0])
        y = add_bias_to_shard(y, bias, plan.fp8 is not None, plan.group_name)
        y = _moved_back(y, d)
    if plan.use_local_output:
        return y
    return DTensor.from_local(y, plan.mesh, [want], run_check=False)
