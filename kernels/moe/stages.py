"""What one direction of a call computes, apart from moving rows: a stage.

Both directions have one shape, which every path (the no-overlap path, the Triton engine, the
copy engine's protocol) runs the same way:

    source   rows = stage.outgoing()                     sorted rows, bytes (routing.py)
    (dispatch: rows to the ranks of their experts; slot s = the rows from rank s, grouped by
     expert; a piece = one slot's rows of a range of experts)
    expert   stage.first(pieces, their rows)             the first GEMMs, as the pieces land
             stage.second(pieces) -> rows back           the last GEMM of those pieces
    (combine: each slot's rows back to its source)
    source   stage.finish(rows back, in sorted order)    the weighted sum at the source

Forward (per row of expert e, x_r its token's row, w_r its weight):
    first:  gu = x_r @ W13[e];  h = silu(gu[:I]) * gu[I:]          kept per slot
    second: o = h @ W2[e]                                          (the row sent back)
    finish: y[t] = sum_j w[t, j] * o[pair (t, j)]                  float32, then x's dtype

(float32 is ``acc_dtype``: float64 for float64 operands.)

Backward, recomputing the forward's activations (nothing of a data-dependent size is kept
between the directions), with dy_r the output gradient of its token:
    first:  gu, h as above;  dhu = dy_r @ W2[e].T;  dw_r = <dhu, h>;  dh = w_r * dhu
            dW2[e] += h.T @ (w_r * dy_r);  dgu = swiglu'(gu) dh;  dW13[e] += x_r.T @ dgu
    second: dx_r = dgu @ W13[e].T                                  (sent back with dw_r)
    finish: dx[t] = sum_j dx[pair (t, j)];  d topk_weights[t, j] = dw[pair (t, j)]

since y depends on w[t, j] through w * (h @ W2) and <dy, h @ W2> = <dy @ W2.T, h>.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from fo_kernels.moe.exchange import Layout, pack, unpack
from fo_kernels.moe.grouped import (
    acc_dtype,
    device_ints,
    grouped_mm,
    grouped_mm_t,
    swiglu,
    swiglu_backward,
    weight_grad,
)
from fo_kernels.moe.routing import FfnShape, Routing

# A piece of the received rows: (slot, first expert, end expert): the rows source ``slot`` sent
# for local experts [first, end), contiguous in that slot's block.
Piece = tuple[int, int, int]


class Stage(ABC):
    """One direction's compute (see the module docstring). ``first`` and ``second`` take pieces
    (``Piece``: a slot's rows of a range of experts) in any grouping, each piece once; rows of
    several pieces run as one grouped GEMM."""

    def __init__(
        self, shape: FfnShape, routing: Routing, layout: Layout, w13: torch.Tensor, w2: torch.Tensor
    ) -> None:
        self.shape, self.routing, self.layout, self.w13, self.w2 = shape, routing, layout, w13, w2
        self.dtype = w13.dtype
        self.acc = acc_dtype(self.dtype)  # sums, activations, the routing weights' rows
        self._kept: dict[tuple[Piece, ...], tuple] = {}

    @property
    @abstractmethod
    def out_parts(self) -> tuple[tuple[torch.dtype, int], ...]:
        """The (dtype, width) parts of an outgoing row."""

    @property
    @abstractmethod
    def back_parts(self) -> tuple[tuple[torch.dtype, int], ...]:
        """The (dtype, width) parts of a row sent back."""

    @abstractmethod
    def outgoing(self) -> torch.Tensor:
        """The sorted rows to send, as bytes."""

    @abstractmethod
    def _first(self, parts: list[torch.Tensor], counts: list[int]) -> tuple: ...

    @abstractmethod
    def _second(self, kept: tuple, counts: list[int]) -> torch.Tensor: ...

    @abstractmethod
    def finish(self, back: torch.Tensor) -> torch.Tensor | None:
        """The call's result from the rows sent back (bytes, sorted order)."""

    # ------------------------------------------------------------------ pieces
    def whole(self, slot: int) -> Piece:
        """Every row of ``slot``."""
        return (slot, 0, self.shape.experts)

    def counts(self, pieces: Sequence[Piece]) -> list[int]:
        """Rows per local expert over ``pieces`` together."""
        out = [0] * self.shape.experts
        for s, e0, e1 in pieces:
            for e in range(e0, e1):
                out[e] += self.layout.recv[s][e]
        return out

    def piece_rows(self, piece: Piece) -> tuple[int, int]:
        """Rows [r0, r1) of ``piece`` in the received rows (slot by slot, in rank order)."""
        s, e0, e1 = piece
        at = self.layout.recv_offsets[s] + sum(self.layout.recv[s][:e0])
        return at, at + sum(self.layout.recv[s][e0:e1])

    def _expert_major(self, pieces: Sequence[Piece]) -> torch.Tensor | None:
        """The permutation that orders the rows of ``pieces`` (concatenated) by expert; None when
        they already are (one piece)."""
        if len(pieces) == 1:
            return None
        experts = [e for _, e0, e1 in pieces for e in range(e0, e1)]
        rows = [self.layout.recv[s][e] for s, e0, e1 in pieces for e in range(e0, e1)]
        dev = self.w13.device
        key = torch.repeat_interleave(
            device_ints(experts, torch.int64, dev), device_ints(rows, torch.int64, dev), output_size=sum(rows)
        )  # (output_size: the host knows it, and without it torch reads it back from the GPU)
        return torch.sort(key, stable=True).indices

    def first(self, pieces: Sequence[Piece], rows: torch.Tensor) -> None:
        """Phase 1 of ``pieces``: ``rows`` are their received rows (bytes), concatenated in order."""
        pieces = tuple(pieces)
        perm = self._expert_major(pieces)
        if perm is not None:
            rows = rows[perm]
        parts = unpack(rows, self.out_parts)
        self._kept[pieces] = (perm, self._first(parts, self.counts(pieces)))

    def second(self, pieces: Sequence[Piece]) -> torch.Tensor:
        """Phase 2 of ``pieces`` (given to ``first`` as one group): their rows back, as bytes, in
        the order they arrived."""
        perm, kept = self._kept.pop(tuple(pieces))
        back = self._second(kept, self.counts(pieces))
        if perm is not None:
            unsorted = torch.empty_like(back)
            unsorted[perm] = back
            back = unsorted
        return back


class ForwardStage(Stage):
    """``y = sum_j w[t, j] * (silu(x W1) * (x W3)) W2`` (module docstring, forward)."""

    def __init__(self, x: torch.Tensor, weights: torch.Tensor, *args) -> None:
        super().__init__(*args)
        self.x, self.weights = x, weights

    @property
    def out_parts(self) -> tuple[tuple[torch.dtype, int], ...]:
        return ((self.dtype, self.shape.hidden),)

    @property
    def back_parts(self) -> tuple[tuple[torch.dtype, int], ...]:
        return ((self.dtype, self.shape.hidden),)

    def outgoing(self) -> torch.Tensor:
        return pack(self.x[self.routing.tokens])

    def _first(self, parts, counts):
        (x,) = parts
        return (swiglu(grouped_mm(x, self.w13, counts)),)

    def _second(self, kept, counts):
        (h,) = kept
        return pack(grouped_mm(h, self.w2, counts))

    def finish(self, back: torch.Tensor) -> torch.Tensor:
        (o,) = unpack(back, self.back_parts)
        t, k = self.shape.tokens, self.shape.top_k
        pairs = self.routing.unsort(o).view(t, k, self.shape.hidden).to(self.acc)
        return (pairs * self.weights.to(self.acc).unsqueeze(-1)).sum(1).to(self.x.dtype)


class BackwardStage(Stage):
    """The gradients of ``ForwardStage``'s output (module docstring, backward); ``grads()`` gives
    (dx, d topk_weights, dw13, dw2) once ``finish`` has run."""

    def __init__(self, dy: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, *args) -> None:
        super().__init__(*args)
        self.dy, self.x, self.weights = dy, x, weights
        e, h, i = self.shape.experts, self.shape.hidden, self.shape.intermediate
        self.dw13 = torch.zeros((e, h, 2 * i), dtype=self.acc, device=x.device)
        self.dw2 = torch.zeros((e, i, h), dtype=self.acc, device=x.device)

    @property
    def out_parts(self) -> tuple[tuple[torch.dtype, int], ...]:
        h = self.shape.hidden
        return ((self.dtype, h), (self.dtype, h), (self.acc, 1))

    @property
    def back_parts(self) -> tuple[tuple[torch.dtype, int], ...]:
        return ((self.dtype, self.shape.hidden), (self.acc, 1))

    def outgoing(self) -> torch.Tensor:
        tokens = self.routing.tokens
        w = self.weights.reshape(-1)[self.routing.order].to(self.acc).unsqueeze(1)
        return pack(self.x[tokens], self.dy.to(self.dtype)[tokens], w)

    def _first(self, parts, counts):
        x, dy, w = parts
        gu = grouped_mm(x, self.w13, counts)
        h = swiglu(gu)
        dhu = grouped_mm_t(dy, self.w2, counts).to(self.acc)
        dw = (dhu * h.to(self.acc)).sum(1, keepdim=True)
        self.dw2 += weight_grad(h, (dy.to(self.acc) * w).to(self.dtype), counts)
        dgu = swiglu_backward(gu, dhu * w)
        self.dw13 += weight_grad(x, dgu, counts)
        return dgu, dw

    def _second(self, kept, counts):
        dgu, dw = kept
        return pack(grouped_mm_t(dgu, self.w13, counts), dw)

    def finish(self, back: torch.Tensor) -> None:
        dx_rows, dw = unpack(back, self.back_parts)
        t, k = self.shape.tokens, self.shape.top_k
        pairs = self.routing.unsort(dx_rows).view(t, k, self.shape.hidden)
        self.dx = pairs.to(self.acc).sum(1).to(self.x.dtype)
        self.dweights = self.routing.unsort(dw).view(t, k).to(self.weights.dtype)

    def grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dx, self.dweights, self.dw13.to(self.dtype), self.dw2.to(self.dtype)
