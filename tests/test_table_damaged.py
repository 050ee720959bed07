"""Damaged and hand-edited table files: whatever a file holds, the runtime's lookup raises a
``TableError`` naming the file and what to do, and the `fo-tune table` commands exit 2 (list: 1)
with one line on stderr, never a Python error from the parsers underneath."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
import warnings
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from big_table import write_big_table
from cli import app
from cli_checks import assert_one_line_error, isolate_tables
from fo_kernels.errors import TableError, VersionDriftWarning
from fo_kernels.fingerprint import current_fingerprint, make_device_key
from fo_kernels.moe.schedule import MoeProblem, MoeSchedule
from fo_kernels.moe.table import MoeRow, MoeTable, MoeTableCache, moe_table_path, save_moe_table
from fo_kernels.table import lookup as table_lookup
from fo_kernels.table import lookup_schedule, table_path
from fo_kernels.table import paths as table_paths
from fo_kernels.table.format import read_table_text
from fo_tune.tables.kinds import load_any_table

# The first row big_table writes: 64x1024x1024, a copy-engine row.
FIRST_ROW = '{"problem": {"m": 64, "n": 1024, "k": 1024}'
# The experts' shape of the MoE tables here (H, I, E_local, k).
MOE_KEY = (1024, 512, 4, 2)
MOE_SHAPE = dict(zip(("hidden", "intermediate", "experts", "top_k"), MOE_KEY, strict=True))


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


def _moe_table(tmp_path: Path) -> Path:
    """An MoE table of this machine (world size 2, bfloat16) of two no-overlap rows, tokens [0, 512]
    and [513, 4096], written where the runtime's MoE lookup reads it."""
    fp = current_fingerprint("cpu", world_size=2)
    rows = [
        MoeRow(
            schedule=MoeSchedule(
                dtype="bfloat16", world_size=2, problem=MoeProblem(**MOE_SHAPE, tokens_min=lo, tokens_max=hi)
            ),
            provenance={"mode": "predict"},
        )
        for lo, hi in ((0, 512), (513, 4096))
    ]
    path = moe_table_path(tmp_path / "tables", fp.device_key, 2, "bfloat16")
    save_moe_table(MoeTable(fingerprint=fp, world_size=2, dtype="bfloat16", rows=rows), path)
    return path


def _moe_lookup_error(path: Path) -> str:
    """The ``TableError`` the runtime's MoE lookup raises for a call of the table's second row."""
    with pytest.raises(TableError) as info:
        MoeTableCache().lookup(MOE_KEY, 1000, dtype="bfloat16", world_size=2, device="cpu")
    assert str(path) in str(info.value)
    return str(info.value)


# A YAML anchor bomb: nine aliases of the anchor before, six deep (9^6 values written out).
BOMB = ", ".join(
    ['"a0": &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]']
    + [f'"a{i}": &a{i} [{", ".join([f"*a{i - 1}"] * 9)}]' for i in range(1, 6)]
)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_an_anchor_bomb_in_a_rows_provenance_is_refused_before_anything_writes_it_out(
    runner: CliRunner, tmp_path: Path, kind: str
) -> None:
    """A provenance of a few lines whose aliases expand to 531,441 values (`table show` printed one of
    43 million for minutes): the row is refused where it is built, as any malformed row."""
    path = _table(tmp_path) if kind == "dense" else _moe_table(tmp_path)
    lines = path.read_text(encoding="utf-8").split("\n")
    row = next(i for i, line in enumerate(lines) if line.startswith("- {")) + (kind == "moe")
    lines[row] = lines[row].replace('"provenance": {', '"provenance": {' + BOMB + ", ", 1)
    path.write_text("\n".join(lines), encoding="utf-8")
    message = _lookup_error(path) if kind == "dense" else _moe_lookup_error(path)
    assert "rows[" in message and "provenance: holds more than" in message, message
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert "provenance: holds more than" in line


@pytest.mark.parametrize(
    "edit, says",
    [
        (
            ('"provenance": {"mode": "predict"}', '"provenance": [1, 2]'),
            "rows[1]: provenance: expected a mapping",
        ),
        (
            ('"provenance": {"mode": "predict"}', '"provenance": [["mode", "x"]]'),
            "rows[1]: provenance: expected a mapping",
        ),
        (
            ('"provenance": {"mode": "predict"}', '"provenance": "abc"'),
            "rows[1]: provenance: expected a mapping",
        ),
        (('"engine": null', '"engine": null, "dtype": "float32"'), "rows[1]: dtype: the row says 'float32'"),
        (('"engine": null', '"engine": null, "world_size": 4'), "rows[1]: world_size: the row says 4"),
        (("rows:\n", ""), "rows: missing"),
        # a key the schedule derives: refused as unknown (it was Python's "unexpected keyword
        # argument 'op_text'", and the list of valid keys named it)
        (('"engine": null', '"engine": null, "op_text": "x"'), "rows[1]: schedule: unknown key(s) op_text"),
    ],
    ids=[
        "provenance-list",
        "provenance-pairs",
        "provenance-string",
        "row-dtype",
        "row-world-size",
        "no-rows",
        "derived-key",
    ],
)
def test_a_damaged_moe_table_is_a_table_error_naming_the_file_and_row(
    runner: CliRunner, tmp_path: Path, edit: tuple[str, str], says: str
) -> None:
    """Rows the MoE table read as a Python error (a provenance that is no mapping: TypeError), took
    silently (a list of pairs as a mapping; a row's other dtype or world size overridden by the
    header's), or a file cut short before its rows, read as an empty table."""
    path = _moe_table(tmp_path)
    text = path.read_text(encoding="utf-8")
    if edit[0] == "rows:\n":  # the file cut short after its header
        text = text[: text.index("rows:\n")]
    else:
        first, second = text.rsplit(edit[0], 1)
        text = first + edit[1] + second  # (the second row's)
    path.write_text(text, encoding="utf-8")
    assert says in _moe_lookup_error(path)
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert says in line and str(path) in line and "op_text" not in line.partition("valid:")[2]


@pytest.mark.parametrize("kind", ["folder", "symlink-loop"])
def test_a_table_name_that_is_no_file_is_a_table_error_in_lookup_and_the_cli(
    runner: CliRunner, tmp_path: Path, kind: str
) -> None:
    """A folder or a symlink loop under a table's name: the runtime raised OSError for the loop, and
    `table lookup` skipped both (exit 0) where the runtime refuses them."""
    path = _table(tmp_path)
    path.unlink()
    if kind == "folder":
        path.mkdir()
    else:
        path.symlink_to(path)
    _lookup_error(path)
    line = assert_one_line_error(
        runner.invoke(app, ["table", "lookup", "--shape", "64x1024x1024", "-c", "all_reduce"])
    )
    assert str(path) in line


@pytest.mark.parametrize("kind, column", [("dense", "layout"), ("moe", "engine")])
def test_show_csv_gives_every_provenance_key_a_column_of_its_own(
    runner: CliRunner, tmp_path: Path, kind: str, column: str
) -> None:
    """A hand-edited provenance holding a schedule column's name and ``provenance_<it>`` (the
    column the first gets): two columns of one name, of which a CSV reader keeps one value."""
    path = _table(tmp_path) if kind == "dense" else _moe_table(tmp_path)
    text = path.read_text(encoding="utf-8")
    edited = f'"provenance": {{"{column}": "edited-a", "provenance_{column}": "edited-b", '
    path.write_text(text.replace('"provenance": {', edited, 1), encoding="utf-8")
    result = runner.invoke(app, ["table", "show", str(path), "--format", "csv"])
    assert result.exit_code == 0, result.output
    header, first = list(csv.reader(io.StringIO(result.stdout)))[:2]
    assert len(header) == len(set(header)), header
    row = dict(zip(header, first, strict=True))
    assert "edited-a" in row.values() and "edited-b" in row.values(), row


def test_a_table_tuned_on_another_device_key_of_this_capability_is_used_with_a_warning(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A table another machine of this compute capability tuned (here twice the SMs), copied into
    this device key's folder: lookup uses it, as the README says, but no longer silently; validate
    says so instead of claiming lookup never reads it there."""
    ours = current_fingerprint("cpu", world_size=2)
    fields = dict(gpu_name=ours.gpu_name, sm_count=2 * ours.sm_count, interconnect=ours.interconnect)
    key = make_device_key(compute_capability=ours.compute_capability, world_size=2, **fields)
    theirs = dataclasses.replace(ours, device_key=key, sm_count=fields["sm_count"])
    path = table_path(tmp_path / "tables", ours.device_key, "all_reduce", 2, "bfloat16")
    write_big_table(path, theirs, 4)
    with pytest.warns(
        VersionDriftWarning, match=f"tuned on device key {key}, this device is {ours.device_key}"
    ):
        row = lookup_schedule("all_reduce", 64, 1024, 1024, dtype="bfloat16", world_size=2, device="cpu")
    assert row.engine == "copy_engine"
    result = runner.invoke(app, ["table", "validate", str(path)])
    assert result.exit_code == 0, result.output
    assert (
        f"note: {path}: lookup on device key {ours.device_key} reads this table, tuned on {key}"
        in result.stdout
    )
    # under a key of another world size, where no lookup reads it: the note says where one would
    w4 = make_device_key(compute_capability=ours.compute_capability, world_size=4, **fields)
    moved = path.parents[1] / w4 / path.name
    moved.parent.mkdir()
    path.rename(moved)
    result = runner.invoke(app, ["table", "validate", str(moved)])
    assert result.exit_code == 0, result.output
    assert f"note: {moved}: lookup reads this table only as <table folder>/{key}/{path.name}" in result.stdout


@pytest.mark.parametrize(
    "old, new, says",
    [
        ('"settings": {"mode": "ring", "weights": [2, 2, 1, 1]}, ', "", "rows[0]: settings: missing"),
        ('"block_k": 64, ', "", "rows[2]: tile: missing key(s) block_k"),
        ('"groups": [1], ', "", "rows[2]: settings (triton): missing key(s) groups"),
    ],
    ids=["settings", "tile-field", "settings-field"],
)
def test_a_row_missing_a_field_says_which_field_in_the_tables_words(
    runner: CliRunner, tmp_path: Path, old: str, new: str, says: str
) -> None:
    """A hand edit that drops a row's settings or one of its fields: the message named Python's
    constructor (``Tile.__init__() missing 1 required keyword-only argument``) or ``NoneType``."""
    path = _table(tmp_path)
    text = path.read_text(encoding="utf-8")
    row = 2 if "rows[2]" in says else 0
    lines = text.split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("- {"))
    assert old in lines[first + row]
    lines[first + row] = lines[first + row].replace(old, new, 1)
    path.write_text("\n".join(lines), encoding="utf-8")
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert says in line and "__init__" not in line and "NoneType" not in line, line


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_show_csv_keeps_the_value_of_a_provenance_key_yaml_reads_as_a_number(
    runner: CliRunner, tmp_path: Path, kind: str
) -> None:
    """A hand-written ``7: ...`` in a provenance (YAML reads the key as an int): its column ``7``
    was empty, while --json printed the value."""
    path = _table(tmp_path) if kind == "dense" else _moe_table(tmp_path)
    text = path.read_text(encoding="utf-8")
    path.write_text(
        text.replace('"provenance": {', '"provenance": {7: "hand-written", ', 1), encoding="utf-8"
    )
    result = runner.invoke(app, ["table", "show", str(path), "--format", "csv"])
    assert result.exit_code == 0, result.output
    header, first = list(csv.reader(io.StringIO(result.stdout)))[:2]
    assert dict(zip(header, first, strict=True))["7"] == "hand-written"


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("how", ["two-files-joined", "rows-twice", "header-key-twice"])
def test_a_key_a_table_file_gives_twice_is_refused_not_read_as_the_last(
    runner: CliRunner, tmp_path: Path, kind: str, how: str
) -> None:
    """YAML's readers keep the last of a repeated key: two tables joined into one file (``cat a b``)
    read as the second alone, a second ``rows:`` block as its rows alone, and a header key added
    below the one there as the addition, every other row silently gone or the header changed."""
    path = _table(tmp_path) if kind == "dense" else _moe_table(tmp_path)
    text = path.read_text(encoding="utf-8")
    header, rows = text.split("rows:\n")
    if how == "two-files-joined":
        text = text + text
    elif how == "rows-twice":
        text = f"{header}rows:\n{rows}rows:\n{rows.split(chr(10))[0]}\n"
    else:
        text = text.replace("dtype: bfloat16\n", "dtype: bfloat16\ndtype: bfloat16\n", 1)
    path.write_text(text, encoding="utf-8")
    message = _lookup_error(path) if kind == "dense" else _moe_lookup_error(path)
    assert "is given twice" in message and "YAML keeps the last alone" in message, message
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert "is given twice" in line


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize(
    "old, new",
    [
        ('"provenance": {', '"provenance": {"mode": "hand", '),  # a row's own key, in JSON
        ('"problem": {', '"problem": {"{key}": 1, '),  # a nested one, in JSON
        ('"problem": {', '"problem": {{key}: 1, '),  # in a YAML flow mapping
    ],
    ids=["json", "json-nested", "yaml-flow"],
)
def test_a_key_a_row_line_gives_twice_is_refused_naming_its_row_and_line(
    runner: CliRunner, tmp_path: Path, kind: str, old: str, new: str
) -> None:
    """json and YAML keep the last of a repeated key: a row edited by hand to ``{"m": 1, "m": 2}``
    read as ``m: 2``; every reader refuses it, naming the row (and, loading it whole, its line)."""
    path = _table(tmp_path) if kind == "dense" else _moe_table(tmp_path)
    lines = path.read_text(encoding="utf-8").split("\n")
    row = 0 if kind == "dense" else 1  # the row lookup takes (``_lookup_error``, ``_moe_lookup_error``)
    at = next(i for i, line in enumerate(lines) if line.startswith("- {")) + row
    new = new.replace("{key}", "m" if kind == "dense" else "tokens_max")
    assert old in lines[at] and '"mode": ' in lines[at]
    lines[at] = lines[at].replace(old, new, 1)
    path.write_text("\n".join(lines), encoding="utf-8")
    message = _lookup_error(path) if kind == "dense" else _moe_lookup_error(path)
    assert f"rows[{row}]" in message and "is given twice" in message, message
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert f"rows[{row}] (line {at + 1})" in line and "is given twice" in line, line


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_row_line_that_gives_its_problem_twice_is_refused_not_filed_under_the_first(
    runner: CliRunner, tmp_path: Path, kind: str
) -> None:
    """A row line edited by hand to start with another problem before its own: the runtime reads a
    line's problem from its start, so it filed the row under the first and its own call silently
    missed it (no overlap, or another folder's row); now it refuses the file, naming the row."""
    path = _table(tmp_path) if kind == "dense" else _moe_table(tmp_path)
    lines = path.read_text(encoding="utf-8").split("\n")
    row = 0 if kind == "dense" else 1  # the row lookup takes (``_lookup_error``, ``_moe_lookup_error``)
    at = next(i for i, line in enumerate(lines) if line.startswith("- {")) + row
    other = (
        '{"m": 8, "n": 1024, "k": 1024}'
        if kind == "dense"
        else json.dumps({**MOE_SHAPE, "tokens_min": 5000, "tokens_max": 6000}, separators=(", ", ": "))
    )
    lines[at] = lines[at].replace('{"problem": ', '{"problem": ' + other + ', "problem": ', 1)
    path.write_text("\n".join(lines), encoding="utf-8")
    message = _lookup_error(path) if kind == "dense" else _moe_lookup_error(path)
    assert f"rows[{row}]" in message and "'problem' is given twice" in message, message
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert f"rows[{row}]" in line and "'problem' is given twice" in line, line


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_provenance_whose_keys_read_as_one_name_is_refused(
    runner: CliRunner, tmp_path: Path, kind: str
) -> None:
    """``7:`` and ``"7":`` in one provenance (YAML reads the first as an int): the CSV's column
    ``7``, --json's key ``"7"`` held one of the two values, the other silently gone. Loading
    refuses it, as building a row with it does (``check_record``)."""
    path = _table(tmp_path) if kind == "dense" else _moe_table(tmp_path)
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace('"provenance": {', '"provenance": {7: "a", "7": "b", ', 1), encoding="utf-8")
    for command in (["validate", str(path)], ["show", str(path), "--format", "csv"]):
        line = assert_one_line_error(runner.invoke(app, ["table", *command]))
        assert "rows[0]: provenance: the keys 7 and '7' read as one name" in line, line
    problem = MoeProblem(**MOE_SHAPE, tokens_min=0, tokens_max=8)
    with pytest.raises(TableError, match="the keys True and 'True' read as one name"):
        MoeRow(
            schedule=MoeSchedule(dtype="bfloat16", world_size=2, problem=problem),
            provenance={True: 1, "True": 2},
        )


def test_a_table_name_that_links_to_nothing_is_refused_not_read_as_no_table(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A table's name a symbolic link to a file that is not there (a share not mounted): lookup
    read it as no table, the calls silently without overlap, and `table show -k` said there was
    no such table while listing its name in the folder."""
    path = _table(tmp_path)
    path.unlink()
    path.symlink_to(tmp_path / "share" / path.name)
    message = _lookup_error(path)
    assert f"a symbolic link to {tmp_path / 'share' / path.name}, which does not exist" in message
    for args in (["validate", str(path)], ["show", "-k", path.parent.name], ["lookup", "-s", "64x1024x1024"]):
        line = assert_one_line_error(runner.invoke(app, ["table", *args]))
        assert str(path) in line and "which does not exist; mount or restore" in line, line


@pytest.mark.parametrize(
    "old, new, says",
    [
        (r"sm_count: [0-9]+\n", "sm_count: 0\n", "fingerprint.sm_count: must be >= 1, got 0"),
        (None, "hello: 1\n", "not a table: no kind and no schema_version (its keys: hello)"),
        ("schema_version: 1\n", "schema_version: true\n", "schema_version 1, got "),
    ],
    ids=["no-sms", "not-a-table", "moe-schema-true"],
)
def test_a_header_no_table_can_have_is_refused_saying_so(
    runner: CliRunner, tmp_path: Path, old: str | None, new: str, says: str
) -> None:
    """A fingerprint of 0 SMs validated (each plan made for no SMs); a file of other YAML beside the
    tables (notes) was "schema_version None is not supported; re-run `fo-tune search`"; an MoE
    table's ``schema_version: true`` read as version 1 (YAML's true is Python's 1)."""
    path = _moe_table(tmp_path) if old == "schema_version: 1\n" else _table(tmp_path)
    text = path.read_text(encoding="utf-8")
    assert old is None or re.search(old, text)
    path.write_text(new if old is None else re.sub(old, new, text, count=1), encoding="utf-8")
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert says in line, line


def test_a_table_with_a_byte_order_mark_reads_as_without_it(runner: CliRunner, tmp_path: Path) -> None:
    """An editor's byte order mark before a table written as one JSON document sent it to the YAML
    parser (60 times slower than json); the text is read without it."""
    path = _table(tmp_path)
    table = load_any_table(path)
    path.write_text("\ufeff" + json.dumps(table.to_dict()), encoding="utf-8")
    assert read_table_text(path).startswith("{")
    assert runner.invoke(app, ["table", "validate", str(path)]).exit_code == 0
    assert load_any_table(path) == table


@pytest.mark.parametrize("reader", ["block-rows", "yaml-parser"])
def test_a_key_a_block_style_row_gives_twice_is_refused(
    runner: CliRunner, tmp_path: Path, reader: str
) -> None:
    """A table in ``yaml.safe_dump``'s block style with a row's key given twice: its line reader and
    the YAML parser (which reads a file with a comment in its rows) kept the last value."""
    path = _table(tmp_path)
    text = yaml.safe_dump(load_any_table(path).to_dict(), sort_keys=False)
    assert "\n    m: 64\n" in text
    text = text.replace("\n    m: 64\n", "\n    m: 64\n    m: 128\n", 1)
    if reader == "yaml-parser":
        text = text.replace("\nrows:\n", "\nrows: # hand-edited\n", 1)
    path.write_text(text, encoding="utf-8")
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert "the key 'm' is given twice" in line, line


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_table_cut_short_after_its_rows_line_is_refused_not_read_as_empty(
    runner: CliRunner, tmp_path: Path, kind: str
) -> None:
    """A file that ends at ``rows:`` (a copy cut short there) read as a table without rows: lookup
    silently ran every call without overlap and validate said OK."""
    path = _table(tmp_path) if kind == "dense" else _moe_table(tmp_path)
    text = path.read_text(encoding="utf-8")
    path.write_text(text[: text.index("rows:\n") + len("rows:\n")], encoding="utf-8")
    message = _lookup_error(path) if kind == "dense" else _moe_lookup_error(path)
    assert "rows: holds nothing (a file cut short after `rows:` reads so)" in message, message
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert "write `rows: []` for a table without rows" in line, line


def test_validate_of_a_bare_file_name_in_its_device_keys_folder_knows_where_it_sits(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cd <device key>; fo-tune table validate <name>.yaml`: the file's folder was taken from the
    path as given (none), and the note said lookup reads the table only where it already was."""
    path = _table(tmp_path)
    monkeypatch.chdir(path.parent)
    result = runner.invoke(app, ["table", "validate", path.name])
    assert result.exit_code == 0 and "note:" not in result.stdout, result.output
