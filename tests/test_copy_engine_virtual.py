"""CPU tests of the virtual ranks (N copy-engine ranks in one process) and the kernel warm-up.

With fakes of the CUDA driver, torch's streams and events, cuBLAS and ``rows_gemm`` recording every
call: the virtual ranks issue, for each rank, exactly the calls a lone ``GpuExecutor`` of that rank
issues for the same plan (``modes.plan_call``, as a real rank builds it), interleaved so that every
flag wait follows its writer; the warm-up runs before the first wait, issues no flag operation, and
launches every kernel (stream, shapes, beta, alignments) the call launches. The GPU run of the same
code is ``tests/test_gpu_virtual_ranks.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from copy_engine_fakes import FakeLog, FakeStream, fake_driver, install_torch_fakes

import fo_kernels.engines.copy_engine.gpu as gpu
from fo_kernels.engines.copy_engine import plan_call
from fo_kernels.engines.copy_engine.buffers import Dtypes, Regions, data_bytes, region_bytes_for
from fo_kernels.engines.copy_engine.cpu import ProtocolError
from fo_kernels.engines.copy_engine.layout import COUNTER_SLOTS, Cell, FlagLayout
from fo_kernels.engines.copy_engine.ops import CallPlan, Signal, Wait
from fo_kernels.engines.copy_engine.virtual import VirtualDevice, VirtualRanks, issue_order
from fo_kernels.engines.copy_engine.warmup import SCRATCH_ALIGN, scratch_like
from fo_kernels.errors import ScheduleError, ShapeError
from fo_kernels.tile import Tile

TILE = Tile(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1)
# The fake streams' driver handles, counted from here (any values the executor never sees otherwise).
FIRST_HANDLE = 1000
FLAG_CALLS = ("wait", "write", "memset")


class Log(FakeLog):
    """What the fakes saw, in order; streams named by the test."""

    def __init__(self) -> None:
        super().__init__("caller")


def new_stream(log: Log, name: str) -> FakeStream:
    """A fake stream with the next free driver handle."""
    return FakeStream(log, name, FIRST_HANDLE + len(log.names))


def _key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.data_ptr() % SCRATCH_ALIGN)


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    """A log the fakes write to, with cuBLAS, rows_gemm, torch.cuda.stream and events faked."""
    log = Log()

    def gemm(x: torch.Tensor, out: torch.Tensor, beta: int) -> tuple:
        return _key(x), _key(out), beta, out.data_ptr()

    def rows_gemm(a, b, out, tile, *, grid, row_group, counters=None, ready=None, out2=None, **kw) -> tuple:
        keys = tuple(None if t is None else _key(t) for t in (counters, ready, out2))
        # (whether the ready cells the kernel's tiles wait for are set)
        ready_set = ready is None or bool((ready[: int(row_group.max()) + 1] != 0).all())
        return _key(a), _key(out), grid, keys, kw.get("remote_counters"), ready_set

    install_torch_fakes(monkeypatch, log, gemm, rows_gemm)
    return log


def _device(log: Log, sms: int = 132) -> VirtualDevice:
    made = iter(range(10_000))
    return VirtualDevice(
        device=torch.device("cpu"),
        driver=fake_driver(log),
        new_stream=lambda priority: new_stream(log, f"s{next(made)}"),
        current_stream=lambda: caller,
        capturing=lambda: False,
        synchronize=lambda: log.ops.append(("sync",)),
        sms=sms,
    )


caller: FakeStream | None = None


def _ok(err: object, what: str) -> None:
    assert err == 0, what


def _launches(ops: list[tuple]) -> set[tuple]:
    """The kernels of a log: (kind, stream, shapes and alignments, beta or arguments)."""
    return {op[:5] if op[0] == "gemm" else op[:7] for op in ops if op[0] in ("gemm", "kernel")}


def _operands(world: int, collective: str, m: int, n: int, k: int):
    rows = m // world if collective == "all_gather" else m
    return [torch.randn(rows, k) for _ in range(world)], [torch.randn(k, n) for _ in range(world)]


CASES = [
    *[
        ("ring", coll, world, m, weights)
        for coll in ("all_reduce", "reduce_scatter", "all_gather")
        for world in (2, 3, 4, 8)
        for m, weights in ((8 * world, (1,)), (13 * world, (1, 2, 3)))
    ],
    ("tiled", "all_reduce", 2, 70, (1, 2)),
    ("tiled", "reduce_scatter", 2, 64, (1, 1, 1)),
]


def _label(case) -> str:
    return "-".join(map(str, case))


@pytest.mark.parametrize("case", CASES, ids=[_label(c) for c in CASES])
def test_virtual_ranks_issue_each_ranks_list_as_a_lone_rank_does(case, log: Log):
    """Call 2 on the virtual ranks, restricted to rank r's streams, equals what a lone
    ``GpuExecutor`` of rank r issues for plan_call's list of rank r with the same memory, after
    rank r's main stream waits for the caller's stream; the caller then waits for every rank."""
    global caller
    mode, collective, world, m, weights = case
    n, k = 40, 24
    tile = TILE if mode == "tiled" else None
    caller = new_stream(log, "caller")
    ranks = VirtualRanks(world, _device(log))
    a, b = _operands(world, collective, m, n, k)
    dtypes = Dtypes(torch.float32, torch.float32)
    vp = ranks.plan(collective, m, n, k, dtypes, mode=mode, weights=weights, tile=tile)
    outs = [torch.empty(p.out_rows, n) for p in vp.plans]
    gathered = [torch.empty(m, k) for _ in range(world)] if collective == "all_gather" else None
    ranks.issue(vp, a, b, outs, gathered)
    start = len(log.ops)
    ranks.issue(vp, a, b, outs, gathered)
    call = log.ops[start:]
    assert not [op for op in call if op[0] == "sync" or (op[0] in ("gemm", "kernel") and op[1] == "caller")]
    share = 132 // world
    for r in range(world):
        plan = plan_call(mode, collective, world, r, m, n, k, weights, tile)
        assert vp.plans[r].ops == plan.ops
        ex = ranks._executors[r]
        mine = {s.name for s in ex._streams.values()} | {ranks._mains[r].name}
        projected = [op for op in call if op[0] != "sync" and op[1] in mine]
        lone = gpu.GpuExecutor(fake_driver(log), r, ex.layout, ex._streams, ex.flags, ex.counters, share, _ok)
        lone.regions = ex.regions
        before = len(log.ops)
        compiled = lone.compile(plan, dtypes)
        mine_gathered = None if gathered is None else gathered[r]
        operand = gpu.BOperand.of(b[r]) if tile else None
        with torch.cuda.stream(ranks._mains[r]):  # (a real rank's call runs on its current stream)
            lone.issue(compiled.eager, a[r], b[r], outs[r], ranks._mains[r], mine_gathered, operand)
        alone = log.ops[before:]
        del log.ops[before:]
        assert _renamed(projected) == [("join", ranks._mains[r].name, "caller"), *_renamed(alone)]
    assert call[-world:] == [("join", "caller", main.name) for main in ranks._mains]


def _renamed(ops: list[tuple]) -> list[tuple]:
    """Events numbered by first appearance (each executor makes its own)."""
    seen: dict[int, int] = {}
    return [
        (*op[:2], seen.setdefault(op[2], len(seen))) if op[0] in ("record", "wait_event") else op
        for op in ops
    ]


@pytest.mark.parametrize("case", CASES, ids=[_label(c) for c in CASES])
def test_the_warm_up_launches_every_kernel_before_the_first_wait(case, log: Log):
    """The first call: every kernel it launches (stream, shapes, alignments, beta or the tiled
    kernel's arguments) was launched before the first flag wait, with the device synchronized
    around it and no flag written or waited for meanwhile; the ready cells it hands a tiled kernel
    are set. The second call launches no new kernel and synchronizes nothing."""
    global caller
    mode, collective, world, m, weights = case
    tile = TILE if mode == "tiled" else None
    caller = new_stream(log, "caller")
    ranks = VirtualRanks(world, _device(log))
    a, b = _operands(world, collective, m, 40, 24)
    rows = a[0].shape[0]
    a[0] = torch.randn(rows * 24 + 8)[8:].view(rows, 24)  # (an operand 32 bytes off an alignment)
    start = len(log.ops)
    dtypes = Dtypes(torch.float32, torch.float32)
    vp = ranks.plan(collective, m, 40, 24, dtypes, mode=mode, weights=weights, tile=tile)
    outs = [torch.empty(p.out_rows, 40) for p in vp.plans]
    gathered = [torch.empty(m, 24) for _ in range(world)] if collective == "all_gather" else None
    ranks.issue(vp, a, b, outs, gathered)
    call = log.ops[start:]
    first_wait = next(i for i, op in enumerate(call) if op[0] == "wait")
    syncs = [i for i, op in enumerate(call[:first_wait]) if op[0] == "sync"]
    assert len(syncs) >= 2, "the warm-up is not between two synchronizations"
    warm = call[syncs[-2] : syncs[-1]]
    assert not [op for op in warm if op[0] in ("wait", "write")], warm
    assert _launches(call[syncs[-1] :]) <= _launches(warm)
    assert _launches(warm), "nothing warmed up"
    assert all(op[7] for op in warm if op[0] == "kernel"), "a warm-up kernel would wait for a flag"
    kinds = {op[0] for op in call[syncs[-1] :]} & {"copy", "memset"}
    assert kinds <= {op[0] for op in warm}
    again = len(log.ops)
    ranks.issue(vp, a, b, outs, gathered)
    assert not [op for op in log.ops[again:] if op[0] == "sync"]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_the_warm_up_covers_a_lone_ranks_kernels(world: int, collective: str, log: Log):
    """What the real engine runs (``CopyEnginePeers``: one rank's executor): ``warm_up`` of rank
    1's compiled list launches every kernel its issue launches, each distinct one once."""
    m, n, k = 40 * world, 40, 24
    plan = plan_call("ring", collective, world, 1, m, n, k, (1, 2, 3))
    layout = FlagLayout(world)
    flags = {q: torch.zeros(layout.slots, dtype=torch.int32) for q in range(world)}
    rb = region_bytes_for(plan, torch.float32)
    data = {q: torch.zeros(data_bytes(world, rb, 0), dtype=torch.uint8) for q in range(world)}
    streams = {name: new_stream(log, name) for name in ("side", "local", "notify", "alt")}
    counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32)
    ex = gpu.GpuExecutor(fake_driver(log), 1, layout, streams, flags, counters, 132, _ok)
    ex.regions = Regions(world, rb, data)
    compiled = ex.compile(plan, torch.float32)
    a, b = torch.randn(m // world if collective == "all_gather" else m, k), torch.randn(k, n)
    out = torch.empty(plan.out_rows, n)
    gathered = torch.empty(m, k) if collective == "all_gather" else None
    main = new_stream(log, "main")
    ran = ex.warm_up(compiled.eager, ex.bind(a, b, out, main, gathered))
    warm = list(log.ops)
    log.ops.clear()
    ex.issue(compiled.eager, a, b, out, main, gathered)
    gemms = [op for op in warm if op[0] == "gemm"]
    assert ran == len(gemms) == len(_launches(gemms)), "a kernel ran twice in the warm-up"
    assert _launches(log.ops) == _launches(warm)
    assert not [op for op in warm if op[0] in ("wait", "write")]
    outputs = {op[5] for op in warm if op[0] == "gemm"}
    touched = [out, *data.values(), *([gathered] if gathered is not None else [])]
    assert not [t for t in touched for p in outputs if t.data_ptr() <= p < t.data_ptr() + t.nbytes]


def test_scratch_keeps_shape_strides_and_alignment():
    base = torch.empty(1000, dtype=torch.bfloat16)
    for view in (base[3:403].view(20, 20), base[8:].view(-1, 8)[:, :4], base[:0]):
        twin = scratch_like(view)
        assert (twin.shape, twin.stride(), twin.dtype) == (view.shape, view.stride(), view.dtype)
        assert twin.data_ptr() % SCRATCH_ALIGN == view.data_ptr() % SCRATCH_ALIGN
        assert twin.data_ptr() != view.data_ptr() or view.numel() == 0
    assert bool((scratch_like(torch.zeros(5, dtype=torch.int32), fill=1) == 1).all())


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_issue_order_puts_every_wait_after_its_writer(world: int, collective: str):
    """Each rank's operations in its own order, all of them, and each flag wait after the
    signals that satisfy it, counted afresh here (guards start at 1, resets zero a cell)."""
    plans = [plan_call("ring", collective, world, r, 13 * world, 10, 7, (1, 2, 3)) for r in range(world)]
    order = issue_order(plans)
    assert sorted(order) == [(r, i) for r in range(world) for i in range(len(plans[r].ops))]
    for r in range(world):
        assert [i for q, i in order if q == r] == list(range(len(plans[r].ops)))
    cells: Counter = Counter({c: 1 for q in range(world) for c in FlagLayout(world).guards(q)})
    waits = 0
    for r, i in order:
        op = plans[r].ops[i]
        if isinstance(op, Signal):
            cells[op.cell] = 1
        elif isinstance(op, Wait):
            assert cells[op.cell] >= op.target, (r, i, op)
            waits += 1
        elif type(op).__name__ == "Reset":
            cells[op.cell] = 0
    assert waits, "the lists hold no flag wait, so no wait was checked"


def test_issue_order_refuses_lists_that_would_hang():
    """A wait nobody signals has no order: ProtocolError naming the rank and the operation."""
    plans = [plan_call("ring", "all_reduce", 2, r, 8, 4, 4, (1,)) for r in range(2)]
    lost = Wait("side", Cell(1, "shard", (0,)))
    broken = CallPlan(plans[1].spec, "ring", (*plans[1].ops[:3], lost, *plans[1].ops[3:]), 2, 8)
    with pytest.raises(ProtocolError, match="rank 1 at op 3"):
        issue_order([plans[0], broken])


def test_virtual_ranks_refuse_bad_input(log: Log):
    global caller
    caller = new_stream(log, "caller")
    with pytest.raises(ShapeError, match="at least 2"):
        VirtualRanks(1, _device(log))
    ranks = VirtualRanks(2, _device(log))
    a, b = _operands(2, "all_reduce", 8, 4, 4)
    with pytest.raises(ShapeError, match="expected 2 operands"):
        ranks.run("all_reduce", a[:1], b)
    with pytest.raises(ShapeError, match="the same shapes"):
        ranks.run("all_reduce", [a[0], torch.randn(9, 4)], b)
    with pytest.raises(ScheduleError, match="mode tiled"):
        ranks.run("all_gather", a, b, mode="tiled", tile=TILE)
    with pytest.raises(ShapeError, match="divisible"):
        ranks.run("reduce_scatter", [torch.randn(7, 4)] * 2, b)


def test_tiled_kernels_get_a_share_of_the_sms(log: Log):
    """Each rank's persistent kernel takes sms // N SMs, so all of them are resident at once."""
    global caller
    caller = new_stream(log, "caller")
    ranks = VirtualRanks(2, _device(log, sms=132))
    a, b = _operands(2, "reduce_scatter", 64, 40, 24)
    ranks.run("reduce_scatter", a, b, mode="tiled", weights=(1, 1), tile=TILE)
    grids = {op[4] for op in log.ops if op[0] == "kernel"}
    assert grids == {66}


def test_a_tile_over_the_gpus_limits_is_refused_before_any_flag(log: Log, monkeypatch: pytest.MonkeyPatch):
    """A tiled-mode tile whose rows kernel needs more shared memory than the GPU has (Triton's
    OutOfResources as it loads the kernel, stood in for: the interpreter has no limit) is a
    ScheduleError naming the tile, raised by the warm-up before any flag is waited for or written,
    so no peer is left waiting on a flag this rank never writes."""
    from triton.runtime.errors import OutOfResources

    global caller
    caller = new_stream(log, "caller")

    def too_large(*args, **kwargs):
        raise OutOfResources(327704, 232448, "shared memory")

    monkeypatch.setattr(gpu, "rows_gemm", too_large)
    ranks = VirtualRanks(2, _device(log))
    a, b = _operands(2, "all_reduce", 64, 40, 24)
    vp = ranks.plan(
        "all_reduce",
        64,
        40,
        24,
        Dtypes(torch.float32, torch.float32),
        mode="tiled",
        weights=(1, 1),
        tile=TILE,
    )
    outs = [torch.empty(p.out_rows, 40) for p in vp.plans]
    with pytest.raises(ScheduleError, match=r"tile 16x32x16 .*327704 bytes of shared memory.*232448"):
        ranks.issue(vp, a, b, outs, None)
    assert not [op for op in log.ops if op[0] in ("wait", "write")]
