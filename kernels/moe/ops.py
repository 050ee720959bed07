"""The expert-parallel FFN as torch.library custom ops: schemas, fake implementations, autograd.

    fo_kernels::expert_parallel_ffn(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13,
        Tensor w2, str group_name, str schedule) -> Tensor
    fo_kernels::expert_parallel_ffn_backward(Tensor dy, Tensor x, Tensor topk_ids,
        Tensor topk_weights, Tensor w13, Tensor w2, str group_name, str schedule)
        -> (Tensor, Tensor, Tensor, Tensor)

As the dense ops (``fo_kernels.ops``): the group goes in by name, the schedule as its JSON text
(``MoeSchedule.op_text``; "" for none), so torch.compile keeps both as constants and traces the
call without a graph break. Every output has a static shape (y like x; the gradients like x,
topk_weights, w13 and w2): the routed rows, whose number depends on the data, never leave the op.

Autograd: the forward saves its inputs only; the backward op dispatches x, dy and the weights
again and recomputes the experts' activations (``fo_kernels.moe.stages``), one All-to-All each
way as the forward. topk_ids gets no gradient. The backward op's own backward (a double backward:
``create_graph=True``, then a backward through the gradients) raises ``DoubleBackwardError``
before any collective; its gradients taken with ``create_graph=True`` and never differentiated
again are the plain backward's. Importing this module registers the ops.
"""

from __future__ import annotations

import functools
import json

import torch

from fo_kernels.errors import DoubleBackwardError, ScheduleError
from fo_kernels.groups import resolve_group
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.ops import LIBRARY, SCHEDULE_CACHE_SIZE, check_schedule_text, direct_call, refuse_schedule

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def schedule_text(schedule: MoeSchedule | None) -> str:
    """The ops' ``schedule`` argument ("" for None)."""
    if schedule is None:
        return ""
    if not isinstance(schedule, MoeSchedule):
        return refuse_schedule(f"schedule: expected a fo_kernels.MoeSchedule, got {type(schedule).__name__}")
    return schedule.op_text


@functools.lru_cache(maxsize=SCHEDULE_CACHE_SIZE)
def parse_schedule(text: str) -> MoeSchedule | None:
    """The ``MoeSchedule`` of an op's schedule argument, its JSON text (None for ""); ``ScheduleError`` for
    text that is not a schedule."""
    if not text:
        return None
    check_schedule_text(text)
    try:
        return MoeSchedule.from_dict(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"schedule: not a schedule's JSON text ({exc})") from None


def _execute(*args, group_name: str, schedule: str, dy: torch.Tensor | None = None):
    from fo_kernels.moe.call import execute_ffn

    return execute_ffn(*args, parse_schedule(schedule), resolve_group(group_name), dy=dy)


@torch.library.custom_op(f"{LIBRARY}::expert_parallel_ffn", mutates_args=())
def _ffn(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    group_name: str,
    schedule: str,
) -> torch.Tensor:
    return _execute(x, topk_ids, topk_weights, w13, w2, group_name=group_name, schedule=schedule)


@torch.library.custom_op(f"{LIBRARY}::expert_parallel_ffn_backward", mutates_args=())
def _ffn_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    group_name: str,
    schedule: str,
) -> Grads:
    return _execute(x, topk_ids, topk_weights, w13, w2, group_name=group_name, schedule=schedule, dy=dy)


# The fake implementations check nothing: Dynamo turns any exception raised while it propagates
# fake tensors into a RuntimeError (torch._dynamo.exc.TorchRuntimeError), so a check here would
# give bad input under torch.compile a RuntimeError instead of the op's ValueError. Their outputs
# are shaped like the inputs whatever those are; the op itself checks at run time
# (``execute_ffn``), before any collective, in eager calls and compiled graphs alike.
@_ffn.register_fake
def _(x, topk_ids, topk_weights, w13, w2, group_name, schedule):
    return x.new_empty(x.shape)


@_ffn_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w13, w2, group_name, schedule):
    return tuple(t.new_empty(t.shape) for t in (x, topk_weights, w13, w2))


def _setup(ctx, inputs, output) -> None:
    x, topk_ids, topk_weights, w13, w2, group_name, schedule = inputs
    ctx.group_name, ctx.schedule = group_name, schedule
    ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2)


def _backward(ctx, dy: torch.Tensor):
    inputs = ctx.saved_tensors  # x, topk_ids, topk_weights, w13, w2
    # the backward op, directly where ``direct_call`` allows, else through the dispatcher
    if direct_call(dy, *inputs):
        dx, dw, dw13, dw2 = _execute(*inputs, group_name=ctx.group_name, schedule=ctx.schedule, dy=dy)
    else:
        dx, dw, dw13, dw2 = _ffn_backward(dy, *inputs, ctx.group_name, ctx.schedule)
    need = ctx.needs_input_grad
    return (
        dx if need[0] else None,
        None,
        dw if need[2] else None,
        dw13 if need[3] else None,
        dw2 if need[4] else None,
        None,
        None,
    )


_ffn.register_autograd(_backward, setup_context=_setup)


def _double_backward(ctx, *grads: torch.Tensor):
    raise DoubleBackwardError(
        "expert_parallel_ffn has no double backward (its backward is not differentiable): take its "
        "gradients without create_graph=True, or detach them before differentiating them again"
    )


_ffn_backward.register_autograd(_double_backward)

# Every rank must enter the ops' collectives whatever its tokens: both are marked side-effectful,
# so that no compiler pass drops a call whose output is unused or has no element (inductor drops
# the call of a rank of no tokens in DeepSeek-V3's MoE block, whose output it never reads), which
# would leave the other ranks waiting in the call's first collective.
for _op in (_ffn, _ffn_backward):
    torch.fx.node.has_side_effect(_op._opoverload)
