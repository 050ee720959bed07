"""CPU tests of the ``engine: copy_engine`` schedule kind: its contract, its row chunks, tables,
search spaces and the search's candidates. The engine itself runs on two GPUs only
(``tests/test_gpu.py::test_copy_engine_ops``)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from cli_checks import isolate_tables
from dist_cases import copy_engine_refusal
from fo_kernels.copy_engine import ROW_ALIGN, chunk_bounds, shard_rows, tile_row_bounds
from fo_kernels.errors import ScheduleError
from fo_kernels.fingerprint import current_fingerprint
from fo_kernels.schedule import MAX_CHUNKS, Problem, Schedule, Tile
from fo_kernels.table import ScheduleTable, load_table, lookup_schedule, save_table, table_path
from fo_tune.launch import run_ranks
from fo_tune.progress import SilentReporter
from fo_tune.search import SearchRequest, _copy_engine_candidates, _plans_everywhere
from fo_tune.space import SearchSpace, SpaceError, load_space, packaged_spaces_dir
from fo_tune.tables import changed_fields, validate_table

HEAD = dict(collective="reduce_scatter", dtype="bfloat16", world_size=2)
# A space's optional keys for the copy engine's tiled mode, other than hopper.yaml's.
MODES = {
    "copy_engine_tiles": [{"block_m": 128, "block_n": 256, "block_k": 64}],
    "copy_engine_tiled_chunks": [1, 2],
}


def ce(m: int = 4096, groups: tuple[int, ...] = (1, 1, 1, 1), **kw) -> Schedule:
    fields = {
        **HEAD,
        "problem": Problem(m=m, n=8192, k=4096),
        "engine": "copy_engine",
        "groups": groups,
        **kw,
    }
    return Schedule(**fields)


def test_schedule_round_trip_and_describe():
    s = ce(groups=(2, 1, 1))
    data = s.to_dict()
    assert data["engine"] == "copy_engine" and data["groups"] == [2, 1, 1]
    assert not {"tile", "sms_free", "layout", "wait_mode", "signal_tiles", "nccl_max_ctas"} & set(data)
    assert Schedule.from_dict(data) == s
    assert "copy engine, 3 chunk(s)" in s.describe()
    triton = Schedule.from_dict(
        {**data, "engine": "triton", "collective": "all_reduce"}
        | {"tile": dict(block_m=64, block_n=64, block_k=32)}
    )
    assert "engine" not in triton.to_dict()  # the default stays out of the tables


def test_tiled_schedule_round_trip_and_describe():
    tile = Tile(block_m=128, block_n=256, block_k=64, warp_specialize=True)
    s = ce(groups=(1, 1), tile=tile)
    data = s.to_dict()
    assert data["tile"] == tile.to_dict() and data["groups"] == [1, 1]
    assert not {"sms_free", "layout", "wait_mode", "signal_tiles", "nccl_max_ctas"} & set(data)
    assert Schedule.from_dict(data) == s
    assert "copy engine, 2 chunk(s) per shard, weights [1, 1], tiled 128x256x64 gm8 w8 s3 ws" in s.describe()


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(world_size=4), "engine"),
        (dict(tile={"block_m": 64}), "tile"),
        (dict(sms_free=8), "sms_free"),
        (dict(wait_mode="spin"), "wait_mode"),
        (dict(nccl_max_ctas=16), "nccl_max_ctas"),
        (dict(layout="row_band"), "layout"),
        (dict(groups=()), "groups"),
        (dict(groups=(1, 0)), "groups[1]"),
        (dict(groups=(1,) * (MAX_CHUNKS + 1)), "groups"),
        (dict(engine="nvshmem"), "engine"),
    ],
)
def test_schedule_refuses(change, field):
    with pytest.raises(ScheduleError, match="^" + field.replace("[", "\\[")):
        ce(**change)


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


def test_table_rows_validate_diff_and_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    isolate_tables(monkeypatch, tmp_path)
    fp = current_fingerprint("cpu", world_size=2)
    exact = ce(m=4096)
    ranged = Schedule(
        **{**HEAD, "problem": Problem(m_min=2, m_max=2048, n=8192, k=4096)},
        engine="copy_engine",
        groups=(1, 1),
    )
    table = ScheduleTable(
        fingerprint=fp, collective="reduce_scatter", world_size=2, dtype="bfloat16", rows=[exact, ranged]
    )
    root = tmp_path / "tables"
    path = table_path(root, fp.device_key, "reduce_scatter", 2, "bfloat16")
    save_table(table, path)
    loaded = load_table(path)
    assert [r.engine for r in loaded.rows] == ["copy_engine", "copy_engine"]
    assert validate_table(loaded) == []
    assert "groups" in changed_fields(exact, ce(m=4096, groups=(1, 1)))
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(root))
    got = lookup_schedule("reduce_scatter", 1024, 8192, 4096, dtype="bfloat16", world_size=2, device="cpu")
    assert got.engine == "copy_engine" and got.groups == (1, 1)


def test_space_copy_engine_chunks(tmp_path: Path):
    hopper = load_space(packaged_spaces_dir() / "hopper.yaml")
    assert hopper.copy_engine_chunks and max(hopper.copy_engine_chunks) <= MAX_CHUNKS
    again = SearchSpace.from_dict(hopper.to_dict())
    assert again.copy_engine_chunks == hopper.copy_engine_chunks
    default = load_space(packaged_spaces_dir() / "default.yaml")
    assert default.copy_engine_chunks == ()  # optional: left out means no copy-engine candidates
    for bad, where in (
        ([0], "copy_engine_chunks[0]"),
        ([2, 2], "copy_engine_chunks[1]"),
        ([MAX_CHUNKS + 1], "copy_engine_chunks[0]"),
    ):
        data = hopper.to_dict() | {"copy_engine_chunks": bad}
        with pytest.raises(SpaceError, match=rf"copy_engine_chunks\[{where[-2]}\]"):
            SearchSpace.from_dict(data)
    assert (2, 2, 1) in SearchSpace.from_dict(  # weights may repeat within one weighting
        hopper.to_dict() | {"copy_engine_weights": [[2, 2, 1]]}
    ).copy_engine_weights
    assert again.copy_engine_weights == hopper.copy_engine_weights
    # the shipped space searches the tiled mode with its first two tiles
    assert hopper.copy_engine_tiles[:2] == hopper.tiles[:2] and hopper.copy_engine_tiled_chunks == (1, 2)
    modes = SearchSpace.from_dict(hopper.to_dict() | MODES)
    again = SearchSpace.from_dict(modes.to_dict())
    assert again.copy_engine_tiles == modes.copy_engine_tiles == (Tile(block_m=128, block_n=256, block_k=64),)
    assert again.copy_engine_tiled_chunks == (1, 2)
    for change, where in (
        ({"copy_engine_tiled_chunks": [MAX_CHUNKS + 1]}, r"copy_engine_tiled_chunks\[0\]: 65 > 64"),
        ({"copy_engine_tiled_chunks": [0]}, r"copy_engine_tiled_chunks\[0\]"),
        ({"copy_engine_tiles": [{"block_m": 128}]}, r"copy_engine_tiles\[0\]"),
    ):
        with pytest.raises(SpaceError, match=where):
            SearchSpace.from_dict(hopper.to_dict() | MODES | change)
    lone = {k: v for k, v in modes.to_dict().items() if k != "copy_engine_tiles"}
    with pytest.raises(SpaceError, match=r"copy_engine_tiles: the tiled mode needs both"):
        SearchSpace.from_dict(lone)
    for bad, where in (
        ([[1]], r"copy_engine_weights\[0\]: expected a list of 2 to"),
        ([[2, 0]], r"copy_engine_weights\[0\]\[1\]: expected a positive integer"),
        ([[2, 1], [2, 1]], r"copy_engine_weights\[1\]: repeats"),
        ([[1] * (MAX_CHUNKS + 1)], r"copy_engine_weights\[0\]: expected a list of 2 to"),
    ):
        with pytest.raises(SpaceError, match=where):
            SearchSpace.from_dict(hopper.to_dict() | {"copy_engine_weights": bad})


def test_search_candidates_only_on_two_gpus():
    space = SearchSpace.from_dict(load_space(packaged_spaces_dir() / "hopper.yaml").to_dict() | MODES)
    req = SearchRequest(shapes=((4096, 8192, 4096),), collective="all_reduce", world_size=2, mode="measure")
    got = _copy_engine_candidates(req, space, (4096, 8192, 4096), cpu=False)
    want = [(1,) * c for c in space.copy_engine_chunks] + list(space.copy_engine_weights)
    tiled = [((1,) * c, t) for t in space.copy_engine_tiles for c in space.copy_engine_tiled_chunks]
    # equal chunks first, then the extra weightings, then the tiled mode
    assert [(s.groups, s.tile) for s in got] == [(w, None) for w in want] + tiled
    assert all(s.engine == "copy_engine" and s.problem.m == 4096 for s in got)
    rs = dataclasses.replace(req, collective="reduce_scatter")
    assert _copy_engine_candidates(rs, space, (4096, 8192, 4096), cpu=False) == [
        dataclasses.replace(s, collective="reduce_scatter") for s in got
    ]
    fp32 = dataclasses.replace(req, dtype="float32")
    assert not any(s.tile for s in _copy_engine_candidates(fp32, space, (4096, 8192, 4096), cpu=False))
    assert _copy_engine_candidates(req, space, (4096, 8192, 4096), cpu=True) == []
    four = SearchRequest(shapes=((4096, 8192, 4096),), world_size=4, mode="measure")
    assert _copy_engine_candidates(four, space, (4096, 8192, 4096), cpu=False) == []
    small = _copy_engine_candidates(req, space, (4, 8192, 4096), cpu=False)
    # no more chunks than a shard has rows
    assert small and all(len(s.groups) <= 2 for s in small)
    assert _plans_everywhere(got[0], (1, 2, 4096, 100000), 132)


def test_table_show_and_csv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from typer.testing import CliRunner

    from cli import app

    isolate_tables(monkeypatch, tmp_path)
    fp = current_fingerprint("cpu", world_size=2)
    tiled = ce(m=2048, groups=(1,), tile=Tile(block_m=128, block_n=256, block_k=64))
    table = ScheduleTable(
        fingerprint=fp,
        collective="reduce_scatter",
        world_size=2,
        dtype="bfloat16",
        rows=[ce(groups=(2, 1)), tiled],
    )
    path = tmp_path / "t.yaml"
    save_table(table, path)
    shown = CliRunner().invoke(app, ["table", "show", str(path)])
    assert shown.exit_code == 0 and "copy engine" in shown.output, shown.output
    assert "tiled 128x256x64" in shown.output, shown.output
    got = CliRunner().invoke(app, ["table", "show", str(path), "--format", "csv"])
    assert got.exit_code == 0, got.output
    header, *rows = got.output.strip().splitlines()
    cells = [dict(zip(header.split(","), row.split(","), strict=False)) for row in rows]
    by_m = {c["m"]: c for c in cells}
    plain, tiled_cells = by_m["4096"], by_m["2048"]
    assert plain["engine"] == "copy_engine" and plain["groups"] == "2 1" and plain["block_m"] == ""
    assert "exchange" not in header.split(",")
    assert (tiled_cells["block_m"], tiled_cells["block_n"], tiled_cells["groups"]) == ("128", "256", "1")


def test_exchange_schedule_contract():
    ar = dict(HEAD, collective="all_reduce")
    problem = Problem(m=2048, n=4096, k=4096)
    s = Schedule(**ar, problem=problem, engine="copy_engine", groups=(1, 1), exchange=True)
    assert s.to_dict()["exchange"] is True and Schedule.from_dict(s.to_dict()) == s
    assert "exchange, 2 chunk(s) of M" in s.describe()
    assert "exchange" not in ce().to_dict()  # the default stays out of the tables
    with pytest.raises(ScheduleError, match=r"^exchange: only all_reduce"):
        ce(exchange=True)  # reduce_scatter
    with pytest.raises(ScheduleError, match=r"^exchange: only all_reduce"):
        Schedule(
            **ar, problem=Problem(m=64, n=64, k=64), engine="copy_engine", groups=(1,), exchange=True,
            tile=Tile(block_m=64, block_n=64, block_k=32),
        )  # fmt: skip
    with pytest.raises(ScheduleError, match=r"^exchange: only an overlapped engine: copy_engine"):
        Schedule(**ar, problem=Problem(m=64, n=64, k=64), overlap=False, exchange=True)
    with pytest.raises(ScheduleError, match=r"^exchange: expected true or false"):
        Schedule(**ar, problem=Problem(m=64, n=64, k=64), engine="copy_engine", groups=(1,), exchange="yes")


class FakeMeasurer:
    """Stands in for the GPU ranks: fixed timings per engine (no process, no GPU)."""

    def __init__(self, *, trial_ok=True, ce_ms=1.0, tri_ms=1.5, seq_ms=2.0, fb_ms=None, why=""):
        self.count, self.trial_ok, self.why = 0, trial_ok, why
        self.ce_ms, self.tri_ms, self.seq_ms, self.fb_ms = ce_ms, tri_ms, seq_ms, fb_ms
        self.confirmed: list = []

    def _t(self, ms):
        from fo_tune.timing import Timing

        return Timing(ms, 0.01, 10, 0.01)

    def baseline(self, collective, shape, dtype):
        t = self._t(self.seq_ms)
        return dict(rel_err=0.0, has_nan=False, gemm=t, comm=t, sequential=t)

    def trial(self, schedule, shape):
        self.count += 1
        if not self.trial_ok:
            return dict(rel_err=1.0, has_nan=False, ok=False, timing=None)
        return dict(rel_err=0.0, has_nan=False, ok=True, timing=self._t(self.tri_ms))

    def confirm(self, schedules, shape):
        self.confirmed.append(list(schedules))
        ts = [self._t(self.ce_ms if s.engine == "copy_engine" else self.tri_ms) for s in schedules]
        fallback = self._t(self.fb_ms) if self.fb_ms is not None else None
        seq = self._t(self.seq_ms)
        return dict(sequential=seq, fallback=fallback, timings=ts, rel_err=[0.0] * len(schedules))

    def copy_engine_unavailable(self):
        return self.why


@pytest.mark.parametrize(
    "measurer, want",
    [
        (FakeMeasurer(), "copy_engine"),  # the copy engine is fastest and gains
        (FakeMeasurer(trial_ok=False), "copy_engine"),  # no Optuna trial passed: still a row
        (FakeMeasurer(ce_ms=1.99, tri_ms=2.5), "none"),  # fastest, but inside the no-gain margin
        (FakeMeasurer(fb_ms=1.0), "none"),  # beats sequential, not the (graphed) fallback
        (FakeMeasurer(fb_ms=2.2), "copy_engine"),  # a fallback slower than sequential
        (FakeMeasurer(ce_ms=1.8, tri_ms=1.0), "triton"),
        (FakeMeasurer(why="cuda-bindings is not installed"), "triton"),  # candidates dropped
    ],
)
def test_confirmation_with_copy_engine_candidates(measurer, want):
    import optuna

    from fo_tune import search as S

    space = SearchSpace.from_dict(load_space(packaged_spaces_dir() / "hopper.yaml").to_dict() | MODES)
    shape = (4096, 8192, 4096)
    req = SearchRequest(shapes=(shape,), world_size=2, mode="measure", trials=3, space=space)
    r = S._search_shape(
        req, shape, space=space, sm_count=132, device_key="h200", cpu=False, model=None, measurer=measurer,
        storage=optuna.storages.InMemoryStorage(), table=None, budget_s=None, reporter=SilentReporter(),
    )  # fmt: skip
    engines = [s.engine for s in measurer.confirmed[0]]
    candidates = (
        len(space.copy_engine_chunks)
        + len(space.copy_engine_weights)
        + len(space.copy_engine_tiles) * len(space.copy_engine_tiled_chunks)
    )
    assert engines.count("copy_engine") == (0 if measurer.why else candidates)
    if measurer.fb_ms is not None:  # decided against the fallback, both timings kept
        assert r.row.provenance["fallback_ms"] == pytest.approx(measurer.fb_ms)
        assert r.row.provenance["sequential_ms"] == pytest.approx(measurer.seq_ms)
        assert "the overlap: false fallback" in r.row.provenance["decision"]
    if want == "none":
        assert not r.row.overlap and r.best_schedule.engine == "copy_engine" and r.best_trial is None
        assert "rejected_measured_ms" in r.row.provenance
        return
    assert r.row.overlap and r.row.engine == want
    assert (r.best_trial is None) == (want == "copy_engine")
    assert ("trial" in r.row.provenance) == (want == "triton")
    assert r.row.provenance["measured_ms"] == pytest.approx(
        measurer.ce_ms if want == "copy_engine" else measurer.tri_ms
    )


def test_schedule_engine_needs_overlap():
    with pytest.raises(ScheduleError, match=r"^engine: an overlap: false row"):
        Schedule(**HEAD, problem=Problem(m=8, n=8, k=8), overlap=False, engine="copy_engine")


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
