"""The no-overlap path, and what every engine falls back to: each step once, in sequence.

    rows = stage.outgoing()                           sorted rows (bytes)
    got  = all_to_all(rows)                           dispatch: one All-to-All, splits by counts
    stage.first(every slot, got); back = stage.second(every slot)
                                                      the grouped GEMMs over every received row
                                                      at once, ordered by expert
    ret  = all_to_all(back)                           combine: the dispatch's splits swapped
    stage.finish(ret)                                 the weighted sum at the source

Any backend with ``all_to_all_single`` runs it (NCCL; gloo on the CPU). It is what a call without
a schedule, or with ``engine: null``, runs, and the baseline the engines are timed beside.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fo_kernels.moe.exchange import all_to_all_rows
from fo_kernels.moe.stages import Stage


def run(stage: Stage, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """One call of ``stage`` without overlap (see the module docstring)."""
    layout = stage.layout
    pieces = [stage.whole(s) for s in range(layout.world)]
    got = all_to_all_rows(stage.outgoing(), layout.send_splits, layout.recv_splits, group)
    stage.first(pieces, got)
    back = stage.second(pieces)
    return stage.finish(all_to_all_rows(back, layout.recv_splits, layout.send_splits, group))
