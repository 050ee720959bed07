"""``LinearPlan``: how one ``nn.Linear`` that ``fo_kernels.parallel``'s styles parallelized runs (its
kind, the style's layouts, its mesh and group, its fp8 scaling), and the module attribute that
holds it. The styles (``fo_kernels.parallel``) make it; the forward (``fo_kernels.parallel_forward``)
and the fp8 weight's state (``fo_kernels.parallel_fp8``) read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from fo_kernels.groups import PickledGroup

# The attribute of the module that holds its LinearPlan.
PLAN_ATTR = "_fo_parallel_plan"
COLWISE, ROWWISE = "colwise", "rowwise"


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """How one parallelized ``nn.Linear`` runs: the style's layouts, its mesh and group."""

    kind: str
    mesh: DeviceMesh
    group: torch.distributed.ProcessGroup
    group_name: str
    world_size: int
    input_layouts: tuple[Placement, ...]
    output_layouts: tuple[Placement, ...]
    use_local_output: bool
    fp8: str | None = None  # the scaling of an fp8 module ("tensorwise" or "rowwise"), or None

    def __reduce__(self) -> tuple[Callable[..., LinearPlan], tuple[object, ...]]:
        """The plan as ``copy.deepcopy`` and pickle take it (a deep copy of a parallelized model):
        its group by name, found again in this process as ``DeviceMesh`` finds its own, since a
        ``ProcessGroup`` neither pickles nor deep-copies."""
        fields = (self.kind, self.mesh, self.group_name, self.world_size)
        layouts = (self.input_layouts, self.output_layouts, self.use_local_output)
        return _plan_of_group_name, (*fields, *layouts, self.fp8)


def _plan_of_group_name(
    kind: str,
    mesh: DeviceMesh,
    group_name: str,
    world_size: int,
    input_layouts: tuple[Placement, ...],
    output_layouts: tuple[Placement, ...],
    use_local_output: bool,
    fp8: str | None = None,
) -> LinearPlan:
    """A ``LinearPlan`` whose group is the one named ``group_name`` in this process (``GroupError``
    where there is none, as for the layers' pickled group: ``PickledGroup``)."""
    group = PickledGroup(group_name).resolve()
    return LinearPlan(
        kind, mesh, group, group_name, world_size, input_layouts, output_layouts, use_local_output, fp8
    )
