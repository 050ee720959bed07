"""Process groups as the ops name them: ``group.group_name`` ("" for the default group) in a
custom op's arguments, checked and resolved back inside the op."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fo_kernels.errors import GroupError, NotInitializedError

# The ops' ``group_name`` of a group argument that ``check_group`` refuses, in a traced call
# (torch.compile): Dynamo makes a RuntimeError of anything its trace raises, so the name carries
# the refusal instead and ``resolve_group`` raises that ``GroupError`` when the graph runs the op,
# before any collective, as an eager call raises it. No process group has such a name.
REFUSED_GROUP = "<refused group> "


def group_name(group: object) -> str:
    """The ops' ``group_name`` argument of ``group`` ("" for the default group); refuses what is
    not a process group of this rank (``GroupError``) before any collective starts: at once, or
    in a traced call when the op runs (``REFUSED_GROUP``)."""
    if group is None:
        return ""
    problem = group_problem(group)
    if problem:
        if torch.compiler.is_compiling():
            return REFUSED_GROUP + problem
        raise GroupError(problem)
    return group.group_name


def group_problem(group: object) -> str:
    """Why ``check_group`` refuses ``group``; "" when it takes it."""
    if group is None:
        return ""
    if isinstance(group, dist.ProcessGroup):
        if group not in dist.distributed_c10d._world.pg_map:
            return (
                "group: the process group was destroyed (dist.destroy_process_group) or was not made "
                "by torch.distributed; pass a live group, or None for the default one"
            )
        return ""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return (
            "group: this rank is not a member of the process group it was given (dist.new_group returns "
            "GroupMember.NON_GROUP_MEMBER on ranks outside it); call the op only on the group's ranks"
        )
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):  # (a traced call sees it as another type: named here)
        return (
            "group: expected a torch.distributed ProcessGroup or None, got a DeviceMesh; pass the group "
            "of one of its dimensions, mesh.get_group(dim)"
        )
    return f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}"


def check_group(group: object) -> None:
    """Raise ``GroupError`` unless ``group`` is None or a live process group this rank is in (one
    that ``dist.destroy_process_group`` has not removed from torch.distributed's registry: the
    runtime's cache would otherwise keep running collectives on it where the ops' dispatcher path,
    which resolves the group by name, refuses it)."""
    problem = group_problem(group)
    if problem:
        raise GroupError(problem)


def resolve_group(name: str) -> dist.ProcessGroup | None:
    """The process group of an op's ``group_name`` (None: the default group); a ``REFUSED_GROUP``
    name raises the refusal it carries."""
    if not name:
        return None
    if name.startswith(REFUSED_GROUP):
        raise GroupError(name[len(REFUSED_GROUP) :])
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except (ValueError, RuntimeError, KeyError) as exc:
        raise GroupError(
            f"group: no process group named {name!r} in this process: destroyed, made in another "
            f"process, or one this rank is not in (a rank outside a group holds no record of it): {exc}"
        ) from None


# What every collective entry point says when torch.distributed is not initialized.
NOT_INITIALIZED = (
    "torch.distributed is not initialized: call torch.distributed.init_process_group(...) before this "
    "call, then leave group as None (the default process group) or pass a group made from it"
)


def require_initialized() -> None:
    """Raise ``NotInitializedError`` unless torch.distributed has a default process group (every
    group a call can pass is made after it), before any collective or world-size query."""
    if not dist.is_available() or not dist.is_initialized():
        raise NotInitializedError(NOT_INITIALIZED)


def group_size(name: str) -> int:
    """The world size of an op's ``group_name``."""
    require_initialized()
    return dist.get_world_size(resolve_group(name))


@dataclass(frozen=True, slots=True)
class PickledGroup:
    """A module's process group in its pickle (``torch.save`` of the whole model): the group's
    ``group_name``, found again in the loading process (a ``ProcessGroup`` does not pickle)."""

    name: str

    def resolve(self) -> dist.ProcessGroup:
        """The process group of that name in this process; ``GroupError`` where there is none."""
        try:
            require_initialized()
            group = resolve_group(self.name)
        except (GroupError, NotInitializedError):
            raise GroupError(
                f"group: the module was sharded over the process group named {self.name!r}, which this "
                "process does not have; before loading it, init_process_group and make the groups as "
                "the saving job did (dist.new_group, in the same order), or load its state_dict instead"
            ) from None
        return group if group is not None else dist.group.WORLD


class SharesGroupWhenCopied:
    """A module mix-in for modules that keep their process group in ``self.group``: a deep copy
    (a model's EMA or frozen reference copy, ``copy.deepcopy``) shares the group, which cannot be
    copied, and copies everything else; the copy runs on the group the original was sharded over.
    A pickle (``torch.save`` of the whole model, as torch's DeviceMesh and fo-tune's styles take
    one) keeps the group by name (``PickledGroup``), which ``torch.load`` finds again."""

    group: dist.ProcessGroup | None

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self.group is not None:
            memo[id(self.group)] = self.group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # type: ignore[misc]  (nn.Module's: drops compiled code)
        if state.get("group") is not None:
            state["group"] = PickledGroup(state["group"].group_name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state.get("group"), PickledGroup):
            state = {**state, "group": state["group"].resolve()}
        super().__setstate__(state)  # type: ignore[misc]  (nn.Module's)
