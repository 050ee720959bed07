"""CPU tests of the ``engine: copy_engine`` runtime: its row chunks, modes, refusals, capture rules
and own graphs (with its GPU parts stood in for). Its protocol runs on the CPU executor in
``tests/test_copy_engine_protocol.py``; the engine itself on GPUs in ``tests/test_gpu.py``; its
schedule contract is in ``tests/test_schedule.py``, its tuner side in ``tests/test_engines.py``."""

from __future__ import annotations

import itertools

import pytest

from dist_cases import copy_engine_refusal
from fo_kernels.engines.copy_engine import ROW_ALIGN, chunk_bounds, shard_rows, tile_row_bounds
from fo_kernels.errors import ScheduleError
from fo_kernels.tile import Tile
from fo_tune.ranks.launch import run_ranks


def test_chunk_bounds():
    assert chunk_bounds(4096, (1, 1, 1, 1)) == [0, 1024, 2048, 3072, 4096]
    assert chunk_bounds(2048, (2, 1, 1)) == [0, 1024, 1536, 2048]
    # inner cuts on ROW_ALIGN rows once every chunk can get that many
    cuts = chunk_bounds(1000, (1, 1, 1))
    assert cuts[0] == 0 and cuts[-1] == 1000 and all(c % ROW_ALIGN == 0 for c in cuts[1:-1])
    assert chunk_bounds(100, (1, 1, 1)) == [0, 33, 67, 100]
    assert chunk_bounds(2, (1, 1, 1)) == [0, 1, 2]  # fewer rows than chunks: a row each
    assert chunk_bounds(0, (1, 1)) == [0]
    for rows in (1, 7, 129, 1024, 4097):
        for weights in ((1,), (1, 1), (3, 1), (1,) * 6):
            b = chunk_bounds(rows, weights)
            assert b[0] == 0 and b[-1] == rows and all(x < y for x, y in itertools.pairwise(b))
            assert len(b) - 1 <= len(weights)


def test_tile_row_bounds():
    assert tile_row_bounds(1024, (1, 1), 128) == [0, 512, 1024]
    assert tile_row_bounds(1000, (1, 1, 1), 128) == [0, 384, 640, 1000]  # 8 tile rows: 3, 2, 3
    assert tile_row_bounds(100, (1, 1), 128) == [0, 100]  # one tile row: one chunk
    assert tile_row_bounds(129, (1, 1, 1), 64) == [0, 64, 128, 129]
    for rows in (1, 7, 129, 1024, 4097):
        for weights in ((1,), (1, 1), (3, 1), (1,) * 6):
            for bm in (64, 128):
                b = tile_row_bounds(rows, weights, bm)
                assert b[0] == 0 and b[-1] == rows and all(x < y for x, y in itertools.pairwise(b))
                assert all(x % bm == 0 for x in b[:-1]) and len(b) - 1 <= len(weights)


def test_shard_rows():
    assert shard_rows(8) == ((0, 4), (4, 8))
    assert shard_rows(5) == ((0, 3), (3, 5))  # two ranks: ceil(M/2), then the rest
    assert shard_rows(1) == ((0, 1), (1, 1))
    assert shard_rows(12, 4) == ((0, 3), (3, 6), (6, 9), (9, 12))  # M/w rows each when w divides M
    assert shard_rows(10, 4) == ((0, 3), (3, 5), (5, 8), (8, 10))
    for m, w in ((7, 3), (100, 8), (8, 8)):
        spans = shard_rows(m, w)
        assert (
            spans[0][0] == 0 and spans[-1][1] == m and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        )
        assert max(r1 - r0 for r0, r1 in spans) - min(r1 - r0 for r0, r1 in spans) <= 1


def test_refused_on_the_cpu_with_what_to_do():
    msgs = run_ranks(copy_engine_refusal, 2, None, backend="gloo")
    for msg in msgs:
        assert "copy_engine needs CUDA GPUs" in msg and "overlap: false" in msg, msg


class _Executor:
    """Stands in for the GPU executor: logs which steps a call issues."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.warmed: list = []  # (steps warmed, the call's a) of each warm-up

    def issue(self, steps, a, b, out, main, gathered=None, operand=None) -> None:
        self.log.append(steps)

    def bind(self, a, b, out, main, *extra):
        return a

    def warm_up(self, steps, call) -> int:
        self.warmed.append((steps, call))
        return 1


def _bare_peers(monkeypatch: pytest.MonkeyPatch, log: list, world: int = 2):
    """An engine without GPUs: its bookkeeping (``_init_state``), a logging executor, plans made
    without buffers and an agreement without a collective (the real ``_agree`` with
    ``dist.all_reduce`` as the identity: one rank that agrees with itself)."""
    import torch

    import fo_kernels.engines.copy_engine.peers as P
    from fo_kernels.engines.copy_engine import CopyEnginePeers
    from fo_kernels.engines.copy_engine.gpu import Compiled

    peers = object.__new__(CopyEnginePeers)
    peers._init_state(torch.device("cpu"), None, 0, world)
    peers._executor = _Executor(log)
    peers._streams = {}
    peers._make = lambda key, plan, dtype: peers._plans.setdefault(
        key, (plan, Compiled(("eager",), ("captured",)))
    )
    monkeypatch.setattr(P.dist, "all_reduce", lambda tensor, op=None, group=None: tensor)
    return peers


def test_a_plans_first_eager_call_warms_its_kernels_up(monkeypatch: pytest.MonkeyPatch):
    """Before a plan's first eager call issues anything, its kernels run once; again for an
    operand at another alignment (another cuBLAS or Triton kernel), not for a repeated call or
    another address at the same alignment."""
    from types import SimpleNamespace

    import torch

    log: list = []
    peers = _bare_peers(monkeypatch, log)
    peers.graph_after = 0
    out = torch.empty(8, 6)
    peers._outputs = SimpleNamespace(empty=lambda shape, dtype: out)
    stream = SimpleNamespace(wait_stream=lambda other: None, cuda_stream=7)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    warmed = peers._executor.warmed
    b = torch.randn(4, 6)
    base = torch.randn(8 * 4 * 3 + 64)
    a = base[:32].view(8, 4)
    peers.run("all_reduce", a, b, mode="ring", weights=(1, 1))
    assert warmed == [(("eager",), a)] and log == [("eager",)]
    peers.run("all_reduce", a, b, mode="ring", weights=(1, 1))
    peers.run("all_reduce", base[64:96].view(8, 4), b, mode="ring", weights=(1, 1))  # 256 bytes on
    assert len(warmed) == 1 and len(log) == 3
    shifted = base[4:36].view(8, 4)  # 16 bytes on
    peers.run("all_reduce", shifted, b, mode="ring", weights=(1, 1))
    assert warmed[1:] == [(("eager",), shifted)] and len(log) == 4


def test_capture_needs_one_eager_call_first(monkeypatch: pytest.MonkeyPatch):
    """Inside a CUDA graph capture the first call of a shape cannot run, and is refused before
    anything is issued, for each of its two reasons: the ranks have not agreed on the schedule
    yet; or they have (another M ran eagerly: M is not in the signature) but this M has no plan.
    A shape that ran eagerly is recorded as it stands (without the eager-only prologue)."""
    import torch

    log: list = []
    peers = _bare_peers(monkeypatch, log)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the capture stream")
    monkeypatch.setattr(
        peers, "_eager", lambda plan, compiled, a, b, *rest: log.append(compiled.eager) or (None, None)
    )
    b = torch.randn(4, 6)
    with pytest.raises(ScheduleError, match=r"once before capturing.*have not yet agreed"):
        peers.run("all_reduce", torch.randn(8, 4), b, mode="ring", weights=(1, 1))
    capturing[0] = False
    peers.run("all_reduce", torch.randn(16, 4), b, mode="ring", weights=(1, 1))  # another M, eagerly
    assert log == [("eager",)]
    capturing[0] = True
    with pytest.raises(ScheduleError, match=r"once before capturing.*M=8 has no plan yet"):
        peers.run("all_reduce", torch.randn(8, 4), b, mode="ring", weights=(1, 1))
    out = peers.run("all_reduce", torch.randn(16, 4), b, mode="ring", weights=(1, 1))
    assert log == [("eager",), ("captured",)] and tuple(out.shape) == (16, 6) and peers._captured
    assert peers.call_counts() == (1, 0)  # the eager call went to the stand-in, which counts nothing


def test_refusals_before_any_work(monkeypatch: pytest.MonkeyPatch):
    """What a caller can get wrong is refused with what to do, before any collective: an unknown
    mode (listing the valid ones), a mode that cannot run the call, bad weights, M below the
    world size, reduce_scatter's M not divisible by it, a b the tiled kernel cannot read; and an
    engine whose earlier call failed part-way, or buffers that would move under a captured graph."""
    import torch

    from fo_kernels.errors import EnvironmentMismatchError, ShapeError

    log: list = []
    peers = _bare_peers(monkeypatch, log, world=4)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    tile = Tile(block_m=64, block_n=64, block_k=32)
    for kw, error, match in (
        (
            dict(mode="exchange", weights=(1,)),
            ScheduleError,
            r"mode: 'exchange' is not a copy-engine mode; valid: ring, tiled",
        ),
        (
            dict(mode="tiled", weights=(1,), tile=tile),
            ScheduleError,
            "mode tiled: runs between exactly 2 ranks, this group has 4",
        ),
        (
            dict(mode="ring", weights=(1,), tile=tile),
            ScheduleError,
            "mode ring: uses cuBLAS chunk GEMMs and takes no tile",
        ),
        (dict(mode="ring", weights=()), ScheduleError, "weights: expected 1 to 64 positive integers"),
        (dict(mode="ring", weights=(1, 0)), ScheduleError, "weights: expected"),
        (dict(mode="ring", weights=(True,)), ScheduleError, "weights: expected"),
    ):
        with pytest.raises(error, match=match):
            peers.run("all_reduce", a, b, **kw)
    with pytest.raises(ShapeError, match=r"needs M >= the world size 4.*got M=3"):
        peers.run("all_reduce", torch.randn(3, 4), b, mode="ring", weights=(1,))
    with pytest.raises(ShapeError, match="reduce_scatter needs M divisible by the world size 4, got M=10"):
        peers.run("reduce_scatter", torch.randn(10, 4), b, mode="ring", weights=(1,))
    two = _bare_peers(monkeypatch, log)
    with pytest.raises(ShapeError, match="b must be row-major"):
        two.run("all_reduce", a, torch.randn(4, 12)[:, ::2], mode="tiled", weights=(1,), tile=tile)
    assert log == [] and not peers._agreed  # nothing issued, nothing agreed
    peers._broken = "cuMemcpyDtoDAsync failed (CUDA_ERROR_INVALID_VALUE)"
    with pytest.raises(EnvironmentMismatchError, match=r"failed in an earlier call.*restart"):
        peers.run("all_reduce", a, b, mode="ring", weights=(1,))
    peers._broken, peers._ok, peers._recording = "", 0, True
    with pytest.raises(EnvironmentMismatchError, match="cuMemcpyDtoDAsync failed"):
        peers._check(1, "cuMemcpyDtoDAsync")
    assert peers._broken == ""  # while the engine records its own graph nothing ran: still usable
    peers._recording = False
    with pytest.raises(EnvironmentMismatchError):
        peers._check(1, "cuMemcpyDtoDAsync")
    assert peers._broken == "cuMemcpyDtoDAsync failed (1)"  # eagerly, part of a call may be queued
    peers._broken, peers._captured, peers._capacity = "", True, 1024
    peers._reserve(512)  # fits: nothing moves
    with pytest.raises(ScheduleError, match="run the largest shape eagerly before capturing"):
        peers._reserve(4096)


def test_modes_by_name_and_what_each_can_run():
    """The registry: modes by exact name, each with its feasibility rule."""
    from fo_kernels.engines.copy_engine import MODE_NAMES, mode_blocker, mode_named

    assert MODE_NAMES == ("ring", "tiled")
    with pytest.raises(ScheduleError, match="valid: ring, tiled"):
        mode_named("Ring")
    tile = Tile(block_m=64, block_n=64, block_k=32)
    for world in (2, 3, 4, 8):
        for collective in ("all_reduce", "reduce_scatter", "all_gather"):
            assert mode_blocker("ring", collective, world) == ""
    assert "at least 2 ranks" in mode_blocker("ring", "all_reduce", 1)
    assert (
        mode_blocker("tiled", "all_reduce", 2, tile) == mode_blocker("tiled", "reduce_scatter", 2, tile) == ""
    )
    assert "exactly 2 ranks" in mode_blocker("tiled", "all_reduce", 4, tile)
    assert "not 'all_gather'" in mode_blocker("tiled", "all_gather", 2, tile)
    assert "needs the persistent GEMM's tile" in mode_blocker("tiled", "all_reduce", 2)


def test_blocker_names_what_is_missing():
    import torch

    from fo_kernels.engines.copy_engine import copy_engine_blocker

    assert "needs CUDA GPUs with peer access; this call runs on cpu" in copy_engine_blocker(
        torch.device("cpu"), 4
    )


def test_m1_runs_as_gemm_then_the_collective():
    """An engine: copy_engine schedule called with M = 1 (an M-range row reaching decode at batch
    1) gives the right sum through GEMM then the collective, on the CPU as on GPUs."""
    from dist_cases import copy_engine_m1

    for err in run_ranks(copy_engine_m1, 2, None, backend="gloo"):
        assert err < 1e-5, err


def test_eager_calls_are_graphed_once_their_addresses_repeat(monkeypatch: pytest.MonkeyPatch):
    """The engine's own graphs (``fo_kernels.graphs.OwnGraphs``): a call is issued eagerly until
    its key (mode, weights, shape, operand and output addresses) has been seen GRAPH_AFTER_CALLS
    times, then captured once (its list without the eager-only prologue) and replayed; another
    output address or mode is another key; graph_after = 0 never captures; a failed capture
    leaves the engine issuing eagerly, unless it left a side stream capturing."""
    from types import SimpleNamespace

    import torch

    from fo_kernels.engines.copy_engine import GRAPH_AFTER_CALLS

    assert GRAPH_AFTER_CALLS == 2
    log: list = []
    peers = _bare_peers(monkeypatch, log)
    outs = [torch.empty(8, 6), torch.empty(8, 6)]
    which = [0]
    peers._outputs = SimpleNamespace(empty=lambda shape, dtype: outs[which[0]])
    stream = SimpleNamespace(wait_stream=lambda other: log.append("wait"), cuda_stream=7)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def capture(record):
        record()
        return SimpleNamespace(replay=lambda: log.append("replay"))

    monkeypatch.setattr(peers._graphs, "_capture", capture)
    a, b = torch.randn(8, 4), torch.randn(4, 6)

    def call(mode: str = "ring", weights=(1, 1)) -> list:
        log.clear()
        assert peers.run("all_reduce", a, b, mode=mode, weights=weights) is outs[which[0]]
        return [x[0] if isinstance(x, tuple) else x for x in log]

    assert call() == ["eager"]
    assert call() == ["captured", "replay"]
    assert call() == ["replay"] and peers.call_counts() == (3, 2)
    assert call(weights=(2, 1)) == ["eager"]  # the schedule is in the key
    which[0] = 1  # another output block: another key
    assert call() == ["eager"] and call() == ["captured", "replay"]
    peers.graph_after = 0
    which[0] = 0
    assert call() == ["eager"]  # even with a graph of this key
    peers.graph_after = 2

    def refused(record):  # any error: the capture queued nothing, so the call runs eagerly
        raise ValueError("operation not permitted when stream is capturing")

    monkeypatch.setattr(peers._graphs, "_capture", refused)
    a = torch.randn(16, 4)
    assert call() == ["eager"]
    with pytest.warns(RuntimeWarning, match="capturing a call in a CUDA graph failed"):
        assert call() == ["eager"]  # the capture failed: this call runs eagerly, and later ones
    assert peers.graph_after == 0 and call() == ["eager"]
    other = SimpleNamespace(wait_stream=lambda last: log.append("wait"), cuda_stream=8)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: other)
    assert call() == ["wait", "eager"]  # another stream first waits for the last call's stream
    assert call() == ["eager"]  # the same stream again: no wait
    assert peers.call_counts()[0] == 12


def test_a_capture_that_leaves_a_side_stream_capturing_breaks_the_engine(monkeypatch: pytest.MonkeyPatch):
    """After a failed capture the engine checks its side streams: one left capturing would record
    later calls instead of running them, so the error is raised and later calls are refused."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from fo_kernels.errors import EnvironmentMismatchError

    peers = _bare_peers(monkeypatch, [])
    peers._streams = {"side": SimpleNamespace(name="side")}
    current = ["main"]

    @contextlib.contextmanager
    def on(stream):
        current[0] = stream.name
        yield

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0] == "side")
    error = RuntimeError("capture invalidated")
    with pytest.raises(RuntimeError, match="capture invalidated"):
        peers._after_failed_capture(error)
    assert "left a side stream capturing" in peers._broken
    with pytest.raises(EnvironmentMismatchError, match="failed in an earlier call"):
        peers.run("all_reduce", torch.randn(8, 4), torch.randn(4, 6), mode="ring", weights=(1,))
