"""CPU tests of the ``engine: copy_engine`` runtime: its row chunks, its refusals and its own graphs.
The engine itself runs on two GPUs only (``tests/test_gpu.py::test_copy_engine_ops``); its
schedule contract is in ``tests/test_schedule.py``, its tuner side in ``tests/test_engines.py``."""

from __future__ import annotations

import itertools

import pytest

from dist_cases import copy_engine_refusal
from fo_kernels.copy_engine import ROW_ALIGN, chunk_bounds, shard_rows, tile_row_bounds
from fo_kernels.errors import ScheduleError
from fo_tune.launch import run_ranks


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
    assert shard_rows(5) == ((0, 3), (3, 5))
    assert shard_rows(1) == ((0, 1), (1, 1))


def test_refused_on_the_cpu_with_what_to_do():
    msgs = run_ranks(copy_engine_refusal, 2, None, backend="gloo")
    for msg in msgs:
        assert "copy_engine needs CUDA GPUs" in msg and "overlap: false" in msg, msg


def test_gemm_streams_one_or_two():
    """The chunk GEMMs alternate between one or two streams; any other count is refused first."""
    import torch

    from fo_kernels.copy_engine import CopyEnginePeers

    for bad in (0, 3):
        with pytest.raises(ValueError, match="gemm_streams: 1 or 2"):
            CopyEnginePeers(device=torch.device("cpu"), gemm_streams=bad)


def _bare_peers():
    """A peers object without GPUs: only the checks a call makes before any work can run."""
    from fo_kernels.copy_engine import CopyEnginePeers

    peers = object.__new__(CopyEnginePeers)
    peers._agreed, peers._plans, peers._broken, peers._captured = set(), {}, "", False
    peers._capacity = 0
    return peers


def test_capture_needs_one_eager_call_first(monkeypatch: pytest.MonkeyPatch):
    """Inside a CUDA graph capture the first call of a shape (buffers, the ranks' agreement) cannot
    run: it is refused with what to do, before anything is issued; an agreed (collective, N, K,
    dtype, weights) is not enough when this M has no plan yet."""
    import torch

    peers = _bare_peers()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    with pytest.raises(ScheduleError, match="once before capturing it in a CUDA graph"):
        peers.run("all_reduce", a, b, (1, 1))
    peers._agreed.add(("all_reduce", 6, 4, str(a.dtype), (1, 1)))  # another M ran eagerly
    with pytest.raises(ScheduleError, match="once before capturing it in a CUDA graph"):
        peers.run("all_reduce", a, b, (1, 1))


def test_refusals_before_any_work():
    """M < 2 (a rank would own no row), a peers object whose earlier call failed part-way, and
    buffers that would move under a captured graph are refused with what to do; a driver error
    while the engine records its own graph (nothing ran) leaves the peers usable."""
    import torch

    from fo_kernels.errors import EnvironmentMismatchError, ShapeError

    peers = _bare_peers()
    with pytest.raises(ShapeError, match="M >= 2, got M=1"):
        peers.run("all_reduce", torch.randn(1, 4), torch.randn(4, 6), (1,))
    peers._broken = "cuMemcpyDtoDAsync failed (CUDA_ERROR_INVALID_VALUE)"
    with pytest.raises(EnvironmentMismatchError, match=r"failed in an earlier call.*restart"):
        peers.run("all_reduce", torch.randn(8, 4), torch.randn(4, 6), (1,))
    peers._broken, peers._ok, peers._capturing_own = "", 0, True
    with pytest.raises(EnvironmentMismatchError, match="cuMemcpyDtoDAsync failed"):
        peers._check(1, "cuMemcpyDtoDAsync")
    assert peers._broken == ""  # while the engine records its own graph nothing ran: still usable
    peers._capturing_own = False
    with pytest.raises(EnvironmentMismatchError):
        peers._check(1, "cuMemcpyDtoDAsync")
    assert peers._broken == "cuMemcpyDtoDAsync failed (1)"  # eagerly, part of a call may be queued
    peers._broken, peers._captured, peers._capacity = "", True, 1024
    peers._reserve(512)  # fits: nothing moves
    with pytest.raises(ScheduleError, match="run the largest shape eagerly before capturing"):
        peers._reserve(4096)


def test_m1_runs_as_gemm_then_the_collective():
    """An engine: copy_engine schedule called with M = 1 (an M-range row reaching decode at batch
    1) gives the right sum through GEMM then the collective, on the CPU as on GPUs."""
    from dist_cases import copy_engine_m1

    for err in run_ranks(copy_engine_m1, 2, None, backend="gloo"):
        assert err < 1e-5, err


def test_eager_calls_are_graphed_once_their_addresses_repeat(monkeypatch: pytest.MonkeyPatch):
    """The engine's own graphs: a call is issued eagerly until its key (shape, operand and output
    addresses) has been seen GRAPH_AFTER_CALLS times, then captured once and replayed; another
    output address is another key; graph_after = 0 never captures; the sightings are bounded."""
    from collections import OrderedDict
    from types import SimpleNamespace

    import torch

    import fo_kernels.copy_engine as ce

    peers = _bare_peers()
    peers.graph_after, peers.replays, peers._calls = 2, 0, 0
    peers._graphs, peers._seen, peers._plans = OrderedDict(), OrderedDict(), OrderedDict()
    peers.device, peers._side, peers._local = torch.device("cpu"), None, None
    peers._agree = lambda signature: None
    log = []

    def run(collective, a, b, weights, mode, out, capturing=False):
        log.append("capture" if capturing else "eager")
        peers._plans[ce._plan_key(collective, a.shape[0], b.shape[1], a.dtype, weights, mode)] = "plan"

    def capture(collective, a, b, weights, mode, out):
        run(collective, a, b, weights, mode, out, capturing=True)
        return SimpleNamespace(replay=lambda: log.append("replay"))

    peers._run, peers._capture = run, capture
    stream = SimpleNamespace(wait_stream=lambda other: log.append("wait"), cuda_stream=7)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    outs = [torch.empty(8, 6), torch.empty(8, 6)]
    which = [0]
    monkeypatch.setattr(ce.torch, "empty", lambda *args, **kw: outs[which[0]])
    peers._output = lambda shape, dtype: outs[which[0]]  # (the engine's output pool needs CUDA)
    peers._last_main = None
    a, b = torch.randn(8, 4), torch.randn(4, 6)

    def call() -> list[str]:
        log.clear()
        assert peers.run("all_reduce", a, b, (1, 1)) is outs[which[0]]
        return list(log)

    assert call() == ["eager"]
    assert call() == ["capture", "replay"]
    assert call() == ["replay"] and peers.replays == 2
    # the engine's settings are in the key: a graph recorded under the other setting never replays
    peers.gemm_streams = 3 - peers.gemm_streams
    assert call() == ["eager"] and call() == ["capture", "replay"]
    peers.gemm_streams = 3 - peers.gemm_streams
    assert call() == ["replay"]
    peers.own_copy_at_end = not peers.own_copy_at_end
    assert call() == ["eager"] and call() == ["capture", "replay"]
    peers.own_copy_at_end = not peers.own_copy_at_end
    assert call() == ["replay"] and len(peers._graphs) == 3
    which[0] = 1  # another output block: another key
    assert call() == ["eager"]
    assert call() == ["capture", "replay"] and len(peers._graphs) == 4
    peers.graph_after = 0
    which[0] = 0
    assert call() == ["eager"]  # even with a graph of this key
    peers.graph_after = 2
    monkeypatch.setattr(ce, "SEEN_CACHE_SIZE", 1)
    for rows in (10, 12, 14):
        a = torch.randn(rows, 4)
        assert call() == ["eager"]
    assert len(peers._seen) == 1

    def refused(*args):  # any error: the capture queued nothing, so the call runs eagerly
        raise ValueError("operation not permitted when stream is capturing")

    peers._capture = refused
    a = torch.randn(16, 4)
    assert call() == ["eager"]
    with pytest.warns(RuntimeWarning, match="capturing a call in a CUDA graph failed"):
        assert call() == ["eager"]  # the capture failed: this call runs eagerly, and later ones
    assert peers.graph_after == 0 and call() == ["eager"]
    other = SimpleNamespace(wait_stream=lambda last: log.append("wait"), cuda_stream=8)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: other)
    assert call() == ["wait", "eager"]  # another stream first waits for the last call's stream
    assert call() == ["eager"]  # the same stream again: no wait
