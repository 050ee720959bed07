"""A table file's text: the header in YAML's block style, then ``rows:`` with one row a line, each a
JSON object. JSON objects are YAML flow mappings, so the file is YAML throughout (any YAML reader,
``yq`` or a hand edit takes it), and the rows are read by ``json`` in one call instead of by the
YAML parser.

That is what makes a large table cheap: on the 2-core CPU machine, PyYAML's libyaml loader took
167 s for a 100,000-row table in block style (50 MB); ``json`` reads the same rows in about a
second (docs/perf-notes.md#tables-and-lookup). A file that is not in this form (a
hand-written table, a schema-1 file, a comment between rows) is read as one JSON document by
``json`` (``json.dump`` of a table), or with its rows in YAML's block style by
``fo_kernels.table.block_rows`` (``yaml.safe_dump`` of a table), else by the YAML parser; a row line
that is not JSON is read by the YAML parser alone.

A row's numbers read the same in both parsers: a float whose JSON form has no ``.`` (``1e-05``)
is written ``1.0e-05`` (PyYAML, a YAML 1.1 reader, takes ``1e-05`` for a string); a row holding a
non-finite float or a non-string key is written as a YAML flow mapping instead.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import yaml

from fo_kernels.errors import TableError
from fo_kernels.files import SAFE_LOADER
from fo_kernels.table.block import TOO_BIG, json_exact
from fo_kernels.table.block_rows import read_block_rows
from fo_kernels.table.index import EXACT, RANGE, ProblemKey

# What a table file that does not parse (cut short by a full disk or an interrupted copy, or edited
# by hand) says to do, after what the parser found.
UNREADABLE_HINT = "restore the file from its copy, or move it away and re-tune its rows with `fo-tune search`"


class RepeatedKey(ValueError):
    """A JSON object holding one key twice (``unique_keys``); a ``ValueError``, as ``json``'s own."""


# How many keys of a mapping with a repeated key its message lists (a row holds about 6, its
# settings about 10), enough to find it in the file.
_QUOTED_KEYS = 10


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict (``json``'s ``object_pairs_hook``); ``RepeatedKey`` for a key
    given twice: ``json`` keeps the last alone, so a row edited by hand to ``{"m": 1, "m": 2}``
    would read as ``m: 2``, the first value silently gone. One ``dict`` and one ``len`` an object:
    on the 2-core CPU machine, ``tests/big_table.py``'s 100,000 row lines decode in one call in
    0.82 s of CPU (0.69 without it; 0.59 and 0.43 with the collector paused, as validate reads),
    and ``fo-tune table validate`` of them takes 1.89-1.95 s of CPU in-process (1.76-1.81 without;
    the two alternating, three runs each); the runtime's first lookup decodes no row."""
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                break
            seen.add(key)
        keys = ", ".join(str(name) for name, _value in pairs[:_QUOTED_KEYS])
        more = ", ..." if len(pairs) > _QUOTED_KEYS else ""
        raise RepeatedKey(
            f"the key {key!r} is given twice in one mapping (keys {keys}{more}), and a reader keeps "
            "the last alone, the first's value dropped; keep one"
        )
    return found


# The JSON reader of table text: ``json``'s, refusing a repeated key (``unique_keys``).
_JSON = json.JSONDecoder(object_pairs_hook=unique_keys)


def loads(text: str) -> Any:
    """``json.loads(text)``, refusing a key an object repeats (``RepeatedKey``)."""
    return _JSON.decode(text)


def unreadable(source: str, exc: Exception) -> str:
    """The one-line message of a table file at ``source`` that the parser refused with ``exc``."""
    return f"{source}: not valid YAML: {' '.join(str(exc).split())}; {UNREADABLE_HINT}"


# The line that starts the rows, and how every row line starts.
ROWS_LINE = "rows:"
ROW_PREFIX = "- "
# How a row is written: JSON with a space after each separator (readable, and YAML needs the
# space after ':' in a flow mapping whose keys are not quoted; ours are, the space costs nothing).
_SEPARATORS = (", ", ": ")
# Placeholder of a float written in its YAML-safe form (``1.0e-05``); NUL never occurs in YAML text.
_FLOAT_MARK = "\u0000f{}\u0000"


def _yaml_safe_floats(value: Any, floats: list[str]) -> Any:
    """``value`` with each float that JSON writes without a ``.`` replaced by a placeholder (its
    YAML-safe text appended to ``floats``); raises ``ValueError`` for what JSON cannot carry to
    YAML unchanged (a non-finite float, a non-string key, a value of no JSON type: a timestamp
    YAML read from a hand-written unquoted date)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("non-finite float")
        text = repr(value)
        if "." in text:
            return value
        mantissa, _, exponent = text.partition("e")
        floats.append(f"{mantissa}.0e{exponent}")
        return _FLOAT_MARK.format(len(floats) - 1)
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise ValueError("non-string key")
        return {key: _yaml_safe_floats(item, floats) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_safe_floats(item, floats) for item in value]
    if value is not None and not isinstance(value, (str, int)):  # (a bool is an int)
        raise ValueError(f"{type(value).__name__}: no JSON type")
    return value


# What in a row's JSON text the YAML parser would not read back as JSON does: a float written
# with an exponent and no ``.`` (``1e-05``), a non-finite one (``NaN``, ``Infinity``). A string
# that holds such text sends its row the long way, which writes the same line.
_NOT_YAML_SAFE = re.compile(r"[0-9]e[-+][0-9]|NaN|Infinity")


def row_line(row: Mapping[str, Any]) -> str:
    """One row as its line's text (without ``- ``): JSON, else a one-line YAML flow mapping."""
    try:
        text = json.dumps(row, separators=_SEPARATORS, ensure_ascii=False)
    except (TypeError, ValueError):  # a value JSON cannot hold: the long way says what to do
        text = None
    if text is not None and _NOT_YAML_SAFE.search(text) is None and json_exact(row):
        return text  # what the walk below writes, in one C call
    floats: list[str] = []
    try:
        safe = _yaml_safe_floats(row, floats)
    except ValueError:
        text = yaml.safe_dump(dict(row), default_flow_style=True, width=math.inf, sort_keys=False)
        return " ".join(text.split("\n")).strip()
    text = json.dumps(safe, separators=_SEPARATORS, ensure_ascii=False)
    for i, number in enumerate(floats):
        text = text.replace(json.dumps(_FLOAT_MARK.format(i)), number, 1)
    return text


def dump_table_text(header_text: str, rows: list[Mapping[str, Any]]) -> str:
    """The file: ``header_text`` (YAML block style, ending in a newline, without ``rows``), then
    ``rows:`` and one line a row (``rows: []`` when there is none)."""
    if not rows:
        return f"{header_text}{ROWS_LINE} []\n"
    lines = [f"{ROW_PREFIX}{row_line(row)}\n" for row in rows]
    return f"{header_text}{ROWS_LINE}\n{''.join(lines)}"


def _row_lines(body: str) -> list[str] | None:
    """The row lines of ``body`` (the text after ``rows:``), each without ``- ``; None unless every
    non-empty line is one flow-mapping row, and for none (``rows:`` holds nothing, which the
    header's reader refuses: a file cut short there)."""
    lines = body.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines or not all(line.startswith("- {") and line.endswith("}") for line in lines):
        return None
    return [line[len(ROW_PREFIX) :] for line in lines]


def load_yaml_text(text: str, *, row: bool = False) -> Any:
    """A safe YAML load (libyaml's parser where PyYAML has it) of a file's text, or of one ``row``
    line; ``yaml.YAMLError`` also for a key any mapping repeats (``_refuse_repeated_keys``: YAML's
    readers keep the last, as ``loads`` refuses it in JSON) and for an integer too long to convert
    or nesting too deep to build (``TOO_BIG``), which PyYAML lets out as Python's own errors."""
    loader = SAFE_LOADER(text)  # a safe loader, C or Python
    try:
        node = loader.get_single_node()
        for mapping in _mappings(node):
            if isinstance(mapping, yaml.MappingNode):
                _refuse_repeated_keys(mapping, top=mapping is node and not row, lines=not row)
        return None if node is None else loader.construct_document(node)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply to read (past Python's recursion limit)") from None
    except ValueError as exc:  # (its advice, to raise Python's limit, is not the reader's to take)
        raise yaml.YAMLError(str(exc).split(";")[0]) from None
    finally:
        loader.dispose()


def _mappings(node: yaml.Node | None) -> list[yaml.Node]:
    """``node`` and every node under it, each once (an alias's node is its anchor's)."""
    found, seen, stack = [], set(), [node] if node is not None else []
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        found.append(item)
        if isinstance(item, yaml.MappingNode):
            stack.extend(part for pair in item.value for part in pair)
        elif isinstance(item, yaml.SequenceNode):
            stack.extend(item.value)
    return found


def _refuse_repeated_keys(node: yaml.MappingNode, *, top: bool, lines: bool) -> None:
    """``yaml.YAMLError`` for a key the mapping ``node`` holds twice, naming the key and (with
    ``lines``: the text is a file's) both lines: YAML's readers keep the last one alone, so a row's
    key given twice reads as its second value, and at the file's ``top`` level two tables in one
    file (``cat a.yaml b.yaml``), or a header key added by hand below the one there, read as the
    second alone, the first's rows silently gone."""
    seen: dict[tuple[str, str], int] = {}
    for key, _value in node.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        line, first = key.start_mark.line + 1, seen.get((key.tag, key.value))
        seen[(key.tag, key.value)] = line
        if first is not None:
            where = f"lines {first} and {line}" if first != line else f"both on line {line}"
            why = " (a file holds one table: two joined into one file read as the second alone)"
            raise yaml.YAMLError(
                f"the key {key.value!r} is given twice ({where if lines else 'in one mapping'}), and "
                f"YAML keeps the last alone, the first's content dropped; keep one{why if top else ''}"
            )


# Where a block sequence of rows ends: the first line at column 0 that is not one of its items
# (the next key of a file whose keys are sorted, as ``yaml.safe_dump`` writes them by default).
_ROWS_END = re.compile(r"\n(?=[^ \n#-]|-[^ \n])")


def _block_document(text: str, lazy: bool) -> dict[str, Any] | None:
    """The data of a file whose ``rows`` are a block sequence ``fo_kernels.table.block_rows``
    reads (the keys before and after them by the YAML parser, in their order); None for any
    other text."""
    if text.startswith(f"{ROWS_LINE}\n"):
        head, body = "", text[len(ROWS_LINE) + 1 :]
    else:
        head, found, body = text.partition(f"\n{ROWS_LINE}\n")
        if not found:
            return None
    if body[:1] not in (" ", "-"):
        return None
    end = _ROWS_END.search(body)
    rows_text, tail = (body[: end.start() + 1], body[end.start() + 1 :]) if end else (body, "")
    rows = read_block_rows(rows_text, as_text=lazy)
    if rows is None:
        return None
    try:
        before = load_yaml_text(head + "\n") if head.strip() else {}
        after = load_yaml_text(tail) if tail.strip() else {}
    except yaml.YAMLError:  # an alias to an anchor in the rows, say: the parser reads it all
        return None
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    if "rows" in before or "rows" in after or before.keys() & after.keys():
        return None
    return {**before, "rows": rows, **after}


def load_document(text: str, *, lazy: bool = False) -> Any:
    """A whole file that is not in the written form: by ``json`` when it is one JSON document (a
    table a script wrote with ``json.dump``; JSON is YAML, and ``json`` reads a 100,000-row one in
    about a second where the YAML parser took a minute); the header by the YAML parser and the
    rows by ``fo_kernels.table.block_rows`` when the rows are in the block style ``yaml.safe_dump``
    writes (``lazy``: rows it reads by template stay JSON text, as a written file's lines); else
    all of it by the YAML parser."""
    if text.lstrip().startswith("{"):
        try:
            return loads(text)
        except RepeatedKey as exc:
            raise yaml.YAMLError(str(exc)) from None
        except TOO_BIG:  # a YAML flow mapping that is not JSON (or JSON json will not read)
            pass
    data = _block_document(text, lazy)
    if data is not None:
        return data
    return load_yaml_text(text)


def decode_row_line(line: str) -> Any:
    """One row line (without ``- ``): by ``json``, else by the YAML parser; ``yaml.YAMLError`` for
    a key a mapping of it repeats, in either."""
    try:
        return loads(line)
    except RepeatedKey as exc:
        raise yaml.YAMLError(str(exc)) from None
    except TOO_BIG:
        return load_yaml_text(line, row=True)


def split_table_text(text: str) -> tuple[dict[str, Any], list[str]] | None:
    """(the header's data, the row lines undecoded) of a file in the written form (see the module
    docstring); None for any other text (read it with ``load_document``). Raises
    ``yaml.YAMLError`` for a header that is not YAML."""
    head, found, body = text.partition(f"\n{ROWS_LINE}\n")
    lines = _row_lines(body) if found else None
    if lines is None:
        return None
    header = load_yaml_text(head + "\n")
    if not isinstance(header, dict) or "rows" in header:
        return None
    return header, lines


def parse_table_text(text: str) -> Any:
    """The data of a table file's ``text``: in the written form the header by the YAML parser and
    the rows by ``json`` in one call (a line that is not JSON by the YAML parser), else all of it
    by ``load_document`` (``json`` for one JSON document, else the YAML parser). Raises
    ``yaml.YAMLError`` for text that is not YAML."""
    split = split_table_text(text)
    if split is None:
        return load_document(text)
    data, lines = split
    data["rows"] = decode_row_lines(lines, first_line=rows_first_line(text))
    return data


def rows_first_line(text: str) -> int:
    """The line number (from 1) of the first row line of ``text``, a file in the written form."""
    return text.partition(f"\n{ROWS_LINE}\n")[0].count("\n") + 3


def decode_row_lines(lines: list[str], *, first_line: int | None = None) -> list[Any]:
    """Row lines (without ``- ``) by ``json`` in one call, else each by ``decode_row_line``;
    ``yaml.YAMLError`` naming the row (``rows[i]``, and its line in the file where ``first_line``,
    that of ``lines[0]``, is given) that does not read."""
    try:
        return loads("[" + ",".join(lines) + "]")
    except TOO_BIG:  # (``RepeatedKey`` too: the line that holds it is named below)
        pass
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(decode_row_line(line))
        except yaml.YAMLError as exc:
            where = f"rows[{i}]" if first_line is None else f"rows[{i}] (line {first_line + i})"
            raise yaml.YAMLError(f"{where}: {' '.join(str(exc).split())}") from None
    return rows


def lazy_table_data(text: str, source: str) -> Any:
    """The data of a table file's ``text`` for a reader that builds rows on first use: in the
    written form the header's data with ``rows`` the row lines undecoded (``decode_row_at`` reads
    one), else the whole document (``load_document``, its block-style rows that templates read
    left as JSON text too). ``TableError`` naming ``source`` for text that is not YAML."""
    try:
        split = split_table_text(text)
        if split is None:
            return load_document(text, lazy=True)
    except yaml.YAMLError as exc:
        raise TableError(unreadable(source, exc)) from None
    header, lines = split
    return {**header, "rows": lines}


def decode_row_at(rows: list[Any], i: int, source: str) -> Any:
    """Row line ``rows[i]`` of the table at ``source`` decoded (``decode_row_line``);
    ``TableError`` naming the row when it is not YAML."""
    try:
        return decode_row_line(rows[i])
    except yaml.YAMLError as exc:
        raise TableError(unreadable(f"{source}: rows[{i}]", exc)) from None


# What a lazily read table builds from a row.
T = TypeVar("T")


def row_built_once(built: dict[int, T], rows: list[Any], i: int, source: str, build: Callable[[Any], T]) -> T:
    """Row ``i`` of a lazily read table: ``built[i]``, else ``build`` of its data (its line decoded
    first, ``decode_row_at``) kept in ``built``; the caller holds its table's lock."""
    found = built.get(i)
    if found is None:
        raw = rows[i]
        if isinstance(raw, str):
            raw = decode_row_at(rows, i, source)
        found = built[i] = build(raw)
    return found


# The problem at the start of a written row line (``row_line`` writes ``problem`` first, with
# these separators): exact ``m``, or ``m_min`` and ``m_max``; then ``n`` and ``k``.
_PROBLEM_PREFIX = re.compile(
    r'\{"problem": \{(?:"m": ([1-9][0-9]{0,18})|"m_min": ([1-9][0-9]{0,18}), "m_max": ([1-9][0-9]{0,18})), '
    r'"n": ([1-9][0-9]{0,18}), "k": ([1-9][0-9]{0,18})\}'
)


# The key a written row line starts with; a line that holds it again is decoded whole (``json``
# and YAML keep the last of a repeated key, the prefix the first: decoding refuses the repeat).
_PROBLEM_KEY = '"problem"'


def problem_again(line: str, end: int) -> bool:
    """Whether ``line`` holds the key ``problem`` again after its prefix (ending at ``end``): a
    hand edit that put a second problem in the row, which the prefix alone would not see, so a
    lookup would file the row under the first and miss it under the second. One ``str.find``:
    25 ms over 100,000 written lines on the 2-core CPU machine."""
    return line.find(_PROBLEM_KEY, end) != -1


def line_problem(line: str) -> ProblemKey | None:
    """The ``ProblemKey`` at the start of a written row line, without decoding the rest; None when
    the line does not start that way, or its range is empty, or it names ``problem`` again
    (``problem_again``): decoding it names the error."""
    match = _PROBLEM_PREFIX.match(line)
    if match is None or problem_again(line, match.end()):
        return None
    m, lo, hi, n, k = match.groups()
    if m is not None:
        return (int(n), int(k), int(m), EXACT, int(m))
    if int(lo) > int(hi):
        return None
    return (int(n), int(k), int(lo), RANGE, int(hi))
