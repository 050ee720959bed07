"""The ``overlap: false`` call: the library GEMM then one collective (for all_gather: the collective
then the GEMM), replayed from a graph once it repeats.

A table says ``overlap: false`` where no overlap beats GEMM then the collective: small shapes,
whose GPU work is short. There a call's host time matters: issued eagerly, the runtime's call
(lookup, checks, cuBLAS, NCCL's enqueue) cost 66-69 us of host time a call against 80 us of GPU
work at 1024x4096x4096 ReduceScatter on H200 x2, and its loop ran 15-65% slower than the GPU work
(``docs/design.md#fallback``). So on GPUs with NCCL a call whose shape, operands' and
output's addresses repeat (a loop's steady state) is captured into a graph of its own
(``fo_kernels.graphs.OwnGraphs``) and replayed: one launch a call. Replayed, the fallback ran at
0.95-1.86x of the bench's GEMM then collective on the tables' ``overlap: false`` shapes on H200 x2
(the most where the process's eager calls were slow). A graph holding an NCCL collective lets the
host queue 28 launches ahead of the GPU; the next one waits until the GPU has drained them
(``docs/design.md#cuda-graphs``).

Graphed calls write the GEMM's (M, N) product of a ReduceScatter into one scratch buffer of the
runtime's (a graph holds its address), grown in powers of two, which drops the graphs; a replay on
another stream than the previous graphed call's first waits for that stream, so two calls never
share the scratch at once. An AllReduce sums in place in its output; an AllGather gathers into its
second output (the gathered A, from the same pool) and multiplies that. Calls that the graphs must not
hold run eagerly: on the CPU or another backend than NCCL, inside a caller's own capture (they are
recorded there), when autograd records the GEMM, and calls through the custom ops of
``fo_kernels.ops`` (compiled code, autograd: ``own_graphs=False``), whose outputs the caller's
allocator must hold.

At world size 1 the collective is the identity: the ops run ``one_rank`` instead, the GEMM alone
(an AllGather's gathered A a copy of the operand), with no collective call.

fp8 calls (``scales``, ``fo_kernels.scaling``) run the scaled GEMM (``torch._scaled_mm``) in its
place and reduce its ``out_dtype`` output; an AllGather gathers the fp8 shard as bytes and, rowwise,
the shard's rows of ``scale_a`` (one more small gather), then multiplies. A graphed fp8 call's key
holds the scales' addresses too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fo_kernels.collectives import all_gather_now, all_reduce_now, reduce_scatter_now
from fo_kernels.graphs import OutputPool, OwnGraphs
from fo_kernels.scaling import Scales, gather_scales, matmul, out_dtype_of, wire


def one_rank(
    collective: str, a: torch.Tensor, b: torch.Tensor, scales: Scales | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The overlap: false call of a group of one rank, whose collective is the identity: ``a @ b``
    (all_gather: ``(gathered @ b, gathered)``, the gathered A a copy of ``a``; fp8: scaled by
    ``scales``). No collective runs."""
    if collective == "all_gather":
        gathered = a.clone(memory_format=torch.contiguous_format)
        return matmul(gathered, b, scales), gathered
    return matmul(a, b, scales)


def sequential(
    collective: str,
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None,
    world: int,
    scales: Scales | None = None,
) -> torch.Tensor:
    """GEMM then the collective, issued eagerly: ``collective(a @ b)`` (fp8: the scaled GEMM)."""
    full = matmul(a, b, scales)
    if collective == "all_reduce":
        all_reduce_now(full, group)
        return full
    out = torch.empty((a.shape[0] // world, full.shape[1]), dtype=full.dtype, device=full.device)
    reduce_scatter_now(out, full, group)
    return out


def sequential_all_gather(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None,
    world: int,
    scales: Scales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather then GEMM, issued eagerly: ``(gathered @ b, gathered)`` where ``gathered`` holds
    rank r's rows of ``a`` at rows [r*M/w, (r+1)*M/w) (fp8: as bytes, and rowwise the rows' scales
    gathered too, before the scaled GEMM)."""
    gathered = torch.empty((a.shape[0] * world, a.shape[1]), dtype=a.dtype, device=a.device)
    all_gather_now(wire(gathered), wire(a.contiguous()), group)
    if scales is not None:
        scales = gather_scales(scales, world, group)
    return matmul(gathered, b, scales), gathered


def _scale_key(scales: Scales | None) -> tuple:
    """What a graphed fp8 call's key adds: the scales' kind, addresses and the output dtype."""
    if scales is None:
        return ()
    return (scales.rowwise, scales.out_dtype, scales.a.data_ptr(), scales.b.data_ptr(), scales.a.shape[0])


# Views of the scratch buffer kept, one per (M, N, dtype) in use (oldest dropped first).
SCRATCH_VIEWS = 256


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Fallback:
    """The ``overlap: false`` calls of one (device, process group); see the module docstring."""

    def __init__(
        self, device: torch.device, group: dist.ProcessGroup | None, world: int, graphable: bool
    ) -> None:
        self.device = device
        self.group = group
        self.world = world
        # only NCCL on a GPU is captured: gloo and the CPU have no graphs
        self.graphs: OwnGraphs | None = OwnGraphs(device, "overlap: false fallback") if graphable else None
        self._outputs = OutputPool(device)
        self._index = device.index if device.index is not None else 0  # (an int is resolved faster)
        self._scratch: torch.Tensor | None = None  # ReduceScatter's (M, N) product, graphed calls
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # (m, n, dtype) -> view
        self._last: torch.cuda.Stream | None = None  # the stream of the last graphed call

    @property
    def graph_after(self) -> int:
        """An eager call is captured into a graph of the fallback's own after this many calls with
        the same key; 0 never. Always 0 where nothing is graphed (the CPU, backends other than
        NCCL)."""
        return self.graphs.after if self.graphs is not None else 0

    @graph_after.setter
    def graph_after(self, calls: int) -> None:
        # where nothing is graphed every call is already eager: a setting of 0 (or any) changes nothing
        if self.graphs is not None:
            self.graphs.after = calls

    def _eager(self, a: torch.Tensor, b: torch.Tensor, scales: Scales | None) -> bool:
        """True when this call must not be graphed (see the module docstring)."""
        tensors = (a, b) if scales is None else (a, b, scales.a, scales.b)
        return (
            self.graphs is None
            or self.graphs.after <= 0
            or torch.cuda.is_current_stream_capturing()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        )

    def all_gather(
        self, a: torch.Tensor, b: torch.Tensor, *, scales: Scales | None = None, own_graphs: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gathered @ b, gathered)``: the (M, N) product and the (M, K) gathered A (M = world x
        a's rows). ``own_graphs=False``: issued eagerly, outputs from the caller's allocator."""
        if not own_graphs or self._eager(a, b, scales):
            return sequential_all_gather(a, b, self.group, self.world, scales)
        a = a.contiguous()
        m, k, n = a.shape[0] * self.world, a.shape[1], b.shape[1]
        gathered = self._outputs.empty((m, k), a.dtype)
        out = self._outputs.empty((m, n), out_dtype_of(a, scales))
        group, world = self.group, self.world

        def issue() -> None:
            all_gather_now(wire(gathered), wire(a), group)
            matmul(gathered, b, None if scales is None else gather_scales(scales, world, group), out)

        key = (
            "all_gather", a.dtype, tuple(a.shape), a.data_ptr(),
            tuple(b.shape), b.stride(), b.data_ptr(), out.data_ptr(), gathered.data_ptr(), _scale_key(scales),
        )  # fmt: skip
        self.graphs.call(key, issue)
        return out, gathered

    def run(
        self,
        collective: str,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        scales: Scales | None = None,
        own_graphs: bool = True,
    ) -> torch.Tensor:
        """``collective(a @ b)`` over the group: (M, N) for all_reduce, (M / world, N) for
        reduce_scatter. ``own_graphs=False``: issued eagerly, outputs from the caller's allocator."""
        graphs = self.graphs
        if not own_graphs or self._eager(a, b, scales):
            return sequential(collective, a, b, self.group, self.world, scales)
        m, n = a.shape[0], b.shape[1]
        dtype = out_dtype_of(a, scales)
        main = torch.cuda.current_stream(self._index)
        last, self._last = self._last, main
        if last is not None and last.cuda_stream != main.cuda_stream:
            main.wait_stream(last)  # the previous call's use of the scratch is done
        group = self.group
        if collective == "all_reduce":
            out = self._outputs.empty((m, n), dtype)

            def issue() -> None:
                matmul(a, b, scales, out)
                all_reduce_now(out, group)

            full_ptr = out.data_ptr()
        else:
            out = self._outputs.empty((m // self.world, n), dtype)
            full = self._full(m, n, dtype, last)

            def issue() -> None:
                matmul(a, b, scales, full)
                reduce_scatter_now(out, full, group)

            full_ptr = full.data_ptr()
        key = (
            collective, a.dtype, tuple(a.shape), a.stride(), a.data_ptr(),
            tuple(b.shape), b.stride(), b.data_ptr(), out.data_ptr(), full_ptr, _scale_key(scales),
        )  # fmt: skip
        graphs.call(key, issue)
        return out

    def _full(self, m: int, n: int, dtype: torch.dtype, last: torch.cuda.Stream | None) -> torch.Tensor:
        """An (m, n) view of the scratch buffer (views are kept: a call's host time counts here).
        Growing the buffer drops the graphs (they hold the old buffer's address); ``last``, the
        stream of the previous graphed call, may still be reading the old buffer, so its memory is
        reused only after that."""
        view = self._views.get((m, n, dtype))
        if view is not None:
            return view
        nbytes = m * n * dtype.itemsize
        if self._scratch is None or self._scratch.numel() < nbytes:
            if self.graphs is not None:
                self.graphs.clear()
            if self._scratch is not None and last is not None and self._scratch.is_cuda:
                self._scratch.record_stream(last)
            self._views.clear()
            self._scratch = None  # (freed first: the new one may take its memory)
            self._scratch = torch.empty(_pow2_at_least(nbytes), dtype=torch.uint8, device=self.device)
        view = self._views[(m, n, dtype)] = self._scratch[:nbytes].view(dtype).view(m, n)
        while len(self._views) > SCRATCH_VIEWS:
            self._views.pop(next(iter(self._views)))
        return view
