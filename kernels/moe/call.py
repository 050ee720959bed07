"""``execute_ffn``: one eager call of the expert-parallel FFN, forward or backward, under both the
custom ops and the direct calls.

    checks        the tensors (routing.check_call), torch.distributed, the group, the schedule's
                  type, the engine's blocker: all before any collective
    routing       the sorted rows and per-expert counts (one device-to-host copy)
    counts        the first collectives: every rank's call signature and tokens, then its counts
                  (exchange.py); then the schedule against the call (dtype, H, I, E_local, k) and
                  its token range against the most tokens any rank holds, which every rank sees
                  alike (a rank refusing alone would leave the others waiting in the dispatch)
    table         no schedule given: the MoE table's row for the experts' shape and the most
                  tokens any rank holds (``fo_kernels.moe.table``), kept only where its engine can
                  run here, looked up between the two exchanges: the second carries each rank's
                  row (a checksum), and ranks whose rows differ all run the no-overlap path; a
                  rank whose table cannot be read (``TableError``) makes every rank raise one
                  after that exchange (it cannot raise alone: the others would wait in it)
    path          the schedule's engine (``MOE_PATHS``) or, for none, the fallback (fallback.py)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fo_kernels.errors import ScheduleError, ShapeError, TableError
from fo_kernels.groups import check_group, require_initialized
from fo_kernels.moe import fallback
from fo_kernels.moe.exchange import exchange_counts, schedule_code
from fo_kernels.moe.routing import MOE_DTYPES, FfnShape, check_call, route
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.moe.stages import BackwardStage, ForwardStage
from fo_kernels.moe.table import MoeTableCache
from fo_kernels.registry import Registry
from fo_kernels.runtime import runtime_for
from fo_kernels.schedule import dtype_name

# The runtime's engine_state key of its MoE table lookups (``MoeTableCache``).
TABLE_STATE = "moe.table"

# The counts exchange's choice of a rank whose table lookup raised (a schedule's code is >= 0).
TABLE_FAILED = -1

# Each engine's MoE path: ``blocker(device, world) -> str`` ("" when it can run here) and
# ``run(stage, schedule, group)``, in the module registered under the engine's name.
MOE_PATHS = Registry(
    "engine:",
    {"triton": "fo_kernels.engines.triton.moe", "copy_engine": "fo_kernels.engines.copy_engine.moe_gpu"},
    error=ScheduleError,
)


def execute_ffn(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    schedule: MoeSchedule | None,
    group: dist.ProcessGroup | None,
    *,
    dy: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward ``y`` (``dy`` None), or the backward's ``(dx, d topk_weights, dw13, dw2)`` for
    the output gradient ``dy``; see ``fo_kernels.moe.ffn.expert_parallel_ffn``."""
    require_initialized()
    check_group(group)
    world = dist.get_world_size(group)
    shape = check_call(x, topk_ids, topk_weights, w13, w2, world)
    if dy is not None and (not isinstance(dy, torch.Tensor) or dy.shape != x.shape):
        raise ShapeError(f"dy must have x's shape {tuple(x.shape)}, got {getattr(dy, 'shape', dy)}")
    if schedule is not None and not isinstance(schedule, MoeSchedule):
        raise ScheduleError(f"schedule: expected a fo_kernels.MoeSchedule, got {type(schedule).__name__}")
    engine = schedule.engine if schedule is not None else None
    path = None
    if engine is not None:
        path = MOE_PATHS.load(engine)
        why = path.blocker(x.device, world)
        if why:
            raise ScheduleError(f"engine: {engine} {why}; use a schedule with engine: null here")
    routing = route(topk_ids, shape)
    direction = "forward" if dy is None else "backward"
    chosen: list[tuple[MoeSchedule | None, object]] = []
    failed: list[TableError] = []

    def choose(tokens: tuple[int, ...]) -> int:
        """The table's row for the call's tokens, and its checksum for the counts exchange (0 for
        the no-overlap path, ``TABLE_FAILED`` where this rank's table cannot be read)."""
        try:
            chosen.append(table_schedule(shape, tokens, x, group))
        except TableError as exc:
            # raised after the second exchange, which tells every rank, so none waits for this one
            failed.append(exc)
            return TABLE_FAILED
        return 0 if chosen[0][1] is None else schedule_code(chosen[0][0])

    layout = exchange_counts(
        routing, shape, x.dtype, direction, group, schedule, choose if schedule is None else None
    )
    if schedule is None:
        if failed:
            raise failed[0]
        if TABLE_FAILED in layout.choices:
            ranks = [r for r, code in enumerate(layout.choices) if code == TABLE_FAILED]
            raise TableError(
                f"group rank(s) {ranks} could not read their MoE table (each raised why): every rank of "
                "the call stops; fix or move that table file, or pass a MoeSchedule"
            )
        schedule, path = chosen[0]
        if len(set(layout.choices)) > 1:
            # the ranks took different rows: a table file that changed between their lookups, or
            # an engine that runs on some ranks only; all of them run the no-overlap path
            schedule, path = None, None
    else:
        # checked after the exchange, where every rank's signature agrees and every rank's tokens
        # are known: a schedule for another call is refused by every rank alike
        schedule.check_call(shape, x.dtype)
        schedule.check_tokens(layout.tokens)
    common = (shape, routing, layout, w13, w2)
    if dy is None:
        stage = ForwardStage(x, topk_weights, *common)
    else:
        stage = BackwardStage(dy, x, topk_weights, *common)
    result = fallback.run(stage, group) if path is None else path.run(stage, schedule, group)
    return result if dy is None else stage.grads()


def table_schedule(
    shape: FfnShape, tokens: tuple[int, ...], x: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[MoeSchedule | None, object]:
    """(the table's schedule for this call, its engine's path), or (None, None): no row, a float64
    call (no table holds one), or a row whose engine cannot run here. Keyed by the most tokens any
    rank holds (``tokens``: every rank's), so every rank of the call takes the same row."""
    dtype = dtype_name(x.dtype) if x.dtype != torch.float64 else ""
    if dtype not in MOE_DTYPES:
        return None, None
    runtime = runtime_for(x.device, group)
    cache = runtime.engine_state.setdefault(TABLE_STATE, MoeTableCache())
    key = (shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    found = cache.lookup(key, max(tokens), dtype=dtype, world_size=shape.world, device=x.device)
    if found is None or found.engine is None:
        return found, None
    path = MOE_PATHS.load(found.engine)
    if path.blocker(x.device, shape.world):
        return None, None
    return found, path
