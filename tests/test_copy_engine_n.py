"""The copy engine at N peers measured on one GPU (``fo-tune calibrate --only copy_engine_n``), on
the CPU: the calibration's host points, their merge into a TP=2 calibration, the stage's shapes and
options, and how the copy engine's model reads them (host growth with N, measured chunk GEMMs)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from cli_checks import assert_one_line_error, isolate_tables, tp2_only
from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
from fo_kernels.schedule import Problem, Schedule
from fo_tune.calibrate.calibration import (
    Calibration,
    CalibrationError,
    EngineCalibration,
    HostPoint,
    LibraryGemmPoint,
    MoeHost,
    Quantity,
    load_calibration,
)
from fo_tune.calibrate.run import (
    DEFAULT_PARTS,
    ONE_GPU_PARTS,
    PARTS,
    CalibrationRequest,
    CalibrationRequestError,
    merge_into,
)
from fo_tune.cli.calibrate import PART_NAMES
from fo_tune.cli.common import fmt
from fo_tune.engines.copy_engine import calibrate_n as cn
from fo_tune.engines.copy_engine.model import CopyEngineTerm, chunk_rows

# The CPU stage's GEMMs: 2 layers (cn.CPU_TP_LAYERS) x (the whole GEMM + 3 chunk counts
# (cn.LAYER_CHUNKS) x beta 0 and 1).
CPU_LAYER_GEMMS = 2 * (1 + 3 * 2)


def _host(world: int, graph_ms: float, eager_ms: float, collective: str = "all_reduce") -> HostPoint:
    return HostPoint(
        world=world, collective=collective, chunks=2, ops=50.0, eager_ms=eager_ms, graph_ms=graph_ms
    )


def test_host_points_round_trip_and_older_sections_load():
    section = EngineCalibration(
        params={"flag_ms": Quantity(value=0.01, source="probe")},
        host=[_host(2, 0.01, 0.4), _host(8, 0.05, 2.0)],
    )
    data = section.to_dict()
    assert EngineCalibration.from_dict(data, "copy_engine") == section
    older = {k: v for k, v in data.items() if k != "host"}
    assert EngineCalibration.from_dict(older, "copy_engine").host == []
    bad = {**data, "host": [{**data["host"][0], "world": "8"}]}
    with pytest.raises(CalibrationError, match=r"copy_engine.host\[0\].world: expected int"):
        EngineCalibration.from_dict(bad, "copy_engine")


def test_the_packaged_calibration_holds_the_host_term_at_every_n(h200: Calibration):
    """The packaged calibration's copy-engine section has a host point for every world size 2..8
    and collective (what the model reads at N peers), each naming the GPU that measured it."""
    host = h200.copy_engine.host
    assert {(h.world, h.collective) for h in host} == {
        (world, collective)
        for world in range(2, 9)
        for collective in ("all_reduce", "reduce_scatter", "all_gather")
    }
    assert all(h.measured_on for h in host), [h for h in host if not h.measured_on]


def test_merge_points_adds_to_the_tp2_section(h200: Calibration):
    """The TP=2 parameters and points stay; the new points join them (the same shape, or world
    size and collective, replaced); merge_into does it for --only copy_engine_n."""
    old = tp2_only(h200).copy_engine
    first = old.library_gemm[0]
    new = EngineCalibration(
        library_gemm=[
            dataclasses.replace(first, paced_ms=first.paced_ms * 2),
            LibraryGemmPoint(m=1024, n=8192, k=3584, beta=1, paced_ms=0.1, sustained_ms=0.12),
        ],
        host=[_host(2, 0.01, 0.4), _host(8, 0.05, 2.0)],
    )
    merged = cn.merge_points(old, new)
    assert merged.params == old.params and merged.copies == old.copies
    assert len(merged.library_gemm) == len(old.library_gemm) + 1
    got = {(p.m, p.n, p.k, p.beta): p for p in merged.library_gemm}
    assert got[(first.m, first.n, first.k, first.beta)].paced_ms == first.paced_ms * 2
    assert merged.host == new.host
    again = cn.merge_points(merged, EngineCalibration(host=[_host(8, 0.07, 2.5)]))
    assert [p.graph_ms for p in again.host] == [0.01, 0.07]
    measured = dataclasses.replace(h200, copy_engine=new, gemm=[], bandwidth=[])
    target = dataclasses.replace(h200, copy_engine=dataclasses.replace(old))
    done = merge_into(target, measured, ("copy_engine_n",))
    assert done.gemm == h200.gemm and done.bandwidth == h200.bandwidth
    assert done.copy_engine.host == new.host and len(done.copy_engine.library_gemm) == len(
        merged.library_gemm
    )


def test_the_stage_is_asked_for_by_name():
    """copy_engine_n is a part (the CLI's names match the library's), measured only when named."""
    assert PART_NAMES == PARTS and "copy_engine_n" in PARTS and "copy_engine_n" not in DEFAULT_PARTS
    assert CalibrationRequest(world_size=2).selected() == DEFAULT_PARTS
    assert CalibrationRequest(world_size=1, parts=("copy_engine_n",)).selected() == ("copy_engine_n",)
    # the MoE host times: the host's, measured whatever the world size unless --only leaves them out
    assert "moe_host" in DEFAULT_PARTS and CalibrationRequest(world_size=1).selected() == ONE_GPU_PARTS
    assert ONE_GPU_PARTS == ("gemm", "copy_engine", "moe_host")


def test_layer_shapes_are_the_engines_chunks_beside_the_whole_gemm():
    """Every TP=4/8 layer: its whole GEMM and, for each chunk count, the chunk GEMM of the rows the
    runtime cuts (beta 0 and 1): the model finds them by exact shape."""
    shapes = set(cn.layer_gemm_shapes(cpu=False))
    assert {w for *_, w in cn.TP_LAYERS} == {4, 8}
    for m, n, k, world in cn.TP_LAYERS:
        assert m % world == 0 and (m, n, k, 0) in shapes
        for chunks in cn.LAYER_CHUNKS:
            rows = chunk_rows(m // world, (1,) * chunks)
            assert len(set(rows)) == 1, (m, world, chunks)  # equal chunks: one GEMM shape
            assert {(rows[0], n, k, 0), (rows[0], n, k, 1)} <= shapes
    assert len(cn.layer_gemm_shapes(cpu=True)) < len(shapes)


def test_the_stage_on_the_cpu_measures_the_chunk_gemms_and_says_why_not_the_host(tmp_path, monkeypatch):
    """On gloo (no GPU) the stage measures the CPU layers' GEMMs and leaves the host times out
    (they need virtual ranks on a GPU); the file loads. moe_host beside it (the other one-GPU part
    --into merges) writes its record: the CPU's tiny experts, shown in the summary."""
    isolate_tables(monkeypatch, tmp_path)
    out = tmp_path / "cal"
    only = "copy_engine_n,moe_host"
    result = CliRunner().invoke(
        app, ["calibrate", "--backend", "gloo", "--world-size", "1", "--only", only, "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    host = load_calibration(out).moe_host
    assert host is not None and host.shapes == "cpu EP 1 at 8 tokens" and host.reps == 3
    assert f"a call {fmt(host.call_ms)} ms (medians over 1 shape, 3 calls each)" in result.stdout
    # the summary says why no collective was measured, and shows no table of a part not measured
    assert "bandwidth: not measured (world size 1 has no collective)" in result.stdout, result.stdout
    assert "interference: not measured (world size 1 has no collective)" in result.stdout, result.stdout
    assert "sms_free > 0" not in result.stdout and "GEMM: best tile" not in result.stdout, result.stdout
    section = load_calibration(out / "calibration.yaml").copy_engine
    # what the model looks up for the CPU layers (its own chunk cut, not the stage's list): each
    # whole GEMM and, per chunk count, the chunk GEMM at beta 0 and 1
    want = set()
    for m, n, k, world in cn.CPU_TP_LAYERS:
        want.add((m, n, k, 0))
        for chunks in cn.LAYER_CHUNKS:
            rows = chunk_rows(m // world, (1,) * chunks)[0]
            want |= {(rows, n, k, 0), (rows, n, k, 1)}
    assert len(want) == CPU_LAYER_GEMMS, want
    assert {(p.m, p.n, p.k, p.beta) for p in section.library_gemm} == want
    assert section.host == [] and not section.params


def _schedule(world: int, collective: str = "all_reduce", weights=(1, 1)) -> Schedule:
    return Schedule(
        collective=collective,
        dtype="bfloat16",
        world_size=world,
        problem=Problem(m=8192, n=8192, k=3584),
        settings=CopyEngineSettings(mode="ring", weights=weights),
    )


def test_the_host_term_grows_as_measured(model, h200: Calibration):
    """With host points the term adds their growth from N = 2 (interpolated between measured N,
    extended past them); without them, or at N = 2, it is the TP=2 constants'."""
    params = h200.copy_engine.values()
    old = CopyEngineTerm(model, params)
    host = [_host(2, 0.010, 0.40), _host(4, 0.020, 0.80), _host(8, 0.060, 2.40)]
    new = CopyEngineTerm(model, params, host)
    graph, per_op = params["host_graph_call_ms"], params["host_eager_op_ms"]
    for world in (2, 3, 4, 8):
        assert old.host_ms(_schedule(world), 2, graphed=True) == graph
    assert new.host_ms(_schedule(2), 2, graphed=True) == pytest.approx(graph)
    assert new.host_ms(_schedule(4), 2, graphed=True) == pytest.approx(graph + 0.010)
    assert new.host_ms(_schedule(6), 2, graphed=True) == pytest.approx(graph + 0.030)
    assert new.host_ms(_schedule(16), 2, graphed=True) == pytest.approx(graph + 0.130)
    ops = 123
    assert new.host_ms(_schedule(8), 2, graphed=False, ops=ops) == pytest.approx((per_op + 0.040) * ops)
    assert old.host_ms(_schedule(8), 2, graphed=False, ops=ops) == pytest.approx(per_op * ops)
    other = _schedule(8, "reduce_scatter")  # no points for this collective: the constants
    assert new.host_ms(other, 2, graphed=True) == graph
    only = CopyEngineTerm(model, params, [_host(8, 0.06, 2.4)])  # no base at N = 2: the constants
    assert only.host_ms(_schedule(8), 2, graphed=True) == graph
    # a time the calibration could not measure (NaN: the host waited for the GPU) is left out:
    # the term follows the points that were measured
    unmeasured = [*host[:2], _host(8, math.nan, math.nan)]
    holes = CopyEngineTerm(model, params, unmeasured)
    assert holes.host_ms(_schedule(4), 2, graphed=True) == pytest.approx(graph + 0.010)
    assert holes.host_ms(_schedule(8), 2, graphed=True) == pytest.approx(graph + 0.030)
    assert holes.host_ms(_schedule(8), 2, graphed=False, ops=ops) == pytest.approx((per_op + 0.024) * ops)


def test_measured_chunk_gemms_replace_the_wave_model_above_two_peers(model, h200: Calibration):
    """A chunk GEMM measured at its exact shape (copy_engine_n's layers) decides the prediction at
    N > 2; at N = 2 the wave model stays (the free parameters were fitted with it)."""
    term = CopyEngineTerm(model, h200.copy_engine.values())
    m, n, k = 8192, 8192, 3584
    before = {w: term.predict(_schedule(w), m, n, k).gemm_alone_ms for w in (2, 4)}
    lib = model.library
    saved = dict(lib.points)
    try:
        for world in (2, 4):
            rows = chunk_rows(m // world, (1, 1))[0]
            for beta in (0, 1):
                slow = lib.paced_ms(rows, n, k, beta=beta) * 3
                lib.points[(rows, n, k, beta)] = type(next(iter(saved.values())))(slow, slow)
        after = {w: term.predict(_schedule(w), m, n, k).gemm_alone_ms for w in (2, 4)}
    finally:
        lib.points.clear()
        lib.points.update(saved)
    assert after[2] == pytest.approx(before[2])
    assert after[4] > 2 * before[4]


def test_replays_not_measured_leave_the_graph_term_to_the_constants(model, h200: Calibration):
    """The replays run in a task of their own; where it failed their points are NaN: the replayed
    host term keeps the constants, the eager one still grows; such points survive the file."""
    eager = [{"world": w, "collective": "all_reduce", "ops": 50.0, "eager_ms": 0.4 * w / 2} for w in (2, 8)]
    points = cn.host_points(eager, [])
    assert all(math.isnan(p.graph_ms) for p in points)
    back = EngineCalibration.from_dict(EngineCalibration(host=points).to_dict(), "copy_engine").host
    assert [p.eager_ms for p in back] == [p.eager_ms for p in points] and math.isnan(back[0].graph_ms)
    params = h200.copy_engine.values()
    term = CopyEngineTerm(model, params, points)
    assert term.host_ms(_schedule(8), 2, graphed=True) == params["host_graph_call_ms"]
    grown = (params["host_eager_op_ms"] + (1.6 - 0.4) / 50) * 10
    assert term.host_ms(_schedule(8), 2, graphed=False, ops=10) == pytest.approx(grown)
    both = cn.host_points(eager, [{"world": 8, "collective": "all_reduce", "graph_ms": 0.05}])
    assert [p.graph_ms for p in both][1] == 0.05 and math.isnan(both[0].graph_ms)


def test_recalibrating_the_tp2_section_keeps_the_n_peer_points(h200: Calibration):
    """``--only copy_engine --into`` after ``copy_engine_n``: the TP=2 measurements are replaced,
    the TP=4/8 chunk GEMMs and the host points stay."""
    from fo_tune.engines.copy_engine.calibrate import merge_section

    extra = LibraryGemmPoint(m=1024, n=8192, k=3584, beta=1, paced_ms=0.1, sustained_ms=0.12)
    with_n = cn.merge_points(
        h200.copy_engine, EngineCalibration(library_gemm=[extra], host=[_host(2, 0.01, 0.4)])
    )
    first = h200.copy_engine.library_gemm[0]
    remeasured = EngineCalibration(
        params={"library_wave_ms": Quantity(value=0.5, source="new")},
        library_gemm=[dataclasses.replace(first, paced_ms=9.0)],
    )
    merged = merge_section(with_n, remeasured)
    got = {(p.m, p.n, p.k, p.beta): p for p in merged.library_gemm}
    assert got[(first.m, first.n, first.k, first.beta)].paced_ms == 9.0 and extra in merged.library_gemm
    assert merged.host == with_n.host and merged.params["library_wave_ms"].source == "new"


# ----------------------------------------------------------------- a sibling GPU (--into-sibling)
H100_NAME = "NVIDIA H100 80GB HBM3"


def _sibling_of(cal: Calibration, gpu_name: str = H100_NAME, sm_count: int | None = None) -> Calibration:
    """A one-GPU ``copy_engine_n`` measurement of another GPU model (the same die unless
    ``sm_count`` says otherwise): two chunk GEMMs and two host points."""
    from fo_kernels.fingerprint import make_device_key

    fp = cal.fingerprint
    sms = fp.sm_count if sm_count is None else sm_count
    key = make_device_key(gpu_name, fp.compute_capability, sms, 1, "single")
    other = dataclasses.replace(
        fp, gpu_name=gpu_name, sm_count=sms, world_size=1, interconnect="single", device_key=key
    )
    section = EngineCalibration(
        params={"host_growth_test": Quantity(value=1.5, source="`fo-tune calibrate` on " + key)},
        library_gemm=[LibraryGemmPoint(m=1024, n=8192, k=3584, beta=1, paced_ms=0.1, sustained_ms=0.12)],
        host=[_host(2, 0.01, 0.4), _host(8, 0.05, 2.0)],
    )
    return Calibration(
        fingerprint=other,
        world_size=1,
        dtype=cal.dtype,
        space=cal.space,
        quick=False,
        created="now",
        copy_engine=section,
    )


def _copy(cal: Calibration) -> Calibration:
    return dataclasses.replace(cal, copy_engine=dataclasses.replace(cal.copy_engine))


def test_into_sibling_merges_and_records_where_points_were_measured(h200: Calibration, tmp_path):
    """An H100's copy_engine_n into the H200 calibration: merged with sibling=True, each new point
    carrying the H100's device key (the H200's own points none), the parameters' sources naming it;
    measured_on survives the file and is written only where set."""
    from fo_tune.calibrate.calibration import save_calibration

    h200 = tp2_only(h200)
    measured = _sibling_of(h200)
    key = measured.fingerprint.device_key
    done = merge_into(_copy(h200), measured, ("copy_engine_n",), sibling=True)
    section = done.copy_engine
    assert done.fingerprint == h200.fingerprint and done.gemm == h200.gemm
    assert [p.measured_on for p in section.host] == [key, key]
    new = [p for p in section.library_gemm if p.measured_on]
    assert [(p.m, p.n, p.k, p.beta, p.measured_on) for p in new] == [(1024, 8192, 3584, 1, key)]
    assert len(section.library_gemm) == len(h200.copy_engine.library_gemm) + 1
    assert key in section.params["host_growth_test"].source
    assert section.params["flag_ms"] == h200.copy_engine.params["flag_ms"]
    path = tmp_path / "calibration.yaml"
    save_calibration(done, path)
    back = load_calibration(path).copy_engine
    assert back.host == section.host and back.library_gemm == section.library_gemm
    text = path.read_text()
    assert text.count("measured_on:") == len(section.host) + len(new)


def test_a_sibling_is_refused_without_the_flag(h200: Calibration):
    """Without --into-sibling another GPU name is refused as before; for copy_engine_n of the same
    die the message names the flag, for other parts it does not."""
    measured = _sibling_of(h200)
    with pytest.raises(CalibrationRequestError, match=r"gpu_name differs.*--into-sibling"):
        merge_into(_copy(h200), measured, ("copy_engine_n",))
    with pytest.raises(CalibrationRequestError, match="gpu_name differs") as info:
        merge_into(_copy(h200), measured, ("copy_engine",))
    assert "--into-sibling" not in str(info.value)


def test_the_flag_refuses_another_die_and_other_parts(h200: Calibration):
    """--into-sibling needs the same compute capability and SM count, and merges copy_engine_n
    and moe_host only."""
    fewer = _sibling_of(h200, "NVIDIA H100 PCIe", sm_count=114)
    with pytest.raises(CalibrationRequestError, match=r"--into-sibling: .*\(sm_count differs\)"):
        merge_into(_copy(h200), fewer, ("copy_engine_n",), sibling=True)
    with pytest.raises(CalibrationRequestError, match="--into-sibling merges --only copy_engine_n alone"):
        merge_into(_copy(h200), _sibling_of(h200), ("copy_engine",), sibling=True)


def test_the_flag_merges_a_sibling_moe_host_record(h200: Calibration):
    """A sibling's MoE host times, alone or beside copy_engine_n: refused without the flag (naming
    it), merged with it recording the sibling's device key, which the MoE model's basis names."""
    from fo_tune.engines import moe_cost_model

    record = MoeHost(phase1_ms=0.2, phase2_ms=0.1, call_ms=0.9, shapes="x", reps=3)
    measured = dataclasses.replace(_sibling_of(h200), moe_host=record)
    key = measured.fingerprint.device_key
    with pytest.raises(CalibrationRequestError, match=r"gpu_name differs.*--into-sibling"):
        merge_into(_copy(h200), measured, ("moe_host",))
    done = merge_into(_copy(h200), measured, ("moe_host",), sibling=True)
    assert done.moe_host == dataclasses.replace(record, measured_on=key)
    assert done.copy_engine == h200.copy_engine and done.gemm == h200.gemm
    assert moe_cost_model(done).basis.endswith(f"MoE host times measured on {key}")
    both = merge_into(_copy(h200), measured, ("copy_engine_n", "moe_host"), sibling=True)
    assert both.moe_host.measured_on == key and "host_growth_test" in both.copy_engine.params


def test_the_flag_merges_a_sibling_gemm_profile_of_another_dtype(h200: Calibration):
    """--into-sibling also takes a sibling's GEMM profile in another dtype than the calibration's
    (fp8): kept beside its own, each point recording where; a profile in its own dtype is refused."""
    measured = dataclasses.replace(
        _sibling_of(h200), dtype="float8_e4m3fn", gemm=h200.gemm[:2], copy_engine=None
    )
    with pytest.raises(CalibrationRequestError, match=r"gpu_name differs.*--into-sibling"):
        merge_into(dataclasses.replace(h200, gemm_dtypes={}), measured, ("gemm",))
    done = merge_into(dataclasses.replace(h200, gemm_dtypes={}), measured, ("gemm",), sibling=True)
    assert done.gemm == h200.gemm
    assert {p.measured_on for p in done.gemm_dtypes["float8_e4m3fn"]} == {measured.fingerprint.device_key}
    with pytest.raises(CalibrationRequestError, match="or --only gemm in another dtype"):
        merge_into(_copy(h200), _sibling_of(h200), ("gemm",), sibling=True)


@pytest.fixture
def shipped(tmp_path) -> Path:
    """A copy of the packaged H200 TP=2 calibration, without its N-peer copy-engine points."""
    from cli_checks import H200_KEY
    from fo_tune.calibrate.calibration import load_calibration, save_calibration
    from fo_tune.calibrate.find import packaged_calibration

    target = tmp_path / "calibration.yaml"
    save_calibration(tp2_only(load_calibration(packaged_calibration(H200_KEY, 2))), target)
    return target


def _calibrate(*args: str):
    return CliRunner().invoke(app, ["calibrate", "--backend", "gloo", "--world-size", "1", *args])


def _as_if_on(monkeypatch, measured: Calibration) -> list:
    """This machine's fingerprint and its measurement replaced by ``measured``'s; returns the list
    the measurement requests are appended to (a refusal leaves it empty)."""
    import fo_kernels.fingerprint
    import fo_tune.calibrate.run as run

    asked: list = []

    def measure(request, reporter=None):
        asked.append(request)
        return measured

    monkeypatch.setattr(fo_kernels.fingerprint, "current_fingerprint", lambda *a, **k: measured.fingerprint)
    monkeypatch.setattr(run, "run_calibration", measure)
    return asked


def test_cli_into_sibling_merges_a_sibling_measurement(h200: Calibration, shipped, tmp_path, monkeypatch):
    """The command on (a stand-in for) an H100: refused without the flag, naming it, the file
    untouched; merged with it, the file's new points carrying the H100's device key."""
    isolate_tables(monkeypatch, tmp_path / "env")
    measured = _sibling_of(h200)
    asked = _as_if_on(monkeypatch, measured)
    before = shipped.read_bytes()
    line = assert_one_line_error(_calibrate("--only", "copy_engine_n", "--into", str(shipped)))
    assert "gpu_name differs" in line and "--into-sibling" in line
    assert asked == [] and shipped.read_bytes() == before
    result = _calibrate("--only", "copy_engine_n", "--into", str(shipped), "--into-sibling")
    assert result.exit_code == 0, result.output
    assert len(asked) == 1
    section = load_calibration(shipped).copy_engine
    key = measured.fingerprint.device_key
    assert [p.measured_on for p in section.host] == [key, key]
    assert sum(p.measured_on == key for p in section.library_gemm) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--only", "copy_engine_n", "--into-sibling"], "--into-sibling merges into an existing"),
        (["--only", "copy_engine", "--into", "{cal}", "--into-sibling"], "--only copy_engine_n alone"),
        (["--into", "{cal}", "--into-sibling"], "--only copy_engine_n alone"),
        (["--only", "copy_engine_n", "--into", "{cal}", "--into-sibling"], "(sm_count differs)"),
    ],
)
def test_cli_into_sibling_misuse(h200: Calibration, shipped, tmp_path, monkeypatch, args, needle):
    """Without --into, with other parts, or on another die: exit 2, one line, nothing measured."""
    isolate_tables(monkeypatch, tmp_path / "env")
    asked = _as_if_on(monkeypatch, _sibling_of(h200, "NVIDIA H100 PCIe", sm_count=114))
    before = shipped.read_bytes()
    line = assert_one_line_error(_calibrate(*[a.format(cal=shipped) for a in args]))
    assert needle in line, line
    assert asked == [] and shipped.read_bytes() == before


def test_cli_into_sibling_on_this_cpu_is_another_die(shipped, tmp_path, monkeypatch):
    """Unpatched: this CPU's fingerprint is not the H200's die, so the flag is refused up front."""
    isolate_tables(monkeypatch, tmp_path / "env")
    line = assert_one_line_error(
        _calibrate("--only", "copy_engine_n", "--into", str(shipped), "--into-sibling")
    )
    assert line.startswith("error: --into-sibling: the calibration is for nvidia-h200"), line
    assert "(compute_capability differs)" in line
