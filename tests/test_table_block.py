"""Tables whose rows are in YAML's block style (what ``yaml.safe_dump`` writes, and fo-tune wrote
before one JSON row a line) read as the YAML parser reads them, by the template and line readers
of ``fo_kernels.table.block_rows`` and ``fo_kernels.table.block``; text outside the subset they
read goes to the YAML parser."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from fo_kernels.table.block_rows import read_block_rows
from fo_kernels.table.text import (
    decode_row_line,
    lazy_table_data,
    load_document,
    load_yaml_text,
    parse_table_text,
)

RESULTS = Path(__file__).resolve().parents[1] / "results"

# Scalars that YAML 1.1 reads in many ways: words it takes for null or booleans, numbers in its
# other forms, timestamps, indicators, quotes, spaces where folding matters, long text it wraps.
TRICKY = [
    "",
    " ",
    "a",
    "yes",
    "No",
    "OFF",
    "null",
    "~",
    "y",
    "1",
    "-1",
    "+1",
    "0",
    "-0",
    "0x1F",
    "0o17",
    "017",
    "1_000",
    "1e5",
    "1.0e5",
    "1.0e+05",
    "1.5",
    ".5",
    "1.",
    "-.inf",
    ".NaN",
    "2026-11-30",
    "2026-11-30T13:00:39+00:00",
    "12:30",
    "a: b",
    "a #b",
    "#c",
    "- x",
    "? x",
    "[x]",
    "{x}",
    "'q'",
    '"dq"',
    "tab\tx",
    "new\nline",
    "two\n\nbreaks",
    "ünï",
    "emoji 🎉",
    "word " * 30,
    "trailing ",
    " leading",
    "a  b",
    "%pct",
    "@at",
    "`bt",
    "!bang",
    "&amp",
    "*star",
    "a,b",
    "=",
    "<<",
    "key:",
    ":x",
    "x:y",
    "it's",
    "a  'b'  c " * 12,
    "x" * 120,
]
NUMBERS = [0, 7, -3, 2**70, 0.1, 1e-05, 1e20, -0.0, 123456.789, float("inf"), float("-inf"), 2.5]
KEYS = ["m", "block_m", "measured_ms", "a b", "1", "yes", "x-y", "_k", "K9"]


def _scalar(rng: random.Random) -> Any:
    pick = rng.random()
    if pick < 0.45:
        return rng.choice(TRICKY)
    if pick < 0.8:
        return rng.choice(NUMBERS)
    return rng.choice([True, False, None])


def _node(rng: random.Random, depth: int, shared: list[Any]) -> Any:
    pick = rng.random()
    if depth >= 3 or pick < 0.55:
        return _scalar(rng)
    if shared and pick < 0.62:
        return rng.choice(shared)  # one object in many places: safe_dump writes an anchor
    if pick < 0.8:
        return [_node(rng, depth + 1, shared) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(KEYS): _node(rng, depth + 1, shared) for _ in range(rng.randrange(0, 4))}


def _rows(seed: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    shared = [{"block_m": 128, "block_n": 256, "warp_specialize": True}, [2, 2, 1]]
    rows = []
    for i in range(count):
        row: dict[str, Any] = {"problem": {"m": 64 * (i + 1), "n": 1024, "k": 4096}}
        for _ in range(rng.randrange(1, 5)):
            row[rng.choice(KEYS)] = _node(rng, 1, shared)
        rows.append(row)
    return rows


def _same(text: str) -> None:
    """``text`` reads as the YAML parser reads it: equal, with the same types and key order."""
    expected = load_yaml_text(text)
    assert repr(load_document(text)) == repr(expected)
    assert repr(parse_table_text(text)) == repr(expected)
    lazy = lazy_table_data(text, "t.yaml")
    lazy["rows"] = [decode_row_line(row) if isinstance(row, str) else row for row in lazy["rows"]]
    assert repr(lazy) == repr(expected)


def _read_or_refused_alike(text: str) -> None:
    """``text`` reads as the YAML parser reads it, or both refuse it."""
    try:
        expected = load_yaml_text(text)
    except yaml.YAMLError:
        with pytest.raises(yaml.YAMLError):
            load_document(text)
        return
    assert repr(load_document(text)) == repr(expected), text


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "style",
    [
        {},  # yaml.safe_dump's defaults: keys sorted, block style, lines wrapped at 80
        {"sort_keys": False, "default_flow_style": None},  # collections of scalars in flow style
        {"sort_keys": False, "width": 20, "allow_unicode": True},
    ],
)
def test_block_rows_read_as_the_yaml_parser_reads_them(seed: int, style: dict[str, Any]) -> None:
    data = {"schema_version": 2, "collective": "all_reduce", "rows": _rows(seed, 40)}
    _same(yaml.safe_dump(data, **style))


def test_rows_pyyaml_writes_are_read_without_the_yaml_parser() -> None:
    # the reader takes what safe_dump writes for plain table rows, anchors included: it must not
    # hand them all to the YAML parser (which is what makes a large table slow)
    tile = {"block_m": 128, "block_n": 256, "block_k": 64, "warp_specialize": True}
    rows = [
        {
            "problem": {"m": 64 * i, "n": 1024, "k": 4096},
            "engine": "triton",
            "settings": {"tile": tile, "groups": [1, 2], "layout": "tile_major"},
            "provenance": {"study": f"s-{i}", "decision": "best 0.092 ms vs 0.066 ms: " * 5, "ms": 0.05 + i},
        }
        for i in range(1, 30)
    ]
    for style in ({}, {"sort_keys": False, "default_flow_style": None}):
        text = yaml.safe_dump({"rows": rows}, **style)
        body = text.partition("rows:\n")[2]
        assert repr(read_block_rows(body)) == repr(yaml.safe_load(text)["rows"])
        texts = read_block_rows(body, as_text=True)
        assert texts is not None and all(isinstance(row, str) for row in texts)
        _same(text)
    # keys sorted, as safe_dump writes them by default: the rows between the header's keys
    text = yaml.safe_dump({"schema_version": 2, "collective": "all_reduce", "rows": rows, "world_size": 2})
    assert text.index("collective:") < text.index("rows:") < text.index("world_size:")
    lazy = lazy_table_data(text, "t.yaml")
    assert list(lazy) == ["collective", "rows", "schema_version", "world_size"]
    assert all(isinstance(row, str) for row in lazy["rows"])
    _same(text)


@pytest.mark.parametrize(
    "body",
    [
        "- a: 1\n  # a comment\n  b: 2\n",
        "- a: 1 # a comment after the value\n",
        "- a: !!str 1\n",
        "- a: |\n    block\n    scalar\n",
        '- a: "double\n    quoted"\n',
        "- a: 1\n\tb: 2\n",
        "- <<: {a: 1}\n  b: 2\n",
        "- a: *nowhere\n",
        "- a: 1\n---\n- b: 2\n",
        "- a: {b: [1, 2]}\n",
        "- ? complex\n  : key\n",
        "- a: 1\n  ? complex\n",
        "- a: 1\n  ? complex\n  : key\n",
    ],
)
def test_text_outside_the_subset_goes_to_the_yaml_parser(body: str) -> None:
    assert read_block_rows(body) is None
    _read_or_refused_alike("schema_version: 2\nrows:\n" + body)


@pytest.mark.parametrize(
    "body",
    [
        "- a: b: c\n",
        "- a: 'open\n",
        "- a: 1\n b: 2\n",
        "- a: [1, 2\n",
        "-  a: 1\n  b: 2\n",  # the item's mapping at column 3, its next key at 2
        "- a: {b: 1, c\n    d: 2}\n",  # a flow key over two lines
        "- a: {K9\n    : 1}\n",  # a flow key's ``:`` on the next line
    ],
)
def test_text_the_yaml_parser_refuses_is_still_refused(body: str) -> None:
    with pytest.raises(yaml.YAMLError):
        load_document("schema_version: 2\nrows:\n" + body)


def test_the_packaged_tables_read_as_the_yaml_parser_reads_them() -> None:
    tables = sorted((RESULTS / "tables").rglob("*.yaml"))
    assert tables
    for path in tables:
        _same(path.read_text())


# What the mutations insert: YAML's indicators, quotes, line breaks and indentation.
FRAGMENTS = ["? ", ": ", "- ", "#", " #x", "'", "''", "  ", "\n", "\n  ", "\n    ", "&a ", "*a", "{", "}"]
FRAGMENTS += ["[", "]", ",", "x", "1", "!", "|", ">", '"', "-", ":", " "]


@pytest.mark.parametrize("seed", range(4))
def test_mutated_tables_read_as_the_yaml_parser_reads_them_or_are_refused_alike(seed: int) -> None:
    # text cut and spliced at random: the reader never reads text otherwise than the parser
    rng = random.Random(seed)
    for _ in range(100):
        style = rng.choice([{}, {"sort_keys": False, "default_flow_style": None}, {"width": 30}])
        text = yaml.safe_dump({"schema_version": 2, "rows": _rows(rng.randrange(10**6), 3)}, **style)
        head, _, body = text.partition("rows:\n")
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(body) + 1)
            cut = 0 if rng.random() < 0.5 else rng.randrange(1, 4)
            body = body[:at] + (rng.choice(FRAGMENTS) if cut == 0 else "") + body[at + cut :]
        _read_or_refused_alike(f"{head}rows:\n{body}")


@pytest.mark.parametrize(
    "body",
    [
        "- a:\n  - 1.0e+20\n\n    - 0\n",  # a plain scalar over lines with an empty line: a string
        "- a: 1\n#  b: 2\n  c: 3\nschema: 2\n",  # a comment at column 0 inside a row, a key after
        "- a: 1\n    ? complex\n",  # a plain scalar's next line that starts as a complex key
        "- a: x\n   y\n  b: 2\n",
        "- - 1\n  - 2\n- 3\n",
        "- a:\n  - 1\n  -\n    b: 2\n",
    ],
)
def test_texts_the_fuzz_found_read_as_the_yaml_parser_reads_them(body: str) -> None:
    _same("collective: all_reduce\nrows:\n" + body)
