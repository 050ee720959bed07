"""One call's routing on this rank: the checks that need only this rank's tensors, and which rows go
to which rank in what order.

Every (token t, slot j) pair is one row, duplicates included: a token routed twice to expert e
sends two rows and gets two results back, each weighted by its own slot's weight, which is what
``y[t] = sum_j w[t, j] * f_e(x[t])`` sums. Rows are sorted by global expert id (stable), so the
rows for destination rank d form one block, grouped by d's local experts in order:

    pair p = t * k + j                  (row-major over topk_ids)
    order  = argsort(topk_ids.view(-1), stable)        # the pair of each sorted row
    tokens = order // k                                 # the token of each sorted row
    counts[d, e] = #{p : topk_ids.view(-1)[p] == d * E_local + e}
    rows to rank d: sorted rows [offset_d, offset_d + sum_e counts[d, e])

The expert side sees, per source rank, its block of rows grouped by local expert in the same
order, so every block is already in the layout a grouped GEMM takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fo_kernels.errors import ShapeError
from fo_kernels.schedule import TORCH_DTYPES

# Index dtypes ``topk_ids`` may have: torch.topk returns int64; int32 is what some routers store.
ID_DTYPES = (torch.int64, torch.int32)
# The dtypes a MoE schedule and table name: the dense schedules' but float8 (the experts' grouped
# GEMMs have no scaled path).
MOE_DTYPES = ("bfloat16", "float16", "float32")
# The dtypes of x and the experts: the schedules' three, and float64 (a reference; the no-overlap
# path only, since a schedule names one of the three).
FFN_DTYPES = (*(TORCH_DTYPES[name] for name in MOE_DTYPES), torch.float64)


@dataclass(frozen=True, slots=True)
class FfnShape:
    """The sizes of one call on this rank: T tokens of width H, k slots, E_local experts of
    intermediate size I, in a group of ``world`` ranks (E = world x E_local experts)."""

    tokens: int
    hidden: int
    top_k: int
    experts: int  # E_local
    intermediate: int
    world: int

    @property
    def total_experts(self) -> int:
        return self.world * self.experts


def _describe(name: str, t: object) -> str:
    return f"{name} {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else f"{name} {t!r}"


def check_call(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    world: int,
    *,
    check_ids: bool = True,
) -> FfnShape:
    """The call's sizes; raises ``ShapeError`` for input that disagrees (the message names the
    tensors). ``check_ids`` also reads the ids' range (a device sync: the real call makes it, a
    traced one cannot), and so refuses meta tensors, which hold no ids to read."""
    named = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "w13": w13, "w2": w2}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if x.dim() != 2 or topk_ids.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ShapeError(
            "x must be (T, H), topk_ids and topk_weights (T, k), w13 (E_local, H, 2I) and w2 "
            f"(E_local, I, H); got {', '.join(_describe(n, t) for n, t in named.items())}"
        )
    tokens, hidden = x.shape
    if hidden == 0:
        raise ShapeError(f"x must be (T, H) with H >= 1; got {_describe('x', x)}")
    if topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ShapeError(
            f"topk_ids and topk_weights must both be (T, k) with T = x.shape[0] = {tokens}; got "
            f"{_describe('topk_ids', topk_ids)}, {_describe('topk_weights', topk_weights)}"
        )
    experts, h13, i2 = w13.shape
    if h13 != hidden or i2 % 2 or i2 == 0:
        raise ShapeError(
            f"w13 must be (E_local, H, 2I) with H = {hidden} (x's width) and 2I even and > 0; got "
            f"{tuple(w13.shape)}"
        )
    inter = i2 // 2
    if experts == 0:
        raise ShapeError(
            f"w13 {tuple(w13.shape)} holds no experts: every rank holds E_local >= 1 of them (its "
            "experts [rank x E_local, (rank + 1) x E_local) of the E = world size x E_local)"
        )
    if tuple(w2.shape) != (experts, inter, hidden):
        raise ShapeError(
            f"w2 must be (E_local, I, H) = ({experts}, {inter}, {hidden}) to match w13 {tuple(w13.shape)}"
            f" and x; got {tuple(w2.shape)}"
        )
    if x.dtype not in FFN_DTYPES:
        raise ShapeError(f"x is {x.dtype}; use bfloat16, float16 or float32 (float64 without a schedule)")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ShapeError(
            f"x is {x.dtype} but w13 is {w13.dtype} and w2 {w2.dtype}; all three must agree (cast "
            "them, or call inside torch.autocast)"
        )
    if topk_ids.dtype not in ID_DTYPES:
        raise ShapeError(f"topk_ids is {topk_ids.dtype}; expert ids are int64 (or int32)")
    if not topk_weights.dtype.is_floating_point:
        raise ShapeError(f"topk_weights is {topk_weights.dtype}; routing weights are floating point")
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ShapeError(f"every tensor must be on one device, got {', '.join(sorted(map(str, devices)))}")
    shape = FfnShape(tokens, hidden, topk_ids.shape[1], experts, inter, world)
    if check_ids and x.device.type == "meta":
        raise ShapeError(
            "the tensors are on the meta device, which holds no data: call with the tokens and "
            "experts on a real device (a model made on meta: to_empty, then load its weights)"
        )
    if check_ids and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= shape.total_experts:
            raise ShapeError(
                f"topk_ids: expert ids must be in [0, {shape.total_experts}) (world size {world} x "
                f"E_local {experts}); got ids from {lo} to {hi}"
            )
    return shape


@dataclass(frozen=True, slots=True)
class Routing:
    """The sorted rows of one call on the source rank (see the module docstring)."""

    order: torch.Tensor  # (T*k,) int64: the pair of each sorted row
    tokens: torch.Tensor  # (T*k,) int64: the token of each sorted row
    counts: torch.Tensor  # (world, E_local) int64 on the call's device
    host_counts: tuple[tuple[int, ...], ...]  # the same on the host

    @property
    def splits(self) -> list[int]:
        """Rows this rank sends to each rank."""
        return [sum(row) for row in self.host_counts]

    def unsort(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (T*k, ...) in sorted order, put back in pair order (t * k + j)."""
        out = torch.empty_like(rows)
        out[self.order] = rows
        return out


def route(topk_ids: torch.Tensor, shape: FfnShape) -> Routing:
    """The routing of ``topk_ids`` (checked by ``check_call``); one device-to-host copy (the counts)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=shape.total_experts).view(shape.world, shape.experts)
    host = tuple(tuple(row) for row in counts.tolist())
    return Routing(order, order // max(shape.top_k, 1), counts, host)
