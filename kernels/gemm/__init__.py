"""The signalled GEMM: persistent kernels that signal each group of output tiles as it lands.

One kernel per job over shared ``@triton.jit`` helpers (as Triton's persistent-matmul tutorial
writes one kernel per variant):

    operands   BOperand, TMA checks, the kernels' shared compile-time arguments (host only)
    tiles      the tile order, the main loop, the layouts' positions        (jit helpers)
    epilogue   a tile's stores and its release signal                       (jit helpers)
    waves      the whole waves (and the fused tail); signalled_gemm, KernelOptions
    tail       the last partial wave: the split tail (and its own launch), the stream-K tail
    pingpong   the warp-specialized ping-pong kernel (Gluon, Hopper)
    rows       rows_gemm, the copy engine's rows GEMM
    restore    restore_tile_major, the tile-major slots back to row-major

Imports run one way: ``waves`` imports ``tail``, ``pingpong``, ``epilogue``, ``tiles`` and
``operands``; nothing imports ``waves`` but this package.
"""

from __future__ import annotations

from fo_kernels.gemm.operands import BOperand, interpreting, store_view, tma_usable
from fo_kernels.gemm.restore import restore_tile_major
from fo_kernels.gemm.rows import rows_gemm
from fo_kernels.gemm.waves import DEFAULT_OPTIONS, KernelOptions, signalled_gemm

__all__ = [
    "DEFAULT_OPTIONS",
    "BOperand",
    "KernelOptions",
    "interpreting",
    "restore_tile_major",
    "rows_gemm",
    "signalled_gemm",
    "store_view",
    "tma_usable",
]
