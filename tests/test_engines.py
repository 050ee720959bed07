"""The tuner's engine plug-ins (``fo_tune.engines``): the registry, each engine's feasibility rule,
calibration needs and encoding, the union of engines one study searches, the strategies' registry,
and a measured search's confirmation with a stand-in for the ranks."""

from __future__ import annotations

import dataclasses
import math

import optuna
import pytest

from cli_checks import with_all_gather_standin
from fo_kernels.engines import engine_names as runtime_engines
from fo_kernels.engines import engine_settings
from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.plan import check_fits
from fo_kernels.schedule import Schedule
from fo_kernels.tile import Tile
from fo_tune.engines import ShapeTask, UnknownEngineError, cost_model, engine_names, get_tuner
from fo_tune.output import SilentReporter
from fo_tune.search import SearchError, SearchRequest, select_engines
from fo_tune.search.encoding import Infeasible, UnionEncoding, schedule_key
from fo_tune.search.strategies import get_strategy, strategy_names
from fo_tune.space import space_for


@pytest.fixture(scope="module")
def ag_model(h200):
    """The shipped calibration with a stand-in all_gather curve (its reduce_scatter points
    relabelled: not a measurement; the shipped file has no all_gather curve) for the encoding."""
    return cost_model(with_all_gather_standin(h200))


def fingerprint(h200, **changes) -> Fingerprint:
    return dataclasses.replace(h200.fingerprint, **changes)


def task(model, collective="all_reduce", shape=(4096, 8192, 4096), *, world=2, dtype="bfloat16", **kw):
    m, n, k = shape
    return ShapeTask(
        collective=collective,
        dtype=dtype,
        world_size=world,
        m=m,
        n=n,
        k=k,
        sm_count=132,
        cpu=False,
        space=space_for("9.0"),
        model=model,
        predictable=model is not None,
        **kw,
    )


# ------------------------------------------------------------------------------------ registry
def test_every_runtime_engine_has_a_tuner_plug_in():
    assert set(engine_names()) == set(runtime_engines())
    for name in engine_names():
        assert get_tuner(name).name == name and get_tuner(name).settings_type is engine_settings(name)


def test_an_unknown_engine_lists_the_valid_ones():
    with pytest.raises(UnknownEngineError, match="'Triton' is not one of triton, copy_engine") as info:
        get_tuner("Triton")
    assert isinstance(info.value, ValueError)
    assert set(strategy_names()) == {"measure", "predict", "hybrid", "exhaustive"}
    with pytest.raises(SearchError, match="is not one of measure, predict, hybrid, exhaustive"):
        get_strategy("random")


# ------------------------------------------------------------------------------------ feasibility
@pytest.mark.parametrize(
    ("changes", "collective", "needle"),
    [
        ({}, "all_reduce", ""),
        ({"interconnect": "p2p"}, "reduce_scatter", ""),
        ({"interconnect": "pcie"}, "all_reduce", "needs peer access between the GPUs"),
        ({"interconnect": "gloo"}, "all_reduce", "has interconnect gloo"),
        ({"world_size": 1, "interconnect": "single"}, "all_reduce", "world size 1 has none"),
        ({}, "all_gather", ""),
        ({"interconnect": "gloo"}, "all_gather", "has interconnect gloo"),
        ({}, "all_to_all", "does not run all_to_all"),
    ],
)
def test_copy_engine_runs_where_the_gpus_are_peers(h200, changes, collective, needle):
    why = get_tuner("copy_engine").blocker(fingerprint(h200, **changes), collective, "bfloat16")
    assert (needle in why) if needle else why == ""


def test_triton_runs_on_any_interconnect_with_a_collective(h200):
    tuner = get_tuner("triton")
    assert tuner.blocker(fingerprint(h200, interconnect="pcie"), "all_reduce", "float16") == ""
    assert "world size 1" in tuner.blocker(fingerprint(h200, world_size=1), "all_reduce", "bfloat16")
    assert tuner.blocker(fingerprint(h200), "all_gather", "bfloat16") == ""
    assert "all_to_all" in tuner.blocker(fingerprint(h200), "all_to_all", "bfloat16")


def test_each_engine_names_the_calibration_it_misses(h200):
    assert get_tuner("copy_engine").calibration_gap(h200, "all_reduce") == ""
    assert get_tuner("triton").calibration_gap(h200, "reduce_scatter") == ""
    bare = dataclasses.replace(h200, copy_engine=None, bandwidth=[])
    gap = get_tuner("copy_engine").calibration_gap(bare, "all_reduce")
    assert "copy_engine section" in gap and "fo-tune calibrate --world-size 2 --only copy_engine" in gap
    gap = get_tuner("triton").calibration_gap(bare, "all_reduce")
    assert "bandwidth curve of all_reduce" in gap and "--collectives all_reduce" in gap
    # the shipped calibration has no all_gather curve: the command measures it beside the others
    gap = get_tuner("triton").calibration_gap(h200, "all_gather")
    assert "has no bandwidth curve for all_gather" in gap
    assert "--only bandwidth --collectives all_reduce,reduce_scatter,all_gather --into" in gap
    assert get_tuner("copy_engine").calibration_gap(h200, "all_gather") == ""  # (its pulls: no NCCL)


def test_gaps_of_an_extrapolated_calibration_name_the_world_size_that_measures_them(h200):
    """At world size 8 from the TP=2 file: the GEMM profile is measured on one GPU and the copy
    engine's section on two, never on the 8 GPUs the extrapolation stands in for, into a copy of
    the packaged TP=2 file it was extrapolated from (the file a later search reads again)."""
    from fo_tune.calibrate.extrapolate import extrapolate
    from fo_tune.engines import moe_term

    bare = extrapolate(dataclasses.replace(h200, gemm=[], copy_engine=None), 8)
    own = f"{h200.fingerprint.device_key}.yaml"
    copy = f"`cp {h200.file} {own}`, then "
    one_gpu = f"{copy}`fo-tune calibrate --world-size 1 --only gemm --into {own}`"
    two_gpus = f"{copy}`fo-tune calibrate --world-size 2 --only copy_engine --into {own}`"
    gaps = {
        one_gpu: [
            get_tuner("triton").calibration_gap(bare, "all_reduce"),
            moe_term("triton").calibration_gap(bare),
        ],
        two_gpus: [
            get_tuner("copy_engine").calibration_gap(bare, "all_reduce"),
            moe_term("copy_engine").calibration_gap(bare),
        ],
    }
    for command, texts in gaps.items():
        for text in texts:
            assert command in text and f"then pass `--calibration {own}`" in text, text
            assert "extrapolated to world size 8" in text and "CALIBRATION.yaml" not in text
    # a bandwidth curve its TP=2 file lacks is measured on 2 GPUs, not 8
    one_curve = [b for b in h200.bandwidth if b.collective == "all_reduce"]
    gap = get_tuner("triton").calibration_gap(
        extrapolate(dataclasses.replace(h200, bandwidth=one_curve), 8), "reduce_scatter"
    )
    assert "on 2 GPUs" in gap and "`fo-tune calibrate --world-size 2 --dtype bfloat16 --only bandwidth" in gap
    # a calibration's own file takes what it lacks
    mine = dataclasses.replace(h200, gemm=[], file="/data/mine.yaml")
    assert "--into /data/mine.yaml`; then pass `--calibration /data/mine.yaml`" in moe_term(
        "triton"
    ).calibration_gap(mine)


def test_select_engines(h200):
    req = SearchRequest(shapes=((4096, 8192, 4096),), calibration=h200)
    assert select_engines(req, h200.fingerprint, space_for("9.0")) == ("triton", "copy_engine")
    cpu_like = fingerprint(h200, interconnect="gloo")
    assert select_engines(req, cpu_like, space_for("9.0")) == ("triton",)  # left out, not an error
    assert select_engines(req, h200.fingerprint, space_for("cpu")) == ("triton",)  # no section there
    with pytest.raises(SearchError, match="--engine copy_engine: engine copy_engine needs peer access"):
        select_engines(dataclasses.replace(req, engines=("copy_engine",)), cpu_like, space_for("9.0"))
    with pytest.raises(SearchError, match=r"copy_engine section.*leave it out with --engine"):
        bare = dataclasses.replace(h200, copy_engine=None)
        select_engines(dataclasses.replace(req, calibration=bare), bare.fingerprint, space_for("9.0"))
    one = dataclasses.replace(req, world_size=1)
    assert select_engines(one, fingerprint(h200, world_size=1, interconnect="single"), None) == ()


# ------------------------------------------------------------------------------------ encoding
def test_copy_engine_points_per_shape(model):
    tuner = get_tuner("copy_engine")
    points = list(tuner.points(task(model), exhaustive=False))
    ring = [p for p in points if p["mode"] == "ring"]
    tiled = [p for p in points if p["mode"] == "tiled"]
    assert [p["ring.weights"] for p in ring] == [
        "1",
        "1-1",
        "1-1-1",
        "1-1-1-1",
        "1-1-1-1-1-1",
        "2-1",
        "2-2-1",
        "2-2-2-1",
    ]
    offered = space_for("9.0").engine("copy_engine").modes["tiled"].tiles
    priced = [t for t in offered if model.knows_tile(t)]  # a predicted search offers what it can price
    assert priced and {(p["tiled.weights"], p["tiled.tile"]) for p in tiled} == {
        (w, t.label()) for w in ("1", "1-1") for t in priced
    }
    assert tuner.seeds(task(model)) == list(tuner.points(task(model), exhaustive=True))
    # no more chunks than a shard has rows; the tiled mode at world size 2 and 16-bit inputs only
    small = [
        p["ring.weights"]
        for p in tuner.points(task(model, shape=(4, 8192, 4096)), exhaustive=False)
        if p["mode"] == "ring"
    ]
    assert small == ["1", "1-1", "2-1"]
    for other in (task(model, dtype="float32"), task(model, world=4)):
        assert {p["mode"] for p in tuner.points(other, exhaustive=False)} == {"ring"}


@pytest.mark.parametrize(
    ("shape", "world", "space", "priced"),
    [
        ((4096, 8192, 4096), 2, "9.0", True),
        ((16384, 8192, 4096), 2, "9.0", True),
        ((2050, 3074, 1030), 2, "9.0", False),  # an odd shape, measure mode (no model: custom groups)
        ((8192, 8192, 8192), 4, "9.0", False),
        ((768, 96, 64), 3, "cpu", False),
    ],
)
def test_all_gather_points_are_what_its_runtime_paths_take(ag_model, shape, world, space, priced):
    """Every all_gather point either engine enumerates (exhaustive or not) builds a schedule the
    runtime takes: Schedule's checks (TritonSettings.check, CopyEngineSettings.check) and a plan."""
    m, n, k = shape
    t = ShapeTask(
        collective="all_gather",
        dtype="bfloat16",
        world_size=world,
        m=m,
        n=n,
        k=k,
        sm_count=132,
        cpu=space == "cpu",
        space=space_for(space),
        model=ag_model if priced else None,
        predictable=priced,
    )
    engines = ("triton", "copy_engine") if space != "cpu" else ("triton",)
    enc = UnionEncoding(t, engines)
    triton = get_tuner("triton").choices(t)
    assert triton["layout"] == ["row_band"] and "wait_mode" not in triton
    assert triton["signal"] and all(s.startswith("band") for s in triton["signal"])
    seen = {name: 0 for name in engines}
    for exhaustive in (False, True):
        for params in enc.points(exhaustive=exhaustive):
            assert "triton.wait_mode" not in params and params.get("copy_engine.mode", "ring") == "ring"
            schedule = enc.build(params)
            again = Schedule.from_dict(schedule.to_dict())  # the runtime's own parse of the row
            check_fits(again, m, n, k, sm_count=132)
            st = again.settings
            if isinstance(st, TritonSettings):
                assert st.layout == "row_band" and st.signal_tiles % world == 0
            else:
                assert isinstance(st, CopyEngineSettings) and st.mode == "ring" and st.tile is None
            assert enc.params_of(again) is not None
            seen[again.engine] += 1
    assert all(seen.values()), seen
    for params in enc.seeds():
        check_fits(enc.build(params), m, n, k, sm_count=132)
    with pytest.raises(Infeasible, match="layout 'tile_major' is not offered for all_gather"):
        first = next(enc.points(exhaustive=False))
        enc.build({**first, "triton.layout": "tile_major"})


def test_all_gather_settings_the_space_cannot_build_are_left_out(ag_model):
    enc = UnionEncoding(task(ag_model, "all_gather"), ("triton", "copy_engine"))
    tile = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
    st = TritonSettings(
        tile=tile, sms_free=24, nccl_max_ctas=16, signal_tiles=2 * 8 * 32, groups=(1, 1), layout="row_band"
    )
    params = enc.params_of(enc.task.schedule(st))
    assert params is not None and "triton.wait_mode" not in params
    assert schedule_key(enc.build(params)) == schedule_key(enc.task.schedule(st))
    # a spin wait is never built for all_gather (the field is unused there): not reachable
    assert enc.params_of(enc.task.schedule(dataclasses.replace(st, wait_mode="spin"))) is None
    with pytest.raises(Infeasible, match="not offered"):
        enc.build({"engine": "copy_engine", "copy_engine.mode": "tiled", "copy_engine.tiled.weights": "1"})


def test_copy_engine_settings_round_trip_through_the_encoding(model):
    enc = UnionEncoding(task(model), ("triton", "copy_engine"))
    tile = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
    for settings in (
        CopyEngineSettings(mode="ring", weights=(2, 2, 1)),
        CopyEngineSettings(mode="tiled", weights=(1, 1), tile=tile),
    ):
        schedule = enc.task.schedule(settings)
        params = enc.params_of(schedule)
        assert params is not None and params["engine"] == "copy_engine"
        assert schedule_key(enc.build(params)) == schedule_key(schedule)
    assert enc.params_of(enc.task.schedule(CopyEngineSettings(mode="ring", weights=(5, 1)))) is None
    with pytest.raises(Infeasible, match="not offered"):
        enc.build({"engine": "copy_engine", "copy_engine.mode": "ring", "copy_engine.ring.weights": "9-1"})
    with pytest.raises(Infeasible, match="not searched here"):
        UnionEncoding(task(model), ("triton",)).build({"engine": "copy_engine", "copy_engine.mode": "ring"})


def test_one_study_samples_the_union(model):
    """TPE over the union: the engine is a choice, each engine's parameters exist under it only."""
    enc = UnionEncoding(task(model), ("triton", "copy_engine"))
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=3))
    built = []

    def objective(trial):
        try:
            schedule = enc.build(enc.suggest(trial))
        except Infeasible as exc:
            raise optuna.TrialPruned(str(exc)) from None
        built.append(schedule)
        return model.predict(schedule, 4096, 8192, 4096).total_ms

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=40)
    assert {s.engine for s in built} == {"triton", "copy_engine"}
    for t in study.trials:
        engine = t.params["engine"]
        assert all(key == "engine" or key.startswith(f"{engine}.") for key in t.params)
    assert all(isinstance(s.settings, (TritonSettings, CopyEngineSettings)) for s in built)


# ------------------------------------------------------------------------------------ confirmation
class FakeMeasurer:
    """Stands in for the GPU ranks: fixed timings per engine (no process, no GPU)."""

    def __init__(self, *, trial_ok=True, ce_ms=1.0, tri_ms=1.5, seq_ms=2.0, fb_ms=None, why=""):
        self.count, self.trial_ok, self.why = 0, trial_ok, why
        self.ce_ms, self.tri_ms, self.seq_ms, self.fb_ms = ce_ms, tri_ms, seq_ms, fb_ms
        self.confirmed: list = []

    def _t(self, ms):
        from fo_tune.ranks.timing import Timing

        return Timing(ms, 0.01, 10, 0.01)

    def unavailable(self, engine, task):
        return self.why if engine == "copy_engine" else ""

    def baseline(self, collective, shape, dtype):
        t = self._t(self.seq_ms)
        return dict(rel_err=0.0, has_nan=False, gemm=t, comm=t, sequential=t)

    def trial(self, schedule, shape):
        self.count += 1
        if not self.trial_ok:
            return dict(rel_err=1.0, has_nan=False, ok=False, timing=None)
        ms = self.ce_ms if schedule.engine == "copy_engine" else self.tri_ms
        return dict(rel_err=0.0, has_nan=False, ok=True, timing=self._t(ms))

    def confirm(self, schedules, shape):
        self.confirmed.append(list(schedules))
        ts = [self._t(self.ce_ms if s.engine == "copy_engine" else self.tri_ms) for s in schedules]
        fallback = self._t(self.fb_ms) if self.fb_ms is not None else None
        return dict(
            sequential=self._t(self.seq_ms), fallback=fallback, timings=ts, rel_err=[0.0] * len(schedules)
        )


class StepCounter:
    """A ``Reporter`` that counts each stage's steps against its total, and notes when the
    measurer confirmed (re-timed) relative to the steps."""

    def __init__(self, measurer: FakeMeasurer) -> None:
        self.totals: dict[str, int] = {}
        self.steps: dict[str, list[str]] = {}
        self.measurer = measurer

    def stage(self, name: str, total: int) -> None:
        self.totals[name] = total
        self.steps[name] = []

    def step(self, name: str, detail: str = "", *, log: bool = True) -> None:
        self.steps.setdefault(name, []).append(f"{detail} (after {len(self.measurer.confirmed)} re-timings)")


def test_measured_search_counts_its_re_timing_as_a_stage_of_its_own(h200):
    """Every stage's bar ends at its total: the re-timing of the best schedules had been one step
    more than the strategy's stage counted (``64x96x64 measure 4/3``), and its line said done
    before it ran."""
    from fo_tune.search import driver

    measurer = FakeMeasurer()
    shape = (4096, 8192, 4096)
    req = SearchRequest(shapes=(shape,), world_size=2, mode="measure", trials=3, space=space_for("9.0"))
    fp = h200.fingerprint
    engines = driver._engines(req, fp, req.space, measurer, SilentReporter())
    enc = driver._encoding(req, shape, req.space, fp, False, None, engines)
    rep = StepCounter(measurer)
    driver._search_shape(req, enc, fp, None, measurer, optuna.storages.InMemoryStorage(), None, None, rep)
    assert {name: len(steps) for name, steps in rep.steps.items()} == rep.totals, rep.steps
    (retime,) = [steps for name, steps in rep.steps.items() if name.endswith("re-time")]
    assert retime[0].startswith("re-timed the best") and retime[0].endswith("(after 1 re-timings)")


@pytest.mark.parametrize(
    ("measurer", "want"),
    [
        (FakeMeasurer(), "copy_engine"),  # the copy engine is fastest and gains
        (FakeMeasurer(trial_ok=False), "none"),  # no trial passed its check: overlap: false
        (FakeMeasurer(ce_ms=1.99, tri_ms=2.5), "none"),  # fastest, but inside the no-gain margin
        (FakeMeasurer(fb_ms=1.0), "none"),  # beats sequential, not the (graphed) fallback
        (FakeMeasurer(fb_ms=2.2), "copy_engine"),  # a fallback slower than sequential
        (FakeMeasurer(ce_ms=1.8, tri_ms=1.0), "triton"),
        (FakeMeasurer(why="cuda-bindings is not installed"), "triton"),  # left out, with why
    ],
)
def test_measured_search_confirms_every_engines_best(h200, measurer, want):
    from fo_tune.search import driver

    shape = (4096, 8192, 4096)
    req = SearchRequest(shapes=(shape,), world_size=2, mode="measure", trials=3, space=space_for("9.0"))
    fp = h200.fingerprint
    engines = driver._engines(req, fp, req.space, measurer, SilentReporter())
    enc = driver._encoding(req, shape, req.space, fp, False, None, engines)
    storage = optuna.storages.InMemoryStorage()
    r = driver._search_shape(req, enc, fp, None, measurer, storage, None, None, SilentReporter())
    if measurer.trial_ok:
        confirmed = [s.engine for s in measurer.confirmed[0]]
        assert set(confirmed) == ({"triton"} if measurer.why else {"triton", "copy_engine"})
    if measurer.fb_ms is not None:  # decided against the fallback, both timings kept
        assert r.row.provenance["fallback_ms"] == pytest.approx(measurer.fb_ms)
        assert r.row.provenance["sequential_ms"] == pytest.approx(measurer.seq_ms)
        assert "the overlap: false fallback" in r.row.provenance["decision"]
    if want == "none":
        assert not r.row.overlap
        if measurer.trial_ok:
            assert "rejected_measured_ms" in r.row.provenance
        return
    assert r.row.overlap and r.row.engine == want
    assert r.row.provenance["measured_ms"] == pytest.approx(
        measurer.ce_ms if want == "copy_engine" else measurer.tri_ms
    )
    assert "trial" in r.row.provenance and not math.isnan(r.best_ms)
