"""Tests of fo_tune.tables.merge (merge under a lock, validation, diff) and the ``fo-tune table`` commands."""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import io
import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import yaml
from filelock import FileLock
from typer.testing import CliRunner

from big_table import write_big_table
from cli import app
from cli_checks import assert_one_line_error, isolate_tables
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.errors import FoTuneError, TableError
from fo_kernels.fingerprint import Fingerprint, current_fingerprint, make_device_key
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.table import (
    ScheduleTable,
    load_table,
    lookup_schedule,
    save_table,
    table_filename,
    table_path,
    table_search_path,
)
from fo_kernels.table import paths as table_paths
from fo_kernels.tile import Tile
from fo_tune.cli.table_rows import SHOW_ROWS
from fo_tune.engines.triton.defaults import default_schedule
from fo_tune.tables.diff import RowDiff, diff_tables, header_differences
from fo_tune.tables.find import find_tables, known_device_keys
from fo_tune.tables.merge import TableLockTimeout, lock_path, merge_rows
from fo_tune.tables.validate import validate_table

HEADER = {"collective": "all_reduce", "world_size": 2, "dtype": "bfloat16"}
CPU_TILE = Tile(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
H200 = {
    "device_key": make_device_key("NVIDIA H200", "9.0", 132, 2, "nvlink18"),
    "gpu_name": "NVIDIA H200",
    "compute_capability": "9.0",
    "sm_count": 132,
    "world_size": 2,
    "interconnect": "nvlink18",
    "driver": "580.159.04",
    "cuda": "13.0",
    "nccl": "2.28.9",
    "torch": "2.11.0",
    "triton": "3.6.0",
}
# Concurrent merge test: processes, and merges (one new row each) per process.
MERGE_PROCS = 3
MERGES_PER_PROC = 15


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hermetic search path (env and user folders under tmp_path, no packaged tables), wide output."""
    isolate_tables(monkeypatch, tmp_path)
    monkeypatch.setattr(table_paths, "_packaged_table_dir", lambda: None)
    monkeypatch.setenv("COLUMNS", "250")  # rich tables without squeezed cells


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def cpu_fp(world_size: int = 2, **changes: Any) -> Fingerprint:
    return dataclasses.replace(current_fingerprint("cpu", world_size), **changes)


def h200_fp(**changes: Any) -> Fingerprint:
    return Fingerprint(**{**H200, **changes})


def cpu_row(m: int, n: int = 96, k: int = 48, collective: str = "all_reduce", **prov: Any) -> Schedule:
    """A valid CPU row (the heuristic default) with ``prov`` as its provenance."""
    row = default_schedule(
        collective, m, n, k, dtype="bfloat16", world_size=2, sm_count=cpu_fp().sm_count, on_gpu=False
    )
    return dataclasses.replace(row, provenance=prov or {"source": "test"})


def gpu_row(m: int, n: int = 8192, k: int = 4096) -> Schedule:
    return default_schedule("all_reduce", m, n, k, dtype="bfloat16", world_size=2, sm_count=132, on_gpu=True)


def tweak(row: Schedule, **changes: Any) -> Schedule:
    """``row`` with some of its Triton settings changed."""
    return dataclasses.replace(row, settings=dataclasses.replace(row.settings, **changes))


def range_row(m_min: int, m_max: int, n: int = 96, k: int = 48, **changes: Any) -> Schedule:
    header = {key: changes.pop(key) for key in list(changes) if key in (*HEADER, "provenance")}
    settings = {"signal_tiles": 2, "groups": (3, 1), "layout": "tile_major", "wait_mode": "spin", **changes}
    problem = Problem(m_min=m_min, m_max=m_max, n=n, k=k)
    return Schedule(
        problem=problem, **{**HEADER, **header}, settings=TritonSettings(tile=CPU_TILE, **settings)
    )


def merge(path: Path, rows: list[Schedule], fp: Fingerprint | None = None, **header: Any) -> ScheduleTable:
    return merge_rows(path, fp or cpu_fp(), rows, **{**HEADER, **header})


def write(path: Path, rows: list[Schedule], fp: Fingerprint | None = None, **header: Any) -> Path:
    save_table(ScheduleTable(fingerprint=fp or cpu_fp(), **{**HEADER, **header}, rows=rows), path)
    return path


# ------------------------------------------------------------------------------------ merge
def test_a_row_whose_provenance_holds_a_yaml_timestamp_merges_and_shows_as_it_reads(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A provenance date written by hand without quotes (``date: 2026-11-30``) reads as a YAML
    timestamp: merging a row into that table (what every search and pull does) and `table show
    --format yaml` write it back as YAML reads it (they raised "TypeError: Object of type date is
    not JSON serializable", the search's rows and the pull lost)."""
    path = write(tmp_path / "t.yaml", [cpu_row(64, date="DATE")])
    path.write_text(path.read_text().replace('"DATE"', "2026-11-30"))
    stamped = load_table(path)
    assert stamped.rows[0].provenance["date"] == dt.date(2026, 11, 30)
    merged = merge(path, [cpu_row(200)])
    assert load_table(path) == merged and merged.rows[0] == stamped.rows[0]
    result = runner.invoke(app, ["table", "show", str(path), "--format", "yaml"])
    assert result.exit_code == 0, result.output
    assert ScheduleTable.from_dict(yaml.safe_load(result.stdout)).rows == merged.rows


def test_merge_creates_then_updates(tmp_path: Path) -> None:
    path = tmp_path / "new" / "folder" / "t.yaml"
    first = merge(path, [cpu_row(64, tag="a"), cpu_row(200)])
    assert load_table(path) == first
    assert [r.problem.m for r in first.rows] == [64, 200]

    second = merge(path, [cpu_row(64, tag="b"), cpu_row(256)])
    assert load_table(path) == second
    assert [r.problem.m for r in second.rows] == [64, 200, 256]
    assert second.find(64, 96, 48).provenance == {"tag": "b"}  # replaced, not duplicated
    assert second.fingerprint == cpu_fp()
    assert merge(path, []).rows == second.rows  # nothing to merge: unchanged


def test_merge_takes_the_new_fingerprint_on_version_drift(tmp_path: Path) -> None:
    path = write(tmp_path / "t.yaml", [cpu_row(64)], cpu_fp(torch="0.0.1", triton="0.0.2"))
    merged = merge(path, [cpu_row(200)])
    assert merged.fingerprint == cpu_fp()
    assert load_table(path).fingerprint.torch == cpu_fp().torch
    assert [r.problem.m for r in merged.rows] == [64, 200]  # old rows kept


@pytest.mark.parametrize(
    ("existing", "needle"),
    [
        (h200_fp(), "device_key"),
        (cpu_fp(compute_capability="9.0"), "compute_capability"),  # same key, other capability
    ],
)
def test_merge_refuses_a_table_for_other_hardware(tmp_path: Path, existing: Fingerprint, needle: str) -> None:
    path = write(tmp_path / "t.yaml", [cpu_row(64)], existing)
    before = path.read_bytes()
    with pytest.raises(TableError, match=rf"other hardware \({needle}.*move this file away") as info:
        merge(path, [cpu_row(200)])
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    assert path.read_bytes() == before


def test_merge_refuses_other_header_or_world_size(tmp_path: Path) -> None:
    path = write(tmp_path / "t.yaml", [cpu_row(64)])
    before = path.read_bytes()
    f16 = dataclasses.replace(cpu_row(200), dtype="float16")
    with pytest.raises(TableError, match=r"holds all_reduce world size 2 bfloat16 rows.*float16"):
        merge(path, [f16], dtype="float16")
    with pytest.raises(TableError, match="dtype"):  # a row that disagrees with the header it is merged as
        merge(path, [f16])
    with pytest.raises(TableError, match="world size 4"):
        merge(path, [cpu_row(200)], cpu_fp(world_size=4))
    assert path.read_bytes() == before
    assert not (tmp_path / "other.yaml").exists()
    # a file under the new rows' own name that holds another table's rows: rename the file (the
    # message named that same file as the rows' own table)
    misnamed = write(tmp_path / "all_reduce-w2-float16.yaml", [cpu_row(64)])
    with pytest.raises(TableError, match=r"rename it to all_reduce-w2-bfloat16\.yaml"):
        merge(misnamed, [f16], dtype="float16")


def test_merge_refuses_a_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("rows: [\n")
    # the message says what to do (the runtime's lookup raises it inside a user's process)
    with pytest.raises(TableError, match=r"not valid YAML: .*; restore the file .* `fo-tune search`$"):
        merge(path, [cpu_row(64)])
    assert path.read_text() == "rows: [\n"


def test_merge_times_out_on_a_held_lock(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    with FileLock(str(lock_path(path)), timeout=1), pytest.raises(TableLockTimeout, match="lock") as info:
        merge_rows(path, cpu_fp(), [cpu_row(64)], **HEADER, lock_timeout_s=0.1)
    assert isinstance(info.value, FoTuneError) and not isinstance(info.value, ValueError)  # exit 1
    assert not path.exists()
    merge(path, [cpu_row(64)])  # released: merges again
    assert path.exists()


def _merge_worker(path: str, worker: int, count: int, barrier: Any) -> None:
    """One process of the concurrent test: ``count`` merges of one distinct row each."""
    barrier.wait()
    for i in range(count):
        merge(Path(path), [cpu_row(32 * (worker * 1000 + i + 1), worker=worker, i=i)])


def test_concurrent_merges_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "t.yaml"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(MERGE_PROCS)
    procs = [
        ctx.Process(target=_merge_worker, args=(str(path), w, MERGES_PER_PROC, barrier))
        for w in range(MERGE_PROCS)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * MERGE_PROCS
    table = load_table(path)
    assert len(table.rows) == MERGE_PROCS * MERGES_PER_PROC
    got = {(r.provenance["worker"], r.provenance["i"]) for r in table.rows}
    assert got == {(w, i) for w in range(MERGE_PROCS) for i in range(MERGES_PER_PROC)}
    assert sorted(p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")) == []


# ------------------------------------------------------------------------------------ validate
def cpu_table(rows: list[Schedule], **header: Any) -> ScheduleTable:
    return ScheduleTable(fingerprint=cpu_fp(), **{**HEADER, **header}, rows=rows)


def test_validate_passes_good_tables() -> None:
    rows = [cpu_row(m) for m in (1, 64, 200, 256)]
    no_overlap = Schedule(**HEADER, problem=Problem(m=8, n=64, k=32))
    ranges = [range_row(1, 100), range_row(101, 4096), range_row(1, 4096, n=64)]
    assert validate_table(cpu_table([*rows, no_overlap, *ranges])) == []
    gpu = ScheduleTable(fingerprint=h200_fp(), **HEADER, rows=[gpu_row(4096), gpu_row(8192), gpu_row(16384)])
    assert all(r.overlap for r in gpu.rows)
    assert validate_table(gpu) == []
    assert any("sms_free" in issue for issue in validate_table(gpu, sm_count=16))  # a smaller GPU


def test_validate_reduce_scatter_ranges_use_divisible_m() -> None:
    rs = {"collective": "reduce_scatter"}
    table = cpu_table([range_row(1, 99, signal_tiles=2, **rs), range_row(3, 3, n=64, **rs)], **rs)
    issues = validate_table(table)
    assert len(issues) == 1, issues  # [1, 99] is checked at 2, 50 and 98; [3, 3] holds no even M
    assert issues[0].startswith("row [3,3]x64x48: problem:") and "divisible by world_size 2" in issues[0]


def test_validate_passes_a_range_row_band_row_of_one_tile_units() -> None:
    """A range row_band row whose units are single tiles plans at every M: the runtime cuts its
    groups where bands start (at M=1, 1x3 tiles in one band, it is one group)."""
    row = range_row(1, 512, signal_tiles=1, groups=(1, 1), layout="row_band")
    assert validate_table(cpu_table([cpu_row(200), row])) == []


def test_validate_all_gather_rows_plan_the_gathered_m() -> None:
    """An all_gather row's M is the gathered M: ranges are checked at multiples of the world size
    (a plan of M/w-row shards), and its row_band groups start on whole bands of every shard."""
    ag = {"collective": "all_gather"}
    good = range_row(
        2, 512, signal_tiles=2 * 2 * 3, groups=(1, 1), layout="row_band", wait_mode="stream_wait", **ag
    )
    table = cpu_table(
        [cpu_row(256, collective="all_gather"), good, range_row(3, 3, n=64, layout="row_band", **ag)], **ag
    )
    issues = validate_table(table)
    assert len(issues) == 1, issues  # [3, 3] holds no even M
    assert issues[0].startswith("row [3,3]x64x48: problem:") and "which all_gather needs" in issues[0]


@pytest.mark.parametrize(
    ("row", "needles"),
    [
        # 64x96x48 in 32x32 tiles: 6 tiles = 6 units of 1 tile; groups sum to 3
        (
            tweak(cpu_row(64), signal_tiles=1, groups=(2, 1)),
            ["row 64x96x48: groups", "sum to 3"],
        ),
        # 128x64 output: 4x2 tiles, bands of group_m=2 rows = 4 tiles; group 1 starts at tile 1
        (
            tweak(cpu_row(128, 64), signal_tiles=1, groups=(1, 7), layout="row_band"),
            ["row 128x64x48: groups", "row_band", "starts at local tile 1"],
        ),
        (tweak(cpu_row(64), sms_free=8), ["row 64x96x48: sms_free: 8 leaves no SM of 8"]),
        (range_row(1, 512, sms_free=8), ["[1,512]x96x48 at M=1: sms_free"]),
    ],
)
def test_validate_catches_a_bad_row(row: Schedule, needles: list[str]) -> None:
    issues = validate_table(cpu_table([cpu_row(200), row]))
    assert issues, issues
    for needle in needles:
        assert needle in issues[0], issues


def test_validate_refuses_fp8_rows_no_call_takes() -> None:
    """An fp8 row whose N or K is not a multiple of 16 is never called (the fp8 ops refuse the
    shape): validate names it; a bf16 row of that shape is fine."""
    fp8 = {**HEADER, "dtype": "float8_e4m3fn"}
    rows = [Schedule(**fp8, problem=Problem(m=8, n=n, k=k)) for n, k in ((64, 32), (40, 32), (64, 24))]
    issues = validate_table(cpu_table(rows, dtype="float8_e4m3fn"))
    assert [issue.split(":")[0] for issue in issues] == ["row 8x40x32", "row 8x64x24"], issues
    assert all("multiples of 16" in issue for issue in issues), issues
    bf16 = [Schedule(**HEADER, problem=Problem(m=8, n=40, k=24))]
    assert validate_table(cpu_table(bf16)) == []


def test_validate_refuses_rows_above_the_int32_sizes_no_call_takes(runner: CliRunner, tmp_path: Path) -> None:
    """A row whose N, K or smallest M is above int32 is never called (lookup and the GEMMs refuse
    the shape): `fo-tune table validate` names it, exit 2; a range reaching past it still covers
    the Ms below and passes."""
    big = 2**31
    rows = [
        Schedule(**HEADER, problem=Problem(m=8, n=big, k=48)),
        Schedule(**HEADER, problem=Problem(m=8, n=96, k=big * 10**20)),
        Schedule(**HEADER, problem=Problem(m=big, n=96, k=48)),
        Schedule(**HEADER, problem=Problem(m_min=big, m_max=big + 2, n=64, k=48)),
        Schedule(**HEADER, problem=Problem(m_min=1, m_max=big, n=32, k=48)),
    ]
    path = write(tmp_path / "huge.yaml", rows)
    result = runner.invoke(app, ["table", "validate", str(path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    fields = sorted(line.split("problem.")[1].split(":")[0] for line in lines)
    assert fields == ["k", "m", "m_min", "n"] and all("no call ever takes" in line for line in lines), lines
    assert "[1,2147483648]x32x48" not in result.stderr
    help_text = " ".join(runner.invoke(app, ["table", "validate", "--help"]).stdout.split())
    assert f"smallest M above {big - 1}" in help_text, help_text  # the help states the bound


def test_tables_refuse_overlapping_ranges() -> None:
    """Loading refuses what validate_table reported before: ranges of one (N, K) that overlap."""
    with pytest.raises(TableError, match=r"rows\[0\] \(\[1,100\]x96x48\) and rows\[1\] \(\[50,200\]x96x48\)"):
        cpu_table([range_row(1, 100), range_row(50, 200), range_row(1, 300, n=64)])
    assert len(cpu_table([range_row(1, 100), range_row(101, 200), range_row(1, 300, n=64)]).rows) == 3


# ------------------------------------------------------------------------------------ diff
def by_problem(diffs: list[RowDiff]) -> dict[str, RowDiff]:
    return {d.problem.describe(): d for d in diffs}


def test_diff_categories() -> None:
    a = cpu_table(
        [
            cpu_row(64, measured_ms=1.0),
            cpu_row(200, measured_ms=2.0, predicted_ms=1.5),
            cpu_row(256),
            cpu_row(512),
        ]
    )
    changed = tweak(cpu_row(200, predicted_ms=1.2), sms_free=2, groups=(2, 2))
    no_overlap = Schedule(**HEADER, problem=Problem(m=512, n=96, k=48))
    b = cpu_table([cpu_row(64, measured_ms=0.9), changed, no_overlap, range_row(1, 64)])
    diffs = diff_tables(a, b)
    assert [d.problem.describe() for d in diffs] == [
        "[1,64]x96x48",
        "64x96x48",
        "200x96x48",
        "256x96x48",
        "512x96x48",
    ]
    got = by_problem(diffs)
    same = got["64x96x48"]
    assert same.status == "same" and not same.differs and same.fields == ()
    assert same.provenance_changed == ("measured_ms",)
    assert (same.latency_a, same.latency_b) == ({"measured_ms": 1.0}, {"measured_ms": 0.9})
    row = got["200x96x48"]
    assert row.status == "changed" and row.fields == ("sms_free", "groups")
    assert row.latency_a == {"measured_ms": 2.0, "predicted_ms": 1.5}
    assert row.latency_b == {"predicted_ms": 1.2}
    assert got["256x96x48"].status == "only_a" and got["256x96x48"].b is None
    assert got["[1,64]x96x48"].status == "only_b" and got["[1,64]x96x48"].a is None
    assert got["512x96x48"].fields == ("overlap",)
    assert [d.status for d in diff_tables(a, a)] == ["same"] * 4


def test_header_differences() -> None:
    a = cpu_table([])
    b = ScheduleTable(fingerprint=cpu_fp(torch="0.0.1"), **HEADER)
    assert header_differences(a, b) == [("fingerprint.torch", cpu_fp().torch, "0.0.1")]
    assert header_differences(a, a) == []


def test_find_tables_in_search_order(tmp_path: Path) -> None:
    key = cpu_fp().device_key
    env, user = tmp_path / "tables", tmp_path / "xdg" / "fo-tune" / "tables"
    assert find_tables(key, **HEADER) == [] and known_device_keys() == []
    paths = [write(table_path(root, key, **HEADER), [cpu_row(64)]) for root in (user, env)]
    write(table_path(env, H200["device_key"], **HEADER), [gpu_row(8192)], h200_fp())
    assert find_tables(key, **HEADER) == paths[::-1]
    assert known_device_keys() == sorted([key, H200["device_key"]])


def test_a_folder_without_a_table_is_no_device_key_to_pick(tmp_path: Path, runner: CliRunner) -> None:
    """A folder of notes or junk YAML beside the tables holds no file lookup reads: a lookup miss
    names only the keys that have a table, and its example is one of them."""
    env = tmp_path / "tables"
    write(table_path(env, H200["device_key"], **HEADER), [gpu_row(8192)], h200_fp())
    (env / "notes").mkdir()
    (env / "notes" / "readme.yaml").write_text("todo: re-tune\n", encoding="utf-8")
    (env / "aaa-scratch").mkdir()
    (env / "aaa-scratch" / "all_reduce.yaml").write_text("rows: []\n", encoding="utf-8")
    assert known_device_keys() == [H200["device_key"]]
    result = runner.invoke(app, ["table", "lookup", "-s", "64x96x48", "--json"])
    miss = json.loads(result.stdout)
    assert result.exit_code == 0 and miss["other_device_keys"] == [H200["device_key"]], result.output
    assert miss["hint"].endswith(f"e.g. -k {H200['device_key']}"), miss


def test_a_lookup_miss_hint_gives_a_pick_that_runs(tmp_path: Path, runner: CliRunner) -> None:
    """A miss under a key whose tables hold other dtypes names the files it holds (it said
    nothing); a miss of a world size no key has tables of gives an example with that key's -w,
    which runs (-k alone with the call's -w is refused as another world size's key)."""
    env, key = tmp_path / "tables", H200["device_key"]
    write(table_path(env, key, **HEADER), [gpu_row(8192)], h200_fp())
    lookup = ["table", "lookup", "-s", "8192x8192x4096", "--json"]
    miss = json.loads(runner.invoke(app, [*lookup, "-k", key, "-d", "float16"]).stdout)
    assert miss["source"].startswith("no table row"), miss
    assert f"{key}; it holds {table_filename(**HEADER)}: pick the collective and dtype" in miss["hint"], miss
    miss = json.loads(runner.invoke(app, [*lookup, "-w", "4"]).stdout)
    assert "(none of world size 4)" in miss["hint"], miss
    pick = miss["hint"].split("e.g. ")[1].split()
    assert pick == ["-k", key, "-w", "2"], miss
    result = runner.invoke(app, [*lookup, *pick])
    found = json.loads(result.stdout)
    assert result.exit_code == 0 and found["source"].endswith(table_filename(**HEADER)), result.output


# ------------------------------------------------------------------------------------ CLI
def test_table_help(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "table" in result.output
    result = runner.invoke(app, ["table", "--help"])
    assert result.exit_code == 0, result.output
    for word in ("show", "validate", "diff", "FO_TUNE_TABLE_DIR"):
        assert word in result.output, word
    expected = {
        "show": ("--device-key", "--collective", "--world-size", "--dtype", "--format", "fingerprint"),
        "validate": ("plan", "row_band", "m_min", "must not overlap", "Exit code"),
        "diff": ("--exit-code", "only in A", "changed", "measured_ms"),
        "list": ("one line on stderr with its path, why and what to do", "1 when some file is not"),
        "lookup": ("another GPU's fingerprint in this device key's folder",),
    }
    for command, words in expected.items():
        result = runner.invoke(app, ["table", command, "--help"])
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.split())
        for word in words:
            assert word in text, (command, word)


def gpu_table_file(tmp_path: Path) -> Path:
    rows = [
        dataclasses.replace(gpu_row(8192), provenance={"measured_ms": 1.25, "speedup": 1.05, "mode": "x"}),
        gpu_row(16384),
        Schedule(**HEADER, problem=Problem(m=128, n=8192, k=4096)),
    ]
    return write(table_path(tmp_path / "tables", H200["device_key"], **HEADER), rows, h200_fp())


def test_show_a_file(runner: CliRunner, tmp_path: Path) -> None:
    path = gpu_table_file(tmp_path)
    result = runner.invoke(app, ["table", "show", str(path)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in (H200["device_key"], "NVIDIA H200", "nccl 2.28.9", "torch 2.11.0", "3 row(s)"):
        assert text in out, text
    for column in ("problem", "tile", "sms_free", "cap", "signal", "groups", "layout", "wait"):
        assert column in out, column
    for column in ("measured_ms", "speedup", "mode", "source"):
        assert column in out, column
    line = next(line for line in out.splitlines() if line.startswith("8192x8192x4096"))
    assert "128x256x64 gm8 w8 s3" in line and "1.25" in line and "row_band" in line
    assert "stream_wait" in line and "heuristic" not in line
    line = next(line for line in out.splitlines() if line.startswith("128x8192x4096"))
    assert " no " in line


def test_show_finds_the_table_by_header(runner: CliRunner, tmp_path: Path) -> None:
    path = gpu_table_file(tmp_path)
    args = [
        "table",
        "show",
        "--device-key",
        H200["device_key"],
        "-c",
        "all_reduce",
        "-w",
        "2",
        "-d",
        "bfloat16",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert str(path) in result.stdout and "8192x8192x4096" in result.stdout
    # defaults: this machine's device key, all_reduce, world size 2, bfloat16
    here = current_fingerprint(None, 2)
    own = write(table_path(tmp_path / "tables", here.device_key, **HEADER), [cpu_row(64)], here)
    result = runner.invoke(app, ["table", "show"])
    assert result.exit_code == 0, result.output
    assert str(own) in result.stdout and "64x96x48" in result.stdout


def test_show_not_found_and_bad_options_are_one_line(runner: CliRunner, tmp_path: Path) -> None:
    gpu_table_file(tmp_path)
    line = assert_one_line_error(runner.invoke(app, ["table", "show", "-k", "nope", "-d", "float16"]))
    assert (
        "nope/all_reduce-w2-float16.yaml" in line and "fo-tune search" in line and H200["device_key"] in line
    )
    line = assert_one_line_error(runner.invoke(app, ["table", "show", str(tmp_path / "missing.yaml")]))
    assert "fo-tune search" in line
    # a key that has tables, but none of this dtype: what the key holds, not the key list again
    line = assert_one_line_error(
        runner.invoke(app, ["table", "show", "-k", H200["device_key"], "-d", "float16"])
    )
    assert f"{H200['device_key']} holds all_reduce-w2-bfloat16.yaml: pick one with -c, -w and -d" in line, (
        line
    )
    line = assert_one_line_error(runner.invoke(app, ["table", "show", "x.yaml", "--dtype", "float16"]))
    assert "--dtype" in line
    assert "--format" in assert_one_line_error(runner.invoke(app, ["table", "show", "-f", "json"]))
    assert "--collective" in assert_one_line_error(runner.invoke(app, ["table", "show", "-c", "all_to_all"]))
    # an fp8 MoE table: the option and the dtypes the MoE FFN runs (it said "dtype: ... is not one of")
    line = assert_one_line_error(runner.invoke(app, ["table", "show", "-c", "moe", "-d", "float8_e4m3fn"]))
    assert line.endswith("-c moe --dtype float8_e4m3fn: the MoE FFN runs bfloat16, float16, float32"), line
    # an empty value (an unset shell variable) showed the default table
    for option, name in (("-c", "--collective"), ("-d", "--dtype")):
        line = assert_one_line_error(
            runner.invoke(app, ["table", "show", "-k", H200["device_key"], option, ""])
        )
        assert f"{name} '': expected one of" in line, line


def test_show_yaml_and_csv(runner: CliRunner, tmp_path: Path) -> None:
    path = gpu_table_file(tmp_path)
    result = runner.invoke(app, ["table", "show", str(path), "--format", "yaml"])
    assert result.exit_code == 0, result.output
    assert ScheduleTable.from_dict(yaml.safe_load(result.stdout)) == load_table(path)
    # the file's own form (one row a line), which a 100,000-row table prints in seconds where the
    # YAML emitter took minutes
    assert result.stdout == f"# {path}\n{path.read_text()}", result.stdout
    result = runner.invoke(app, ["table", "show", str(path), "-f", "csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["m"] for r in rows] == ["128", "8192", "16384"]
    assert rows[1]["block_n"] == "256" and rows[1]["measured_ms"] == "1.25" and rows[1]["file"] == str(path)
    assert rows[0]["overlap"] == "False" and rows[0]["block_m"] == ""
    assert len(rows[1]["groups"].split()) >= 1


def _shown_rows(out: str, table: ScheduleTable) -> list[str]:
    """The problems of ``table``'s rows that the terminal view ``out`` prints, in its order."""
    problems = {row.problem.describe() for row in table.rows}
    return [line.split(" ", 1)[0] for line in out.splitlines() if line.split(" ", 1)[0] in problems]


def test_show_prints_a_capped_number_of_rows_and_says_how_to_see_the_rest(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A fleet-scale table in the terminal view: its first SHOW_ROWS rows (rich lays out about 2 ms
    a row, so 80,000 rows held the terminal for minutes) and one line on the rows left out."""
    path = write_big_table(tmp_path / "big.yaml", cpu_fp(), SHOW_ROWS + 1)
    table = load_table(path)
    described = [row.problem.describe() for row in table.rows]
    result = runner.invoke(app, ["table", "show", str(path)])
    assert result.exit_code == 0, result.output
    assert _shown_rows(result.stdout, table) == described[:SHOW_ROWS]
    assert f"1 of {SHOW_ROWS + 1} rows not shown" in result.stdout
    assert f"{SHOW_ROWS + 1} row(s)" in result.stdout  # the header counts every row
    for how in ("--limit N", "--all", "--format csv", "--json"):
        assert how in result.stdout, how
    result = runner.invoke(app, ["table", "show", str(path), "--limit", "2"])
    assert result.exit_code == 0, result.output
    assert _shown_rows(result.stdout, table) == described[:2]
    assert f"{SHOW_ROWS - 1} of {SHOW_ROWS + 1} rows not shown (showing the first 2)" in result.stdout
    result = runner.invoke(app, ["table", "show", str(path), "--all"])
    assert result.exit_code == 0, result.output
    assert _shown_rows(result.stdout, table) == described and "not shown" not in result.stdout
    help_text = runner.invoke(app, ["table", "show", "--help"]).stdout
    assert "--limit" in help_text and f"first {SHOW_ROWS} rows" in help_text


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--limit", "3", "--all"], "--limit N and --all"),
        (["--limit", "3", "--json"], "--json prints every row"),
        (["--all", "-f", "csv"], "--format csv prints every row"),
        (["--limit", "0"], "--limit"),
    ],
)
def test_show_row_cap_options_are_for_the_terminal_view(
    runner: CliRunner, tmp_path: Path, args: list[str], needle: str
) -> None:
    path = gpu_table_file(tmp_path)
    assert needle in assert_one_line_error(runner.invoke(app, ["table", "show", str(path), *args]))


def test_validate_ok(runner: CliRunner, tmp_path: Path) -> None:
    good = gpu_table_file(tmp_path)
    other = write(tmp_path / "candidate.yaml", [cpu_row(64), range_row(1, 100)])
    result = runner.invoke(app, ["table", "validate", str(good), str(other)])
    assert result.exit_code == 0, result.output
    assert f"OK {good}" in result.stdout and f"OK {other}" in result.stdout
    assert "note:" in result.stdout and result.stdout.count("note:") == 1  # candidate.yaml: not a lookup path
    assert result.stderr == ""


def test_validate_skips_a_tables_lock_file_with_a_note(runner: CliRunner, tmp_path: Path) -> None:
    """``fo-tune table validate TABLES/*/*`` after a search: the merge's lock file beside each table
    (empty) is skipped with a note, not refused as an empty table file, nor counted among the files
    the summary names; a non-empty file of that name is still read as a table."""
    good = gpu_table_file(tmp_path)
    table = load_table(good)
    merge_rows(good, table.fingerprint, table.rows, **HEADER)  # (a search's merge: leaves the lock file)
    lock = lock_path(good)
    assert lock.is_file() and lock.stat().st_size == 0
    result = runner.invoke(app, ["table", "validate", str(good), str(lock)])
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert f"note: {lock}: a table's lock file" in result.stdout and f"OK {good}" in result.stdout
    result = runner.invoke(app, ["table", "validate", "--json", str(lock)])
    assert result.exit_code == 0 and json.loads(result.stdout)["files"][0]["ok"], result.output
    bad = write(tmp_path / "bad.yaml", [tweak(cpu_row(64), signal_tiles=1, groups=(2, 1))])
    result = runner.invoke(app, ["table", "validate", str(good), str(lock), str(bad)])
    assert result.exit_code == 2 and "1 problem(s) in 1 of 2 file(s)" in result.stdout, result.output
    lock.write_text("rows: []\n")
    assert "error:" in runner.invoke(app, ["table", "validate", str(lock)]).stderr


def test_validate_bad_row_is_one_line_per_problem(runner: CliRunner, tmp_path: Path) -> None:
    bad_row = tweak(cpu_row(64), signal_tiles=1, groups=(2, 1))
    bad = write(tmp_path / "bad.yaml", [cpu_row(200), bad_row])
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(bad)]))
    assert str(bad) in line and "row 64x96x48: groups" in line
    worse = write(
        tmp_path / "worse.yaml",
        [bad_row, range_row(1, 100), tweak(cpu_row(256), signal_tiles=1, groups=(2, 1))],
    )
    good = write(tmp_path / "good.yaml", [cpu_row(64)])
    result = runner.invoke(app, ["table", "validate", str(good), str(worse)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"error: {worse}: row ") for line in lines), lines
    assert f"OK {good}" in result.stdout and "2 problem(s) in 1 of 2 file(s)" in result.stdout


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("rows: [\n  - {m: 1\n", "not valid YAML"),
        (None, "fo-tune search"),  # missing file
        ("schema_version: 9\n", "schema_version 9"),
    ],
)
def test_validate_malformed_or_missing_is_one_line(
    runner: CliRunner, tmp_path: Path, text: str | None, needle: str
) -> None:
    path = tmp_path / "t.yaml"
    if text is not None:
        path.write_text(text)
    result = runner.invoke(app, ["table", "validate", str(path)])
    line = assert_one_line_error(result)
    assert str(path) in line and needle in line
    assert result.stdout == "", result.stdout  # no summary about rows beside a file that does not read


def test_validate_summary_names_the_remedy_of_each_kind_of_problem(runner: CliRunner, tmp_path: Path) -> None:
    """With a missing file among several, the summary says to name files that exist; with one that
    does not load (rows that overlap), to fix or replace it; rows to fix only where a file that
    loaded has a bad row."""
    good = write(tmp_path / "good.yaml", [cpu_row(64)])
    result = runner.invoke(app, ["table", "validate", str(good), str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2, result.output
    assert result.stdout.endswith("1 problem(s) in 1 of 2 file(s); name table files that exist\n"), (
        result.stdout
    )
    # a file that reads but does not load (two rows for one problem): fixed or replaced, not named again
    lines = good.read_text().splitlines()
    dup = tmp_path / "dup.yaml"
    dup.write_text("\n".join([*lines, lines[-1]]) + "\n")
    result = runner.invoke(app, ["table", "validate", str(good), str(dup)])
    assert result.exit_code == 2, result.output
    want = "1 problem(s) in 1 of 2 file(s); fix or replace the files that do not load (each line says "
    assert result.stdout.endswith(want + "what to do)\n"), result.stdout


@pytest.mark.parametrize("command", ["show", "validate", "diff"])
@pytest.mark.parametrize(
    ("what", "needle"),
    [
        ("folder", "is a folder, not a table file; name one of its files"),
        ("empty", "got an empty file; give a schedule table file"),
        ("binary", "cannot read: 'utf-8' codec"),
    ],
)
def test_a_file_that_is_no_table_at_all_says_what_to_give(
    runner: CliRunner, tmp_path: Path, command: str, what: str, needle: str
) -> None:
    """A folder, an empty file or a binary one given as a table is one line naming it, what it is
    and what to give instead (a schedule table file), from every command that reads a table."""
    path = tmp_path / "t.yaml"
    if what == "folder":
        path.mkdir()
    else:
        path.write_bytes(b"" if what == "empty" else b"\xff\xfe\x00")
    args = [str(path), str(path)] if command == "diff" else [str(path)]
    line = assert_one_line_error(runner.invoke(app, ["table", command, *args]))
    assert str(path) in line and needle in line, line
    assert "`fo-tune " in line, line


def test_validate_sm_count_option(runner: CliRunner, tmp_path: Path) -> None:
    path = gpu_table_file(tmp_path)
    result = runner.invoke(app, ["table", "validate", str(path), "--sm-count", "16"])
    assert result.exit_code == 2 and "sms_free" in result.stderr


def test_diff_command(runner: CliRunner, tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", [cpu_row(64, measured_ms=1.0), cpu_row(200), cpu_row(256)])
    changed = tweak(cpu_row(64, measured_ms=0.8), sms_free=2)
    b = write(tmp_path / "b.yaml", [changed, cpu_row(200), cpu_row(512)], cpu_fp(torch="0.0.1"))
    result = runner.invoke(app, ["table", "diff", str(a), str(b)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "header fingerprint.torch" in out and "-> 0.0.1" in out
    row = next(line for line in out.splitlines() if line.startswith("64x96x48"))
    assert "changed" in row and "sms_free 0 -> 2" in row and "0.8" in row
    assert "only in A" in out and "only in B" in out and "200x96x48" not in out
    assert "1 changed, 1 only in A, 1 only in B, 1 same (--same lists them)" in out
    assert "200x96x48" in runner.invoke(app, ["table", "diff", str(a), str(b), "--same"]).stdout
    # --all lifts the row cap, as show's: the same rows stay out
    assert "200x96x48" not in runner.invoke(app, ["table", "diff", str(a), str(b), "--all"]).stdout
    assert runner.invoke(app, ["table", "diff", str(a), str(b), "--exit-code"]).exit_code == 1
    same = runner.invoke(app, ["table", "diff", str(a), str(a), "--exit-code"])
    assert same.exit_code == 0 and "no differences in 3 row(s)" in same.stdout
    line = assert_one_line_error(runner.invoke(app, ["table", "diff", str(a), str(tmp_path / "c.yaml")]))
    assert "c.yaml" in line


def test_diff_prints_a_capped_number_of_rows_and_says_how_to_see_the_rest(
    runner: CliRunner, tmp_path: Path
) -> None:
    """Two fleet-scale tables compared in the terminal: the first SHOW_ROWS listed rows, one line
    on the rows left out, as `show` prints them; the counts and --exit-code cover every row."""
    a = write_big_table(tmp_path / "big.yaml", cpu_fp(), SHOW_ROWS + 1)
    b = write(tmp_path / "empty.yaml", [])
    table = load_table(a)
    result = runner.invoke(app, ["table", "diff", str(a), str(b), "--exit-code"])
    assert result.exit_code == 1, result.output
    assert len(_shown_rows(result.stdout, table)) == SHOW_ROWS
    assert f"1 of {SHOW_ROWS + 1} rows not shown (showing the first {SHOW_ROWS})" in result.stdout
    assert "--limit N shows N, --all every row" in result.stdout and "--json" not in result.stdout
    assert f"0 changed, {SHOW_ROWS + 1} only in A, 0 only in B, 0 same" in result.stdout
    result = runner.invoke(app, ["table", "diff", str(a), str(b), "-n", "2"])
    assert len(_shown_rows(result.stdout, table)) == 2
    assert f"{SHOW_ROWS - 1} of {SHOW_ROWS + 1} rows not shown (showing the first 2)" in result.stdout
    result = runner.invoke(app, ["table", "diff", str(a), str(b), "--all"])
    assert len(_shown_rows(result.stdout, table)) == SHOW_ROWS + 1 and "not shown" not in result.stdout
    # the same rows listed with --same count towards the cap
    result = runner.invoke(app, ["table", "diff", str(a), str(a), "--same", "--limit", "3"])
    assert len(_shown_rows(result.stdout, table)) == 3 and f"{SHOW_ROWS - 2} of" in result.stdout
    help_text = runner.invoke(app, ["table", "diff", "--help"]).stdout
    assert "--limit" in help_text and f"first {SHOW_ROWS} of them" in help_text
    line = assert_one_line_error(runner.invoke(app, ["table", "diff", str(a), str(b), "-n", "3", "--all"]))
    assert "--limit N and --all: give one of them" in line


def _layout(table: ScheduleTable, n: int) -> list[tuple[str, str]]:
    """(M or [m_min,m_max], tag) of the rows of ``table`` with this N, in order."""
    return [(r.problem.describe().split("x")[0], r.provenance["tag"]) for r in table.rows if r.problem.n == n]


def test_merging_keeps_every_m_newer_rows_over_their_own_ms(runner: CliRunner, tmp_path: Path) -> None:
    """A new row takes only its own Ms; an older row it overlaps keeps the rest with its settings
    (trimmed, split in two, or removed when covered), except a row lookup takes first (measured
    before predicted, exact before range), which keeps its Ms; for reduce_scatter every part holds
    the Ms divisible by the world size. One (N, K) per layout; the merged files validate,
    round-trip and answer lookups by the rows that own each M."""
    key = cpu_fp().device_key
    path = table_path(tmp_path / "tables", key, **HEADER)

    def rng(lo: int, hi: int, n: int, tag: str, mode: str = "measure", **changes: Any) -> Schedule:
        return range_row(lo, hi, n=n, provenance={"tag": tag, "mode": mode}, **changes)

    def exact(m: int, n: int, tag: str, mode: str = "measure") -> Schedule:
        return dataclasses.replace(cpu_row(m, n=n), provenance={"tag": tag, "mode": mode})

    merge(path, [rng(1, 256, 96, "a"), rng(257, 1024, 96, "b"), rng(1025, 4096, 96, "c")])
    merge(
        path,
        [
            rng(1, 4096, 128, "a", groups=(1, 2)),
            exact(1500, 128, "x"),
            exact(64, 160, "e"),
            rng(100, 200, 160, "a"),
            exact(300, 160, "p", "predict"),
        ],
    )
    merge(path, [rng(1, 1000, 192, "m"), rng(1001, 3000, 192, "p", "predict")])
    merge(path, [rng(1, 1000, 224, "p", "predict"), exact(1200, 224, "e")])
    new = [
        rng(1, 512, 96, "n1"),  # partial over a, b, c; covers a
        rng(513, 2048, 96, "n2"),
        rng(1000, 2000, 128, "n"),  # inside an older range: splits it; goes around a measured exact row
        exact(3000, 128, "e"),  # an exact row inside a range splits it
        rng(1, 1000, 160, "n"),  # covers a range and a predicted exact row, not a measured one
        rng(500, 2000, 192, "q", "predict"),  # only the Ms no measured row holds
        rng(1, 500, 224, "m"),  # a measured row over a predicted one
        exact(1200, 224, "q", "predict"),  # a predicted row over a measured one: left out
    ]
    table = merge(path, new)
    assert _layout(table, 96) == [("[1,512]", "n1"), ("[513,2048]", "n2"), ("[2049,4096]", "c")]
    assert _layout(table, 128) == [
        ("[1,999]", "a"), ("[1000,1499]", "n"), ("1500", "x"), ("[1501,2000]", "n"),
        ("[2001,2999]", "a"), ("3000", "e"), ("[3001,4096]", "a"),
    ]  # fmt: skip
    assert _layout(table, 160) == [("[1,63]", "n"), ("64", "e"), ("[65,1000]", "n")]
    assert _layout(table, 192) == [("[1,1000]", "m"), ("[1001,2000]", "q"), ("[2001,3000]", "p")]
    assert _layout(table, 224) == [("[1,500]", "m"), ("[501,1000]", "p"), ("1200", "e")]
    parts = {
        (r.provenance["tag"], r.settings.groups)
        for r in table.rows
        if r.problem.n == 128 and r.problem.is_range
    }
    assert parts == {("a", (1, 2)), ("n", (3, 1))}  # each part keeps its row's settings

    rs = {**HEADER, "collective": "reduce_scatter"}
    rs_path = table_path(tmp_path / "tables", key, **rs)
    old = [rng(2, 1024, 96, "a", **rs), rng(1026, 2048, 96, "b", **rs), rng(2, 1025, 128, "a", **rs)]
    merge(rs_path, old, **rs)
    new = [rng(100, 300, 96, "n", **rs), rng(1028, 2046, 96, "m", **rs), rng(2, 1024, 128, "n", **rs)]
    rs_table = merge(rs_path, new, **rs)
    # a keeps the even Ms of [2,99] and [301,1024], b those of [1026,1027] and [2047,2048]
    assert _layout(rs_table, 96) == [
        ("[2,98]", "a"), ("[100,300]", "n"), ("[302,1024]", "a"),
        ("[1026,1026]", "b"), ("[1028,2046]", "m"), ("[2048,2048]", "b"),
    ]  # fmt: skip
    assert _layout(rs_table, 128) == [("[2,1024]", "n")]  # (a's [1025,1025] holds no even M)

    for file, merged in ((path, table), (rs_path, rs_table)):
        assert load_table(file) == merged  # round-trips
        result = runner.invoke(app, ["table", "validate", str(file)])
        assert result.exit_code == 0, result.output
    found = {
        (m, n): lookup_schedule("all_reduce", m, n, 48, dtype="bfloat16", world_size=2, device="cpu")
        for m, n in (
            (2500, 96),
            (3000, 96),
            (1200, 128),
            (1500, 128),
            (2500, 128),
            (3000, 128),
            (300, 160),
            (1500, 192),
            (2500, 192),
            (1200, 224),
        )
    }
    tags = {where: row.provenance["tag"] for where, row in found.items()}
    assert tags == {
        (2500, 96): "c", (3000, 96): "c", (1200, 128): "n", (1500, 128): "x", (2500, 128): "a",
        (3000, 128): "e", (300, 160): "n", (1500, 192): "q", (2500, 192): "p", (1200, 224): "e",
    }  # fmt: skip


# ------------------------------------------------------------------------------------ measured first
def test_a_predicted_row_never_replaces_a_measured_one(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    measured = cpu_row(64, mode="measure", measured_ms=1.0)
    merge(path, [measured, range_row(1, 32, provenance={"mode": "measure"})])
    predicted = cpu_row(64, mode="predict", predicted_ms=0.5)
    new = cpu_row(128, mode="predict", predicted_ms=0.7)
    table = merge(path, [predicted, new, range_row(16, 48, provenance={"mode": "predict"})])
    by_m = {row.problem.describe(): row for row in table.rows}
    assert by_m["64x96x48"].provenance["mode"] == "measure"  # kept
    assert by_m["128x96x48"].provenance["mode"] == "predict"  # nothing measured there: added
    assert by_m["[1,32]x96x48"].provenance["mode"] == "measure"  # a measured range keeps its Ms
    assert by_m["[33,48]x96x48"].provenance["mode"] == "predict"  # the predicted range takes the rest
    # a measured row replaces a predicted one
    table = merge(path, [cpu_row(128, mode="hybrid", measured_ms=0.8)])
    assert {r.problem.describe(): r for r in table.rows}["128x96x48"].provenance["mode"] == "hybrid"


def test_a_rows_basis_is_written_loaded_and_kept_by_merge(tmp_path: Path) -> None:
    """``basis`` (what a row rests on: an extrapolated calibration) is written only when set, so a
    table without it loads as before; merge keeps it; it stays out of the ops' schedule text; a
    measured row still replaces a predicted row that has one, and the runtime takes the measured
    row first (``best_row``)."""
    from fo_kernels.table import best_row

    path = tmp_path / "t.yaml"
    basis = "extrapolated from world size 2 (k) and NVLink facts"
    planned = dataclasses.replace(cpu_row(128, mode="predict", predicted_ms=0.7), basis=basis)
    plain = cpu_row(256, mode="predict", predicted_ms=0.9)
    assert planned.op_text == dataclasses.replace(planned, basis="").op_text
    assert "basis" not in plain.to_dict() and planned.to_dict()["basis"] == basis
    table = merge(path, [planned, plain])
    assert '"basis": "extrapolated from world size 2' in path.read_text()
    loaded = {row.problem.m: row for row in load_table(path).rows}
    assert loaded[128].basis == basis and loaded[256].basis == ""
    assert best_row([table], 128, 96, 48).basis == basis  # the only row: taken as a predicted one
    table = merge(path, [cpu_row(512, mode="measure", measured_ms=1.0)])
    assert {row.problem.m: row.basis for row in table.rows} == {128: basis, 256: "", 512: ""}
    measured = cpu_row(128, mode="hybrid", measured_ms=0.8)
    table = merge(path, [measured])
    assert best_row([table], 128, 96, 48) == measured
    table = merge(path, [planned])  # a predicted row never replaces a measured one
    assert best_row([load_table(path)], 128, 96, 48) == measured
    # a row that rests on another machine's calibration takes no M from one of this machine's
    # own, which takes its Ms back from it
    table = merge(path, [dataclasses.replace(cpu_row(256, mode="predict", predicted_ms=0.5), basis=basis)])
    assert best_row([table], 256, 96, 48) == plain
    table = merge(
        path, [dataclasses.replace(range_row(200, 300, provenance={"mode": "predict"}), basis=basis)]
    )
    assert best_row([table], 256, 96, 48) == plain
    assert best_row([table], 300, 96, 48).basis == basis
    own = range_row(250, 400, provenance={"mode": "predict"})
    table = merge(path, [own])
    assert best_row([table], 300, 96, 48).problem.describe() == "[257,400]x96x48"  # (around 256)
    assert best_row([table], 300, 96, 48).basis == "" and best_row([table], 200, 96, 48).basis == basis


def test_predicted_rows_keep_the_fingerprint_of_a_tables_measured_rows(tmp_path: Path) -> None:
    """The runtime's version-drift warning compares against the header: predicted rows (of a
    calibration made elsewhere, or with other versions) merged into a table of measured rows leave
    it; measured rows, or predicted rows into a table without measured ones, set it."""
    path = tmp_path / "t.yaml"
    ours, theirs = cpu_fp(), dataclasses.replace(cpu_fp(), torch="0.0-elsewhere")
    merge(path, [cpu_row(64, mode="measure", measured_ms=1.0)], fp=ours)
    merge(path, [cpu_row(128, mode="predict", predicted_ms=0.7)], fp=theirs)
    assert load_table(path).fingerprint == ours
    merge(path, [cpu_row(256, mode="measure", measured_ms=1.0)], fp=theirs)
    assert load_table(path).fingerprint == theirs
    fresh = tmp_path / "p.yaml"
    merge(fresh, [cpu_row(128, mode="predict")], fp=ours)
    merge(fresh, [cpu_row(256, mode="predict")], fp=theirs)
    assert load_table(fresh).fingerprint == theirs


def test_show_marks_predicted_rows(runner: CliRunner, tmp_path: Path) -> None:
    path = write(tmp_path / "t.yaml", [cpu_row(64, mode="measure"), cpu_row(128, mode="predict")])
    result = runner.invoke(app, ["table", "show", str(path)])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if "x96x48" in line}
    assert " measured " in lines["64x96x48"] and " predicted " in lines["128x96x48"]
    assert "1 predicted row(s)" in result.stdout
    text = runner.invoke(app, ["table", "show", str(path), "-f", "csv"]).stdout
    header = next(csv.reader(io.StringIO(text)))
    assert len(header) == len(set(header)), header  # provenance's mode beside the copy engine's
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [r["kind"] for r in rows] == ["measured", "predicted"]
    assert [r["provenance_mode"] for r in rows] == ["measure", "predict"]


def test_show_json_is_one_document_of_header_bases_and_rows(runner: CliRunner, tmp_path: Path) -> None:
    basis = "extrapolated from world size 2"
    predicted = dataclasses.replace(cpu_row(128, mode="predict"), basis=basis)
    path = write(tmp_path / "t.yaml", [cpu_row(64, mode="measure"), predicted])
    result = runner.invoke(app, ["table", "show", str(path), "--json"])
    assert result.exit_code == 0 and result.stderr == "", result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "fo-tune-table-show"
    (shown,) = doc["tables"]
    assert shown["path"] == str(path) and shown["fingerprint"]["device_key"] == cpu_fp().device_key
    assert (shown["collective"], shown["world_size"], shown["dtype"]) == ("all_reduce", 2, "bfloat16")
    assert shown["bases"] == [{"basis": basis, "rows": 1}]
    assert [r.pop("kind") for r in shown["rows"]] == ["measured", "predicted"]
    assert shown["rows"] == load_table(path).to_dict()["rows"]
    # errors as lookup --json's: one line on stderr, nothing on stdout
    for args in ([str(path), "-f", "csv"], ["-k", "nope"]):
        result = runner.invoke(app, ["table", "show", *args, "--json"])
        assert_one_line_error(result)
        assert result.stdout == ""


def test_validate_json_lists_every_file_and_keeps_the_exit_code(runner: CliRunner, tmp_path: Path) -> None:
    good = write(tmp_path / "good.yaml", [cpu_row(64), range_row(1, 100)])
    bad = write(tmp_path / "bad.yaml", [tweak(cpu_row(64), signal_tiles=1, groups=(2, 1))])
    broken = tmp_path / "broken.yaml"
    broken.write_text("schema_version: 9\n")
    result = runner.invoke(app, ["table", "validate", str(good), "--json"])
    assert result.exit_code == 0 and result.stderr == "", result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "fo-tune-table-validate" and doc["ok"] and doc["problems"] == 0
    (file,) = doc["files"]
    assert file["ok"] and file["rows"] == 2 and "lookup reads this table only as" in file["note"]
    result = runner.invoke(app, ["table", "validate", str(good), str(bad), str(broken), "--json"])
    line = assert_one_line_error(result)
    assert "2 problem(s) in 2 of 3 file(s)" in line, line
    doc = json.loads(result.stdout)
    assert not doc["ok"] and doc["problems"] == 2
    assert [(f["ok"], f["rows"]) for f in doc["files"]] == [(True, 2), (False, 1), (False, None)]
    assert "row 64x96x48: groups" in doc["files"][1]["problems"][0]
    assert "schema_version 9" in doc["files"][2]["problems"][0]


def _lookup(runner: CliRunner, *args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["table", "lookup", *args])
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.stdout)


def test_lookup_names_the_row_and_its_file(runner: CliRunner, tmp_path: Path) -> None:
    key = cpu_fp().device_key
    env, user = tmp_path / "tables", tmp_path / "xdg" / "fo-tune" / "tables"
    # the env folder comes first, but a measured row in a later folder beats its predicted row
    write(table_path(env, key, **HEADER), [cpu_row(64, mode="predict", predicted_ms=0.1)])
    measured = write(table_path(user, key, **HEADER), [cpu_row(64, mode="measure", measured_ms=0.2)])
    got = _lookup(runner, "--shape", "64x96x48", "-c", "all_reduce", "-w", "2", "-d", "bfloat16", "-k", key)
    assert got["source"] == str(measured) and got["kind"] == "measured"
    assert got["row"]["provenance"]["measured_ms"] == 0.2 and got["row"]["engine"] == "triton"
    # this machine's key by default; no row: overlap: false, and the files read
    got = _lookup(runner, "--shape", "96x96x48", "-k", key)
    assert got["source"].startswith("no table row") and got["row"]["overlap"] is False
    assert str(measured) in got["searched"]
    assert _lookup(runner, "--shape", "64x96x48")["device_key"] == current_fingerprint(None, 2).device_key


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--shape", "64x96"], "MxNxK"),
        (["--shape", "63x96x48", "-c", "reduce_scatter"], "divisible"),
        (["--shape", "64x96x48", "-c", "all_to_all"], "--collective"),
        (["--shape", "63x96x48", "-c", "all_gather"], "all_gather needs M divisible"),
        (["--shape", "64x96x48", "-d", "int8"], "--dtype"),
        # an empty value (an unset shell variable) looked the default up
        (["--shape", "64x96x48", "-c", ""], "--collective '': expected one of"),
        (["--shape", "64x96x48", "-d", ""], "--dtype '': expected one of"),
        (["--shape", "64x96x48", "-w", "0"], "--world-size"),
        ([], "--shape"),
        # a path for a key would read table files outside the table folders
        (["--shape", "64x96x48", "-k", "../../etc"], "a device key is a folder name"),
        (["--experts", "4096,1536,32,8", "--tokens", "5", "-k", ".."], "not a path"),
    ],
)
def test_lookup_bad_input_is_one_line(runner: CliRunner, args: list[str], needle: str) -> None:
    assert needle in assert_one_line_error(runner.invoke(app, ["table", "lookup", *args]))


@pytest.mark.parametrize("key", ["../..", "", "nvidia-h200-cc90-132sm-w2-nvlink18/.."])
def test_list_refuses_a_path_for_a_device_key(runner: CliRunner, key: str) -> None:
    """`table list -k PATH` was exit 0 with "no table for device key PATH", where lookup and show
    refuse the same -k as exit 2."""
    assert "a device key is a folder name" in assert_one_line_error(
        runner.invoke(app, ["table", "list", "-k", key])
    )


def test_lookup_refuses_a_table_of_a_removed_mode(runner: CliRunner, tmp_path: Path) -> None:
    """A schema-1 table whose row uses the removed exchange mode: exit 2, one line, what to do."""
    key = cpu_fp().device_key
    path = table_path(tmp_path / "tables", key, **HEADER)
    path.parent.mkdir(parents=True)
    data = ScheduleTable(fingerprint=cpu_fp(), **HEADER).to_dict() | {"schema_version": 1}
    data["rows"] = [
        {"problem": {"m": 64, "n": 96, "k": 48}, "engine": "copy_engine", "groups": [1], "exchange": True}
    ]
    path.write_text(yaml.safe_dump(data))
    line = assert_one_line_error(runner.invoke(app, ["table", "lookup", "--shape", "64x96x48", "-k", key]))
    assert "exchange" in line and str(path) in line


def test_a_table_under_another_tables_name_is_refused_as_the_runtime_refuses_it(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A world-size-4 table copied to the world-size-2 table's name: the runtime reads it for w2
    calls and raises; `table lookup` says the same (rather than print a row from the other folders
    as if the file were not there) and `table validate` is exit 2 saying where it belongs (not a
    pass with a note): its own device key's folder, since a rename in the w2 folder left it where
    no lookup reads it. A file holding another collective's rows is renamed in its folder."""
    w2 = cpu_fp().device_key
    fp4 = cpu_fp(4)
    row4 = dataclasses.replace(cpu_row(64), world_size=4)
    misplaced = write(table_path(tmp_path / "tables", w2, **HEADER), [row4], fp4, world_size=4)
    home = table_path(tmp_path / "tables", fp4.device_key, "all_reduce", 4, "bfloat16")
    line = assert_one_line_error(runner.invoke(app, ["table", "lookup", "-s", "64x96x48", "-k", w2]))
    assert str(misplaced) in line and "is for world size 4" in line and f"move it to {home}" in line, line
    result = runner.invoke(app, ["table", "validate", str(misplaced)])
    assert result.exit_code == 2, result.output
    line = assert_one_line_error(result)
    assert "a table of all_reduce-w4-bfloat16's rows under another call's name" in line, line
    assert "(world size 4, the folder's 2)" in line and line.endswith(f"move it to {home}"), line
    assert "move or rename the files named" in result.stdout
    scatter = dataclasses.replace(cpu_row(64), collective="reduce_scatter")
    write(misplaced, [scatter], collective="reduce_scatter")
    line = assert_one_line_error(runner.invoke(app, ["table", "lookup", "-s", "64x96x48", "-k", w2]))
    assert "holds reduce_scatter bfloat16 rows, expected all_reduce bfloat16" in line, line
    assert line.endswith("rename it to reduce_scatter-w2-bfloat16.yaml"), line
    result = runner.invoke(app, ["table", "validate", str(misplaced)])
    assert result.exit_code == 2 and "rename it to reduce_scatter-w2-bfloat16.yaml" in result.stderr
    # a file of any other name is never read by lookup: still a note only
    other = write(tmp_path / "mine.yaml", [cpu_row(64)])
    result = runner.invoke(app, ["table", "validate", str(other)])
    assert result.exit_code == 0 and "note: " in result.stdout, result.output


def test_list_shows_every_good_table_and_one_line_per_bad_file(runner: CliRunner, tmp_path: Path) -> None:
    """One malformed file among a fleet's tables: `table list` lists the others and says per bad
    file its path and why, exit 1 (not exit 2 with nothing listed at the first bad file). A table
    lookup refuses where it sits (a CPU table in the H200's folder) is listed and said too."""
    key, gpu = cpu_fp().device_key, H200["device_key"]
    user = tmp_path / "xdg" / "fo-tune" / "tables"
    good = write(table_path(tmp_path / "tables", key, **HEADER), [cpu_row(64)])
    gpu_good = gpu_table_file(tmp_path)
    broken = table_path(tmp_path / "tables", gpu, "all_reduce", 2, "float16")
    broken.write_text("schema_version: 2\nrows: [\n")
    bad_row = table_path(user, key, "reduce_scatter", 2, "bfloat16")
    bad_row.parent.mkdir(parents=True)
    bad_row.write_text(good.read_text().replace("all_reduce", "reduce_scatter").replace('"m": 64', '"m": -1'))
    copied = write(table_path(user, gpu, **HEADER), [cpu_row(64)])
    result = runner.invoke(app, ["table", "list"])
    assert result.exit_code == 1, result.output
    assert str(tmp_path / "tables") in result.stdout and "all_reduce" in result.stdout
    assert key in result.stdout and gpu in result.stdout  # the good tables
    errors = result.stderr.splitlines()
    assert len(errors) == 3 and all(line.startswith("error: ") for line in errors), errors
    assert str(broken) in errors[0] and "not valid YAML" in errors[0] and "Traceback" not in result.output
    assert str(bad_row) in errors[1]
    assert (
        f"{copied} sits in the folder of device key {gpu}, but its fingerprint is device key {key}"
        in errors[2]
    )
    doc = json.loads(runner.invoke(app, ["table", "list", "--json"]).stdout)
    assert [t["path"] for t in doc["tables"]] == [str(good), str(gpu_good), str(copied)]
    assert [bad["path"] for bad in doc["problems"]] == [str(broken), str(bad_row), str(copied)]
    assert all(bad["path"] in bad["error"] for bad in doc["problems"])
    # -k keeps one device key's folder: the other key's bad files are not this listing's
    result = runner.invoke(app, ["table", "list", "-k", key, "--json"])
    assert result.exit_code == 1 and [b["path"] for b in json.loads(result.stdout)["problems"]] == [
        str(bad_row)
    ]
    bad_row.unlink()
    result = runner.invoke(app, ["table", "list", "-k", key])
    assert result.exit_code == 0 and result.stderr == "", result.output


def test_list_names_a_table_folder_it_cannot_read_as_lookup_refuses_it(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A device key's folder that cannot be read (a symbolic link loop here; a folder without read
    permission alike): lookup refuses every call of that key, so `table list` says it, one line
    naming the folder, exit 1, and still lists the other tables (it listed them alone, exit 0)."""
    key, gpu = cpu_fp().device_key, H200["device_key"]
    good = write(table_path(tmp_path / "tables", key, **HEADER), [cpu_row(64)])
    loop = tmp_path / "tables" / gpu
    loop.symlink_to(loop)
    with pytest.raises(TableError, match="cannot read"):  # (as the runtime's lookup on that machine)
        lookup_table_row(gpu)
    result = runner.invoke(app, ["table", "list"])
    assert result.exit_code == 1 and key in result.stdout, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {loop}: cannot read the folder: "), line
    doc = json.loads(runner.invoke(app, ["table", "list", "--json"]).stdout)
    assert [t["path"] for t in doc["tables"]] == [str(good)]
    assert [bad["path"] for bad in doc["problems"]] == [str(loop)]
    assert runner.invoke(app, ["table", "list", "-k", key]).exit_code == 0  # (another key's folder)


def lookup_table_row(device_key: str) -> Any:
    """The row ``fo-tune table lookup -k device_key`` finds for one all_reduce call."""
    from fo_tune.tables.find import find_row

    return find_row(device_key, "all_reduce", 2, "bfloat16", 64, 64, 32)


def test_list_labels_a_table_by_the_device_key_lookup_takes(runner: CliRunner, tmp_path: Path) -> None:
    """An H200 table copied into an H100's folder (the same die: lookup takes it there): `table
    list` labels it with its folder's key, the one `table lookup -k` and `table list -k` take (it
    printed the H200's key, which finds nothing of that file); --json keeps the fingerprint's."""
    sibling = H200["device_key"].replace("nvidia-h200", "nvidia-h100-80gb-hbm3")
    copied = write(table_path(tmp_path / "tables", sibling, **HEADER), [gpu_row(8192)], h200_fp())
    result = runner.invoke(app, ["table", "list", "-k", sibling])
    assert result.exit_code == 0 and result.stderr == "", result.output
    (line,) = [line for line in result.stdout.splitlines() if "all_reduce" in line]
    assert line.split()[0] == sibling, result.stdout
    (entry,) = json.loads(runner.invoke(app, ["table", "list", "--json"]).stdout)["tables"]
    assert entry["device_key"] == sibling and entry["path"] == str(copied), entry
    assert entry["fingerprint_device_key"] == H200["device_key"], entry
    found = _lookup(runner, "-s", "8192x8192x4096", "-k", entry["device_key"])
    assert found["source"] == str(copied), found


def test_list_leaves_out_a_file_that_is_no_table_under_a_name_lookup_never_reads(
    runner: CliRunner, tmp_path: Path
) -> None:
    """Notes kept beside the tables (YAML that is no table, under a name lookup never reads): `table
    list` lists the tables, says on stderr the file is left out, and exits 0 (it was an error, exit
    1, for a file lookup skips); the same YAML under a table's name is still an error."""
    key = cpu_fp().device_key
    good = write(table_path(tmp_path / "tables", key, **HEADER), [cpu_row(64)])
    notes = good.with_name("notes.yaml")
    notes.write_text("hello: 1\n")
    result = runner.invoke(app, ["table", "list"])
    assert result.exit_code == 0 and key in result.stdout and "all_reduce" in result.stdout, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"note: {notes}: not listed, and lookup never reads it under this name"), line
    assert "(not a table: no kind and no schema_version (its keys: hello))" in line, line
    doc = json.loads(runner.invoke(app, ["table", "list", "--json"]).stdout)
    assert [t["path"] for t in doc["tables"]] == [str(good)] and doc["problems"] == []
    assert [n["path"] for n in doc["notes"]] == [str(notes)]
    notes.rename(good.with_name("reduce_scatter-w2-bfloat16.yaml"))
    result = runner.invoke(app, ["table", "list"])
    assert result.exit_code == 1 and result.stderr.startswith("error: "), result.output


def test_lookup_of_a_table_in_another_machines_folder_says_so_and_what_to_do(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A CPU-tuned table copied into the H200's folder: lookup -k H200 refuses it as the runtime
    does, saying the table's device key is not its folder's and where it belongs (it said the
    table "is for compute capability cpu", which named neither key)."""
    gpu, cpu = H200["device_key"], cpu_fp().device_key
    copied = write(table_path(tmp_path / "tables", gpu, **HEADER), [cpu_row(64)])
    line = assert_one_line_error(runner.invoke(app, ["table", "lookup", "-s", "64x96x48", "-k", gpu]))
    home = table_path(tmp_path / "tables", cpu, **HEADER)
    for text in (
        f"table {copied} sits in the folder of device key {gpu}, but its fingerprint is device key {cpu}",
        f"move it to {home} (then look it up with -k {cpu})",
        f"or tune a table for {gpu} with `fo-tune search`",
    ):
        assert text in line, line
    assert "compute capability" not in line
    # validate passed it with a note; lookup refuses it there, so it is a problem saying where it goes
    result = runner.invoke(app, ["table", "validate", str(copied)])
    assert result.exit_code == 2, result.output
    line = assert_one_line_error(result)
    for text in (
        f"its fingerprint is device key {cpu} (compute capability cpu, the folder's 9.0)",
        f"lookup on device key {gpu} reads this file for its calls and refuses it; move it to {home}",
    ):
        assert text in line, line


@pytest.mark.parametrize(
    "args",
    [
        ["table", "list"],
        ["table", "list", "--json"],
        ["table", "show"],
        ["table", "lookup", "--shape", "64x64x64", "-c", "all_reduce"],
        ["table", "lookup", "--experts", "64,64,2,2", "--tokens", "8"],
        ["bench", "--shape", "32x48x40"],
        ["demo", "--shape", "32x48x40"],
    ],
)
def test_a_table_dir_variable_naming_a_file_is_refused_by_every_command_that_reads_tables(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """$FO_TUNE_TABLE_DIR set to a file is exit 2 and one line, before any rank starts, from every
    command that reads the runtime's tables, as from search, instead of being skipped as if it named
    no tables."""
    not_a_folder = tmp_path / "tables.yaml"
    not_a_folder.write_text("x: 1\n")
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(not_a_folder))
    line = assert_one_line_error(runner.invoke(app, args))
    assert f"FO_TUNE_TABLE_DIR={not_a_folder} is a file, not a folder" in line, line
    assert "unset it" in line, line


def test_a_relative_xdg_data_home_is_ignored(runner: CliRunner, tmp_path: Path, monkeypatch) -> None:
    """A relative $XDG_DATA_HOME stands for ~/.local/share, as the XDG spec says: taken as it
    stood, a search wrote its table under the working folder, where the runtime of another
    working folder never looks."""
    monkeypatch.delenv("FO_TUNE_TABLE_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", "rel")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["search", "--mode", "predict", "--shape", "64x64x64", "--json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)["runs"]
    assert Path(run["table"]).is_relative_to(tmp_path / "home" / ".local" / "share" / "fo-tune" / "tables")
    assert not (tmp_path / "rel").exists()


def test_table_dir_env_is_read_by_search_as_by_the_runtime(
    runner: CliRunner, tmp_path: Path, monkeypatch
) -> None:
    """A search writes where the runtime reads: ``~`` in $FO_TUNE_TABLE_DIR (as a service's
    environment file gives it, unexpanded) is the home folder, not a folder named ``~`` under the
    working folder; a variable naming a file is exit 2 naming it, before any work."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", "~/tables")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["search", "--mode", "predict", "--shape", "64x64x64", "--json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)["runs"]
    assert Path(run["table"]).is_relative_to(tmp_path / "home" / "tables")
    assert Path(run["table"]).parent.parent in table_search_path()
    assert not (tmp_path / "~").exists()
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(tmp_path / "afile"))
    dense = ["search", "--mode", "predict", "--shape", "64x64x64"]
    for args in (dense, ["search", "-c", "moe", "--experts", "64,32,2,2"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [
            f"error: FO_TUNE_TABLE_DIR={tmp_path / 'afile'} is a file, not a folder of tables; point "
            "FO_TUNE_TABLE_DIR at a folder, unset it, or give --table-dir"
        ]
