"""Tables at fleet scale: a generated 100,000-row table validates, and the runtime looks rows up in
it, within the budgets of issue 40 on the 2-core CPU machine, as do `fo-tune table show --json`
and `fo-tune table diff` of two versions of it; the table file's text (one JSON row a line) reads
the same as YAML."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import time
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from big_table import (
    EXACT_PER_NK,
    M_STEP,
    big_table_header,
    big_table_rows,
    block_style_text,
    write_big_table,
)
from cli import app
from fo_kernels.errors import TableError
from fo_kernels.fingerprint import Fingerprint, current_fingerprint
from fo_kernels.table import TABLE_DIR_ENV, load_table, lookup_schedule, read_table, table_path
from fo_kernels.table import lookup as table_lookup
from fo_kernels.table import paths as table_paths
from fo_kernels.table.spans import SpanRows, put_row
from fo_kernels.table.text import dump_table_text, parse_table_text, row_line

# The table a merged M-range campaign grows to, and the budgets it must meet (issue 40): `fo-tune
# table validate` <= 10 s, the runtime's first lookup_schedule <= 3 s, a later one <= 1 ms. They
# are asserted on this process's CPU time (time.process_time), which other processes on a shared
# machine do not inflate as they do the wall time; on an idle 2-core machine the two agree.
BIG_ROWS = 100_000
VALIDATE_BUDGET_S = 10.0
FIRST_LOOKUP_BUDGET_S = 3.0
LATER_LOOKUP_BUDGET_S = 1e-3
# Later lookups timed: each a shape not looked up before (its row built from its line).
LATER_LOOKUPS = 50
# `fo-tune table show --json` of the 100,000-row table (85 MB of JSON: 11.6 s of CPU here before
# its rows shared their schedules and the document was written with json's C encoder) and `fo-tune
# table diff` of it and a version with some rows changed and some gone (15.2 s before B's rows
# that A holds were taken from A), in CPU seconds, imports aside (docs/perf-notes.md).
SHOW_JSON_BUDGET_S = 9.0
DIFF_BUDGET_S = 9.0


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Fingerprint]:
    """The 100,000-row table, written once for this module, where lookup finds it on this machine."""
    root = tmp_path_factory.mktemp("big-tables")
    fp = current_fingerprint("cpu", world_size=2)
    path = table_path(root, fp.device_key, "all_reduce", 2, "bfloat16")
    return write_big_table(path, fp, BIG_ROWS), fp


def _validates_within_budget(path: Path) -> None:
    """``fo-tune table validate`` passes the 100,000-row table at ``path`` within its CPU budget."""
    start = time.process_time()
    result = CliRunner().invoke(app, ["table", "validate", str(path)])
    took = time.process_time() - start
    assert result.exit_code == 0, result.output
    assert f"OK {path}: {BIG_ROWS} row(s)" in result.stdout
    assert took <= VALIDATE_BUDGET_S, f"validate took {took:.1f} s of CPU"


def test_a_100k_row_table_validates_within_budget(big: tuple[Path, Fingerprint]) -> None:
    path, _fp = big
    _validates_within_budget(path)


def test_a_100k_row_table_looks_up_within_budget(
    big: tuple[Path, Fingerprint], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, fp = big
    monkeypatch.setenv(TABLE_DIR_ENV, str(path.parents[1]))
    monkeypatch.setattr(table_paths, "_packaged_table_dir", lambda: None)
    table_lookup._CACHE.clear()
    n, k = 1024, 1024
    start = time.process_time()
    first = lookup_schedule("all_reduce", M_STEP, n, k, dtype=torch.bfloat16, world_size=2, device="cpu")
    took = time.process_time() - start
    assert first.engine == "copy_engine" and first.problem.m == M_STEP
    assert took <= FIRST_LOOKUP_BUDGET_S, f"the first lookup took {took:.2f} s"
    later = []
    for i in range(1, LATER_LOOKUPS + 1):  # other shapes, each one's row built on first use
        m = (i + 1) * M_STEP if i % 2 else EXACT_PER_NK * M_STEP + 100 * i  # exact rows, M ranges
        start = time.process_time()
        row = lookup_schedule("all_reduce", m, n, k + 128, dtype=torch.bfloat16, world_size=2, device="cpu")
        later.append(time.process_time() - start)
        assert row.problem.covers(m, n, k + 128) and row.provenance["source"] == "fo-tune search"
        assert row.problem.is_range == (i % 2 == 0)
    start = time.process_time()
    again = lookup_schedule("all_reduce", M_STEP, n, k, dtype=torch.bfloat16, world_size=2, device="cpu")
    repeated = time.process_time() - start
    assert again is first
    assert statistics.median(later) <= LATER_LOOKUP_BUDGET_S, (
        f"later lookups: median {statistics.median(later)}"
    )
    assert repeated <= LATER_LOOKUP_BUDGET_S, f"a repeated lookup took {repeated * 1e3:.2f} ms"
    table_lookup._CACHE.clear()
    assert len(read_table(path)) == BIG_ROWS and fp.device_key in str(path)


def test_a_100k_row_table_written_as_one_json_document_validates_within_budget(tmp_path: Path) -> None:
    # a table a script generated with json.dump (JSON is YAML): read by json, not the YAML parser
    fp = current_fingerprint("cpu", world_size=2)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**big_table_header(fp), "rows": big_table_rows(BIG_ROWS, fp.sm_count)}))
    _validates_within_budget(path)
    small = json.dumps({**big_table_header(fp), "rows": big_table_rows(40, fp.sm_count)})
    assert parse_table_text(small) == yaml.safe_load(small)


def test_a_100k_row_table_in_yaml_block_style_validates_and_looks_up_within_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a table a script wrote with yaml.safe_dump (block style, anchors for the shared tiles), as
    # fo-tune wrote them before one JSON row a line: PyYAML's loader took minutes for it
    fp = current_fingerprint("cpu", world_size=2)
    small = {**big_table_header(fp), "rows": big_table_rows(300, fp.sm_count)}
    assert block_style_text(small) == yaml.safe_dump(small, sort_keys=False)  # the generator is PyYAML's form
    path = table_path(tmp_path, fp.device_key, "all_reduce", 2, "bfloat16")
    path.parent.mkdir(parents=True)
    path.write_text(block_style_text({**big_table_header(fp), "rows": big_table_rows(BIG_ROWS, fp.sm_count)}))
    _validates_within_budget(path)
    monkeypatch.setenv(TABLE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(table_paths, "_packaged_table_dir", lambda: None)
    table_lookup._CACHE.clear()
    start = time.process_time()
    row = lookup_schedule(
        "all_reduce", 3 * M_STEP, 1024, 1024, dtype=torch.bfloat16, world_size=2, device="cpu"
    )
    took = time.process_time() - start
    assert row.engine == "triton" and row.problem.m == 3 * M_STEP
    assert took <= FIRST_LOOKUP_BUDGET_S, f"the first lookup took {took:.2f} s"
    start = time.process_time()
    later = lookup_schedule(
        "all_reduce", 2 * M_STEP, 1024, 1152, dtype=torch.bfloat16, world_size=2, device="cpu"
    )
    assert time.process_time() - start <= LATER_LOOKUP_BUDGET_S * 5 and later.problem.m == 2 * M_STEP
    table_lookup._CACHE.clear()


def test_a_100k_row_table_shows_as_json_within_budget(big: tuple[Path, Fingerprint]) -> None:
    path, _fp = big
    start = time.process_time()
    result = CliRunner().invoke(app, ["table", "show", "--json", str(path)])
    took = time.process_time() - start
    assert result.exit_code == 0, result.output
    (table,) = json.loads(result.stdout)["tables"]
    assert len(table["rows"]) == BIG_ROWS and table["rows"][-1]["problem"]["m_max"] > 0
    assert took <= SHOW_JSON_BUDGET_S, f"show --json took {took:.1f} s of CPU"


def test_two_versions_of_a_100k_row_table_diff_within_budget(
    big: tuple[Path, Fingerprint], tmp_path: Path
) -> None:
    """B is A with every 97th row's weights changed and every 1000th row gone: diff counts them
    (and says so by its exit code) within its CPU budget."""
    path, _fp = big
    head, rows = path.read_text().split("rows:\n")
    lines = rows.splitlines()
    changed = gone = 0
    for i in range(len(lines)):
        if i % 1000 == 999:
            lines[i], gone = "", gone + 1
        elif i % 97 == 0 and '"weights": [' in lines[i]:
            lines[i], changed = lines[i].replace('"weights": [', '"weights": [5, ', 1), changed + 1
    other = tmp_path / "b.yaml"
    other.write_text(head + "rows:\n" + "".join(line + "\n" for line in lines if line))
    start = time.process_time()
    result = CliRunner().invoke(app, ["table", "diff", "--exit-code", str(path), str(other)])
    took = time.process_time() - start
    assert result.exit_code == 1, result.output
    same = BIG_ROWS - changed - gone
    assert f"{changed} changed, {gone} only in A, 0 only in B, {same} same" in result.stdout
    assert took <= DIFF_BUDGET_S, f"diff took {took:.1f} s of CPU"


def test_a_duplicate_row_is_refused_by_validate_with_exit_2(tmp_path: Path) -> None:
    fp = current_fingerprint("cpu", world_size=2)
    path = write_big_table(tmp_path / "t.yaml", fp, 300)
    rows = path.read_text().splitlines()
    path.write_text("\n".join([*rows, rows[-200]]) + "\n")  # the row of rows[100] again, last
    result = CliRunner().invoke(app, ["table", "validate", str(path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "rows[100] and rows[300] are both for problem" in lines[0], lines


@pytest.mark.parametrize(
    ("index", "old", "new", "named"),
    [
        # rows[200] again with other settings: still two rows for one problem
        (
            200,
            '"weights": [2, 2, 1, 1]}',
            '"weights": [1, 1]}',
            "rows[200] and rows[300] are both for problem",
        ),
        # rows[91]'s range moved down to share one M with rows[90]'s
        (
            91,
            '"m_min": 6786,',
            '"m_min": 6783,',
            "rows[90] ([5762,6783]x1024x1024) and rows[300] ([6783,7807]",
        ),
    ],
)
def test_rows_for_one_problem_or_m_are_refused_by_validate_with_exit_2(
    tmp_path: Path, index: int, old: str, new: str, named: str
) -> None:
    """Two rows that differ only in their settings, and M ranges that share their end M, are
    refused as a duplicate is: exit 2, one line naming both rows by their index."""
    fp = current_fingerprint("cpu", world_size=2)
    path = write_big_table(tmp_path / "t.yaml", fp, 300)
    rows = path.read_text().splitlines()
    moved = rows[-300 + index]
    assert old in moved
    path.write_text("\n".join([*rows, moved.replace(old, new)]) + "\n")  # rows[index] changed, last
    result = CliRunner().invoke(app, ["table", "validate", str(path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], lines


# ------------------------------------------------------------------------------------ the text
def test_row_lines_read_the_same_as_json_and_as_yaml() -> None:
    row = {
        "problem": {"m": 64, "n": 64, "k": 32},
        "overlap": False,
        "provenance": {
            "small": 1e-05,
            "large": 1e16,
            "plain": 0.0612,
            "negative": -2.5e-07,
            "text": 'say "hi": {not a map}, # no comment\nsecond line',
            "unicode": "über",
            "list": [1, 2.0, None, True],
        },
    }
    line = row_line(row)
    assert "\n" not in line and "1.0e-05" in line and "1.0e+16" in line
    assert json.loads(line) == row
    assert yaml.safe_load(line) == row
    odd = {"problem": {"m": 8, "n": 64, "k": 32}, "overlap": False, "provenance": {"x": math.inf}}
    odd_line = row_line(odd)  # not JSON: a YAML flow mapping on one line
    assert "\n" not in odd_line and yaml.safe_load(odd_line) == odd
    # rows json writes in one call, and those it would change (a key that is not a string, a
    # float YAML reads otherwise, a tuple) read back as they are, by json and by YAML
    plain = {"problem": {"m": 8, "n": 64, "k": 32}, "provenance": {"ms": 0.05, "text": "1e-05 of NaN"}}
    for provenance in ({1: "int key"}, {"k": {2.5: 1}}, {"t": (1, 2)}, {"e": 3e-20}, {"b": True, "n": None}):
        for case in (plain, {**plain, "provenance": provenance}):
            want = json.loads(json.dumps(case)) if "t" in provenance else case  # (a tuple reads as a list)
            assert repr(yaml.safe_load(row_line(case))) == repr(want)


def test_written_text_parses_as_yaml_does(tmp_path: Path) -> None:
    fp = current_fingerprint("cpu", world_size=2)
    rows = big_table_rows(40, fp.sm_count)
    rows[7]["provenance"]["x"] = math.nan  # one row that only YAML can carry
    text = dump_table_text(yaml.safe_dump({"schema_version": 2}, sort_keys=False), rows)
    fast, slow = parse_table_text(text), yaml.safe_load(text)
    assert math.isnan(fast["rows"][7]["provenance"].pop("x"))
    assert math.isnan(slow["rows"][7]["provenance"].pop("x"))
    assert fast == slow
    assert parse_table_text("schema_version: 2\nrows: []\n") == {"schema_version": 2, "rows": []}
    path = write_big_table(tmp_path / "t.yaml", fp, 40)
    with_comment = path.read_text().replace("rows:\n", "rows:\n# a comment the fast path does not take\n")
    (tmp_path / "c.yaml").write_text(with_comment)
    assert load_table(tmp_path / "c.yaml") == load_table(path)


# ------------------------------------------------------------------------------------ merging
def test_a_range_over_thousands_of_rows_it_yields_to_merges_in_linear_time() -> None:
    """A predicted M range merged over a measured campaign's exact rows of its (N, K) goes in over
    the gaps between them, reading each row's span a bounded number of times (cutting the range by
    one row at a time read them quadratically: 38 s for a 10,000-row (N, K))."""
    count = 3000
    reads = []

    def span(row: tuple[int, int, bool]) -> tuple[int, int]:
        reads.append(1)
        return row[0], row[1]

    exact = SpanRows([(2 * i, 2 * i, True) for i in range(count)], span)  # measured: kept
    ranges: SpanRows[tuple[int, int, bool]] = SpanRows([], span)
    reads.clear()
    placed = put_row(
        (0, 2 * count, False),
        ranges,
        [exact],
        respan=lambda row, ms: (ms[0], ms[1], row[2]),
        yields_to=lambda old: old[2],
    )
    gaps = [(2 * i + 1, 2 * i + 1, False) for i in range(count - 1)] + [(2 * count - 1, 2 * count, False)]
    assert placed == gaps and ranges.rows == gaps and len(exact.rows) == count
    assert len(reads) <= 40 * count, f"{len(reads)} span reads for {count} rows"


def test_reading_a_table_imports_every_engines_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row is built when a lookup first takes it, and building the first row of an engine imports
    that engine's settings (3 ms for the Triton engine's): reading the table (the first lookup's
    work) imports them all, so no later lookup pays for an import."""
    from fo_kernels import engines

    fp = current_fingerprint("cpu", world_size=2)
    path = write_big_table(tmp_path / "t.yaml", fp, 4)  # no Triton row among them is built
    monkeypatch.setattr(engines, "_settings_of", functools.cache(engines._settings_of.__wrapped__))
    read_table(path)
    assert engines._settings_of.cache_info().currsize == len(engines.engine_names())


def test_row_lines_a_script_wrote_in_another_key_order_are_decoded_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table whose row lines are JSON but not as `fo-tune search` writes them (compact, the
    problem last) is read with one ``json`` call for its rows, not one per row (twice as slow for
    100,000 rows), and looks up the same rows."""
    fp = current_fingerprint("cpu", world_size=2)
    rows = big_table_rows(100, fp.sm_count)
    text = yaml.safe_dump(big_table_header(fp), sort_keys=False) + "rows:\n"
    text += "".join(
        "- " + json.dumps(dict(reversed(row.items())), separators=(",", ":")) + "\n" for row in rows
    )
    (tmp_path / "t.yaml").write_text(text)
    calls = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda s, **kw: calls.append(1) or loads(s, **kw))
    table = read_table(tmp_path / "t.yaml")
    assert len(calls) <= 2, f"{len(calls)} json calls for 100 rows"
    monkeypatch.undo()
    assert table.find(M_STEP, 1024, 1024) == load_table(write_big_table(tmp_path / "w.yaml", fp, 100)).find(
        M_STEP, 1024, 1024
    )


# ------------------------------------------------------------------ the commands' fast paths
@pytest.mark.parametrize("bad", ['"block_m": 128.0', '"block_m": true'])
def test_a_row_whose_settings_read_equal_to_an_earlier_rows_is_checked_as_loading_checks_it(
    tmp_path: Path, bad: str
) -> None:
    """Loading builds a schedule once for the rows that share it; 128.0 and true equal 128 in
    Python, yet a row with them is refused, by show and by diff (whose B shares A's rows), as
    ``load_table`` refuses it: exit 2, one line naming the file and the row."""
    fp = current_fingerprint("cpu", world_size=2)
    good = write_big_table(tmp_path / "a.yaml", fp, 40)
    lines = good.read_text().splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if '"mode": "tiled"' in line)  # a shared schedule's
    lines[last] = lines[last].replace('"block_m": 128', bad, 1)
    path = tmp_path / "b.yaml"
    path.write_text("".join(lines))
    with pytest.raises(TableError) as refused:
        load_table(path)
    assert "rows[" in str(refused.value)
    for args in (["show", str(path)], ["diff", str(good), str(path)]):
        result = CliRunner().invoke(app, ["table", *args])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == f"error: {refused.value}", result.stderr


def test_show_writes_what_its_slower_writers_wrote(tmp_path: Path) -> None:
    """``show --json`` writes its document as ``json_text`` does and ``show --format yaml`` its rows
    as ``table_text`` does, rows whose provenance they cannot take the fast way included (1e+16,
    1e-05, a key that is not text, a nested value, a string that reads like an exponent; a NaN no
    table holds: ``check_finite_provenance``)."""
    from fo_kernels.table.format import table_text
    from fo_tune.cli.common import json_text
    from fo_tune.cli.table_json import document_text, show_document
    from fo_tune.cli.table_rows import table_yaml

    fp = current_fingerprint("cpu", world_size=2)
    table = load_table(write_big_table(tmp_path / "t.yaml", fp, 40))
    odd = [{"x": 1e16}, {"x": 1e-05}, {1: "key"}, {"x": {"y": [1e16, -2.5e-07]}}, {"s": "1e-5"}, {}]
    rows = [
        dataclasses.replace(row, provenance=odd[i // 3]) if i % 3 == 0 and i < 3 * len(odd) else row
        for i, row in enumerate(table.rows)
    ]
    table = dataclasses.replace(table, rows=rows)
    assert table_yaml(table) == table_text(table)
    document = show_document([(tmp_path / "t.yaml", table)])
    assert document_text(document) == json_text(document)
    for value in ({}, [], [[]], {"a": ()}, (1, [2, {"b": math.nan}]), {None: 1, True: 2}, "ü", 3.5):
        assert document_text(value) == json_text(value), value
