"""CPU tests of the ``overlap: false`` fallback's own CUDA graphs (``fo_kernels.graphs``,
``fo_kernels.fallback``): when a call is captured, replayed or run eagerly, and that every call's
result is right. CUDA is stood in for: a fake graph replays by issuing the call again, reading the
operands' current values as a graph reads its addresses. The real graphs run on two GPUs in
``tests/test_gpu.py::test_fallback_graphs_on_two_gpus``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fo_kernels import graphs as graphs_mod
from fo_kernels.fallback import Fallback
from fo_kernels.graphs import GRAPH_AFTER_CALLS, OwnGraphs


def _fake_capture(log: list[str]):
    """An ``OwnGraphs._capture`` without CUDA: records the call; its replay issues it again."""

    def capture(self, issue):
        log.append("capture")
        return SimpleNamespace(replay=lambda: (log.append("replay"), issue()))

    return capture


def test_own_graphs_capture_once_a_key_repeats(monkeypatch: pytest.MonkeyPatch):
    """Eager until a key has been seen ``after`` times, then captured once and replayed; another key
    counts on its own; the sightings and graphs are bounded (LRU); ``clear`` drops them all."""
    log: list[str] = []
    monkeypatch.setattr(OwnGraphs, "_capture", _fake_capture(log))
    own = OwnGraphs(torch.device("cpu"), "test")
    assert own.after == GRAPH_AFTER_CALLS == 2

    def call(key) -> list[str]:
        log.clear()
        own.call(key, lambda: log.append("eager"))
        return list(log)

    assert call("a") == ["eager"]
    assert call("a") == ["capture", "replay", "eager"]  # (the fake replay issues the call)
    assert call("a") == ["replay", "eager"] and own.replays == 2 and own.calls == 3
    assert call("b") == ["eager"] and len(own) == 1
    monkeypatch.setattr(graphs_mod, "SEEN_CACHE_SIZE", 1)
    assert call("c") == ["eager"]  # "b"'s sighting is forgotten
    assert call("b") == ["eager"]
    monkeypatch.setattr(graphs_mod, "GRAPH_CACHE_SIZE", 1)
    assert call("b")[0] == "capture" and len(own) == 1  # "a"'s graph is dropped (LRU)
    assert call("a") == ["eager"]
    own.clear()
    assert len(own) == 0 and call("b") == ["eager"]
    own.after = 0
    assert call("b") == ["eager"] and call("b") == ["eager"]


def test_own_graphs_failed_capture_runs_eagerly_from_then_on(monkeypatch: pytest.MonkeyPatch):
    """A capture that fails recorded nothing that ran: the call runs eagerly, with one warning, and
    so does every later call."""
    log: list[str] = []

    def refused(self, issue):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(OwnGraphs, "_capture", refused)
    own = OwnGraphs(torch.device("cpu"), "the fallback")
    own.call("a", lambda: log.append("eager"))
    with pytest.warns(RuntimeWarning, match=r"the fallback: capturing a call in a CUDA graph failed"):
        own.call("a", lambda: log.append("eager"))
    assert log == ["eager", "eager"] and own.after == 0 and "not permitted" in own.failure
    own.call("a", lambda: log.append("eager"))
    assert log == ["eager"] * 3 and own.replays == 0


class _FakeCuda:
    """The CUDA calls ``Fallback.run`` makes, on the CPU: the current stream, whether it captures,
    and an output pool that hands a dropped output's block back (one block per shape)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, log: list[str]) -> None:
        self.log, self.capturing, self.blocks = log, False, {}
        self.stream = self._stream(7)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.stream)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(
            graphs_mod.OutputPool, "empty", lambda pool, shape, dtype: self._empty(shape, dtype)
        )
        monkeypatch.setattr(OwnGraphs, "_capture", _fake_capture(log))

    def _stream(self, handle: int):
        return SimpleNamespace(cuda_stream=handle, wait_stream=lambda other: self.log.append("wait"))

    def switch(self, handle: int) -> None:
        self.stream = self._stream(handle)

    def _empty(self, shape, dtype):
        key = (tuple(shape), dtype)
        if key not in self.blocks:
            self.blocks[key] = torch.empty(shape, dtype=dtype)
        return self.blocks[key].fill_(float("nan"))  # the dropped output, poisoned


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_fallback_replays_repeated_calls_with_right_results(one_rank, monkeypatch, collective):
    """Repeated calls on the same operand blocks are captured once and replayed, each reading the
    operands' new values; a bigger ReduceScatter grows the scratch and drops the graphs; another
    stream waits for the last one; autograd and a caller's capture get eager calls."""
    log: list[str] = []
    fake = _FakeCuda(monkeypatch, log)
    fb = Fallback(torch.device("cpu"), None, 1, graphable=True)
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(16, 12, generator=gen)

    def call(a: torch.Tensor, b: torch.Tensor) -> list[str]:
        log.clear()
        out = fb.run(collective, a, b)
        torch.testing.assert_close(out, a @ b)  # world 1: the collective is the identity
        return list(log)

    assert call(a, b) == []  # eager (nothing captured)
    a.copy_(torch.randn(8, 16, generator=gen))
    assert call(a, b) == ["capture", "replay"]
    b.copy_(torch.randn(16, 12, generator=gen))
    assert call(a, b) == ["replay"] and len(fb.graphs) == 1
    a2 = torch.randn(8, 16, generator=gen)  # another operand block: another key
    assert call(a2, b) == [] and call(a2, b) == ["capture", "replay"] and len(fb.graphs) == 2
    if collective == "reduce_scatter":  # 64 rows outgrow the scratch: every graph is dropped
        big = torch.randn(64, 16, generator=gen)
        assert call(big, b) == [] and len(fb.graphs) == 0
        assert call(a, b) == [] and call(a, b) == ["capture", "replay"]
    fake.switch(8)
    assert call(a, b) == ["wait", "replay"]  # another stream waits for the last call's
    assert call(a, b) == ["replay"]
    calls = fb.graphs.calls
    a.requires_grad_(True)
    with torch.no_grad():
        assert call(a, b) == ["replay"]  # no autograd: still replayed
    out = fb.run(collective, a, b)
    assert out.requires_grad and fb.graphs.calls == calls + 1  # autograd records the GEMM: eager
    a.requires_grad_(False)
    fake.capturing = True  # inside a caller's capture: issued into it
    assert call(a, b) == [] and fb.graphs.calls == calls + 1
    fake.capturing = False
    assert fb.graph_after == GRAPH_AFTER_CALLS
    fb.graph_after = 0  # the README's switch: every call eager from then on
    assert fb.graphs.after == 0 and call(a, b) == [] and call(a, b) == []


def test_cpu_runtime_has_no_fallback_graphs(one_rank):
    """On the CPU (gloo) the fallback issues every call eagerly."""
    from fo_kernels.runtime import OverlapRuntime

    runtime = OverlapRuntime(device=torch.device("cpu"))
    assert runtime.made_fallback() is None
    fallback = runtime.fallback()
    assert fallback.graphs is None and runtime.made_fallback() is fallback
    fallback.graph_after = 0  # the README's switch: nothing to turn off here, and no error
    assert fallback.graph_after == 0
    a, b = torch.randn(6, 4), torch.randn(4, 3)
    torch.testing.assert_close(fallback.run("reduce_scatter", a, b), a @ b)


def test_one_rank_runs_the_gemm_alone(one_rank, monkeypatch, tmp_path):
    """At world size 1 a call no table row matches is the GEMM alone: every collective is the
    identity there, and none is called (each would raise here)."""
    import warnings

    import fo_kernels.collectives as collectives
    import fo_kernels.fallback as fallback
    from fo_kernels import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter

    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(tmp_path / "tables"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for module in (collectives, fallback):
        for name in ("all_reduce_now", "reduce_scatter_now", "all_gather_now"):
            monkeypatch.setattr(module, name, lambda *args, **kw: pytest.fail("a collective ran"))
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kw: pytest.fail("a collective ran"))
    a, b = torch.randn(6, 4), torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no table row: overlap: false
        for op in (gemm_all_reduce, gemm_reduce_scatter):
            torch.testing.assert_close(op(a, b), a @ b)
        out = all_gather_gemm(a, b)
    torch.testing.assert_close(out, a @ b)


def test_fallback_case_on_gloo():
    """The GPU test's rank function (``dist_cases.fallback_auto_graph``) on two CPU processes: every
    result right, none replayed (gloo has no graphs)."""
    from dist_cases import TOL, fallback_auto_graph, fallback_cases
    from fo_tune.ranks.launch import run_ranks

    for rows in run_ranks(fallback_auto_graph, 2, fallback_cases(first_seed=41), backend="gloo"):
        assert len(rows) == (2 * 2 + 3) * (GRAPH_AFTER_CALLS + 3)
        for r in rows:
            assert not r["nan"] and r["err"] < TOL[r["case"].dtype] and r["replayed"] == 0, r
