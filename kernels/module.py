"""A drop-in row-parallel linear layer whose matmul and reduction are overlapped tile-wise.

``RowParallelLinear`` holds this rank's slice of an ``nn.Linear`` weight: the full layer maps
``in_features`` to ``out_features``; rank r owns input columns [r*in/w, (r+1)*in/w) and gets
activations already split that way (the output of a column-parallel layer). ``forward`` returns
the full ``x @ W.T`` summed over ranks (``all_reduce``), or its dim-0 shard (``reduce_scatter``,
sequence parallelism), plus the bias, added once after the reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .errors import ShapeError
from .overlap import gemm_all_reduce, gemm_reduce_scatter
from .schedule import COLLECTIVES, Schedule


class RowParallelLinear(nn.Module):
    """Row-parallel ``nn.Linear`` (see the module docstring); the schedule is looked up per shape."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        collective: str = "all_reduce",
        group: dist.ProcessGroup | None = None,
        schedule: Schedule | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if collective not in COLLECTIVES:
            raise ValueError(f"collective {collective!r} is not one of {', '.join(COLLECTIVES)}")
        world = dist.get_world_size(group)
        if in_features % world:
            raise ShapeError(f"in_features {in_features} is not divisible by the world size {world}")
        self.in_features, self.out_features = in_features, out_features
        self.collective, self.group, self.schedule = collective, group, schedule
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features // world, device=device, dtype=dtype)
        )
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        collective: str = "all_reduce",
        group: dist.ProcessGroup | None = None,
        schedule: Schedule | None = None,
    ) -> RowParallelLinear:
        """This rank's shard of a full ``nn.Linear`` (same weights on every rank beforehand)."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            collective=collective,
            group=group,
            schedule=schedule,
            device=w.device,
            dtype=w.dtype,
        )
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        cols = linear.in_features // world
        with torch.no_grad():
            layer.weight.copy_(w[:, rank * cols : (rank + 1) * cols])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ShapeError(
                f"input has {x.shape[-1]} features, this rank's shard takes {self.weight.shape[1]}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        op = gemm_all_reduce if self.collective == "all_reduce" else gemm_reduce_scatter
        y = op(x2, self.weight.t(), schedule=self.schedule, group=self.group)
        if self.bias is not None:
            y = y + self.bias
        if self.collective == "all_reduce":
            return y.reshape(*lead, self.out_features)
        world = dist.get_world_size(self.group)
        if len(lead) == 0 or lead[0] % world:
            return y  # the shard of the flattened rows
        return y.reshape(lead[0] // world, *lead[1:], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, collective={self.collective}"
        )
