"""``fo-tune bench``: end to end on gloo ranks (all three collectives), the rank task in process,
the files, bad input."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from typer.testing import CliRunner

from cli import app
from cli_checks import assert_one_line_error, interrupted_at_second_call, isolate_tables
from fo_kernels.errors import ShapeError
from fo_kernels.fingerprint import current_fingerprint
from fo_kernels.schedule import COLLECTIVES
from fo_kernels.table import MISS_SOURCE, ScheduleTable, save_table, table_path
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
from fo_tune.bench import variants as bench_variants
from fo_tune.bench.rows import merge
from fo_tune.cli.bench import _request
from fo_tune.engines.triton.defaults import default_schedule
from fo_tune.output import OutputError
from fo_tune.ranks.gemm import GEMM_TOL
from fo_tune.ranks.pool import RankContext

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
# all_gather's rows: torch's fused all-gather + matmul where the others have async-TP.
ORDER_AG = [v if v != "async_tp" else "torch_fused" for v in ORDER]
FUSED = {"all_reduce": "async_tp", "reduce_scatter": "async_tp", "all_gather": "torch_fused"}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path)


def run_bench_cli(*args: str):
    return CliRunner().invoke(app, ["bench", "--backend", "gloo", *args])


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]


def write_triton_row(root: Path, collective: str, m: int, n: int, k: int, world_size: int = 2) -> None:
    """A table row (in ``isolate_tables``' folder under ``root``) holding the CPU's default Triton
    schedule for the shape, so ``fo_tune`` runs the overlapped engine instead of overlap: false."""
    fp = current_fingerprint("cpu", world_size)
    row = default_schedule(collective, m, n, k, dtype="float32", world_size=world_size, sm_count=8,
                           on_gpu=False)  # fmt: skip
    row = dataclasses.replace(row, provenance={"written_by": "tests/test_bench.py"})  # a row, not a guess
    table = ScheduleTable(fingerprint=fp, collective=collective, world_size=world_size, dtype="float32",
                          rows=[row])  # fmt: skip
    save_table(table, table_path(root / "tables", fp.device_key, collective, world_size, "float32"))


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    """One ``bench --world-size 2`` run on gloo with the default collectives (all three):
    64x96x64 (all_gather's fo_tune from a table row: the Triton engine's overlapped path) and
    63x96x64 (reduce_scatter and all_gather impossible on 2 ranks: SKIP rows)."""
    root = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        isolate_tables(mp, root)
        write_triton_row(root, "all_gather", 64, 96, 64)
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
    want = ORDER_AG if collective == "all_gather" else ORDER
    assert [r["variant"] for r in picked] == want, [r["variant"] for r in picked]
    return {r["variant"]: r for r in picked}


# ------------------------------------------------------------------------------------ end to end
def test_bench_writes_every_file(gloo_run):
    result, out = gloo_run
    assert result.exit_code == 0, (result.output, result.exception)
    assert sorted(p.name for p in out.iterdir()) == sorted(BENCH_FILES)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for word in ("all_reduce (ms)", "reduce_scatter (ms)", "all_gather (ms)", "seq", "chunked", "async-TP",
                 "torch fused", "fo-tune", "ideal", "x async-TP", "x torch fused"):  # fmt: skip
        assert word in result.stdout, word
    assert "skipped" in result.stdout and "unavailable" in result.stdout and "wrote 3 files" in result.stdout


def test_bench_progress_goes_to_stderr_and_the_results_to_stdout(gloo_run):
    """Piped, stdout holds the summary alone; the progress lines (and bars) are on stderr."""
    result, _ = gloo_run
    assert "s] start 2 ranks" in result.stderr and "s] bench: " in result.stderr, result.stderr
    assert "s] " not in result.stdout and "start 2 ranks" not in result.stdout, result.stdout
    assert "all_reduce (ms)" in result.stdout, result.stdout


def test_bench_csv_variants_and_statuses(gloo_run):
    _, out = gloo_run
    header, rows = read_csv(out / "bench.csv")
    assert header == HEADER
    assert {r["device_key"] for r in rows} == {current_fingerprint("cpu", 2).device_key}
    assert {(r["world_size"], r["dtype"]) for r in rows} == {("2", "float32")}
    assert {r["status"] for r in rows} == set(STATUSES) - {"FAIL"}  # FAIL: see the tests below
    assert len(rows) == 6 * len(ORDER)  # 2 shapes x 3 collectives (two of them all SKIP rows)
    for collective in COLLECTIVES:
        case = _case(rows, collective, "64x96x64")
        measured = [v for v in case if v not in (FUSED[collective], "ideal", "chunked")]
        for variant in measured:
            row = case[variant]
            assert row["status"] == "PASS", row
            assert float(row["rel_err"]) < 1e-4 and float(row["median_ms"]) > 0, row
        assert case["ideal"]["status"] == "PASS" and case["chunked"]["status"] == "PASS"
        assert "no second stream" in case["chunked_c4"]["detail"]
    for collective in ("all_reduce", "reduce_scatter"):  # no table row: the runtime's overlap: false
        fo = _case(rows, collective, "64x96x64")["fo_tune"]
        assert fo["schedule_source"] == MISS_SOURCE, fo
        assert fo["detail"] == f"{collective} float32 w2 64x96x64: no overlap (GEMM then collective)", fo
    fo = _case(rows, "all_gather", "64x96x64")["fo_tune"]  # the table row: the Triton engine
    assert fo["schedule_source"] == "table", fo
    assert fo["detail"].startswith("all_gather float32 w2 64x96x64: engine triton, tile 32x32x32"), fo
    async_ar = _case(rows, "all_reduce", "64x96x64")["async_tp"]
    assert async_ar["status"] == "SKIP" and "reduce_scatter and all_gather only" in async_ar["detail"]
    for collective, what in (("reduce_scatter", "fused_matmul_reduce_scatter"),
                             ("all_gather", "fused_all_gather_matmul")):  # fmt: skip
        fused = _case(rows, collective, "64x96x64")[FUSED[collective]]
        assert fused["status"] == "UNAVAILABLE", fused
        assert fused["detail"].startswith(what) and "needs CUDA GPUs and NCCL" in fused["detail"], fused
        assert math.isnan(float(fused["median_ms"]))
    assert _case(rows, "all_reduce", "63x96x64")["fo_tune"]["status"] == "PASS"


def test_bench_skips_sharded_collectives_when_m_is_not_divisible(gloo_run):
    _, out = gloo_run
    with (out / "bench.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    for collective, order in (("reduce_scatter", ORDER), ("all_gather", ORDER_AG)):
        skipped = [r for r in rows if r["collective"] == collective and r["m"] == "63"]
        assert [r["variant"] for r in skipped] == order
        assert {r["status"] for r in skipped} == {"SKIP"}
        assert all("not divisible by the world size 2" in r["detail"] for r in skipped)


def test_bench_speedup_arithmetic(gloo_run):
    _, out = gloo_run
    _, rows = read_csv(out / "bench.csv")
    for collective, shape in (
        ("all_reduce", "64x96x64"),
        ("reduce_scatter", "64x96x64"),
        ("all_gather", "64x96x64"),
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
    assert settings["collectives"] == list(COLLECTIVES)  # the default: every collective of the runtime
    assert (settings["world_size"], settings["dtype"], settings["reps"]) == (2, "float32", 2)
    assert settings["chunks"] == [2, 4, 8]
    assert settings["sample_ms"] == 4.0  # fo_tune.ranks.timing.MIN_SAMPLE_MS on the CPU (16 on GPUs)
    text = (out / "bench.yaml").read_text()  # whole settings stay whole (4, not 4.0)
    assert "  sample_ms: 4\n" in text and "  timeout_s: 600\n" in text, text[:800]
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


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_case_task_checks_before_timing(one_rank, monkeypatch, collective):
    """World size 1: every variant runs (all_gather a copy, then the GEMM) but torch's fused op,
    which is a SKIP row with its reason; nothing wrong is timed."""
    task = BenchCaseTask(collective, 16, 24, 8, "float32", chunks=(2, 32), warmup=0, reps=1)
    entries = {e["variant"]: e for e in task.run(one_rank)}
    fused_name = FUSED[collective]
    names = ["gemm", "collective", "sequential", "chunked_c2", "chunked_c32", fused_name, "fo_tune"]
    assert list(entries) == names
    assert entries["chunked_c32"]["status"] == "SKIP" and "fewer than 32" in entries["chunked_c32"]["detail"]
    for name in ("gemm", "collective", "sequential", "chunked_c2", "fo_tune"):
        assert entries[name]["status"] == "PASS" and entries[name]["timing"].median_ms > 0, name
    fused = entries[fused_name]
    assert fused["status"] == "SKIP" and fused["timing"] is None, fused
    why = "reduce_scatter and all_gather only" if collective == "all_reduce" else "world size 1"
    assert why in fused["detail"], fused
    monkeypatch.setitem(GEMM_TOL, "float32", 0.0)  # nothing can pass: every variant FAILs untimed
    entries = {e["variant"]: e for e in task.run(one_rank)}
    for name in ("gemm", "collective", "sequential", "chunked_c2", "fo_tune"):
        e = entries[name]
        assert e["status"] == "FAIL" and e["timing"] is None and "relative error" in e["detail"], e


def test_a_chunk_left_unwritten_reads_nan(one_rank, monkeypatch):
    """The bench's buffers start as NaN: an all_gather chunk that never arrives fails the check as
    a NaN, whatever the memory held before."""
    monkeypatch.setattr(bench_variants, "all_gather_tensor", lambda out, src, group=None: None)
    task = BenchCaseTask("all_gather", 16, 24, 8, "float32", chunks=(2,), warmup=0, reps=1)
    entries = {e["variant"]: e for e in task.run(one_rank)}
    e = entries["chunked_c2"]
    assert e["status"] == "FAIL" and e["timing"] is None and e["detail"].endswith("NaN in the output"), e
    assert entries["sequential"]["status"] == "PASS" and entries["fo_tune"]["status"] == "PASS"


@pytest.mark.parametrize(
    ("collective", "op"), [("all_reduce", "gemm_all_reduce"), ("all_gather", "all_gather_gemm")]
)
def test_fo_tune_is_checked_again_after_timing(one_rank, monkeypatch, collective, op):
    """A call right the first time whose later calls write nothing (a replay gone wrong) hands back
    its previous, poisoned, output block: it FAILs after timing and keeps no time."""
    import fo_kernels

    held: list[torch.Tensor] = []

    def stale(a, b, schedule=None, group=None):
        if not held:
            held.append(a @ b)
        return held[0]  # the same block every call, written only by the first

    monkeypatch.setattr(fo_kernels, op, stale)
    task = BenchCaseTask(collective, 16, 24, 8, "float32", chunks=(2,), warmup=0, reps=1)
    entries = {e["variant"]: e for e in task.run(one_rank)}
    e = entries["fo_tune"]
    assert e["status"] == "FAIL" and e["timing"] is None, e
    assert e["detail"].endswith("NaN in the output after timing"), e["detail"]
    assert entries["sequential"]["status"] == "PASS"
    held.clear()
    monkeypatch.setattr(fo_kernels, op, lambda a, b, schedule=None, group=None: a @ b)
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
    monkeypatch.setattr(bench, "run_bench", lambda request, reporter=None, keep=None: _result("FAIL"))
    out = tmp_path / "out"
    result = run_bench_cli("--shape", "8x8x8", "--out", str(out))
    assert result.exit_code == 1, result.output
    assert "FAILED: 1 of 5 checked variants" in result.stdout
    assert "FAIL all_reduce 8x8x8 fo_tune" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(BENCH_FILES)
    _, rows = read_csv(out / "bench.csv")
    assert [r["status"] for r in rows if r["variant"] == "fo_tune"] == ["FAIL"]


def test_a_ctrl_c_while_a_finished_bench_is_written_keeps_it(tmp_path, monkeypatch):
    """A Ctrl-C while the files of a finished run are written (the plot's matplotlib import takes
    a second or two) is held until they are: every case is kept, said on stderr, and the exit is 130."""
    from fo_tune.bench import output as bench_output

    plot = bench_output._plot

    def interrupted_plot(result, path):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # a terminal's Ctrl-C
        time.sleep(0.05)  # (where it lands without the hold: the write is given up)
        plot(result, path)

    monkeypatch.setattr(bench, "run_bench", lambda request, reporter=None, keep=None: _result())
    monkeypatch.setattr(bench_output, "_plot", interrupted_plot)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        out = tmp_path / "out"
        result = run_bench_cli("--shape", "8x8x8", "--out", str(out))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-2:] == [f"kept every case in {out}", "error: interrupted"]
    assert sorted(p.name for p in out.iterdir()) == sorted(BENCH_FILES)


def test_the_summary_sets_fo_tune_beside_torch_fused(tmp_path, monkeypatch):
    """An all_gather case: rows in order with torch_fused for async_tp, its time in the summary's
    "torch fused" column and fused ms / fo-tune ms in "x torch fused"."""
    times = dict(gemm=3.0, collective=2.0, sequential=6.0, chunked_c2=5.0, torch_fused=7.5, fo_tune=3.0)
    merged = [_merged(v, "PASS", ms, "chunks=2" if v == "chunked_c2" else "") for v, ms in times.items()]
    rows = case_rows({**HEAD, "collective": "all_gather"}, merged)
    assert [r.variant for r in rows] == [v for v in ORDER_AG if v not in ("chunked_c4", "chunked_c8")]
    fake = BenchResult(fingerprint=current_fingerprint("cpu", 2), backend="gloo",
                       settings=dict(shapes=[[8, 8, 8]], dtype="float32"), rows=rows)  # fmt: skip
    monkeypatch.setattr(bench, "run_bench", lambda request, reporter=None, keep=None: fake)
    result = run_bench_cli("--shape", "8x8x8", "-c", "all_gather", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    head = next(line for line in result.stdout.splitlines() if line.startswith("MxNxK"))
    assert head.split() == ["MxNxK", "seq", "chunked", "torch", "fused", "fo-tune", "ideal", "speedup", "of",
                            "ideal", "x", "torch", "fused", "ok"]  # fmt: skip
    line = next(line for line in result.stdout.splitlines() if line.startswith("8x8x8"))
    want = ["8x8x8", "6.00", "5.00", "c2", "7.50", "3.00", "3.00", "2.00x", "1.00", "2.50x", "6/6"]
    assert line.split() == want, line  # (times keep their significant digits: 6.00 beside 7.50)


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
    for bad, why in (
        (tmp_path, r"holds files fo-tune bench did not write \(notes\.txt\)"),
        (tmp_path / "notes.txt", "notes.txt is a file; give a folder"),
        (Path("."), r"--out \. is the current folder or above it"),
    ):
        with pytest.raises(OutputError, match=why):
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
    ("bad", "names"),
    [
        (dict(shapes=()), "no shapes"),
        (dict(shapes=((0, 1, 1),)), r"shape \(0, 1, 1\): expected \(M, N, K\)"),
        (dict(shapes=((8, 8, 8),), reps=0), "reps must be an integer >= 1"),
        (dict(shapes=((8, 8, 8),), collectives=("all_sum",)), r"collectives \['all_sum'\]: choose from"),
        (
            dict(shapes=((63, 8, 8),), collectives=("all_gather",)),
            "63x8x8: all_gather needs M divisible by the world size 2",
        ),
        (
            dict(shapes=((64, 8, 8), (63, 8, 8)), collectives=("reduce_scatter", "all_gather")),
            "63x8x8: reduce_scatter and all_gather need M divisible",
        ),
        (
            dict(shapes=((64, 8, 8),), collectives=("all_gather",), world_size=3),
            "64x8x8: all_gather needs M divisible by the world size 3",
        ),
        (dict(shapes=((8, 8, 8),), chunks=(1,)), r"chunks must be integers >= 2, got \[1\]"),
        (dict(shapes=((8, 8, 8),), sample_ms=0.0), "sample length must be > 0 ms, got 0.0"),
        (dict(shapes=((8, 8, 8),), sample_ms=True), "sample length must be > 0 ms, got True"),
    ],
)
def test_request_validates(bad, names):
    """Each bad field is refused with a ShapeError naming that field, not some other refusal."""
    with pytest.raises(ShapeError, match=names):
        BenchRequest(**bad)


def test_a_shape_another_collective_runs_is_kept():
    """M not divisible by the world size: refused only when no collective asked for can run it."""
    request = BenchRequest(shapes=((63, 8, 8),), collectives=("all_reduce", "all_gather"))
    assert request.shapes == ((63, 8, 8),)
    assert BenchRequest(shapes=((1, 8, 8),), collectives=("all_gather",), world_size=1).world_size == 1


# ------------------------------------------------------------------------------------- bad input
def test_help_says_what_it_measures():
    result = CliRunner().invoke(app, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for word in ("sequential", "chunked", "async_tp", "torch_fused", "fused_all_gather_matmul", "fo_tune",
                 "all_gather_gemm", "ideal", "all_gather", "gathered M", "--suite", "--collective", "--reps",
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
        (["-c", "all_reduce,moe"], "bench/moe_ep.py"),
        (["-c", "all_gather", "--shape", "63x96x64"], "all_gather needs M divisible by the world size 2"),
        (["-c", "reduce_scatter,all_gather", "-s", "64x96x64", "-s", "65x96x64"], "shape 65x96x64"),
        (["-c", "all_gather", "-w", "3", "--shape", "64x96x64"], "world size 3"),
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
def _bench_on_gpus(world_size: int, *args: str) -> list[dict[str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        result = CliRunner().invoke(
            app,
            ["bench", "--backend", "nccl", "--world-size", str(world_size), "--shape", "4096x8192x4096",
             "--shape", "130x257x70", "--reps", "5", "--out", str(out), *args],
        )  # fmt: skip
        assert result.exit_code == 0, (result.output, result.exception)
        _, rows = read_csv(out / "bench.csv")
    assert {r["dtype"] for r in rows} == {"bfloat16"}
    assert {r["collective"] for r in rows} == set(COLLECTIVES)  # the default: every collective
    return rows


@pytest.mark.multigpu
def test_bench_on_two_gpus_with_nccl():
    """Every variant passes (the fused torch ops may be unavailable, with their reason) and
    overlap is timed, for all three collectives."""
    rows = _bench_on_gpus(2)
    by = {(r["collective"], r["m"], r["variant"]): r for r in rows}
    for collective in COLLECTIVES:
        for m in ("4096", "130"):
            for variant in ("gemm", "collective", "sequential", "chunked", "fo_tune", "ideal"):
                row = by[(collective, m, variant)]
                assert row["status"] == "PASS" and float(row["median_ms"]) > 0, row
        assert "no second stream" not in by[(collective, "4096", "chunked_c2")]["detail"]
    for collective in ("reduce_scatter", "all_gather"):
        for m in ("4096", "130"):
            assert by[(collective, m, FUSED[collective])]["status"] in ("PASS", "UNAVAILABLE")


@pytest.mark.gpu
def test_bench_on_one_gpu_at_world_size_1():
    """One GPU, one NCCL rank: all_gather is a copy then the GEMM and every variant passes but
    torch's fused ops (symmetric memory between ranks), which are SKIP rows with the reason."""
    rows = _bench_on_gpus(1)
    by = {(r["collective"], r["m"], r["variant"]): r for r in rows}
    for collective in COLLECTIVES:
        for m in ("4096", "130"):
            for variant in ("gemm", "collective", "sequential", "chunked", "fo_tune", "ideal"):
                row = by[(collective, m, variant)]
                assert row["status"] == "PASS" and float(row["median_ms"]) > 0, row
            fused = by[(collective, m, FUSED[collective])]
            assert fused["status"] == "SKIP", fused
            if collective != "all_reduce":
                assert "world size 1" in fused["detail"], fused


def test_errors_merge_never_hides_a_nan():
    """A NaN output on any rank fails its check, wherever it comes in the merge: ``rel_err`` reads
    it as inf, and ``worst_error`` keeps a NaN that reaches it (``max(0.002, nan)`` is 0.002)."""
    from fo_tune.ranks.gemm import rel_err, worst_error

    ref = torch.ones(4, 4)
    bad = torch.full((4, 4), float("nan"))
    assert rel_err(bad, ref) == math.inf
    assert rel_err(torch.ones(4, 4), ref) == 0.0
    assert math.isnan(worst_error([0.002, math.nan])) and math.isnan(worst_error([math.nan, 0.002]))
    assert worst_error([0.002, 0.003]) == 0.003
    entry = dict(variant="fo_tune", status="PASS", detail="", timing=None, source="table")
    merged = merge([{**entry, "rel_err": 0.002}, {**entry, "rel_err": math.nan}])
    assert math.isnan(merged["rel_err"])


# ------------------------------------------------------------- bench/'s scripts: their inputs
def test_every_shipped_suite_loads():
    """suites/*.yaml: the suite and the shape lists bench/'s scripts read, each valid."""
    paths = sorted(packaged_suite().parent.glob("*.yaml"))
    assert packaged_suite() in paths and len(paths) >= 4
    for path in paths:
        assert load_suite(path).dtype == "bfloat16", path


def test_script_inputs_print_a_suites_shapes(capsys):
    """``python -m fo_tune.bench.script_inputs shapes``: the profile suite's ten shapes, one
    MxNxK a line, in file order (bench/profile.sh loops over them)."""
    from fo_tune.bench import script_inputs

    path = packaged_suite().with_name("h200_profile.yaml")
    assert script_inputs.main(["shapes", str(path)]) == 0
    lines = capsys.readouterr().out.split()
    assert lines == script_inputs.shape_args(path)
    assert len(lines) == 10 and lines[0] == "2048x4096x4096" and lines[7] == "3000x5120x6912"
    assert set(script_inputs.shape_args(packaged_suite())) <= set(lines)  # the suite's five


def test_tp48_suite_holds_small_k_row_parallel_shapes(capsys):
    """suites/tp48_profile.yaml: >= 12 distinct TP=4/8 row-parallel shapes, K <= 4096, N and K
    multiples of 16 (TMA's 16-byte strides in bf16), each named by its model and TP; printed by
    ``script_inputs shapes`` for bench/profile.sh."""
    from fo_tune.bench import script_inputs

    path = packaged_suite().with_name("tp48_profile.yaml")
    shapes = load_suite(path).shapes
    assert len(set(shapes)) == len(shapes) >= 12
    assert all(k <= 4096 and n % 16 == 0 and k % 16 == 0 and m in (4096, 8192) for m, n, k in shapes)
    assert script_inputs.main(["shapes", str(path)]) == 0
    assert capsys.readouterr().out.split() == ["x".join(map(str, s)) for s in shapes]
    comments = [line for line in path.read_text().splitlines() if line.startswith("  # ")]
    named = [c for c in comments if "TP=4" in c or "TP=8" in c]
    assert len(named) == len(shapes)


@pytest.mark.parametrize(
    "script, args",
    [("tune.sh", ["suite"]), ("tune.sh", []), ("bench.sh", []), ("gpu_tests.sh", [])],
)
def test_scripts_at_a_world_size_without_its_gpus_stop_in_one_line(tmp_path, script, args):
    """FO_WORLD_SIZE=8 on a machine without 8 GPUs: exit 2 and one line naming what is needed,
    before anything runs; a world size below 2 the same."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        pytest.skip("checks a machine without GPUs")
    root = packaged_suite().parents[1]
    for world, want in [("8", "needs 8 GPUs"), ("1", "expected an integer >= 2")]:
        env = {**os.environ, "FO_WORLD_SIZE": world}
        cmd = ["bash", str(root / "bench" / script), str(tmp_path / "out"), *args]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and want in r.stderr, r.stderr
        # tune.sh names the stage that runs without the GPUs: the offline plan
        offline = f"plan offline: FO_WORLD_SIZE={world} bash bench/tune.sh OUT_DIR plan"
        assert (offline in r.stderr) == (script == "tune.sh" and world == "8"), r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize(
    ("script", "what"),
    [
        ("virtual_ranks.sh", "bash bench/virtual_ranks.sh"),
        ("profile.sh", "bash bench/profile.sh"),
        ("gpu_tests.sh", "bash bench/gpu_tests.sh"),  # (every test skipped itself, exit 0)
        ("bench.sh", "stage w1"),  # (the default stage without GPUs)
        ("tune.sh", "stage calibrate-w1"),
    ],
)
def test_one_gpu_scripts_and_stages_without_a_gpu_stop_in_one_line(tmp_path, script, what):
    """The one-GPU scripts and stages on a machine without a GPU: exit 2 and one line naming what
    they need, before any work (not minutes of steps bound to fail, nor a traceback); the scripts
    write nothing."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        pytest.skip("checks a machine without GPUs")
    cmd = ["bash", str(packaged_suite().parents[1] / "bench" / script), str(tmp_path / "out")]
    env = {k: v for k, v in os.environ.items() if k != "FO_WORLD_SIZE"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    needs = "needs a CUDA GPU, none visible (nvidia-smi lists none): run it on a machine with one"
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"{what} {needs}"), line
    assert ("plan offline" in line) == (script == "tune.sh"), line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("world", [2, 4, 8])
def test_tune_plan_stage_asks_what_the_offline_calibration_prices(tmp_path, world):
    """``FO_WORLD_SIZE=W bash bench/tune.sh OUT plan`` (no GPU): its one fo-tune command line parses
    and names only collectives the calibration a predict search at W reads has a curve for (the
    packaged TP=2 one has no all_gather curve; its extrapolation to 4 or 8 derives one), so the
    stage's search does not stop at its calibration check. The command is recorded by a stand-in
    interpreter (PYTHON), not run."""
    import subprocess

    import typer

    from fo_tune.calibrate.find import choose_calibration
    from fo_tune.calibrate.missing import missing_curves

    root = packaged_suite().parents[1]
    log = tmp_path / "calls"
    shim = tmp_path / "python"
    shim.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$CALLS"\n')
    shim.chmod(0o755)
    env = {**os.environ, "FO_WORLD_SIZE": str(world), "PYTHON": str(shim), "CALLS": str(log)}
    cmd = ["bash", str(root / "bench" / "tune.sh"), str(tmp_path / "out"), "plan"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    script, *args = log.read_text().splitlines()
    assert script.endswith("cli.py") and args[0] == "search", args
    command = typer.main.get_command(app)
    ctx = command.make_context("fo-tune", ["search"], resilient_parsing=True)
    search = command.get_command(ctx, "search")  # (the root command is a group)
    params = search.make_context("search", args[1:], parent=ctx).params  # an unknown option raises
    assert params["world_size"] == world and params["mode"] == "predict"
    cal, _ = choose_calibration(None, "predict", world, "gloo", torch.device("cpu"))
    assert cal is not None and cal.world_size == world
    collectives = ",".join(params["collective"]).split(",")
    assert "all_reduce" in collectives and ("all_gather" in collectives) == (world > 2)
    assert not [gap for c in collectives if (gap := missing_curves(cal, [c]))]


@pytest.mark.parametrize("stage", ["plan", "suite", "mrange"])
def test_tune_suite_stages_at_a_world_size_the_suite_does_not_divide_stop_in_one_line(tmp_path, stage):
    """``FO_WORLD_SIZE=6 bash bench/tune.sh OUT plan`` (or suite, mrange): suites/tp48_profile.yaml's
    Ms and the mrange stage's 512..16384 do not divide by 6, which reduce_scatter and all_gather
    need, so the stage stops with exit 2 and one line saying so, before any fo-tune command (the
    plan stage ran into the search's refusal with a traceback); the calibrate stage's refusal for
    want of GPUs offers the offline plan that works at that size. Commands are recorded by a
    stand-in interpreter (PYTHON), not run."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        pytest.skip("checks a machine without GPUs")
    root = packaged_suite().parents[1]
    log = tmp_path / "calls"
    shim = tmp_path / "python"
    shim.write_text('#!/bin/sh\nprintf "%s\\n" "$@" >> "$CALLS"\n')
    shim.chmod(0o755)
    env = {**os.environ, "FO_WORLD_SIZE": "6", "PYTHON": str(shim), "CALLS": str(log)}
    for args, want in [
        ([stage], f"stage {stage} at FO_WORLD_SIZE=6: its reduce_scatter and all_gather searches"),
        (["calibrate"], "stage calibrate needs 6 GPUs"),
    ]:
        cmd = ["bash", str(root / "bench" / "tune.sh"), str(tmp_path / "out"), *args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
        (line,) = done.stderr.splitlines()
        assert line.startswith(want), line
        own = "fo-tune search --mode predict --world-size 6 --shape MxNxK (M divisible by 6 for"
        assert line.endswith(f"{own} reduce_scatter and all_gather)"), line
        assert "bench/tune.sh OUT_DIR plan" not in line, line
    assert not log.exists()


def test_script_inputs_narrow_a_space(tmp_path, capsys):
    """``space``: hopper.yaml with the profile's grids and the M-range search's ring chunks, the
    rest as it was; the written file loads; an engine the space leaves out or a bad list is exit
    code 2 with one line."""
    from fo_tune.bench import script_inputs
    from fo_tune.space import load_space, packaged_spaces_dir

    base = packaged_spaces_dir() / "hopper.yaml"
    out = tmp_path / "narrowed.yaml"
    args = ["space", str(base), str(out), "--sms-free", "0,8,12,16", "--ring-chunks", "1,2,4"]
    assert script_inputs.main(args) == 0
    assert out.read_text().startswith(f"# {base} narrowed (--sms-free 0,8,12,16; --ring-chunks 1,2,4)")
    hopper, narrowed = load_space(base), load_space(out)
    assert narrowed.sms_free == (0, 8, 12, 16)
    assert set(narrowed.calibration.quick_interference_sms_free) <= set(narrowed.sms_free)
    ring = narrowed.engine("copy_engine").modes["ring"]
    assert ring.chunks == (1, 2, 4) and ring.weights == ()
    assert narrowed.tiles == hopper.tiles and narrowed.nccl_max_ctas == hopper.nccl_max_ctas
    assert narrowed.engine("copy_engine").modes["tiled"] == hopper.engine("copy_engine").modes["tiled"]
    # only one list replaced: the other stays, a ring without weightings stays without them
    again = script_inputs.narrow_space(narrowed, sms_free=(8,))
    assert again.sms_free == (8,) and again.calibration.quick_interference_sms_free == (8,)
    assert again.engine("copy_engine") == narrowed.engine("copy_engine")
    small = packaged_spaces_dir() / "bench" / "h200_small.yaml"
    capsys.readouterr()
    assert script_inputs.main(["space", str(small), str(out), "--ring-chunks", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engines.copy_engine.ring: missing" in err[0], err
    assert script_inputs.main(["space", str(base), str(out), "--sms-free", "0,0"]) == 2
    assert "repeats" in capsys.readouterr().err
    assert load_space(out).sms_free == (0, 8, 12, 16)  # a refused narrowing leaves the file alone


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
@pytest.mark.parametrize("script", ["moe_grouped_gemm.py", "moe_host.py"])
def test_gpu_bench_scripts_refuse_a_machine_without_gpus(tmp_path, capsys, script):
    """bench/'s one-GPU Python scripts: exit 2 and one line on stderr naming what they need,
    nothing written (its main, in this process); --help explains the script (run as a process)."""
    import subprocess
    import sys

    path = BENCH / script
    assert _main_code(_bench_script(path.stem), ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "needs a CUDA GPU" in err, err
    assert not (tmp_path / "o").exists()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    helped = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0 and "--out" in helped.stdout


BENCH = Path(__file__).resolve().parents[1] / "bench"
SEARCHES = BENCH.parent / "results" / "search" / "nvidia-h200-cc90-132sm-w2-nvlink18" / "hybrid-vs-exhaustive"


def _bench_script(name: str):
    """``bench/<name>.py`` as a module (bench/ is no package; its folder on ``sys.path``, as when
    the script runs, for the scripts that import a sibling)."""
    import importlib.util
    import sys

    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    if f"bench_{name}" not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[f"bench_{name}"]


def _main_code(module, argv: list[str]) -> int:
    try:
        return module.main(argv)
    except SystemExit as exc:  # argparse's usage errors and --help
        return exc.code


def test_moe_host_rows_come_from_the_code_calibrate_measures_with(quiet_one_rank):
    """bench/moe_host.py's rows are ``fo_tune.moe.host.measure_shape``'s (what ``fo-tune calibrate
    --only moe_host`` measures with), times rounded: on the CPU, a tiny model's rows fill the CSV's
    columns but the run's own (GPU, host CPU, torch, time)."""
    bench = _bench_script("moe_host")
    model = dict(name="tiny", hidden=32, intermediate=16, experts=8, top_k=2)
    rows = bench.measure(model, 2, 8, 2, device="cpu")
    assert [(r["model"], r["ep"], r["experts_local"], r["chunks"]) for r in rows] == [
        ("tiny", 2, 4, 1),
        ("tiny", 2, 4, 2),
    ]
    assert [*rows[0], "gpu", "host_cpu", "torch", "time"] == list(bench.COLUMNS)
    times = [r[name] for r in rows for name in ("phase1_host_ms", "phase2_host_ms", "call_host_ms")]
    assert all(t > 0 and t == round(t, 4) for t in times), times


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("moe_ep", [], "on the CPU (gloo, 0 GPUs for 2 ranks) the suite's full shapes take hours"),
        ("moe_ep", ["--scale", "0"], "--scale must be >= 1, got 0"),
        ("moe_ep", ["--scale", "4", "--world-size", "7"], "--world-size 7 divides no model's experts"),
        ("moe_ep", ["--scale", "100000"], "--scale 100000 leaves no column"),
        ("moe_grouped_gemm", ["--ep", "3"], "--ep 3 does not divide DeepSeek-V3's 256 experts"),
        ("moe_grouped_gemm", ["--rounds", "0"], "--rounds must be >= 1"),
        ("moe_host", ["--ep", "3"], "--ep 3 does not divide DeepSeek-V3's 256 experts"),
        ("moe_host", ["--models", "Foo"], "--models: unknown model 'Foo'"),
        ("moe_host", ["--reps", "0"], "--reps must be >= 1"),
        ("hybrid_vs_exhaustive", [str(SEARCHES / "exhaustive" / "summary.yaml"), "nope"], "No such file"),
        ("hybrid_vs_exhaustive", [str(SEARCHES / s / "summary.yaml") for s in ("exhaustive", "hybrid-top7")],
         "needs 2 CUDA GPUs (0 visible)"),
    ],
)  # fmt: skip
def test_moe_and_hybrid_bench_scripts_stop_in_one_line_before_any_work(tmp_path, capsys, script, args, says):
    """On a machine without GPUs: bad options, a world size that divides no model's experts and a
    run that needs GPUs (or, for moe_ep.py on the CPU, a --scale) are exit 2 with one line naming
    the problem, before any rank starts or any file is written."""
    code = _main_code(_bench_script(script), [*args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert says in err[-1] and not any("Traceback" in line for line in err), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("script", "says"),
    [
        ("moe_ep", ["moe_ep.csv", "--scale", "--rounds", "--suite", "on the CPU it must be given"]),
        ("moe_grouped_gemm", ["moe_grouped_gemm.csv", "--rounds", "--suite", "Needs a CUDA GPU"]),
        ("moe_host", ["moe_host.csv", "--reps", "--suite", "Needs a CUDA GPU"]),
        ("hybrid_vs_exhaustive", ["hybrid_vs_exhaustive.csv", "summary.yaml", "Needs 2 CUDA GPUs"]),
    ],
)
def test_moe_and_hybrid_bench_help_explains_every_option(capsys, script, says):
    """--help: a whole first sentence, a line for every option, the file the script writes and
    what it needs."""
    module = _bench_script(script)
    assert _main_code(module, ["--help"]) == 0
    out = capsys.readouterr().out
    description = " ".join(out.split("\n\n")[1].split())
    assert description.endswith("."), description
    lines = [*out.splitlines(), ""]
    helpless = [  # an option's line without its help text beside it or on the next line
        line
        for line, after in itertools.pairwise(lines)
        if line.strip().startswith("-")
        and "  " not in line.strip()
        and not (after.startswith(" " * 8) and not after.strip().startswith("-"))
    ]
    assert not helpless, helpless
    for word in says:
        assert word in " ".join(out.split()), word


def test_a_bench_stopped_after_a_case_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    """A Ctrl-C (or a failing rank) after the first case wrote nothing: the finished cases' rows
    go to --out, bench.yaml saying after which case and why, and the exit is still 130. A finished
    run in --out is never replaced by a stopped one: that goes to <out>-stopped."""
    from fo_tune.bench import run as bench_run

    case_rows = bench_run.case_rows
    monkeypatch.setattr(bench_run, "case_rows", interrupted_at_second_call(case_rows))
    out = tmp_path / "out"
    args = [
        "-w",
        "1",
        "-c",
        "all_reduce",
        "-s",
        "8x16x16",
        "-s",
        "16x16x16",
        "--reps",
        "1",
        "--sample-ms",
        "0.1",
    ]
    result = run_bench_cli(*args, "--out", str(out))
    assert result.exit_code == 130, result.output
    assert f"kept the finished cases (after 1 of 2 cases: interrupted) in {out}" in result.stderr
    _, rows = read_csv(out / "bench.csv")
    assert rows and {(r["m"], r["collective"]) for r in rows} == {("8", "all_reduce")}
    settings = yaml.safe_load((out / "bench.yaml").read_text())["settings"]
    assert settings["stopped"] == "after 1 of 2 cases: interrupted"

    monkeypatch.setattr(bench_run, "case_rows", case_rows)
    assert run_bench_cli(*args, "--out", str(out)).exit_code == 0  # a finished run replaces the stopped one
    finished = (out / "bench.csv").read_bytes()
    monkeypatch.setattr(bench_run, "case_rows", interrupted_at_second_call(case_rows))
    result = run_bench_cli(*args, "--out", str(out))
    assert result.exit_code == 130, result.output
    assert f"in {tmp_path / 'out-stopped'}" in result.stderr, result.stderr
    assert (out / "bench.csv").read_bytes() == finished
    assert yaml.safe_load((tmp_path / "out-stopped" / "bench.yaml").read_text())["settings"]["stopped"]
