"""The copy engine's probe task: whether this machine's ranks can run the copy engine (peer access,
symmetric memory, cuda-bindings), asked on the ranks before a search offers the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fo_kernels.runtime import runtime_for
from fo_tune.ranks.pool import RankContext


@dataclass(frozen=True)
class CopyEngineProbeTask:
    """Whether these ranks can run ``engine: copy_engine``: "" when they can, else why not (the
    same answer on every rank). The cheap local checks are agreed on before the symmetric buffers
    are made, so a rank that cannot make them does not leave the other waiting in the rendezvous."""

    def run(self, ctx: RankContext) -> str:
        from fo_kernels.engines.copy_engine import copy_engine_blocker
        from fo_kernels.errors import EnvironmentMismatchError

        why = copy_engine_blocker(ctx.device, ctx.world_size)
        bad = torch.tensor([1 if why else 0], device=ctx.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if int(bad.item()):
            return f"engine copy_engine {why or 'cannot run on another rank'}"
        try:
            runtime_for(ctx.device, None).copy_engine()
        except EnvironmentMismatchError as exc:
            return str(exc)
        return ""
