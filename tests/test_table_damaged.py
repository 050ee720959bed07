"""Damaged and hand-edited table files: whatever a file holds, the runtime's lookup raises a
``TableError`` naming the file and what to do, and the `fo-tune table` commands exit 2 (list: 1)
with one line on stderr, never a Python error from the parsers underneath."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from big_table import write_big_table
from cli import app
from cli_checks import assert_one_line_error, isolate_tables
from fo_kernels.errors import TableError
from fo_kernels.fingerprint import current_fingerprint
from fo_kernels.table import lookup as table_lookup
from fo_kernels.table import lookup_schedule, table_path
from fo_kernels.table import paths as table_paths

# The first row big_table writes: 64x1024x1024, a copy-engine row.
FIRST_ROW = '{"problem": {"m": 64, "n": 1024, "k": 1024}'


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_tables(monkeypatch, tmp_path)
    monkeypatch.setattr(table_paths, "_packaged_table_dir", lambda: None)
    table_lookup._CACHE.clear()
    yield
    table_lookup._CACHE.clear()


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def _table(tmp_path: Path, name: str = "all_reduce-w2-bfloat16.yaml") -> Path:
    """A 20-row all_reduce bfloat16 table of this machine (world size 2), where lookup reads it
    under the file name ``name``."""
    fp = current_fingerprint("cpu", world_size=2)
    path = table_path(tmp_path / "tables", fp.device_key, "all_reduce", 2, "bfloat16")
    write_big_table(path, fp, 20)
    return path.rename(path.with_name(name))


def _lookup_error(path: Path) -> str:
    """The ``TableError`` lookup raises for the call of the table's first row."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TableError) as info:
            lookup_schedule("all_reduce", 64, 1024, 1024, dtype="bfloat16", world_size=2, device="cpu")
    assert str(path) in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "row_text, says",
    [
        # an M of 5000 digits: past the digits Python converts to an int (json and YAML raised ValueError)
        ('{"problem": {"m": ' + "9" * 5000, "4300 digits"),
        # a value nested past the recursion limit (json raised RecursionError)
        (FIRST_ROW + ', "provenance": ' + "[" * 50_000 + "]" * 50_000 + "}", "nest"),
    ],
    ids=["integer-too-long", "nested-too-deep"],
)
def test_a_row_the_parsers_cannot_build_is_a_table_error_naming_the_file_and_row(
    runner: CliRunner, tmp_path: Path, row_text: str, says: str
) -> None:
    path = _table(tmp_path)
    lines = path.read_text(encoding="utf-8").split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("- {"))
    if row_text.startswith(FIRST_ROW):
        lines[first] = "- " + row_text
    else:  # the M replaced: the rest of the row as it was
        lines[first] = "- " + row_text + lines[first][len("- " + '{"problem": {"m": 64') :]
    path.write_text("\n".join(lines), encoding="utf-8")
    message = _lookup_error(path)
    assert "rows[0]" in message and says in message and "restore the file" in message
    for command in (["validate", str(path)], ["show", str(path)], ["diff", str(path), str(path)]):
        line = assert_one_line_error(runner.invoke(app, ["table", *command]))
        assert str(path) in line and says in line, line
    assert "set_int_max_str_digits" not in message  # (Python's advice, not the reader's to take)


@pytest.mark.parametrize(
    "header_line, name",
    [
        ("collective: all_reduce", "reduce_scatter-w2-bfloat16.yaml"),
        ("dtype: bfloat16", "all_reduce-w2-float16.yaml"),
    ],
)
def test_list_names_a_table_that_holds_another_calls_rows_as_lookup_refuses_it(
    runner: CliRunner, tmp_path: Path, header_line: str, name: str
) -> None:
    """A table under another call's name: lookup of that call refuses it, and `table list` says
    so (exit 1, the file and the name to give it) instead of listing it as good."""
    path = _table(tmp_path, name)
    assert header_line in path.read_text(encoding="utf-8")
    result = runner.invoke(app, ["table", "list"])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(path) in lines[0], result.stderr
    assert "rename it to all_reduce-w2-bfloat16.yaml" in lines[0]
    good = _table(tmp_path / "good")  # another folder's good table: listed, not refused
    listed = runner.invoke(app, ["table", "list"], env={"FO_TUNE_TABLE_DIR": str(good.parents[1])})
    assert listed.exit_code == 0, listed.output
