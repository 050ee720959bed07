"""Tests of fo_kernels.table: file format, validation, atomic save, search path and lookup order."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fo_kernels.engines.copy_engine import cuda_device
from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.errors import (
    ArgumentError,
    HeuristicScheduleWarning,
    ScheduleError,
    TableError,
    TableNotFoundError,
    VersionDriftWarning,
)
from fo_kernels.fingerprint import CPU_NOMINAL_PROGRAMS, Fingerprint, current_fingerprint
from fo_kernels.plan import make_plan
from fo_kernels.runtime import OverlapRuntime
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.table import (
    MISS_SOURCE,
    TABLE_DIR_ENV,
    ScheduleTable,
    check_fingerprint,
    load_table,
    lookup_schedule,
    row_kind,
    save_table,
    table_filename,
    table_path,
    table_search_path,
)
from fo_kernels.table import format as table_format
from fo_kernels.table import lookup as table_lookup
from fo_kernels.table import paths as table_paths
from fo_kernels.tile import Tile

TILE = Tile(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
HEADER = {"collective": "all_reduce", "dtype": "bfloat16", "world_size": 2}


@pytest.fixture(autouse=True)
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Hermetic search path: env and user folders under tmp_path, no packaged tables, empty cache."""
    env_root, xdg = tmp_path / "env", tmp_path / "xdg"
    monkeypatch.setenv(TABLE_DIR_ENV, str(env_root))
    monkeypatch.setenv("XDG_DATA_HOME", str(xdg))
    monkeypatch.setattr(table_paths, "_packaged_table_dir", lambda: None)
    table_lookup._CACHE.clear()
    yield {"env": env_root, "user": xdg / "fo-tune" / "tables"}
    table_lookup._CACHE.clear()


def cpu_fp(**changes: Any) -> Fingerprint:
    return dataclasses.replace(current_fingerprint("cpu", world_size=2), **changes)


def exact_row(m: int = 64, n: int = 64, k: int = 32, tag: str = "exact", **header: Any) -> Schedule:
    # 64x64 output in 32x32 tiles: 4 tiles, one per unit, groups 2 + 2.
    return Schedule(
        **{**HEADER, **header},
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(tile=TILE, signal_tiles=1, groups=(2, 2)),
        provenance={"tag": tag},
    )


def range_row(m_min: int = 1, m_max: int = 4096, n: int = 64, k: int = 32, tag: str = "range") -> Schedule:
    return Schedule(
        **HEADER,
        problem=Problem(m_min=m_min, m_max=m_max, n=n, k=k),
        settings=TritonSettings(
            tile=TILE, signal_tiles=2, groups=(3, 1), layout="tile_major", wait_mode="spin"
        ),
        provenance={"tag": tag},
    )


def no_overlap_row(m: int = 8, n: int = 64, k: int = 32) -> Schedule:
    return Schedule(**HEADER, problem=Problem(m=m, n=n, k=k))


def make_table(rows: list[Schedule], fp: Fingerprint | None = None) -> ScheduleTable:
    return ScheduleTable(fingerprint=fp or cpu_fp(), **HEADER, rows=rows)


def write(root: Path, rows: list[Schedule], fp: Fingerprint | None = None) -> Path:
    fp = fp or cpu_fp()
    path = table_path(root, fp.device_key, "all_reduce", 2, "bfloat16")
    save_table(make_table(rows, fp), path)
    return path


def write_raw(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "raw.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def valid_dict() -> dict[str, Any]:
    return make_table([exact_row(), range_row()]).to_dict()


# ------------------------------------------------------------------------------------ paths
def test_paths() -> None:
    assert table_filename("reduce_scatter", 4, "float16") == "reduce_scatter-w4-float16.yaml"
    assert table_path("/r", "key", "all_reduce", 2, "bfloat16") == Path("/r/key/all_reduce-w2-bfloat16.yaml")
    with pytest.raises(ScheduleError, match="all_reduce"):
        table_filename("all_to_all", 2, "bfloat16")


def test_all_gather_table_round_trip(tmp_path: Path) -> None:
    """all_gather tables: their own file name; a row's M is the gathered M."""
    assert table_filename("all_gather", 2, "float16") == "all_gather-w2-float16.yaml"
    header = {"collective": "all_gather", "dtype": "float16", "world_size": 2}
    row = Schedule(
        **header,
        problem=Problem(m=128, n=64, k=32),
        settings=TritonSettings(tile=TILE, signal_tiles=8, groups=(1, 1), layout="row_band"),
    )
    small = Schedule(**header, problem=Problem(m=8, n=4, k=4))
    path = tmp_path / table_filename("all_gather", 2, "float16")
    save_table(ScheduleTable(fingerprint=cpu_fp(), **header, rows=[row, small]), path)
    assert load_table(path).rows == [small, row]  # sorted by (n, k, m)


def test_search_path_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, roots: dict[str, Path]) -> None:
    monkeypatch.setattr(table_paths, "_packaged_table_dir", lambda: tmp_path / "pkg")
    assert table_search_path() == [roots["env"], roots["user"], tmp_path / "pkg"]
    monkeypatch.delenv(TABLE_DIR_ENV)
    assert table_search_path() == [roots["user"], tmp_path / "pkg"]
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert table_search_path()[0] == tmp_path / "home" / ".local" / "share" / "fo-tune" / "tables"


# ------------------------------------------------------------------------------------ round trip
def test_round_trip(tmp_path: Path) -> None:
    table = make_table([exact_row(), range_row(), no_overlap_row()])
    path = tmp_path / "a" / "b" / "t.yaml"
    save_table(table, path)
    loaded = load_table(path)
    assert loaded == table
    assert loaded.rows == table.rows
    assert len(loaded.rows) == 3
    assert any(r.problem.is_range for r in loaded.rows)
    assert any(not r.overlap for r in loaded.rows)
    assert loaded.fingerprint == table.fingerprint


def test_file_format(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    save_table(make_table([exact_row(), no_overlap_row()]), path)
    data = yaml.safe_load(path.read_text())
    assert list(data)[:2] == ["schema_version", "kind"]
    assert data["schema_version"] == 2 and data["kind"] == "fo-tune-schedule-table"
    assert data["fingerprint"]["device_key"] == cpu_fp().device_key
    assert (data["collective"], data["world_size"], data["dtype"]) == ("all_reduce", 2, "bfloat16")
    for row in data["rows"]:
        assert not {"collective", "dtype", "world_size"} & set(row)
    assert data["rows"][0] == {"problem": {"m": 8, "n": 64, "k": 32}, "overlap": False}
    assert data["rows"][1]["engine"] == "triton" and data["rows"][1]["settings"]["groups"] == [2, 2]


# A schema-1 file: every engine's fields side by side in the row (tables written before the
# Schedule became common fields plus one engine's settings).
V1_ROWS = [
    {"problem": {"m": 8, "n": 64, "k": 32}, "overlap": False, "provenance": {"tag": "none"}},
    {
        "problem": {"m": 64, "n": 64, "k": 32},
        "overlap": True,
        "tile": {"block_m": 32, "block_n": 32, "block_k": 32, "group_m": 2, "num_warps": 4, "num_stages": 1},
        "sms_free": 0,
        "nccl_max_ctas": 0,
        "signal_tiles": 1,
        "groups": [2, 2],
        "layout": "tile_major",
        "wait_mode": "spin",
    },
    {"problem": {"m": 128, "n": 64, "k": 32}, "overlap": True, "engine": "copy_engine", "groups": [2, 1]},
    {
        "problem": {"m_min": 256, "m_max": 512, "n": 64, "k": 32},
        "overlap": True,
        "engine": "copy_engine",
        "groups": [1],
        "tile": {"block_m": 32, "block_n": 32, "block_k": 32, "group_m": 2, "num_warps": 4, "num_stages": 1},
    },
]


def test_schema_1_tables_load_and_save_as_schema_2(tmp_path: Path) -> None:
    data = {**valid_dict(), "schema_version": 1, "rows": V1_ROWS}
    table = load_table(write_raw(tmp_path, data))
    none, triton, ring, tiled = table.rows
    assert none.engine is None and none.provenance == {"tag": "none"}
    assert triton.settings == TritonSettings(tile=TILE, signal_tiles=1, groups=(2, 2), wait_mode="spin")
    assert ring.settings == CopyEngineSettings(mode="ring", weights=(2, 1))
    assert tiled.settings == CopyEngineSettings(mode="tiled", weights=(1,), tile=TILE)
    out = tmp_path / "upgraded.yaml"
    save_table(table, out)
    assert yaml.safe_load(out.read_text())["schema_version"] == 2
    assert load_table(out).rows == table.rows


def test_schema_1_exchange_rows_are_refused_with_what_to_do(tmp_path: Path) -> None:
    row = {**V1_ROWS[2], "exchange": True}
    path = write_raw(tmp_path, {**valid_dict(), "schema_version": 1, "rows": [row]})
    with pytest.raises(
        TableError, match=r"rows\[0\]: exchange: .*no longer exists; re-tune .*fo-tune search"
    ):
        load_table(path)


def test_atomic_save_leaves_no_temp_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.yaml"
    save_table(make_table([exact_row()]), path)
    save_table(make_table([exact_row(), range_row()]), path)
    assert os.listdir(tmp_path) == ["t.yaml"]
    before = path.read_text()

    def fail(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(table_format.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        save_table(make_table([no_overlap_row()]), path)
    assert os.listdir(tmp_path) == ["t.yaml"]
    assert path.read_text() == before


def test_save_refuses_rows_changed_in_place_into_duplicates_or_overlaps(tmp_path: Path) -> None:
    """Rows appended to ``table.rows`` (not through ``upsert``) into two for one problem, or M
    ranges that overlap, are refused by ``save_table`` naming both rows: the file (which every
    reader would refuse) is not written, and the one there is kept."""
    path = tmp_path / "t.yaml"
    save_table(make_table([exact_row(), range_row(1, 32, n=96)]), path)
    before = path.read_text()
    dup = make_table([exact_row(), range_row(1, 32, n=96)])
    dup.rows.append(exact_row(tag="again"))
    with pytest.raises(TableError, match=r"t\.yaml: not written: rows\[0\] and rows\[2\] are both for"):
        save_table(dup, path)
    overlap = make_table([exact_row(), range_row(1, 32, n=96)])
    overlap.rows.append(range_row(16, 64, n=96))
    with pytest.raises(TableError, match=r"rows\[1\] \(\[1,32\]x96x32\) and rows\[2\] .* overlap"):
        save_table(overlap, path)
    assert path.read_text() == before and os.listdir(tmp_path) == ["t.yaml"]
    load_table(path)


def test_upsert_replaces_and_sorts() -> None:
    table = make_table([range_row(), exact_row(m=128, tag="a"), exact_row(m=64)])
    assert [r.problem.describe() for r in table.rows] == ["[1,4096]x64x32", "64x64x32", "128x64x32"]
    table.upsert(exact_row(m=128, tag="b"))
    assert len(table.rows) == 3
    assert table.find(128, 64, 32).provenance["tag"] == "b"
    with pytest.raises(TableError, match="dtype"):
        table.upsert(exact_row(dtype="float16"))


def test_duplicate_row_in_file_is_refused_naming_both_rows(tmp_path: Path) -> None:
    data = valid_dict()
    dup = exact_row(tag="later").to_dict()
    for key in HEADER:
        del dup[key]
    data["rows"].append(dup)
    path = write_raw(tmp_path, data)
    with pytest.raises(TableError, match=r"rows\[1\] and rows\[2\] are both for problem 64x64x32"):
        load_table(path)
    with pytest.raises(TableError, match=r"rows\[1\] and rows\[2\]"):
        table_lookup.read_table(path)  # the runtime's view refuses it as well


def test_overlapping_ranges_are_refused_naming_both_rows() -> None:
    with pytest.raises(
        TableError,
        match=r"rows\[0\] \(\[1,4096\]x64x32\) and rows\[2\] \(\[4000,8000\]x64x32\) overlap for M in "
        r"\[4000,4096\]",
    ):
        make_table([range_row(), exact_row(), range_row(m_min=4000, m_max=8000)])
    table = make_table([range_row(m_max=100), exact_row()])
    with pytest.raises(TableError, match="overlap"):
        table.upsert(range_row(m_min=50, m_max=200))
    assert len(table.rows) == 2  # unchanged


def test_find_exact_beats_range() -> None:
    table = make_table([range_row(), exact_row()])
    assert table.find(64, 64, 32).provenance["tag"] == "exact"
    assert table.find(65, 64, 32).provenance["tag"] == "range"
    assert table.find(5000, 64, 32) is None
    assert table.find(64, 64, 64) is None


# ------------------------------------------------------------------------------------ validation
def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TableNotFoundError, match="fo-tune search") as info:
        load_table(tmp_path / "nope.yaml")
    assert isinstance(info.value, FileNotFoundError)
    assert TABLE_DIR_ENV in str(info.value)


def test_unknown_schema_version(tmp_path: Path) -> None:
    path = write_raw(tmp_path, {**valid_dict(), "schema_version": 3})
    with pytest.raises(TableError, match=r"supported: 1, 2.*fo-tune search"):
        load_table(path)


def test_malformed_yaml(tmp_path: Path) -> None:
    path = write_raw(tmp_path, "schema_version: 1\nrows: [\n  - {m: 1\n")
    with pytest.raises(TableError) as info:
        load_table(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", ""])
def test_non_mapping_yaml(tmp_path: Path, text: str) -> None:
    path = write_raw(tmp_path, text)
    with pytest.raises(TableError, match="mapping"):
        load_table(path)


def test_row_field_error_names_field(tmp_path: Path) -> None:
    data = valid_dict()
    data["rows"][1]["settings"]["tile"]["block_m"] = 100
    path = write_raw(tmp_path, data)
    with pytest.raises(TableError) as info:
        load_table(path)
    message = str(info.value)
    assert str(path) in message and "rows[1]" in message and "tile.block_m" in message


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "[1.0, .nan]", "{ms: .nan}"])
def test_a_non_finite_provenance_number_is_refused(tmp_path: Path, value: str) -> None:
    """A NaN or infinity in a row's provenance (hand-edited, YAML's .nan) is refused where a table
    is read whole (the tuner's commands: validate, show, model check, merges), naming the file, the
    row and the key, also for a row that shares an earlier row's settings (read by their shortcut);
    a row built with one cannot join a table to be written. Accepted, it made `fo-tune model check`
    print "MAPE nan%". The runtime's lookup, which ignores provenance, still takes the row."""
    from fo_tune.tables.kinds import load_any_table

    data = valid_dict()
    same = dict(data["rows"][0], problem={"m": 128, "n": 64, "k": 32}, provenance={"tag": "same"})
    data["rows"] = [data["rows"][0], same, *data["rows"][1:]]
    data["rows"][1]["provenance"]["x"] = "VALUE"
    path = write_raw(tmp_path, yaml.safe_dump(data, sort_keys=False).replace("VALUE", value))
    for read in (load_table, load_any_table):
        with pytest.raises(TableError, match=rf"{path}: rows\[1\]: provenance\.x.*: not a finite number"):
            read(path)
    assert table_lookup.read_table(path).row(1).problem.m == 128
    table = make_table([range_row()])
    with pytest.raises(ScheduleError, match=r"provenance\.tag: not a finite number"):
        table.upsert(dataclasses.replace(exact_row(), provenance={"tag": float("nan")}))


def test_a_pipe_or_device_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A table path that is a named pipe (or a device: /dev/zero) is refused, not read: the read
    of a pipe waited for a writer forever, /dev/zero's filled the memory until the process died."""
    pipe = tmp_path / "all_reduce-w2-bfloat16.yaml"
    os.mkfifo(pipe)
    for read in (load_table, table_lookup.read_table):
        with pytest.raises(TableError, match="not a file \\(a device, a pipe or a socket\\)"):
            read(pipe)


def test_row_header_mismatch(tmp_path: Path) -> None:
    data = valid_dict()
    data["rows"][0]["dtype"] = "float16"
    with pytest.raises(TableError, match=r"rows\[0\]: dtype"):
        load_table(write_raw(tmp_path, data))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"kind": "something-else"}, "kind"),
        ({"collective": "all_to_all"}, "collective"),
        ({"rows": {"a": 1}}, "rows"),
        ({"extra": 1}, "extra"),
    ],
)
def test_header_errors(tmp_path: Path, change: dict[str, Any], needle: str) -> None:
    with pytest.raises(TableError, match=needle):
        load_table(write_raw(tmp_path, {**valid_dict(), **change}))


def test_fingerprint_error_in_file(tmp_path: Path) -> None:
    data = valid_dict()
    del data["fingerprint"]["gpu_name"]
    with pytest.raises(TableError, match=r"fingerprint\.gpu_name"):
        load_table(write_raw(tmp_path, data))


# ------------------------------------------------------------------------------------ fingerprint
def test_check_fingerprint_refuses_other_capability() -> None:
    table = make_table([exact_row()], cpu_fp(compute_capability="9.0", gpu_name="NVIDIA H200"))
    with pytest.raises(TableError, match=r"compute capability 9.0 \(NVIDIA H200\).*fo-tune search"):
        check_fingerprint(table, cpu_fp(), source="t.yaml")


def test_check_fingerprint_refuses_other_world_size() -> None:
    with pytest.raises(TableError, match="world size 2"):
        check_fingerprint(make_table([exact_row()]), cpu_fp(world_size=4), source="t.yaml")


def test_check_fingerprint_warns_on_drift() -> None:
    table = make_table([exact_row()], cpu_fp(torch="0.0.1", nccl="1.2.3"))
    with pytest.warns(VersionDriftWarning, match=r"torch 0\.0\.1") as record:
        check_fingerprint(table, cpu_fp(), source="t.yaml")
    assert len(record) == 1
    assert "nccl 1.2.3" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_fingerprint(make_table([exact_row()]), cpu_fp(), source="t.yaml")  # no drift, no warning


def test_lookup_refuses_table_for_other_gpu(roots: dict[str, Path]) -> None:
    path = write(roots["env"], [exact_row()], cpu_fp(compute_capability="9.0", gpu_name="NVIDIA H200"))
    with pytest.raises(TableError, match=r"compute capability 9\.0") as info:
        lookup_schedule("all_reduce", 64, 64, 32, dtype="bfloat16", world_size=2, device="cpu")
    assert str(path) in str(info.value)


def test_lookup_says_where_a_table_of_another_world_size_belongs(roots: dict[str, Path]) -> None:
    """A world-size-4 table copied to the world-size-2 table's path: the runtime's refusal says where
    it belongs, as `fo-tune table validate` does (its own device key's folder, under its own name),
    not only to tune another."""
    fp4 = current_fingerprint("cpu", 4)
    path = table_path(roots["env"], cpu_fp().device_key, "all_reduce", 2, "bfloat16")
    save_table(ScheduleTable(fingerprint=fp4, **{**HEADER, "world_size": 4}, rows=[]), path)
    home = roots["env"] / fp4.device_key / "all_reduce-w4-bfloat16.yaml"
    with pytest.raises(TableError, match="is for world size 4") as info:
        lookup_schedule("all_reduce", 64, 64, 32, dtype="bfloat16", world_size=2, device="cpu")
    assert f"move it to {home}, and tune one for world size 2" in str(info.value), info.value


def test_lookup_warns_on_version_drift(roots: dict[str, Path]) -> None:
    write(roots["env"], [exact_row()], cpu_fp(torch="0.0.1"))
    with pytest.warns(VersionDriftWarning, match=r"torch 0\.0\.1"):
        found = lookup_schedule("all_reduce", 64, 64, 32, dtype="bfloat16", world_size=2, device="cpu")
    assert found.provenance["tag"] == "exact"


# ------------------------------------------------------------------------------------ lookup
def lookup(m: int, n: int = 64, k: int = 32, **kwargs: Any) -> Schedule:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a table hit must not warn
        return lookup_schedule("all_reduce", m, n, k, dtype="bfloat16", world_size=2, device="cpu", **kwargs)


def test_lookup_exact_beats_range_across_folders(roots: dict[str, Path]) -> None:
    write(roots["env"], [range_row(tag="env-range")])
    write(roots["user"], [exact_row(tag="user-exact")])
    assert lookup(64).provenance["tag"] == "user-exact"
    assert lookup(100).provenance["tag"] == "env-range"


def predicted(row: Schedule) -> Schedule:
    """``row`` as a predict-mode search writes it (chosen by the cost model alone)."""
    return dataclasses.replace(row, provenance={**row.provenance, "mode": "predict"})


def test_lookup_measured_beats_predicted_across_folders(
    roots: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A predict search's rows in the user folder do not shadow the measured rows behind them; among
    rows of one kind the folder order decides, and exact rows come before M-range rows."""
    monkeypatch.setattr(table_lookup, "TABLE_RECHECK_S", 0.0)  # every call looks at the files again
    write(roots["env"], [predicted(exact_row(tag="env-predicted")), predicted(range_row(tag="env-pr-range"))])
    write(roots["user"], [range_row(tag="user-range")])
    assert row_kind(lookup(64)) == "measured" and lookup(64).provenance["tag"] == "user-range"
    write(roots["user"], [exact_row(tag="user-exact"), range_row(tag="user-range")])
    assert lookup(64).provenance["tag"] == "user-exact"
    write(roots["user"], [predicted(exact_row(tag="user-predicted"))])
    assert lookup(64).provenance["tag"] == "env-predicted"  # both predicted: the folder order
    assert lookup(100).provenance["tag"] == "env-pr-range"


def test_lookup_range_row_when_no_exact(roots: dict[str, Path]) -> None:
    write(roots["user"], [range_row(m_min=32, m_max=512)])
    found = lookup(257)
    assert found.problem.is_range and found.provenance["tag"] == "range"
    make_plan(found, 257, 64, 32, sm_count=CPU_NOMINAL_PROGRAMS)  # the range row fits this M


def test_lookup_env_folder_beats_user_folder(roots: dict[str, Path]) -> None:
    write(roots["env"], [exact_row(tag="env"), range_row(tag="env-range")])
    write(roots["user"], [exact_row(tag="user"), range_row(tag="user-range")])
    assert lookup(64).provenance["tag"] == "env"
    assert lookup(100).provenance["tag"] == "env-range"


def test_lookup_accepts_torch_dtype(roots: dict[str, Path]) -> None:
    write(roots["user"], [exact_row()])
    found = lookup_schedule("all_reduce", 64, 64, 32, dtype=torch.bfloat16, world_size=2, device="cpu")
    assert found.provenance["tag"] == "exact"


def test_lookup_sees_rewritten_table(roots: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table_lookup, "TABLE_RECHECK_S", 0.0)  # every call looks at the files again
    write(roots["env"], [exact_row(tag="old")])
    assert lookup(64).provenance["tag"] == "old"
    write(roots["env"], [exact_row(tag="new"), range_row()])
    assert lookup(64).provenance["tag"] == "new"


def test_repeated_lookup_is_answered_from_memory(
    roots: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within TABLE_RECHECK_S a repeated call touches no file (the per-GEMM cost on a slow
    filesystem); after it, a rewritten table is read."""
    write(roots["env"], [exact_row(tag="old")])
    assert lookup(64).provenance["tag"] == "old"
    write(roots["env"], [exact_row(tag="new")])

    def no_files(path: Path) -> None:
        raise AssertionError(f"looked at {path}")

    with monkeypatch.context() as mp:
        mp.setattr(table_lookup._CACHE, "load", no_files)
        assert lookup(64).provenance["tag"] == "old"
    monkeypatch.setattr(table_lookup, "TABLE_RECHECK_S", 0.0)
    assert lookup(64).provenance["tag"] == "new"


@pytest.mark.parametrize(
    ("collective", "m", "n", "k", "dtype"),
    [
        ("all_reduce", 257, 130, 70, torch.bfloat16),
        ("all_reduce", 1, 1, 1, "float32"),
        ("reduce_scatter", 258, 130, 70, "float16"),
        ("reduce_scatter", 1024, 96, 48, torch.float32),
        ("all_gather", 258, 130, 70, "float32"),
    ],
)
def test_table_miss_runs_overlap_false_and_warns_once(
    roots: dict[str, Path], collective: str, m: int, n: int, k: int, dtype: Any
) -> None:
    """A call no row matches gets GEMM then the collective (never slower than sequential, never an
    engine measured to lose), and one warning naming what was looked for and how to tune it."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        found = lookup_schedule(collective, m, n, k, dtype=dtype, world_size=2, device="cpu")
    assert len(record) == 1
    assert issubclass(record[0].category, HeuristicScheduleWarning)
    message = str(record[0].message)
    assert f"{m}x{n}x{k}" in message and collective in message
    assert cpu_fp().device_key in message and str(roots["env"]) in message and str(roots["user"]) in message
    assert isinstance(found, Schedule)
    assert found.problem == Problem(m=m, n=n, k=k) and found.collective == collective
    assert found.world_size == 2 and not found.overlap and found.provenance == {"source": MISS_SOURCE}
    assert f"fo-tune search --shape {m}x{n}x{k} -c {collective} --world-size 2" in message
    # a CPU's rows come from measuring its gloo ranks (without --mode the search plans an H200)
    assert message.endswith(f"--dtype {found.dtype} --mode measure`"), message


def test_table_miss_on_the_cpu_names_a_search_that_runs_for_a_gpu_sized_shape(roots: dict[str, Path]) -> None:
    """A CPU call no row matches, of a shape above the CPU's limit: the hint's measuring search
    carries --allow-slow (without it the search refuses the shape, exit 2) and says what it costs;
    a shape within the limit gets the plain measuring search."""
    from fo_tune.search import SearchError
    from fo_tune.search.setup import check_cpu_sized

    for m, n, k, slow in [(6000, 8192, 4096, True), (1020, 1024, 1024, False)]:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            lookup_schedule("reduce_scatter", m, n, k, dtype="bfloat16", world_size=6, device="cpu")
        (message,) = [str(w.message) for w in record]
        command = message.split("`")[-2]
        assert command.startswith(f"fo-tune search --shape {m}x{n}x{k} -c reduce_scatter --world-size 6")
        assert command.endswith(" --mode measure --allow-slow" if slow else " --mode measure"), command
        assert message.endswith("(hours: every trial runs in Triton's CPU interpreter)") == slow, message
        check_cpu_sized("measure", "gloo", [(m, n, k)], None, allow_slow=slow)  # the hint runs
        if slow:
            with pytest.raises(SearchError, match="--allow-slow"):
                check_cpu_sized("measure", "gloo", [(m, n, k)], None, allow_slow=False)


def test_a_device_key_given_as_the_lookup_device_names_the_command_that_answers_for_it(
    roots: dict[str, Path],
) -> None:
    """A CPU-only user passes the planned machine's device key as ``device=``: an ArgumentError (a
    ValueError) saying it is a key, not a device, and naming `fo-tune table lookup -k KEY`, the
    way to see that machine's row; a string that is neither stays the plain refusal."""
    from fo_kernels.errors import ArgumentError

    key = "nvidia-h200-cc90-132sm-w8-nvlink18"
    with pytest.raises(ArgumentError, match="is a device key, not a device") as caught:
        lookup_schedule("all_reduce", 4096, 8192, 4096, dtype="bfloat16", world_size=8, device=key)
    assert isinstance(caught.value, ValueError)
    assert f"`fo-tune table lookup --shape MxNxK -c COLLECTIVE -k {key}`" in str(caught.value)
    with pytest.raises(ArgumentError, match="'foo' is not a device"):
        lookup_schedule("all_reduce", 4096, 8192, 4096, dtype="bfloat16", world_size=8, device="foo")


def test_table_miss_names_other_machines_tables_of_the_call(roots: dict[str, Path]) -> None:
    """A CPU-only machine holding an offline plan for an H200 (its tables under the H200's device
    key): a miss here names that key and the command that shows its row; a table of another
    collective or world size is not named."""
    key = "nvidia-h200-cc90-132sm-w2-nvlink18"
    h200 = cpu_fp(gpu_name="NVIDIA H200", compute_capability="9.0", sm_count=132, device_key=key)
    write(roots["user"], [exact_row()], h200)
    other = table_path(roots["env"], "nvidia-h100-cc90-132sm-w4-nvlink18", "all_reduce", 4, "bfloat16")
    other.parent.mkdir(parents=True)
    other.write_text("")
    with pytest.warns(HeuristicScheduleWarning) as record:
        lookup_schedule("all_reduce", 4096, 8192, 4096, dtype="bfloat16", world_size=2, device="cpu")
    (message,) = [str(w.message) for w in record]
    assert f"other machines' tables hold all_reduce-w2-bfloat16.yaml: {h200.device_key} (" in message
    assert "`fo-tune table lookup --shape 4096x8192x4096 -c all_reduce -k KEY`" in message
    assert "h100" not in message, message


def test_heuristic_fallback_names_tables_without_match(roots: dict[str, Path]) -> None:
    path = write(roots["user"], [exact_row()])
    with pytest.warns(HeuristicScheduleWarning) as record:
        lookup_schedule("all_reduce", 64, 64, 64, dtype="bfloat16", world_size=2, device="cpu")
    assert len(record) == 1
    assert str(path) in str(record[0].message)


def test_a_table_dir_variable_naming_a_file_warns_and_the_other_folders_answer(
    roots: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$FO_TUNE_TABLE_DIR`` set to a file: the lookup says so (``TableDirWarning``, naming the
    variable) and still finds the user folder's row."""
    from fo_kernels import TableDirWarning

    write(roots["user"], [exact_row()])
    not_a_folder = roots["env"].parent / "tables.yaml"
    not_a_folder.write_text("rows: []\n")
    monkeypatch.setenv(TABLE_DIR_ENV, str(not_a_folder))
    with pytest.warns(TableDirWarning, match=rf"{TABLE_DIR_ENV}=.*tables.yaml is a file, not a folder"):
        found = lookup_schedule("all_reduce", 64, 64, 32, dtype="bfloat16", world_size=2, device="cpu")
    assert found.provenance == {"tag": "exact"}


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"collective": "all_to_all"}, ScheduleError, "reduce_scatter"),
        ({"dtype": "fp8"}, ScheduleError, "bfloat16"),
        ({"dtype": torch.int8}, ScheduleError, "bfloat16"),
        ({"m": 0}, ValueError, "m"),
        ({"collective": "reduce_scatter", "m": 257}, ValueError, "divisible"),
        ({"collective": "all_gather", "m": 257}, ValueError, "all_gather needs M divisible"),
        ({"dtype": ["bfloat16"]}, ScheduleError, "bfloat16"),  # unhashable: not a TypeError
        ({"m": [64]}, ValueError, "m"),
        ({"m": 64.0}, ValueError, "m"),  # equal (and hash-equal) to the good call's 64
        ({"k": True}, ValueError, "k"),
    ],
)
def test_lookup_bad_input(
    roots: dict[str, Path], kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    """Refused with what is wrong, also right after a good call of the same shape (a repeated call
    is answered from memory before its arguments are checked again)."""
    args = {"collective": "all_reduce", "m": 64, "n": 64, "k": 32, "dtype": "bfloat16"} | kwargs
    # the good call: the same sizes as ints where they are a bool or a float (True == 1, 64.0 == 64)
    good = [
        int(v) if isinstance(v, bool | float) else v if isinstance(v, int) and v >= 1 else 64
        for v in (args["m"], args["n"], args["k"])
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeuristicScheduleWarning)
        lookup_schedule("all_reduce", *good, dtype="bfloat16", world_size=2, device="cpu")
    collective, m, n, k, dtype = (args[key] for key in ("collective", "m", "n", "k", "dtype"))
    with pytest.raises(error, match=needle):
        lookup_schedule(collective, m, n, k, dtype=dtype, world_size=2, device="cpu")


@pytest.mark.parametrize("device", ["foo", "cuda:x", -1, 3.5])
def test_a_device_torch_cannot_read_is_an_argument_error(device: Any) -> None:
    """``lookup_schedule``, ``OverlapRuntime`` and ``cuda_device`` name the device and the forms
    they take, as a ValueError of fo-tune's rather than torch's RuntimeError or TypeError."""
    with pytest.raises(ArgumentError, match=r"device: .* give 'cpu', 'cuda', 'cuda:N'"):
        lookup_schedule("all_reduce", 64, 64, 32, dtype="bfloat16", world_size=2, device=device)
    with pytest.raises(ArgumentError, match=re.escape(repr(device))):
        OverlapRuntime(device=device)
    with pytest.raises(ArgumentError, match=re.escape(repr(device))):
        cuda_device(device)  # the copy engine's virtual ranks
