"""The ops as torch.library custom ops: their schemas, fake (meta) implementations and autograd.

    fo_kernels::gemm_all_reduce(Tensor a, Tensor b, str group_name, str schedule,
                                Tensor? scale_a=None, Tensor? scale_b=None,
                                ScalarType? out_dtype=None) -> Tensor
    fo_kernels::gemm_reduce_scatter(...the same arguments...) -> Tensor
    fo_kernels::all_gather_gemm(...the same arguments...) -> (Tensor, Tensor)

``group_name`` is the process group's ``group.group_name`` ("" for the default group), resolved
inside the op with torch.distributed's ``_resolve_process_group``; ``schedule`` is a ``Schedule``
as JSON (``schedule_text``; "" looks one up per call, ``lookup_schedule``). torch.compile passes
both strings into its graph as constants, so a block that calls the ops compiles without a graph
break; the op itself is opaque to it. ``all_gather_gemm`` returns ``(gathered @ b, gathered)``,
both differentiable (the gathered A is also what the backward keeps for the weight gradient).
``scale_a``, ``scale_b`` and ``out_dtype`` are an fp8 call's (``fo_kernels.scaling``); the fake
implementations give its output ``out_dtype`` (bfloat16 by default) and the gathered A fp8.
The fake implementations check nothing (``_fake``): the op checks its input when it runs,
in a compiled graph as in an eager call, and raises the eager call's ``ValueError`` subclass. An
eager call on meta tensors (a model built on the meta device, run for its shapes) runs the fake
implementation, which then checks as the op does (``check_meta_call``).

Autograd, every backward through the ops (so their own schedule lookup applies), with ``dy`` the
gradient of the output:

    y = all_reduce(a @ b)            da = dy @ b.T                         db = a.T @ dy
    y = reduce_scatter(a @ b)        (da, dY) = all_gather_gemm(dy, b.T)   db = a.T @ dY
    (y, A) = all_gather_gemm(a, b)   da = gemm_reduce_scatter(dy, b.T)     db = A.T @ dy

(the first is two local GEMMs: every rank holds the same ``dy``). The local GEMMs run in the
operands' dtype inside ``torch.autocast`` too (``fo_kernels.scaling.matmul``), as the forward's
output is: autocast casts no custom op's arguments. The gathered A's own gradient
``dA``, where a caller uses it, adds ``reduce_scatter(dA)`` to ``da`` (``_scattered``); an unused
one is None, so a plain backward runs no collective for it. With that, a gradient of a gradient
(``create_graph=True``) is the GEMM's: the gathered ``dY`` and ``A`` in the formulas above carry
their dependence on ``dy`` and ``a``, and the gradient of ``gemm_all_reduce``'s ``dy``, one term
per rank, is summed over the group (``_SummedGradient``), as DTensor sums it for torch's
``RowwiseParallel``. A backward whose op cannot run
(its schedule names an engine without that collective in this build) raises ``ScheduleError``
before its collective starts, on every rank alike. A traced call whose shapes the op refuses
(``_refused``) gets zero gradients in its traced backward, so the trace completes and the op
raises its ``ShapeError`` when the graph runs. A backward through an fp8 call raises
``Fp8TrainingError``: fo-tune runs fp8 for inference; training in fp8 is out of its scope.

``call_op`` is how code inside fo-tune calls an op: straight into ``fo_kernels.execute.execute``
where nothing needs the dispatcher (``direct_call``), else through ``torch.ops.fo_kernels``.
Importing this module registers the ops (torch.library declarations; nothing is allocated).
"""

from __future__ import annotations

import functools
import json
import warnings

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from fo_kernels.collectives import summed
from fo_kernels.errors import FoTuneError, Fp8TrainingError, NotOverlappedWarning, ScheduleError
from fo_kernels.groups import group_size, resolve_group
from fo_kernels.scaling import DEFAULT_OUT_DTYPE, is_fp8, matmul
from fo_kernels.schedule import Schedule

LIBRARY = "fo_kernels"
# collective -> op name in torch.ops.fo_kernels
OP_NAMES = {
    "all_reduce": "gemm_all_reduce",
    "reduce_scatter": "gemm_reduce_scatter",
    "all_gather": "all_gather_gemm",
}
# Parsed schedules kept by their JSON text (a model has a few schedules per layer shape).
SCHEDULE_CACHE_SIZE = 256
# Tensor types a direct (dispatcher-free) call takes: parameters are plain tensors too.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
# The ops' ``schedule`` argument of a schedule argument that is not a schedule, in a traced call
# (torch.compile): Dynamo makes a RuntimeError of anything its trace raises, so the text carries
# the refusal instead and ``parse_schedule`` raises that ``ScheduleError`` when the graph runs the
# op, before any collective, as an eager call raises it (``fo_kernels.groups.REFUSED_GROUP`` does
# the same for the group). No schedule's JSON text starts so.
REFUSED_SCHEDULE = "<refused schedule> "


# ------------------------------------------------------------------------------ op arguments
def schedule_text(schedule: Schedule | None) -> str:
    """The ops' ``schedule`` argument: the schedule as JSON without its provenance ("" for None),
    kept on the schedule (``Schedule.op_text``), so torch.compile reads it as a constant attribute
    (guarded on the schedule object) and traces no serialisation."""
    if schedule is None:
        return ""
    if not isinstance(schedule, Schedule):
        return refuse_schedule(f"schedule: expected a fo_kernels.Schedule, got {type(schedule).__name__}")
    return schedule.op_text


def refuse_schedule(message: str) -> str:
    """Raise ``ScheduleError(message)``; in a traced call, the ``REFUSED_SCHEDULE`` text the op
    raises it from when it runs."""
    if torch.compiler.is_compiling():
        return REFUSED_SCHEDULE + message
    raise ScheduleError(message)


def check_schedule_text(text: str) -> None:
    """Raise the ``ScheduleError`` a ``REFUSED_SCHEDULE`` text carries."""
    if text.startswith(REFUSED_SCHEDULE):
        raise ScheduleError(text[len(REFUSED_SCHEDULE) :])


def is_refusal(text: str) -> bool:
    """True for an op's ``schedule`` text that only carries a refusal (the op raises it)."""
    return text.startswith(REFUSED_SCHEDULE)


@torch.compiler.assume_constant_result
def traced_world_size(name: str) -> int:
    """The world size of an op's ``group_name`` for a traced call's refused output (a constant to
    Dynamo); 1 where torch.distributed or the group is refused (the refused call raises first)."""
    try:
        return group_size(name)
    except FoTuneError:
        return 1


@torch.compiler.assume_constant_result
def warn_while_tracing(text: str) -> bool:
    """A ``NotOverlappedWarning`` of ``text`` as torch.compile traces a call that runs without
    overlap (``fo_kernels.symm_mem``, ``fo_kernels.parallel``): Dynamo runs a function marked
    ``assume_constant_result`` at trace time and keeps its result as a constant, so it traces no
    ``warnings.warn``, which would break the graph."""
    warnings.warn(text, NotOverlappedWarning, stacklevel=2)
    return True


@functools.lru_cache(maxsize=SCHEDULE_CACHE_SIZE)
def parse_schedule(text: str) -> Schedule | None:
    """The schedule of an op's ``schedule`` argument (None for "": look one up)."""
    if not text:
        return None
    check_schedule_text(text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"schedule: not a schedule's JSON text ({exc})") from None
    return Schedule.from_dict(data)


# ------------------------------------------------------------------------------ dispatch
def direct_call(*tensors: torch.Tensor | None) -> bool:
    """True when a call can skip the dispatcher and run as a plain Python call: not traced
    (torch.compile, export, FX), plain tensors, no dispatch mode, nothing for autograd to record.
    Through the dispatcher a call costs 30-45 us more host time (CPU, torch 2.13). None (a scale
    left out) is skipped."""
    if torch.compiler.is_compiling():
        return False
    tensors = tuple(t for t in tensors if t is not None)
    for t in tensors:
        # (meta tensors have no runtime: the op's fake implementation gives their output)
        if type(t) not in _PLAIN_TYPES or t.is_meta:
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return not torch._C._len_torch_dispatch_stack()


def op(collective: str) -> torch._ops.OpOverload:
    """The custom op of ``collective``."""
    return getattr(getattr(torch.ops, LIBRARY), OP_NAMES[collective]).default


def call_op(
    collective: str, a: torch.Tensor, b: torch.Tensor, name: str, schedule: str = ""
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One op call by its string arguments, directly where ``direct_call`` allows, else the op."""
    if direct_call(a, b):
        from fo_kernels.execute import execute

        return execute(collective, a, b, parse_schedule(schedule), resolve_group(name))
    return op(collective)(a, b, name, schedule)


# ------------------------------------------------------------------------------ the ops
# The three ops' schema (the module docstring): the same arguments; all_gather_gemm also returns
# the gathered A.
_ARGUMENTS = (
    "(Tensor a, Tensor b, str group_name, str schedule, Tensor? scale_a=None, Tensor? scale_b=None, "
    "ScalarType? out_dtype=None)"
)
_RETURNS = {"all_reduce": "Tensor", "reduce_scatter": "Tensor", "all_gather": "(Tensor, Tensor)"}


def _impl(
    collective: str,
    a: torch.Tensor,
    b: torch.Tensor,
    name: str,
    schedule: str,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    from fo_kernels.execute import execute

    group = resolve_group(name)
    # through the dispatcher (compiled code, autograd): outputs from the caller's allocator, which
    # a caller's CUDA graphs (torch.compile's reduce-overhead mode) require; no graphs of our own
    return execute(
        collective, a, b, parse_schedule(schedule), group,
        scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, own_graphs=False,
    )  # fmt: skip


def _fake(
    collective: str,
    a: torch.Tensor,
    b: torch.Tensor,
    name: str,
    schedule: str,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A traced call's output, shaped from its inputs whatever they are; an eager call on meta
    tensors (plain ones, not a trace's fake tensors) is checked as ``execute`` checks.

    The fake implementations check nothing: Dynamo turns any exception raised while it propagates
    fake tensors into a RuntimeError (torch._dynamo.exc.TorchRuntimeError), so a check here would
    give bad input under torch.compile a RuntimeError instead of the op's ValueError. The op itself
    checks when it runs (``execute``), before any collective, in eager calls and compiled graphs
    alike; for input it refuses, the shapes here are never used."""
    if (a.is_meta or b.is_meta) and not isinstance(a, FakeTensor) and not isinstance(b, FakeTensor):
        from fo_kernels.execute import check_meta_call

        check_meta_call(
            collective, a, b, parse_schedule(schedule), resolve_group(name), scale_a, scale_b, out_dtype
        )
    try:
        world = group_size(name)
    except FoTuneError:  # torch.distributed not initialized, or a refused group: the op raises it
        world = 1
    m = a.shape[0] if a.dim() else 1
    n = b.shape[-1] if b.dim() else 1
    if is_fp8(a.dtype) or is_fp8(b.dtype):
        dtype = DEFAULT_OUT_DTYPE if out_dtype is None else out_dtype
    else:
        dtype = a.dtype
    if collective == "reduce_scatter":
        return a.new_empty((m // world, n), dtype=dtype)
    if collective == "all_reduce":
        return a.new_empty((m, n), dtype=dtype)
    return a.new_empty((m * world, n), dtype=dtype), a.new_empty((m * world, a.shape[-1] if a.dim() else 1))


def _define(collective: str) -> torch.library.CustomOpDef:
    """The custom op of ``collective``: ``_impl`` when it runs, ``_fake`` when it is traced."""
    op = torch.library.custom_op(
        f"{LIBRARY}::{OP_NAMES[collective]}",
        functools.partial(_impl, collective),
        mutates_args=(),
        schema=f"{_ARGUMENTS} -> {_RETURNS[collective]}",
    )
    op.register_fake(functools.partial(_fake, collective))
    return op


_gemm_all_reduce = _define("all_reduce")
_gemm_reduce_scatter = _define("reduce_scatter")
_all_gather_gemm = _define("all_gather")


# ------------------------------------------------------------------------------ autograd
# The op's inputs after a and b (group_name, schedule, scale_a, scale_b, out_dtype), which take no
# gradient.
_NO_GRADS = (None,) * 5
_FP8_TRAINING = (
    "backward through an fp8 call: fo-tune runs float8_e4m3fn operands for inference only; training "
    "in fp8 is out of scope (run the backward in bfloat16, or call the op under torch.no_grad())"
)


@torch.library.custom_op(f"{LIBRARY}::fp8_backward_refused", mutates_args=())
def _fp8_backward_refused(dy: torch.Tensor) -> torch.Tensor:
    """The backward of an fp8 call: raises ``Fp8TrainingError`` when it runs. It is an op rather
    than a raise in the autograd formula because torch.compile traces the backward when it compiles
    a forward whose inputs require a gradient (AOTAutograd's joint graph): a raise there would fail
    the forward, which runs in eager; the op defers the error to a backward that runs, as in eager."""
    raise Fp8TrainingError(_FP8_TRAINING)


@_fp8_backward_refused.register_fake
def _(dy: torch.Tensor) -> torch.Tensor:
    return dy.new_empty(())


def fp8_input_meta(inputs: tuple) -> tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]:
    """(shape, dtype) of each tensor of ``inputs`` (None for the others): what
    ``fp8_refused_grads`` needs."""
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in inputs)


def fp8_refused_grads(
    dy: torch.Tensor,
    meta: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...],
    needs_input_grad: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """An fp8 backward's gradients: ``_fp8_backward_refused`` raises ``Fp8TrainingError`` when it
    runs; traced, each gradient an input needs is a view of its result (so no compiler drops the op
    as unused), of the input's shape (``meta``, from ``fp8_input_meta``) and dtype. (A custom op's
    ``needs_input_grad`` can leave out its trailing non-tensor inputs: those need none.)"""
    refused = _fp8_backward_refused(dy)
    needs = tuple(needs_input_grad) + (False,) * (len(meta) - len(needs_input_grad))
    return tuple(
        refused.to(m[1]).expand(m[0]) if need and m is not None else None
        for m, need in zip(meta, needs, strict=True)
    )


def _fp8_grads(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The gradients of a backward through an fp8 call (``fp8_refused_grads``)."""
    return fp8_refused_grads(dy, ctx.input_meta, ctx.needs_input_grad)


def _refused(collective: str, a: torch.Tensor, b: torch.Tensor, name: str) -> bool:
    """True for operands whose shapes the op refuses when it runs (``execute``'s shape checks:
    ``check_shapes``, ``check_rows``). Only a trace gets this far with them (torch.compile's joint
    graph of a forward whose input needs a gradient): the backward formulas would fail that trace
    on the shapes with a RuntimeError, where the op raises its ``ShapeError`` when the graph runs."""
    from fo_kernels.execute import check_rows, check_shapes

    try:
        check_shapes(a, b)
        if collective == "reduce_scatter":
            check_rows(collective, a.shape[0], group_size(name))
    except FoTuneError:  # a shape refused; or not initialized, or a refused group: the op raises it
        return True
    return False


def _placeholder_grads(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Zero gradients of the inputs' shapes and dtypes for a traced call the op refuses when it
    runs (``_refused``): its forward raises first, so they are never computed."""
    needs = tuple(ctx.needs_input_grad) + (False,) * (len(ctx.input_meta) - len(ctx.needs_input_grad))
    return tuple(
        dy.new_zeros(m[0], dtype=m[1]) if need and m is not None else None
        for m, need in zip(ctx.input_meta, needs, strict=True)
    )


def _save_meta(ctx, collective: str, inputs) -> None:
    """What every backward needs: the group, whether the call is fp8 or refused, and (for those)
    the inputs' shapes and dtypes."""
    a, b, name, schedule, scale_a, *_ = inputs
    ctx.group_name = name
    ctx.fp8 = scale_a is not None
    # (eager, the op's forward has already refused such shapes: only a trace asks, off the hot path)
    ctx.refused = torch.compiler.is_compiling() and (is_refusal(schedule) or _refused(collective, a, b, name))
    ctx.input_meta = fp8_input_meta(inputs) if ctx.fp8 or ctx.refused else None


def _save_ab(ctx, inputs, output, collective: str) -> None:
    a, b, *_ = inputs
    _save_meta(ctx, collective, inputs)
    ctx.save_for_backward(a if ctx.needs_input_grad[1] and not ctx.fp8 else None, None if ctx.fp8 else b)


def _all_reduce_backward(ctx, dy: torch.Tensor):
    if ctx.refused:
        return _placeholder_grads(ctx, dy)
    if ctx.fp8:
        return _fp8_grads(ctx, dy)
    a, b = ctx.saved_tensors
    if dy.requires_grad and torch.is_grad_enabled():  # (create_graph=True: a gradient of a gradient)
        dy = _SummedGradient.apply(dy, ctx.group_name)
    da = matmul(dy, b.t(), None) if ctx.needs_input_grad[0] else None
    db = matmul(a.t(), dy, None) if ctx.needs_input_grad[1] else None
    return da, db, *_NO_GRADS


class _SummedGradient(torch.autograd.Function):
    """``dy`` as it is, whose own gradient is summed over the group: the output gradient that
    ``gemm_all_reduce``'s backward GEMMs take is every rank's alike, while each rank's gradient of
    it, through its shard's GEMMs, is one term of the sum (DTensor sums it, as a ``Partial()``
    gradient of a ``Replicate()`` tensor, for torch's ``RowwiseParallel``)."""

    @staticmethod
    def forward(ctx, dy: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return dy.view_as(dy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return summed(grad, ctx.name), None


def _reduce_scatter_backward(ctx, dy: torch.Tensor):
    if ctx.refused:
        return _placeholder_grads(ctx, dy)
    if ctx.fp8:
        return _fp8_grads(ctx, dy)
    a, b = ctx.saved_tensors
    da, gathered_dy = call_op("all_gather", dy.contiguous(), b.t(), ctx.group_name)
    db = matmul(a.t(), gathered_dy, None) if ctx.needs_input_grad[1] else None
    return (da if ctx.needs_input_grad[0] else None), db, *_NO_GRADS


def _save_gathered(ctx, inputs, output) -> None:
    _a, b, *_ = inputs
    _out, gathered = output
    _save_meta(ctx, "all_gather", inputs)
    # (an output no one differentiates gets None, not zeros: no ReduceScatter of zeros)
    ctx.set_materialize_grads(False)
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.fp8 or ctx.refused:
        ctx.mark_non_differentiable(gathered)
        need_a = need_b = False
    ctx.save_for_backward(gathered if need_b else None, b if need_a else None)


def _all_gather_backward(ctx, dy: torch.Tensor | None, d_gathered: torch.Tensor | None):
    if dy is not None and ctx.refused:
        return _placeholder_grads(ctx, dy)
    if dy is not None and ctx.fp8:
        return _fp8_grads(ctx, dy)
    gathered, b = ctx.saved_tensors
    da = db = None
    if ctx.needs_input_grad[0]:
        if dy is not None:
            da = call_op("reduce_scatter", dy.contiguous(), b.t(), ctx.group_name)
        if d_gathered is not None:  # the gathered A's own gradient: an AllGather's backward
            scattered = _scattered(d_gathered, ctx.group_name)
            da = scattered if da is None else da + scattered
    if ctx.needs_input_grad[1] and dy is not None:
        db = matmul(gathered.t(), dy, None)
    return da, db, *_NO_GRADS


def _scattered(t: torch.Tensor, name: str) -> torch.Tensor:
    """``reduce_scatter_tensor(t)`` on dim 0 over group ``name`` (torch's functional collective
    with autograd): the gradient a shard gets of its gathered rows."""
    group = resolve_group(name)
    pg = group if group is not None else dist.group.WORLD
    out = torch.ops._c10d_functional_autograd.reduce_scatter_tensor(
        t.contiguous(), "sum", pg.size(), pg.group_name
    )
    return torch.ops._c10d_functional.wait_tensor(out)


_gemm_all_reduce.register_autograd(
    _all_reduce_backward, setup_context=functools.partial(_save_ab, collective="all_reduce")
)
_gemm_reduce_scatter.register_autograd(
    _reduce_scatter_backward, setup_context=functools.partial(_save_ab, collective="reduce_scatter")
)
_all_gather_gemm.register_autograd(_all_gather_backward, setup_context=_save_gathered)
