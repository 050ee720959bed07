"""CPU tests of the order in which the copy engine issues a call's operations.

Two kinds of checks:

- **Two ranks, call by call.** ``tests/data/copy_engine_two_rank_order.json`` holds the driver and
  torch calls the two-rank engine issued before its protocol became data, recorded with fakes of
  the CUDA driver, torch's streams and events, cuBLAS and ``rows_gemm`` (for the ``ring`` mode,
  then called chunked with two GEMM streams, and the ``tiled`` mode: both collectives, odd M, one
  to six chunk weights, both ranks, eager and captured). The GPU executor issuing today's plans
  against the same fakes must produce the same calls in the same order, with addresses named by
  buffer, owner and offset, flags by kind, owner and index, events by first appearance.
- **Any world size, over the operation lists.** Rules a result check cannot see until a run hangs
  or races: every stream a call uses is joined back into the caller's; the chunk GEMMs alternate
  between the caller's stream and ``alt``, each chunk's flag right after its GEMM on its stream;
  a GEMM that reads pulled rows waits for the pull's event first; every flag set during a call
  is reset during it by its owner (so every call issues the same operations and a graph of it can
  be replayed). That the lists complete with a rank's streams sharing one FIFO (the rule that a
  wait for a peer's data is queued after the work the peer waits for) is run in
  ``tests/test_copy_engine_protocol.py``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from copy_engine_fakes import FakeLog, FakeStream, fake_driver, install_torch_fakes

import fo_kernels.engines.copy_engine.gpu as gpu
from fo_kernels.engines.copy_engine import plan_call
from fo_kernels.engines.copy_engine.buffers import Regions, region_bytes_for
from fo_kernels.engines.copy_engine.layout import FlagLayout, regions
from fo_kernels.engines.copy_engine.ops import (
    ALT,
    MAIN,
    Clear,
    Copy,
    Gemm,
    Join,
    Record,
    Reset,
    Signal,
    TiledGemm,
    Wait,
    WaitEvent,
)
from fo_kernels.tile import Tile

GOLDEN = json.loads((Path(__file__).parent / "data" / "copy_engine_two_rank_order.json").read_text())
TILE = Tile(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1)
HANDLES = {"main": 1, "side": 2, "local": 3, "alt": 4, "notify": 5}


class Log(FakeLog):
    """The fakes' shared log and the symbolic names of the addresses they see."""

    def __init__(self) -> None:
        super().__init__("main")
        self.tensors: dict[tuple, torch.Tensor] = {}  # symbol prefix -> tensor
        self.cells: dict[int, list] = {}  # address -> [owner, kind, *index]

    def sym(self, address: int) -> list:
        for name, t in self.tensors.items():
            lo = t.data_ptr()
            if lo <= address < lo + t.numel() * t.element_size():
                return [*name, address - lo]
        raise AssertionError(f"unknown address {address}")

    def region(self, address: int, data: dict[int, torch.Tensor], region_bytes: int) -> list | None:
        for q, t in data.items():
            off = address - t.data_ptr()
            if 0 <= off < t.numel():
                name = regions(2)[off // region_bytes]
                head = ["part", int(name[4:])] if name.startswith("part") else [name]
                return [*head, q, off % region_bytes]
        return None


def _record(case: dict, monkeypatch: pytest.MonkeyPatch) -> list[list]:
    """The GPU executor's calls for one recorded case, named as the recording names them."""
    m, n, k, rank = case["m"], case["n"], case["k"], case["rank"]
    tile = TILE if case["mode"] == "tiled" else None
    plan = plan_call(case["mode"], case["collective"], 2, rank, m, n, k, tuple(case["weights"]), tile)
    log = Log()
    layout = FlagLayout(2)
    flags = {q: torch.zeros(layout.slots, dtype=torch.int32) for q in range(2)}
    counters = torch.zeros(64, dtype=torch.int32)
    for q in range(2):
        for slot, cell in enumerate(layout.cells(q)):
            log.cells[flags[q].data_ptr() + 4 * slot] = [q, cell.name, *cell.index]
    for c in range(64):
        log.cells[counters.data_ptr() + 4 * c] = [rank, "counter", c]
    rb = region_bytes_for(plan, torch.float32)
    data = {q: torch.zeros(len(regions(2)) * rb, dtype=torch.uint8) for q in range(2)}
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(plan.out_rows, n)
    log.tensors = {("a",): a, ("out",): out}

    def where(address: int) -> list:
        return log.region(address, data, rb) or log.sym(address)

    def tensor(t: torch.Tensor) -> list:
        return where(t.data_ptr())

    def cell(t: torch.Tensor) -> list:
        return log.cells[t.data_ptr()]

    def gemm(x: torch.Tensor, out: torch.Tensor, beta: int) -> tuple:
        return tensor(x), list(x.shape), tensor(out), list(out.shape), beta

    def rows_gemm(
        a, b, out, tile, *, grid, row_group, counters=None, ready=None, out2=None, remote_counters=False
    ) -> tuple:
        out2_sym = None if out2 is None else [tensor(out2), list(out2.shape)]
        return (
            tensor(a), list(a.shape), tensor(out), list(out.shape), grid, row_group.tolist(),
            None if counters is None else cell(counters), None if ready is None else cell(ready), out2_sym,
            remote_counters,
        )  # fmt: skip

    install_torch_fakes(monkeypatch, log, gemm, rows_gemm)
    streams = {name: FakeStream(log, name, HANDLES[name]) for name in ("side", "local", "notify", "alt")}
    driver = fake_driver(log, log.cells.__getitem__, where)
    executor = gpu.GpuExecutor(driver, rank, layout, streams, flags, counters, 132, lambda e, w: None)
    executor.regions = Regions(2, rb, data)
    compiled = executor.compile(plan, torch.float32)
    steps = compiled.eager if case["eager"] else compiled.captured
    executor.issue(
        steps, a, b, out, FakeStream(log, "main", HANDLES["main"]), None, object() if tile else None
    )
    ops = [list(op) for op in log.ops]  # (the recording's JSON lists)
    renamed: dict[int, int] = {}
    for op in ops:
        if op[0] in ("record", "wait_event"):
            op[2] = renamed.setdefault(op[2], len(renamed))
    return ops


def _label(case: dict) -> str:
    how = "eager" if case["eager"] else "captured"
    return f"{case['mode']}-{case['collective']}-{case['m']}-{case['weights']}-rank{case['rank']}-{how}"


@pytest.mark.parametrize("case", GOLDEN, ids=[_label(c) for c in GOLDEN])
def test_two_rank_calls_equal_the_recorded_order(case: dict, monkeypatch: pytest.MonkeyPatch):
    """At two ranks every call the GPU executor issues equals the recorded one, in order."""
    got = _record(case, monkeypatch)
    want = case["ops"]
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        assert g == w, f"call {i} differs: got {g}, recorded {w}"
    assert len(got) == len(want)


def test_the_recording_covers_both_modes_collectives_and_ranks():
    """The comparison above can fail: the recording is not empty and every kind of call is in it."""
    kinds = Counter(op[0] for case in GOLDEN for op in case["ops"])
    assert {"gemm", "kernel", "copy", "wait", "write", "memset", "record", "wait_event", "join"} <= set(kinds)
    assert {(c["mode"], c["collective"], c["rank"]) for c in GOLDEN} == {
        (mode, coll, rank)
        for mode in ("ring", "tiled")
        for coll in ("all_reduce", "reduce_scatter")
        for rank in (0, 1)
    }


def _plans(collective: str, world: int, m: int, weights: tuple[int, ...], mode: str = "ring"):
    tile = TILE if mode == "tiled" else None
    return [plan_call(mode, collective, world, r, m, 10, 7, weights, tile) for r in range(world)]


CASES = [
    (coll, world, m, weights)
    for coll in ("all_reduce", "reduce_scatter", "all_gather")
    for world in (2, 3, 4, 8)
    for m, weights in ((8 * world, (1,)), (40 * world, (1, 2, 3)), (13 * world, (1,) * 6))
]


@pytest.mark.parametrize("collective, world, m, weights", CASES)
def test_streams_joined_gemms_alternate_flags_follow(collective: str, world: int, m: int, weights):
    """Every stream used is joined into the caller's at the end (its tail is joins); chunk GEMM g
    runs on main (g even) or alt (g odd); the flag a GEMM's rows feed follows it on its stream."""
    for plan in _plans(collective, world, m, weights):
        ops = plan.ops
        used = {op.stream for op in ops} - {MAIN}  # (streams that run work, not only joined)
        tail = []
        for op in reversed(ops):
            if not (isinstance(op, Join) and op.stream == MAIN):
                break
            tail.append(op.other)
        assert used <= set(tail), (used, tail)
        gemms = [i for i, op in enumerate(ops) if isinstance(op, Gemm)]
        assert gemms, f"rank {plan.spec.rank}: no chunk GEMM, so nothing was checked"
        assert [ops[i].stream for i in gemms] == [(MAIN, ALT)[g % 2] for g in range(len(gemms))]
        for i in gemms:
            after = [op for op in ops[i + 1 :] if op.stream == ops[i].stream]
            nxt = after[0] if after else None
            if isinstance(nxt, Signal):
                assert nxt.cell.name in ("partial", "summed"), nxt
            elif collective != "all_gather" and ops[i].beta == 1 and ops[i].out.buffer != "out":
                raise AssertionError(f"GEMM {i} ({ops[i]}) is not followed by its flag")


@pytest.mark.parametrize("collective, world, m, weights", CASES)
def test_gemms_wait_for_the_pulls_they_read(collective: str, world: int, m: int, weights):
    """A GEMM that sums into pulled rows (beta = 1), or reads pulled rows of the gathered A, is
    queued after its stream waited for the event recorded right after that pull."""
    for plan in _plans(collective, world, m, weights):
        ops = plan.ops
        pulls = {}  # event -> the rows its pull wrote
        for i, op in enumerate(ops):
            if (
                isinstance(op, Record)
                and i
                and isinstance(ops[i - 1], Copy)
                and ops[i - 1].stream == op.stream
            ):
                pulls[op.event] = ops[i - 1].dst
        waited: dict[str, set] = {}
        checked = 0
        for op in ops:
            if isinstance(op, WaitEvent) and op.event in pulls:
                waited.setdefault(op.stream, set()).add(pulls[op.event])
            if isinstance(op, Gemm):
                reads = op.a if op.a.buffer == "gathered" else (op.out if op.beta else None)
                if reads is not None:
                    assert reads in waited.get(op.stream, set()), (op, waited)
                    checked += 1
        assert checked, f"rank {plan.spec.rank}: no GEMM reads pulled rows, so nothing was checked"


@pytest.mark.parametrize("collective, world, m, weights", CASES)
def test_every_flag_set_in_a_call_is_reset_by_its_owner(collective: str, world: int, m: int, weights):
    """Over every rank's list: each cell is set as often as its owner waits for and resets it,
    so the flags end a call as they began (guards: set by the reader, taken by the owner)."""
    plans = _plans(collective, world, m, weights)
    sets, resets, waits = Counter(), Counter(), Counter()
    for plan in plans:
        for op in plan.ops:
            if isinstance(op, Signal):
                sets[op.cell] += 1
            elif isinstance(op, Reset):
                assert op.cell.owner == plan.spec.rank, op
                resets[op.cell] += 1
            elif isinstance(op, Wait):
                assert op.cell.owner == plan.spec.rank, op
                waits[op.cell] += 1
    assert sets and sets == resets == waits, (sets - resets, resets - sets)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("weights", [(1,), (2, 1), (1, 1, 1)])
def test_tiled_phase_two_after_its_pulls(collective: str, weights):
    """The tiled mode: the phase-2 kernel, whose tiles spin on ready(c), is queued after every
    pull and ready flag; ready is cleared after it; AllReduce's waits for the peer's counted sums
    come after it too (a wait queued first could block it)."""
    for plan in _plans(collective, 2, 70, weights, mode="tiled"):
        ops = plan.ops
        kernels = [i for i, op in enumerate(ops) if isinstance(op, TiledGemm)]
        assert len(kernels) == 2 and ops[kernels[1]].ready is not None
        ready = [i for i, op in enumerate(ops) if isinstance(op, Signal) and op.cell.name == "ready"]
        assert ready and max(ready) < kernels[1]
        clears = [i for i, op in enumerate(ops) if isinstance(op, Clear)]
        assert len(clears) == 1 and clears[0] > kernels[1]
        summed = [i for i, op in enumerate(ops) if isinstance(op, Wait) and op.cell.name == "summed"]
        assert bool(summed) == (collective == "all_reduce") and all(i > kernels[1] for i in summed)
