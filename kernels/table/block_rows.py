"""A table's rows in YAML's block style read through templates, for a table a script wrote with
``yaml.safe_dump`` or an older fo-tune wrote to load in seconds: PyYAML's libyaml loader builds a
Python object per node and took 167 s for a 100,000-row table in this style (50 MB) on the 2-core
CPU machine; this module reads it in about 3 s (docs/perf-notes.md#tables-and-lookup).

The rows of a table have few shapes (the same keys at the same indentation, values aside). For
each shape a row's JSON is made once with a ``%s`` where each value goes, by reading a row of that
shape line by line (``fo_kernels.table.block``) with a marker in each value; a row of that shape is
then its template filled with its values' JSON, and ``json`` reads every row in one call. A row no
template fits is read line by line, and text outside the subset that reader takes goes to the YAML
parser (``read_block_rows`` returns None).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fo_kernels.table.block import (
    NOT_PLAIN,
    TOO_BIG,
    WORDS,
    Reader,
    Unsupported,
    by_parser,
    check_plain,
    closing_quote,
    fold,
    json_exact,
    lines_of,
    read_lines,
)

# A row's line: the part that gives the row's shape (indentation, ``- ``, the key and ``: ``) and
# the value after it. Rows whose lines have the same shapes are read by one template
# (``_Templates``); a row with other keys or values than these is read line by line.
_LINE_PARTS = re.compile(r"^( *+(?:- )?+(?:[A-Za-z_][A-Za-z0-9_]*:(?: |$))?+)(.*)$", re.M)
# The row shapes a row is first matched against (the most recent first): a table's rows take turns
# among a few; a row of none of them costs a findall of its lines and a dict lookup instead.
RECENT_SHAPES = 8
# A shape not met yet, and one met once (``_Templates.known``): a template is made the second time.
_UNSEEN = object()
_SEEN_ONCE = object()
# The text a template puts where each value goes while it is made, and finds again in its JSON.
_SLOT = "zfotuneslot{}"
_SLOT_JSON = re.compile(r'"zfotuneslot([0-9]+)"')
# A number whose text is its own JSON and reads as YAML reads it: an integer, or a float with a
# ``.`` (YAML 1.1 reads ``1e+05``, without one, as a string).
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+(?:[eE][-+][0-9]+)?)?")
# Plain scalars that are strings whose JSON is the text in quotes: a letter first, then letters,
# digits and ``_.-/+``, single spaces between (no indicator, no ``: ``, no `` #``; a null or boolean
# word is excluded by name).
_PLAIN_WORDS = re.compile(r"[A-Za-z][A-Za-z0-9_./+-]*(?: [A-Za-z0-9_./+-]+)*")
# What an alias to no anchor reads (None is a node's value).
_NO_NODE = object()


class _ValueJson(dict[str, "str | None"]):
    """Each value's JSON (``_Templates.value_json``), made the first time the value is met."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, value: str) -> str | None:
        text = self.make(value)
        if value[:1] != "*":  # an alias reads its anchor's node as it stands when it is met
            self[value] = text
        return text


def _key_column(prefix: str) -> int:
    """The column of a line's key (after ``- `` where the line opens an item with a key), or of
    its ``-``: a continuation of its value sits deeper."""
    column = len(prefix) - len(prefix.lstrip(" "))
    rest = prefix[column:]
    return column + 2 if rest.startswith("- ") and rest != "- " else column


def _joined(parts: list[tuple[str, str]]) -> list[tuple[str, str, list[str]]]:
    """``_LINE_PARTS`` of a row's lines with each continuation line (indentation alone before its
    text, deeper than the line before: a wrapped scalar's next line) joined to the value it goes
    on: (prefix, value with its lines, the continuation lines' prefixes)."""
    out: list[tuple[str, str, list[str]]] = []
    for prefix, value in parts:
        if out and value and out[-1][1] and not prefix.strip(" "):
            before, text, more = out[-1]
            if len(prefix) > _key_column(before):
                out[-1] = (before, f"{text}\n{prefix}{value}", [*more, prefix])
                continue
        out.append((prefix, value, []))
    return out


def _row_pattern(parts: list[tuple[str, str, list[str]]]) -> re.Pattern[str]:
    """The pattern of the rows shaped as ``parts`` (``_joined``): each prefix as it stands, each
    value (with its continuation lines' prefixes as they stand) a group."""
    lines = []
    for prefix, value, more in parts:
        if not value:
            lines.append(re.escape(prefix))
            continue
        rest = "".join(f"\\n{re.escape(line)}[^\\n]+" for line in more)
        lines.append(f"{re.escape(prefix)}([^\\n]+{rest})")
    return re.compile("\\n".join(lines))


class _Templates:
    """Rows read through templates: for each row shape (its lines' ``_LINE_PARTS`` prefixes) the
    row's JSON with a ``%s`` for each value, made once by reading a row of that shape line by line
    with a marker in each value, and a pattern that matches the rows of that shape and takes their
    values; a row is its template filled with its values' JSON. A row no template reads is read
    line by line. ``json`` then reads every row in one call."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        # Each shape met: (the pattern of its rows, their template), None where no template reads
        # them (their rows are read line by line), ``_SEEN_ONCE`` before a second row of it; the
        # shapes met last, tried first by pattern.
        self.known: dict[tuple[Any, ...], Any] = {}
        # The shapes met last, by their rows' line count (a table's shapes mostly differ in it).
        self.recent: dict[int, list[tuple[re.Pattern[str], str]]] = {}
        self.values = _ValueJson(self.value_json)
        # Each anchor's node as JSON, made at its first alias after the row that defines it.
        self.alias_json: dict[str, str | None] = {}

    def line_row_json(self, chunk: str) -> str | None:
        """The JSON of the row whose text is ``chunk``, read line by line (anchors it defines kept
        for the rows after it); None when it leaves the subset or JSON."""
        lines = lines_of(chunk)
        self.alias_json.clear()  # the row may define an anchor again
        rows = read_lines(lines, self.reader) if lines is not None else None
        if rows is None or len(rows) != 1 or not json_exact(rows[0]):
            return None
        return json.dumps(rows[0])

    def row_json(self, chunk: str) -> str | None:
        """The JSON of the row whose text (``- `` and its lines) is ``chunk``, by its shape's
        template, else line by line; None when it leaves the subset or JSON."""
        if "&" in chunk:  # an anchor (or a ``&`` in a value): line by line
            return self.line_row_json(chunk)
        recent = self.recent.setdefault(chunk.count("\n"), [])
        for j, (pattern, made) in enumerate(recent):
            match = pattern.fullmatch(chunk)
            if match is not None:
                template = made
                if j:
                    recent.insert(0, recent.pop(j))  # the most recent shape is tried first
                break
        else:
            parts = _joined(_LINE_PARTS.findall(chunk))
            shape = tuple((prefix, bool(value), tuple(more)) for prefix, value, more in parts)
            entry = self.known.get(shape, _UNSEEN)
            if entry is _UNSEEN:  # a shape met once is read line by line: most are met again
                self.known[shape] = _SEEN_ONCE
                return self.line_row_json(chunk)
            if entry is _SEEN_ONCE:
                made = self._template(parts)
                entry = self.known[shape] = None if made is None else (_row_pattern(parts), made)
            if entry is None:
                return self.line_row_json(chunk)
            pattern, template = entry
            match = pattern.fullmatch(chunk)
            if match is None:
                return self.line_row_json(chunk)
            if entry in recent:
                recent.remove(entry)
            recent.insert(0, entry)
            del recent[RECENT_SHAPES:]
        texts = tuple(map(self.values.__getitem__, match.groups()))
        if None in texts:
            return self.line_row_json(chunk)
        return template % texts

    def _template(self, parts: list[tuple[str, str, list[str]]]) -> str | None:
        """The template of rows shaped as ``parts``, or None when a template cannot read them."""
        filled = []
        slots = 0
        for prefix, value, _more in parts:
            if value:
                value = _SLOT.format(slots)
                slots += 1
            filled.append(prefix + value)
        lines = lines_of("\n".join(filled))
        rows = read_lines(lines, Reader([])) if lines is not None else None
        if rows is None or len(rows) != 1 or not json_exact(rows[0]):
            return None
        text = json.dumps(rows[0]).replace("%", "%%")
        found = [int(slot) for slot in _SLOT_JSON.findall(text)]
        if found != list(range(slots)) or text.count("zfotuneslot") != slots:
            return None
        return _SLOT_JSON.sub("%s", text)

    def value_json(self, value: str) -> str | None:
        """One value's JSON (its continuation lines folded), as the line-by-line reader reads it;
        None where a template cannot hold it (a structure, a value ``json`` does not read back as
        it is)."""
        value = value.rstrip(" ")
        if _JSON_NUMBER.fullmatch(value):
            return value
        if _PLAIN_WORDS.fullmatch(value) and value not in WORDS:
            return f'"{value}"'  # a string: nothing in it to escape
        first = value[:1]
        lines = value.split("\n")
        try:
            if first == "*":
                if len(lines) > 1:
                    return None
                if value[1:] not in self.alias_json:
                    node = self.reader.anchors.get(value[1:], _NO_NODE)
                    exact = node is not _NO_NODE and json_exact(node)
                    self.alias_json[value[1:]] = json.dumps(node) if exact else None
                return self.alias_json[value[1:]]
            elif first == "'":
                body = "\n".join([lines[0][1:], *(line.strip(" ") for line in lines[1:])])
                if closing_quote(body) != len(body) - 1:
                    return None
                read = fold(body[:-1].split("\n"), quoted=True).replace("''", "'")
            elif first in "{[":
                read = self.reader.flow(value)
            elif len(lines) > 1:  # a plain scalar over lines
                if first in NOT_PLAIN:
                    return None
                text = fold(lines, quoted=False)
                check_plain(text)
                read = self.reader.plain(text)
            elif first == '"':
                if len(value) < 2 or value[-1] != '"':
                    return None
                read = by_parser(value)
            elif first in NOT_PLAIN:
                return None
            else:
                check_plain(value)
                read = self.reader.plain(value)
        except Unsupported:
            return None
        return json.dumps(read) if json_exact(read) else None


def read_block_rows(body: str, *, as_text: bool = False) -> list[Any] | None:
    """The rows in ``body`` (the text after a table's ``rows:`` line): a block sequence as
    ``yaml.safe_dump`` writes it; None when the text leaves the subset this module reads (the
    caller then reads the whole file with the YAML parser). With ``as_text``, rows that templates
    read stay their JSON text (``json.loads`` reads each), for a reader that decodes the rows it
    takes."""
    if "\t" in body or "\r" in body:
        return None
    reader = Reader([])
    if body.startswith("- "):
        templates = _Templates(reader)
        texts = []
        for i, row in enumerate(body.rstrip("\n").split("\n- ")):
            text = templates.row_json(row if i == 0 else "- " + row)
            if text is None:
                break
            texts.append(text)
        else:
            if as_text:
                return texts
            try:
                return json.loads("[" + ",".join(texts) + "]")
            except TOO_BIG:  # (``TOO_BIG``'s ValueError is json's): the YAML parser reads it all
                return None
    lines = lines_of(body)
    return read_lines(lines, reader) if lines is not None else None
