"""The kernel-loading rule: every kernel a call launches is loaded before its first flag wait.

Under CUDA's lazy module loading (the default), the first launch of a kernel that is not yet loaded
blocks the host while another stream of the context waits on a flag (``cuStreamWaitValue32``):
measured on one H200 with virtual ranks in one process, the host blocked forever, because the
flag's writer was to be issued by the same host after the launch (docs/design.md#kernel-loading).
A real multi-process run can stall the same way on its first call of a shape, or on a newly
compiled Triton specialization. So before a plan's first wait is issued, each distinct kernel it
launches runs once here:

    for each step of the compiled plan that launches a kernel (a chunk GEMM, a tiled GEMM):
        key = (kind, stream, for every tensor it touches: shape, strides, dtype, address mod 256)
        the first step of each key runs on scratch tensors with those shapes, strides, dtypes
        and alignments (so cuBLAS picks, and Triton specializes, the same kernel), on its stream
        (cuBLAS keeps a workspace per stream), reading the call's B and scales
    and one small copy and memset on each stream that issues them (the driver's own copies)

No flag is waited for or written: the tiled kernel's counters go to scratch cells and its ready
cells are scratch cells already set. The GPU executor (``gpu.GpuExecutor.warm_up``) runs it with
the device synchronized first (no stream waits on a flag while a module loads), after the scratch
tensors are filled (on the current stream; the kernels run on theirs) and at the end (the scratch
is freed only once nothing uses it).
"""

from __future__ import annotations

import torch

# Scratch tensors match the real ones' addresses modulo this many bytes: torch hands cuBLASLt the
# largest power of two dividing each operand's address, up to 256, and its heuristics read it;
# Triton specializes pointers on divisibility by 16, which 256 covers.
SCRATCH_ALIGN = 256


def launch_key(t: torch.Tensor | None) -> tuple | None:
    """What of ``t`` decides which kernel a launch reading or writing it runs."""
    if t is None:
        return None
    return (tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % SCRATCH_ALIGN)


def scratch_like(t: torch.Tensor, fill: int | None = None) -> torch.Tensor:
    """A new tensor with ``t``'s dtype, shape and strides at ``t``'s address modulo
    ``SCRATCH_ALIGN`` (its values uninitialized, or ``fill``)."""
    item = t.element_size()
    span = (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))) * item
    if t.numel() == 0:
        span = item
    raw = torch.empty(span + 2 * SCRATCH_ALIGN, dtype=torch.uint8, device=t.device)
    shift = (t.data_ptr() - raw.data_ptr()) % SCRATCH_ALIGN
    out = raw[shift : shift + span].view(t.dtype).as_strided(tuple(t.shape), t.stride())
    if fill is not None:
        out.fill_(fill)
    return out
