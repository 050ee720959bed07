"""Per-(device, process group) resources the overlapped ops reuse across calls.

An ``OverlapRuntime`` owns:

- the group counters (int32, never reset) and the host's running total of each, from which every
  call takes its wait targets: target_g = total_g + tiles of group g in this call;
- the high-priority communication stream;
- one process group per NCCL CTA cap, made once with ``ProcessGroupNCCL.Options()`` (its config's
  ``max_ctas``, and a high-priority internal stream) and cached: never rebuilt per call;
- the plan tables (unit -> group, group bases) already on the device, keyed by plan;
- the waiter of each wait mode;
- the copy-engine peers (symmetric buffers, flags) of ``engine: copy_engine`` schedules, made on
  first use;
- the ``overlap: false`` calls' CUDA graphs and scratch (``fo_kernels.fallback``), made on first use;
- ``engine_state``: what other paths keep, by name (the MoE copy engine's peers, ``fo_kernels.moe``).

``runtime_for(device, group)`` returns the process-wide instance for that pair, made on first use;
the nn.Module and tests may build their own. Use one runtime from one host thread at a time.
"""

from __future__ import annotations

import atexit
import gc
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fo_kernels.engines.copy_engine import CopyEnginePeers
from fo_kernels.fallback import Fallback
from fo_kernels.fingerprint import device_sm_count, resolve_device
from fo_kernels.groups import require_initialized
from fo_kernels.plan import MAX_GROUPS, Plan, check_group_count
from fo_kernels.wait import Waiter, make_waiter

# Plans whose device tables stay cached (one per distinct shape/schedule in use).
PLAN_CACHE_SIZE = 64
# Highest CUDA stream priority torch exposes (lower is higher).
HIGH_PRIORITY = -1


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (the default group for None)."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


@dataclass
class OverlapRuntime:
    """Resources of one (device, process group); see the module docstring."""

    device: torch.device
    group: dist.ProcessGroup | None = None
    sm_count: int = 0
    _counters: torch.Tensor | None = field(default=None, repr=False)
    _totals: list[int] = field(default_factory=list, repr=False)
    _stream: torch.cuda.Stream | None = field(default=None, repr=False)
    _capped: dict[int, dist.ProcessGroup] = field(default_factory=dict, repr=False)
    _tables: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _waiters: dict[str, Waiter] = field(default_factory=dict, repr=False)
    _peers: CopyEnginePeers | None = field(default=None, repr=False)
    _fallback: Fallback | None = field(default=None, repr=False)
    _world_size: int = field(default=0, repr=False)
    # what other paths keep between calls (the MoE copy engine's peers), by the path's name
    engine_state: dict[str, object] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
        if not self.sm_count:
            self.sm_count = device_sm_count(self.device)

    @property
    def world_size(self) -> int:
        """The group's size (asked once: ``dist.get_world_size`` costs ~17 us of host time a call,
        ``docs/design.md#host-time``)."""
        if not self._world_size:
            require_initialized()
            self._world_size = dist.get_world_size(self.group)
        return self._world_size

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group))

    @property
    def counters(self) -> torch.Tensor:
        if self._counters is None:
            self._counters = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=self.device)
            self._totals = [0] * MAX_GROUPS
        return self._counters

    def reserve_targets(self, plan: Plan) -> list[int]:
        """Advance the running totals by this call's tiles per group; return each group's target."""
        return self.reserve_tiles([plan.group_tiles(g) for g in range(plan.num_groups)])

    def reserve_tiles(self, tiles: Sequence[int]) -> list[int]:
        """Advance counter g's running total by ``tiles[g]`` for every g; return each target."""
        check_group_count(len(tiles))
        self.counters  # noqa: B018 - allocates the counters and totals on first use
        targets = []
        for g, count in enumerate(tiles):
            self._totals[g] = (self._totals[g] + count) & 0xFFFFFFFF
            targets.append(self._totals[g])
        return targets

    @property
    def comm_stream(self) -> torch.cuda.Stream | None:
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device, priority=HIGH_PRIORITY)
        return self._stream

    def comm_group(self, max_ctas: int) -> dist.ProcessGroup | None:
        """The process group the collectives run on: NCCL with the CTA cap, else the caller's group."""
        if self.backend != "nccl":
            return self.group
        if max_ctas not in self._capped:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
            if max_ctas:
                options.config.max_ctas = max_ctas
            self._capped[max_ctas] = dist.new_group(
                list(group_ranks(self.group)),
                backend="nccl",
                pg_options=options,
                use_local_synchronization=True,
            )
        return self._capped[max_ctas]

    def waiter(self, mode: str) -> Waiter:
        """The waiter for ``mode`` on this device (made once; see ``fo_kernels.wait``)."""
        if mode not in self._waiters:
            self._waiters[mode] = make_waiter(mode, self.device)
        return self._waiters[mode]

    def made_copy_engine(self) -> CopyEnginePeers | None:
        """The copy-engine resources if a call has made them (``copy_engine``), else None."""
        return self._peers

    def copy_engine(self) -> CopyEnginePeers:
        """The copy-engine resources of this (device, group), made (collectively) on first use."""
        if self._peers is None:
            self._peers = CopyEnginePeers(device=self.device, group=self.group)
        return self._peers

    def fallback(self) -> Fallback:
        """The ``overlap: false`` calls of this device and group (graphed on GPUs with NCCL)."""
        if self._fallback is None:
            graphable = self.device.type == "cuda" and self.backend == "nccl"
            self._fallback = Fallback(self.device, self.group, self.world_size, graphable)
        return self._fallback

    def made_fallback(self) -> Fallback | None:
        """This runtime's fallback if a call has made it, else None (``fallback`` makes it)."""
        return self._fallback

    def close(self) -> None:
        """Let go of what this runtime made: the device's pending work finished first, then its
        CTA-capped process groups destroyed (their communicators hold GPU memory) and its caches,
        peers, graphs and streams dropped (freed once nothing else holds them). The runtime is not
        used afterwards; ``runtime_for`` makes a new one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for capped in self._capped.values():
            if capped is not self.group:
                dist.destroy_process_group(capped)
        self._capped.clear()
        self._tables.clear()
        self._waiters.clear()
        self.engine_state.clear()
        self._peers = self._fallback = self._stream = self._counters = None

    def plan_tables(self, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """(unit_group, group_info) int32 tensors of the plan on the device, cached per plan."""
        hit = self._tables.get(plan)
        if hit is not None:
            self._tables.move_to_end(plan)
            return hit
        unit_group = torch.tensor(plan.unit_group(), dtype=torch.int32, device=self.device)
        info = torch.tensor(
            [x for pair in plan.group_info() for x in pair], dtype=torch.int32, device=self.device
        )
        self._tables[plan] = (unit_group, info)
        if len(self._tables) > PLAN_CACHE_SIZE:
            self._tables.popitem(last=False)
        return unit_group, info


# The process-wide runtimes, keyed by (device, id of the process group object); the group is kept in
# the value so its id cannot be reused while the entry lives. This is the cache the spec asks for
# (a CTA-capped communicator is built once, never per call), not configuration.
_RUNTIMES: dict[tuple[str, int], tuple[dist.ProcessGroup, OverlapRuntime]] = {}


def _release_at_exit() -> None:
    """Let go of the runtimes' process groups while the interpreter is still whole (``atexit``),
    then collect cyclic garbage. A gloo group that outlives ``dist.destroy_process_group()`` into
    the interpreter's teardown keeps its worker threads; one that releases a finished collective's
    tensors there needs the GIL to drop their Python objects and aborts the process ("terminate
    called without an active exception", seen under gdb; pytorch/pytorch#179291). Freed here, the
    group joins its threads first. Torch itself keeps the default group where torch._dynamo is
    first imported after ``init_process_group`` (``fo_kernels`` imports the module that would pin
    it before any group exists, see its ``__init__``; a caller that imports fo_kernels after its
    group still has it pinned); the collection then runs the main thread long enough to hand the
    GIL to such a thread before the teardown. Measured on two gloo ranks of the CPU, fo_kernels
    imported after the group, one op then the destroy: a rank aborted in 7 of 10 runs, 0 of 12
    with this."""
    _RUNTIMES.clear()
    gc.collect()


atexit.register(_release_at_exit)


def runtime_for(device: torch.device, group: dist.ProcessGroup | None) -> OverlapRuntime:
    """The process-wide runtime of (device, group): counters, streams and capped groups persist."""
    pg = group if group is not None else dist.group.WORLD
    key = (str(device), id(pg))
    hit = _RUNTIMES.get(key)
    if hit is None:
        hit = _RUNTIMES[key] = (pg, OverlapRuntime(device=device, group=group))
    return hit[1]


def release_group(group: dist.ProcessGroup | None = None) -> int:
    """Free what the overlapped ops keep for ``group`` (the default group for None) on every device:
    its runtimes' counters, streams, CTA-capped communicators, copy-engine buffers and CUDA graphs
    (``OverlapRuntime.close``). Call it on each rank of the group before
    ``dist.destroy_process_group(group)``: the ops keep these for as long as the process runs, so a
    job that makes and destroys groups would otherwise hold each one's. A later op on the group
    makes them again. Returns how many runtimes were freed (0 when the group ran no op here)."""
    pg = group if group is not None else dist.group.WORLD
    keys = [key for key, (held, _) in _RUNTIMES.items() if held is pg]
    for key in keys:
        _RUNTIMES.pop(key)[1].close()
    return len(keys)
