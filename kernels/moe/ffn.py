"""``expert_parallel_ffn``: the public op of the expert-parallel MoE FFN."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fo_kernels.autocast import autocast_operands
from fo_kernels.errors import ShapeError
from fo_kernels.execute import check_local
from fo_kernels.groups import group_name
from fo_kernels.moe import ops
from fo_kernels.moe.routing import check_call
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.ops import direct_call
from fo_kernels.refusal import refusal, refused, shape_of


def expert_parallel_ffn(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    schedule: MoeSchedule | None = None,
) -> torch.Tensor:
    """The SwiGLU experts of an MoE layer under expert parallelism, over ``group``'s ranks.

    ``x`` (T, H): this rank's tokens (T may differ between ranks, and may be 0); ``topk_ids``
    (T, k) int64 global expert ids in [0, E) (int32 taken too; other dtypes raise ``ShapeError``),
    E = world size x E_local; ``topk_weights`` (T, k) floating point; ``w13`` (E_local, H, 2I):
    this rank's experts, experts [rank x E_local, (rank + 1) x E_local), the first I columns the
    gate and the last I the up projection; ``w2`` (E_local, I, H). Rank and world size are the
    group's (``dist.get_rank(group)``, ``dist.get_world_size(group)``): on a group of ranks 1 and 3,
    rank 3 holds experts [E_local, 2 x E_local). Returns (T, H) in x's dtype::

        y[t] = sum_j topk_weights[t, j] * (silu(x[t] @ W1[e]) * (x[t] @ W3[e])) @ W2[e],
        e = topk_ids[t, j]

    A token may name one expert in several slots: each slot is its own row, weighted by its own
    weight. Every rank of the group calls at once (it is a collective). Bad input raises a
    ``ValueError`` subclass (``ShapeError``, ``ScheduleError``, ``GroupError``) before any
    collective. ``schedule=None`` takes the MoE table's row for the experts' shape and the most
    tokens any rank holds (``fo_kernels.moe.table``; written by ``fo-tune search -c moe``), else
    runs the no-overlap path (dispatch, grouped GEMMs, combine); a ``MoeSchedule`` names an
    engine that overlaps them. Differentiable in x, topk_weights, w13
    and w2 (``fo_kernels.moe.ops``); traced by ``torch.compile(fullgraph=True)``. Inside
    ``torch.autocast`` x, w13 and w2 are cast to its dtype first, as ``F.linear``'s operands are
    (the output in that dtype); topk_weights, of any floating dtype, stays as it is.
    """
    named = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "w13": w13, "w2": w2}
    if torch.compiler.is_compiling():  # (traced: raised when the graph runs)
        _, why = refusal(lambda: (_check_tensors(named), check_local("", **named)))
        if why is not None:
            return refused(why, (x, w13, w2), shape_of(x))
    else:
        _check_tensors(named)
    x, w13, w2 = autocast_operands(x, w13, w2)
    tensors = (x, topk_ids, topk_weights, w13, w2)
    if not torch.compiler.is_compiling() and any(t.device.type == "meta" for t in tensors):
        # meta tensors hold no ids to route: check_call refuses them (or their mix with a real
        # device); the dispatcher would answer those that need gradients with the fake output
        check_call(*tensors, 1)
    direct = direct_call(x, topk_ids, topk_weights, w13, w2)
    if not direct:  # (a DTensor never takes the direct path; refused before the group, as traced)
        check_local("", **named)
    # (a refused group or schedule, traced: the op raises its ValueError when the graph runs it)
    name = group_name(group)
    text = ops.schedule_text(schedule)
    if direct:
        from fo_kernels.moe.call import execute_ffn

        return execute_ffn(x, topk_ids, topk_weights, w13, w2, schedule, group)
    return ops._ffn(x, topk_ids, topk_weights, w13, w2, name, text)


def _check_tensors(named: dict[str, object]) -> None:
    """``ShapeError`` naming an argument that is not a tensor."""
    for arg, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{arg} must be a torch tensor, got {type(t).__name__}")
