"""``fo-tune bench``: end to end on gloo ranks, the rank task in process, the files, bad input."""

from __future__ import annotations

import csv
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from typer.testing import CliRunner

from cli import app
from cli_checks import assert_one_line_error, isolate_tables
from fo_kernels.fingerprint import current_fingerprint
from fo_kernels.table import MISS_SOURCE
from fo_tune import bench
from fo_tune.bench import (
    BENCH_FILES,
    STATUSES,
    BenchCaseTask,
    BenchRequest,
    BenchResult,
    SuiteError,
    case_rows,
    check_bench_out,
    load_suite,
    packaged_suite,
    write_bench_dir,
)
from fo_tune.bench import output as bench_output
from fo_tune.bench.rows import merge
from fo_tune.cli.bench import _request
from fo_tune.cli.common import COLLECTIVE_NAMES
from fo_tune.launch import RankContext
from fo_tune.measure import GEMM_TOL
from fo_tune.report import OutputError

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
HEADER = [
    "device_key",
    "world_size",
    "dtype",
    "m",
    "n",
    "k",
    "collective",
    "variant",
    "detail",
    "status",
    "rel_err",
    "median_ms",
    "spread_ms",
    "speedup_vs_sequential",
    "fraction_of_ideal",
    "schedule_source",
]
ORDER = [
    "gemm",
    "collective",
    "sequential",
    "chunked",
    "chunked_c2",
    "chunked_c4",
    "chunked_c8",
    "async_tp",
    "fo_tune",
    "ideal",
]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path)


def run_bench_cli(*args: str):
    return CliRunner().invoke(app, ["bench", "--backend", "gloo", *args])


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    """One ``bench --world-size 2`` run on gloo: 64x96x64 (both collectives) and 63x96x64
    (reduce_scatter impossible on 2 ranks: SKIP rows)."""
    root = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        isolate_tables(mp, root)
        out = root / "out"
        result = run_bench_cli(
            "--world-size",
            "2",
            "--shape",
            "64x96x64",
            "--shape",
            "63x96x64",
            "--reps",
            "2",
            "--out",
            str(out),
        )
    return result, out


def _case(rows: list[dict[str, str]], collective: str, shape: str) -> dict[str, dict[str, str]]:
    m, n, k = shape.split("x")
    picked = [r for r in rows if r["collective"] == collective and (r["m"], r["n"], r["k"]) == (m, n, k)]
    assert [r["variant"] for r in picked] == ORDER, [r["variant"] for r in picked]
    return {r["variant"]: r for r in picked}


# ------------------------------------------------------------------------------------ end to end
def test_bench_writes_every_file(gloo_run):
    result, out = gloo_run
    assert result.exit_code == 0, (result.output, result.exception)
    assert sorted(p.name for p in out.iterdir()) == sorted(BENCH_FILES)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for word in ("all_reduce (ms)", "reduce_scatter (ms)", "seq", "chunked", "async-TP", "fo-tune", "ideal"):
        assert word in result.stdout, word
    assert "skipped" in result.stdout and "unavailable" in result.stdout and "wrote 3 files" in result.stdout


def test_bench_csv_variants_and_statuses(gloo_run):
    _, out = gloo_run
    header, rows = read_csv(out / "bench.csv")
    assert header == HEADER
    assert {r["device_key"] for r in rows} == {current_fingerprint("cpu", 2).device_key}
    assert {(r["world_size"], r["dtype"]) for r in rows} == {("2", "float32")}
    assert {r["status"] for r in rows} == set(STATUSES) - {"FAIL"}  # FAIL: see the tests below
    assert len(rows) == 4 * len(ORDER)  # 2 shapes x 2 collectives (one of them all SKIP rows)
    for collective in COLLECTIVE_NAMES:
        case = _case(rows, collective, "64x96x64")
        measured = [v for v in ORDER if v not in ("async_tp", "ideal", "chunked")]
        for variant in measured:
            row = case[variant]
            assert row["status"] == "PASS", row
            assert float(row["rel_err"]) < 1e-4 and float(row["median_ms"]) > 0, row
        assert case["ideal"]["status"] == "PASS" and case["chunked"]["status"] == "PASS"
        assert "no second stream" in case["chunked_c4"]["detail"]
        assert case["fo_tune"]["schedule_source"] == MISS_SOURCE
        assert case["fo_tune"]["detail"].endswith("64x96x64: no overlap (GEMM then collective)")
    async_ar = _case(rows, "all_reduce", "64x96x64")["async_tp"]
    assert async_ar["status"] == "SKIP" and "reduce_scatter only" in async_ar["detail"]
    async_rs = _case(rows, "reduce_scatter", "64x96x64")["async_tp"]
    assert async_rs["status"] == "UNAVAILABLE" and "gloo" in async_rs["detail"], async_rs
    assert math.isnan(float(async_rs["median_ms"]))
    assert _case(rows, "all_reduce", "63x96x64")["fo_tune"]["status"] == "PASS"


def test_bench_skips_reduce_scatter_when_m_is_not_divisible(gloo_run):
    _, out = gloo_run
    with (out / "bench.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    skipped = [r for r in rows if r["collective"] == "reduce_scatter" and r["m"] == "63"]
    assert [r["variant"] for r in skipped] == ORDER
    assert {r["status"] for r in skipped} == {"SKIP"}
    assert all("not divisible by the world size 2" in r["detail"] for r in skipped)


def test_bench_speedup_arithmetic(gloo_run):
    _, out = gloo_run
    _, rows = read_csv(out / "bench.csv")
    for collective, shape in (
        ("all_reduce", "64x96x64"),
        ("reduce_scatter", "64x96x64"),
        ("all_reduce", "63x96x64"),
    ):
        case = _case(rows, collective, shape)
        ms = {v: float(r["median_ms"]) for v, r in case.items()}
        assert math.isclose(ms["ideal"], max(ms["gemm"], ms["collective"]), rel_tol=1e-5)
        assert math.isclose(ms["chunked"], min(ms[f"chunked_c{c}"] for c in (2, 4, 8)), rel_tol=1e-5)
        for variant, row in case.items():
            if row["status"] != "PASS":
                assert math.isnan(float(row["speedup_vs_sequential"])), row
                continue
            assert math.isclose(
                float(row["speedup_vs_sequential"]), ms["sequential"] / ms[variant], rel_tol=1e-4
            ), variant
            assert math.isclose(float(row["fraction_of_ideal"]), ms["ideal"] / ms[variant], rel_tol=1e-4)
        assert float(case["sequential"]["speedup_vs_sequential"]) == 1.0
        assert float(case["ideal"]["fraction_of_ideal"]) == 1.0


def test_bench_yaml(gloo_run):
    _, out = gloo_run
    data = yaml.safe_load((out / "bench.yaml").read_text())
    assert data["schema_version"] == 1 and data["kind"] == "fo-tune-bench"
    assert data["fingerprint"] == current_fingerprint("cpu", 2).to_dict()
    assert data["backend"] == "gloo" and data["wall_s"] > 0
    settings = data["settings"]
    assert settings["shapes"] == [[64, 96, 64], [63, 96, 64]]
    assert settings["collectives"] == list(COLLECTIVE_NAMES)
    assert (settings["world_size"], settings["dtype"], settings["reps"]) == (2, "float32", 2)
    assert settings["chunks"] == [2, 4, 8]
    assert settings["sample_ms"] == 4.0  # fo_tune.timing.MIN_SAMPLE_MS on the CPU (16 on GPUs)
    _, rows = read_csv(out / "bench.csv")
    assert len(data["rows"]) == len(rows)
    assert [r["variant"] for r in data["rows"]] == [r["variant"] for r in rows]
    assert set(data["rows"][0]) == set(HEADER)


# --------------------------------------------------------------------------------- the rank task
@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group in this process (the task's collectives need one)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield RankContext(0, 1, torch.device("cpu"), "gloo")
    finally:
        dist.destroy_process_group()


def test_case_task_checks_before_timing(one_rank, monkeypatch):
    task = BenchCaseTask("reduce_scatter", 16, 24, 8, "float32", chunks=(2, 32), warmup=0, reps=1)
    entries = {e["variant"]: e for e in task.run(one_rank)}
    assert entries["chunked_c32"]["status"] == "SKIP" and "fewer than 32" in entries["chunked_c32"]["detail"]
    for name in ("gemm", "collective", "sequential", "chunked_c2", "fo_tune"):
        assert entries[name]["status"] == "PASS" and entries[name]["timing"].median_ms > 0, name
    monkeypatch.setitem(GEMM_TOL, "float32", 0.0)  # nothing can pass: every variant FAILs untimed
    entries = {e["variant"]: e for e in task.run(one_rank)}
    for name in ("gemm", "collective", "sequential", "chunked_c2", "fo_tune"):
        e = entries[name]
        assert e["status"] == "FAIL" and e["timing"] is None and "relative error" in e["detail"], e
    assert entries["async_tp"]["status"] == "UNAVAILABLE"  # an exception, not a wrong result


def test_fo_tune_is_checked_again_after_timing(one_rank, monkeypatch):
    """A call right the first time whose later calls write nothing (a replay gone wrong) hands back
    its previous, poisoned, output block: it FAILs after timing and keeps no time."""
    import fo_kernels

    held: list[torch.Tensor] = []

    def stale(a, b, schedule=None, group=None):
        if not held:
            held.append(a @ b)
        return held[0]  # the same block every call, written only by the first

    monkeypatch.setattr(fo_kernels, "gemm_all_reduce", stale)
    task = BenchCaseTask("all_reduce", 16, 24, 8, "float32", chunks=(2,), warmup=0, reps=1)
    entries = {e["variant"]: e for e in task.run(one_rank)}
    e = entries["fo_tune"]
    assert e["status"] == "FAIL" and e["timing"] is None, e
    assert e["detail"].endswith("NaN in the output after timing"), e["detail"]
    assert entries["sequential"]["status"] == "PASS"
    held.clear()
    monkeypatch.setattr(fo_kernels, "gemm_all_reduce", lambda a, b, schedule=None, group=None: a @ b)
    assert {e["variant"]: e for e in task.run(one_rank)}["fo_tune"]["status"] == "PASS"


# ------------------------------------------------------------------------------- rows and files
def _merged(variant: str, status: str, ms: float, detail: str = "") -> dict:
    err = 0.0 if status == "PASS" else math.nan
    return dict(variant=variant, status=status, detail=detail, rel_err=err, median_ms=ms, spread_ms=0.0,
                schedule_source=MISS_SOURCE if variant == "fo_tune" else "")  # fmt: skip


HEAD = dict(device_key="k", world_size=2, dtype="float32", m=8, n=8, k=8, collective="all_reduce")


def test_case_rows_derive_best_chunk_ideal_and_ratios():
    nan = math.nan
    merged = [
        _merged("gemm", "PASS", 3.0),
        _merged("collective", "PASS", 2.0),
        _merged("sequential", "PASS", 6.0),
        _merged("chunked_c2", "PASS", 5.0, "chunks=2"),
        _merged("chunked_c4", "PASS", 4.0, "chunks=4"),
        _merged("chunked_c8", "FAIL", nan, "chunks=8: relative error 1e+00 >= 0.0001"),
        _merged("async_tp", "UNAVAILABLE", nan, "no symmetric memory"),
        _merged("fo_tune", "PASS", 4.0, "schedule"),
    ]
    rows = {r.variant: r for r in case_rows(HEAD, merged)}
    assert list(rows) == ORDER
    assert rows["chunked"].median_ms == 4.0 and rows["chunked"].detail == "chunks=4 (best of 2,4)"
    assert rows["ideal"].median_ms == 3.0 and rows["ideal"].status == "PASS"
    assert rows["fo_tune"].speedup_vs_sequential == 1.5 and rows["fo_tune"].fraction_of_ideal == 0.75
    assert rows["sequential"].speedup_vs_sequential == 1.0 and rows["gemm"].fraction_of_ideal == 1.0
    for name in ("chunked_c8", "async_tp"):
        assert math.isnan(rows[name].speedup_vs_sequential) and math.isnan(rows[name].median_ms)
    merged[1] = _merged("collective", "FAIL", nan, "NaN in the output")
    rows = {r.variant: r for r in case_rows(HEAD, merged)}
    assert rows["ideal"].status == "SKIP" and math.isnan(rows["fo_tune"].fraction_of_ideal)


def _result(status: str = "PASS") -> BenchResult:
    ms = 1.0 if status == "PASS" else math.nan
    merged = [_merged(v, "PASS", 1.0) for v in ("gemm", "collective", "sequential", "chunked_c2")]
    merged += [_merged("async_tp", "SKIP", math.nan), _merged("fo_tune", status, ms, "schedule")]
    settings = dict(shapes=[[8, 8, 8]], dtype="float32")
    return BenchResult(
        fingerprint=current_fingerprint("cpu", 2),
        backend="gloo",
        settings=settings,
        rows=case_rows(HEAD, merged),
    )


def test_a_failed_variant_is_exit_1_with_the_files_written(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_bench", lambda request, reporter=None: _result("FAIL"))
    out = tmp_path / "out"
    result = run_bench_cli("--shape", "8x8x8", "--out", str(out))
    assert result.exit_code == 1, result.output
    assert "FAILED: 1 of 5 checked variants" in result.stdout
    assert "FAIL all_reduce 8x8x8 fo_tune" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(BENCH_FILES)
    _, rows = read_csv(out / "bench.csv")
    assert [r["status"] for r in rows if r["variant"] == "fo_tune"] == ["FAIL"]


def test_write_replaces_a_bench_folder_and_leaves_it_on_error(tmp_path, monkeypatch):
    out = tmp_path / "b"
    write_bench_dir(_result(), out)
    first = out.stat().st_ino
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write_bench_dir(_result(), out)  # an earlier bench folder is replaced as a whole
    assert out.stat().st_ino != first and sorted(p.name for p in out.iterdir()) == sorted(BENCH_FILES)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(result, path):
        raise RuntimeError("disk full")

    monkeypatch.setattr(bench_output, "_plot", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_bench_dir(_result(), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_check_bench_out(tmp_path):
    check_bench_out(tmp_path / "new" / "deeper")
    (tmp_path / "bench.csv").write_text("")
    check_bench_out(tmp_path)  # an earlier bench folder: may be replaced
    (tmp_path / "notes.txt").write_text("")
    for bad in (tmp_path, tmp_path / "notes.txt", Path(".")):
        with pytest.raises(OutputError):
            check_bench_out(bad)


# ------------------------------------------------------------------------------------- suites
def test_packaged_suite_is_the_design_suite():
    suite = load_suite(packaged_suite())
    assert suite.name == "h200_tp" and suite.dtype == "bfloat16"
    assert suite.shapes[0] == (2048, 4096, 4096) and len(suite.shapes) == 5 and len(suite.odd_shapes) == 3


def test_request_from_shapes_suite_or_device_default(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: tiny\ndtype: float16\nshapes: [[64, 96, 64]]\nodd_shapes: [[34, 20, 9]]\n")
    r = _request(
        [], path, True, None, "gloo", collectives=("all_reduce",), world_size=2, reps=None, timeout_s=9.0
    )
    assert r.shapes == ((64, 96, 64), (34, 20, 9)) and r.dtype == "float16" and r.suite == "tiny"
    r = _request([], path, False, "float32", "gloo")
    assert r.shapes == ((64, 96, 64),) and r.dtype == "float32"
    assert _request([], None, False, None, "gloo").shapes == bench.CPU_SHAPES  # CPU: the tiny default
    assert _request([], None, False, None, "nccl").suite == "h200_tp"  # GPUs: the packaged suite
    assert _request([(8, 8, 8)], None, False, None, "gloo").shapes == ((8, 8, 8),)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("- 1\n", "expected a mapping"),
        ("shapes: [[64, 0, 64]]\n", "shapes[0]"),
        ("shapes: [[64, 96]]\n", "shapes[0]"),
        ("shapes: []\n", "no shapes"),
        ("dtype: int8\nshapes: [[8, 8, 8]]\n", "dtype"),
        ("shape: [[8, 8, 8]]\n", "unknown key 'shape'"),
        ("shapes: [[8, 8, 8]]\nodd_shapes: [[true, 8, 8]]\n", "odd_shapes[0]"),
        ("shapes: [\n", "not valid YAML"),
    ],
)
def test_bad_suite_names_the_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SuiteError, match=r"bad\.yaml") as info:
        load_suite(path)
    assert key in str(info.value)


@pytest.mark.parametrize(
    "bad",
    [
        dict(shapes=()),
        dict(shapes=((0, 1, 1),)),
        dict(shapes=((8, 8, 8),), reps=0),
        dict(shapes=((8, 8, 8),), collectives=("all_to_all",)),
        dict(shapes=((8, 8, 8),), chunks=(1,)),
        dict(shapes=((8, 8, 8),), sample_ms=0.0),
        dict(shapes=((8, 8, 8),), sample_ms=True),
    ],
)
def test_request_validates(bad):
    with pytest.raises(ValueError):
        BenchRequest(**bad)


# ------------------------------------------------------------------------------------- bad input
def test_help_says_what_it_measures():
    result = CliRunner().invoke(app, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for word in ("sequential", "chunked", "async_tp", "fo_tune", "ideal", "--suite", "--collective", "--reps",
                 "--sample-ms", "--timeout", "--out", "bench.csv", "UNAVAILABLE", "gloo"):  # fmt: skip
        assert word in result.output, word


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--shape", "12x5"], "--shape"),
        (["--shape", "0x8x8"], "--shape"),
        (["--shape", "axbxc"], "--shape"),
        (["--collective", "all_reduce,all_sum"], "all_sum"),
        (["--collective", ","], "--collective"),
        (["--dtype", "int8"], "--dtype"),
        (["--reps", "0"], "--reps"),
        (["--timeout", "0"], "--timeout"),
        (["--sample-ms", "0"], "--sample-ms"),
        (["--world-size", "0"], "--world-size"),
        (["--backend", "mpi"], "--backend"),
        (["--shape", "8x8x8", "--suite", "suites/h200_tp.yaml"], "not both"),
        (["--include-odd"], "--include-odd"),
        (["--suite", "nope.yaml"], "nope.yaml"),
    ],
)
def test_bad_options_are_exit_2_and_write_nothing(tmp_path, args, says):
    out = tmp_path / "never"
    line = assert_one_line_error(run_bench_cli(*args, "--out", str(out)))
    assert says in line, line
    assert not out.exists()


def test_bad_suite_and_bad_out_are_exit_2(tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text("shapes: [[64, -1, 64]]\n")
    line = assert_one_line_error(run_bench_cli("--suite", str(suite), "--out", str(tmp_path / "never")))
    assert "suite.yaml" in line and "shapes[0]" in line
    target = tmp_path / "file"
    target.write_text("keep me")
    assert "is a file" in assert_one_line_error(run_bench_cli("--shape", "8x8x8", "--out", str(target)))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert "notes.txt" in assert_one_line_error(run_bench_cli("--shape", "8x8x8", "--out", str(mine)))
    assert target.read_text() == "keep me" and [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "never").exists()


@pytest.mark.skipif(GPUS >= 2, reason="two GPUs are visible, so NCCL with 2 ranks is valid here")
def test_nccl_without_gpus_is_exit_2(tmp_path):
    line = assert_one_line_error(
        CliRunner().invoke(app, ["bench", "--backend", "nccl", "--out", str(tmp_path / "never")])
    )
    assert "GPU" in line and not (tmp_path / "never").exists()


# ------------------------------------------------------------------------------------------- GPUs
@pytest.mark.multigpu
def test_bench_on_two_gpus_with_nccl():
    """Every variant passes (async-TP may be unavailable, with its reason) and overlap is timed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        result = CliRunner().invoke(
            app,
            ["bench", "--backend", "nccl", "--world-size", "2", "--shape", "4096x8192x4096", "--shape",
             "130x257x70", "--reps", "5", "--out", str(out)],
        )  # fmt: skip
        assert result.exit_code == 0, (result.output, result.exception)
        _, rows = read_csv(out / "bench.csv")
    assert {r["dtype"] for r in rows} == {"bfloat16"}
    by = {(r["collective"], r["m"], r["variant"]): r for r in rows}
    for collective in COLLECTIVE_NAMES:
        for variant in ("gemm", "collective", "sequential", "chunked", "fo_tune", "ideal"):
            row = by[(collective, "4096", variant)]
            assert row["status"] == "PASS" and float(row["median_ms"]) > 0, row
        assert "no second stream" not in by[(collective, "4096", "chunked_c2")]["detail"]
    assert by[("reduce_scatter", "4096", "async_tp")]["status"] in ("PASS", "UNAVAILABLE")
    assert by[("reduce_scatter", "130", "async_tp")]["status"] in ("PASS", "UNAVAILABLE")


def test_errors_merge_never_hides_a_nan():
    """A NaN output on any rank fails its check, wherever it comes in the merge: ``rel_err`` reads
    it as inf, and ``worst_error`` keeps a NaN that reaches it (``max(0.002, nan)`` is 0.002)."""
    from fo_tune.measure import rel_err, worst_error

    ref = torch.ones(4, 4)
    bad = torch.full((4, 4), float("nan"))
    assert rel_err(bad, ref) == math.inf
    assert rel_err(torch.ones(4, 4), ref) == 0.0
    assert math.isnan(worst_error([0.002, math.nan])) and math.isnan(worst_error([math.nan, 0.002]))
    assert worst_error([0.002, 0.003]) == 0.003
    entry = dict(variant="fo_tune", status="PASS", detail="", timing=None, source="table")
    merged = merge([{**entry, "rel_err": 0.002}, {**entry, "rel_err": math.nan}])
    assert math.isnan(merged["rel_err"])
