"""A table's rows in YAML's block style read line by line: the subset of YAML that
``yaml.safe_dump`` writes (and fo-tune wrote before one JSON row a line, ``fo_kernels.table.text``)
for a list of mappings. ``fo_kernels.table.block_rows`` reads most rows through templates and
hands this module the rows and the lines no template fits.

``read_lines`` reads block mappings and sequences (a sequence under a key at the key's
indentation, as PyYAML writes it, or deeper; ``- - `` and ``- key:`` items), plain scalars and
single-quoted scalars (over lines too), flow mappings and sequences of such scalars, anchors and
aliases, empty lines. A plain scalar is resolved by YAML 1.1's rules as PyYAML's safe loader
resolves it (a word is a string unless it is one of the null and boolean words; an integer or a
float of the common forms directly; any other by the YAML parser, once per distinct text).
Anything else (a tag, a block scalar, a double-quoted scalar over lines, a comment line or a
comment after a value, a tab, a complex key, a merge key, a nested flow collection, ...) raises
``Unsupported``: the caller reads the file with the YAML parser, so what it gets is always what
that parser gives.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from fo_kernels.files import SAFE_LOADER

# YAML 1.1's null and boolean words (PyYAML's resolver); any other plain scalar that starts with a
# letter is a string.
WORDS: dict[str, Any] = {
    **dict.fromkeys(("null", "Null", "NULL", "~", ""), None),
    **dict.fromkeys(("yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"), True),
    **dict.fromkeys(("no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"), False),
}
# The integers and floats read directly: YAML 1.1's decimal integer and its float with a ``.``
# and an optional signed exponent (``1e-05``, without a ``.``, is a string there). Other forms
# (``0x1f``, ``1_000``, ``.inf``, ``1:30``) go to the YAML parser.
_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)\.[0-9]*(?:[eE][-+][0-9]+)?")
# A plain scalar's first characters that make it something else (YAML's indicators).
NOT_PLAIN = frozenset("[]{}#&*!|>'\"%@`,")
# A flow collection of plain scalars on one line: nothing nested, nothing quoted.
_SIMPLE_FLOW = re.compile(r"[{\[][^{}\[\]'\"&*!#\n]*[}\]]")
# A plain scalar in a flow collection, up to what ends it (conservative: a ``:`` ends it).
_FLOW_PLAIN = re.compile(r"[^,\[\]{}:'\"]*")
_ANCHOR = re.compile(r"&([^\s\[\]{},]+)(?: +|$)")


class Unsupported(Exception):
    """The text leaves the subset this reader takes: the YAML parser reads the file instead."""


# A line of the rows: its indentation, its text (without the indentation and trailing spaces) and
# the empty lines before it (a line break each inside a multi-line scalar, nothing elsewhere).
Line = tuple[int, str, int]


class Reader:
    """One read of a block's lines (``read_block_rows``): the lines, the anchors met and the
    plain scalars already resolved."""

    def __init__(self, lines: list[Line]) -> None:
        self.lines = lines
        self.anchors: dict[str, Any] = {}
        self.resolved: dict[str, Any] = {}

    # ---------------------------------------------------------------------------------- scalars
    def plain(self, text: str) -> Any:
        """A plain scalar's value, as YAML 1.1 resolves it."""
        try:
            return self.resolved[text]
        except KeyError:
            pass
        if text in WORDS:
            value = WORDS[text]
        elif text[:1].isalpha() or "\n" in text:  # (no YAML 1.1 type but a string spans lines)
            value = text
        elif _INT.fullmatch(text):
            value = int(text)
        elif _FLOAT.fullmatch(text):
            value = float(text)
        else:
            check_plain(text)
            value = by_parser(text)
        self.resolved[text] = value
        return value

    def flow(self, text: str) -> Any:
        """A flow mapping or sequence of scalars (plain or single-quoted), on one line or over
        several (``text`` holds their line breaks); a nested collection is refused."""
        if _SIMPLE_FLOW.fullmatch(text):  # one line of plain scalars: split at the commas
            inner = text[1:-1].strip(" ")
            items = [item.strip(" ") for item in inner.split(",")] if inner else []
            if items and items[-1] == "":
                items.pop()  # a trailing comma
            if text[0] == "[":
                return [self._flow_plain(item) for item in items]
            out: dict[Any, Any] = {}
            for item in items:
                key, sep, value = item.partition(": ")
                if not sep:
                    raise Unsupported
                out[self._flow_plain(key.strip(" "))] = self._flow_plain(value.strip(" "))
            return out
        return self._flow_scanned("\n".join(line.strip(" ") for line in text.split("\n")))

    def _flow_scanned(self, text: str) -> Any:
        """``flow`` of text that is not one line of plain scalars, scanned item by item."""
        close = "}" if text[0] == "{" else "]"
        keys: list[Any] = []
        values: list[Any] = []
        at = _skip_space(text, 1)
        while text[at : at + 1] != close:
            start = at
            key, at = self._flow_scalar(text, at)
            at = _skip_space(text, at)
            if close == "}":
                if text[at : at + 1] != ":" or text[at + 1 : at + 2] not in (" ", "\n"):
                    raise Unsupported
                if "\n" in text[start:at]:  # a key and its ``:`` on one line (an implicit key)
                    raise Unsupported
                value, at = self._flow_scalar(text, _skip_space(text, at + 1))
                values.append(value)
                at = _skip_space(text, at)
            keys.append(key)
            if text[at : at + 1] == ",":
                at = _skip_space(text, at + 1)
            elif text[at : at + 1] != close:
                raise Unsupported
        if text[at + 1 :].strip(" \n"):
            raise Unsupported
        return dict(zip(keys, values, strict=True)) if close == "}" else keys

    def _flow_scalar(self, text: str, at: int) -> tuple[Any, int]:
        """The scalar at ``text[at]`` in a flow collection, and where it ends."""
        if text[at : at + 1] == "'":
            end = closing_quote(text[at + 1 :])
            if end is None:
                raise Unsupported
            raw = text[at + 1 : at + 1 + end]
            return fold(raw.split("\n"), quoted=True).replace("''", "'"), at + end + 2
        match = _FLOW_PLAIN.match(text, at)
        assert match is not None  # the pattern matches the empty text
        raw = match.group().rstrip(" \n")
        if not raw or text[match.end() : match.end() + 1] not in (",", "]", "}", ":"):
            raise Unsupported  # empty, or at a quote or a nested collection
        return self._flow_plain(fold(raw.split("\n"), quoted=False)), at + len(raw)

    def _flow_plain(self, text: str) -> Any:
        if text == "" or ":" in text or "#" in text or "?" in text:
            raise Unsupported
        check_plain(text)
        return self.plain(text)

    # --------------------------------------------------------------------------------- values
    def value(self, text: str, i: int, parent: int) -> tuple[Any, int]:
        """The value ``text`` that follows ``key: `` or ``- `` on the line before line ``i``
        (its continuation lines, deeper than ``parent``, from line ``i``); (value, next line)."""
        anchor = None
        if text[:1] == "&":
            match = _ANCHOR.match(text)
            if match is None:
                raise Unsupported
            anchor, text = match.group(1), text[match.end() :]
        if text == "":
            value, i = self.nested(i, parent)
        elif text[:1] == "*":
            if anchor is not None or text[1:] not in self.anchors:
                raise Unsupported
            return self.anchors[text[1:]], i
        elif text[:1] == "'":
            value, i = self.single_quoted(text, i, parent)
        elif text[:1] == '"':
            if self.continues(i, parent) or len(text) < 2 or text[-1] != '"':
                raise Unsupported
            value = by_parser(text)
        elif text[:1] in "{[":
            parts = [text]
            while self.continues(i, parent):
                parts.extend([""] * self.lines[i][2])
                parts.append(self.lines[i][1])
                i += 1
            value = self.flow("\n".join(parts))
        else:
            parts = [text]
            while self.continues(i, parent):
                parts.extend([""] * self.lines[i][2])
                parts.append(self.lines[i][1])
                i += 1
            if len(parts) > 1:
                text = fold(parts, quoted=False)
            check_plain(text)
            value = self.plain(text)
        if anchor is not None:
            self.anchors[anchor] = value
        return value, i

    def continues(self, i: int, parent: int) -> bool:
        """True when line ``i`` goes on with the value of a node at indentation ``parent``."""
        return i < len(self.lines) and self.lines[i][0] > parent

    def single_quoted(self, text: str, i: int, parent: int) -> tuple[str, int]:
        """A single-quoted scalar that starts ``text`` and may go on in the lines from ``i``."""
        parts = [text[1:]]
        while True:
            body = "\n".join(parts)
            end = closing_quote(body)
            if end is not None:
                if body[end + 1 :]:
                    raise Unsupported  # something after the closing quote (a comment)
                return fold(body[:end].split("\n"), quoted=True).replace("''", "'"), i
            if not self.continues(i, parent):
                raise Unsupported
            parts.extend([""] * self.lines[i][2])
            parts.append(self.lines[i][1])
            i += 1

    def nested(self, i: int, parent: int) -> tuple[Any, int]:
        """The block node that starts at line ``i`` below a key at indentation ``parent`` (a
        sequence may sit at the key's own indentation); None when there is none."""
        if i >= len(self.lines):
            return None, i
        indent, text, _blanks = self.lines[i]
        if indent > parent or (indent == parent and _is_item(text)):
            if _is_item(text):
                return self.sequence(i, indent)
            return self.mapping(i, indent)
        return None, i

    # ---------------------------------------------------------------------------------- nodes
    def sequence(self, i: int, indent: int) -> tuple[list[Any], int]:
        """The block sequence whose items start at line ``i``, indented ``indent``."""
        items: list[Any] = []
        while i < len(self.lines) and self.lines[i][0] == indent and _is_item(self.lines[i][1]):
            rest = self.lines[i][1][2:]
            if rest.startswith(("? ", " ")):  # a complex key, or the item's node further in
                raise Unsupported
            if rest == "" or rest == "-":  # the item's node on the lines below, or null
                if rest == "-" or not self.continues(i + 1, indent):
                    raise Unsupported
                value, i = self.nested(i + 1, indent)
            elif _is_item(rest):  # "- - ...": a sequence whose items sit at indent + 2
                self.lines[i] = (indent + 2, rest, 0)
                value, i = self.sequence(i, indent + 2)
            elif _is_entry(rest):  # "- key: ...": a mapping whose keys sit at indent + 2
                self.lines[i] = (indent + 2, rest, 0)
                value, i = self.mapping(i, indent + 2)
            else:
                value, i = self.value(rest, i + 1, indent)
            items.append(value)
        return items, i

    def mapping(self, i: int, indent: int) -> tuple[dict[Any, Any], int]:
        """The block mapping whose keys start at line ``i``, indented ``indent``."""
        out: dict[Any, Any] = {}
        while i < len(self.lines):
            line_indent, text, _blanks = self.lines[i]
            if line_indent < indent or (line_indent == indent and _is_item(text)):
                break
            if line_indent > indent:
                raise Unsupported
            key_text, rest = _entry(text)
            key = key_text[1:-1].replace("''", "'") if key_text[:1] == "'" else self.plain(key_text)
            if key in out:  # (YAML's readers keep the last: ``fo_kernels.table.text.unique_keys``)
                raise yaml.YAMLError(
                    f"the key {key!r} is given twice in one mapping (at {text!r}), and YAML keeps the "
                    "last alone, the first's content dropped; keep one"
                )
            out[key], i = self.value(rest, i + 1, indent)
        return out, i


# JSON's own scalar types (exactly: a subclass may write otherwise).
_JSON_SCALARS = frozenset((str, int, float, bool, type(None)))


def json_exact(value: Any) -> bool:
    """True when ``value`` is dicts and lists of JSON's scalars whose dicts have string keys only:
    ``json`` reads its text back as it is (it writes other keys as strings, and reads them back
    so); anything else (a tuple, a ``Mapping`` of another type, a YAML timestamp) is False."""
    kind = type(value)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return False
            if type(item) not in _JSON_SCALARS and not json_exact(item):
                return False
        return True
    if kind is list:
        return all(type(item) in _JSON_SCALARS or json_exact(item) for item in value)
    return kind in _JSON_SCALARS


# What ``json`` and the YAML parser raise, besides their own errors, for text they will not read:
# an integer of more digits than Python converts (4300, ``ValueError``) or nesting past the
# interpreter's recursion limit (``RecursionError``); a hand-edited or damaged file holds either.
TOO_BIG = (ValueError, RecursionError)


def by_parser(text: str) -> Any:
    """A scalar this module does not resolve itself, by the YAML parser."""
    try:
        return yaml.load(text, Loader=SAFE_LOADER)  # a safe loader, C or Python
    except (yaml.YAMLError, *TOO_BIG):
        raise Unsupported from None


def check_plain(text: str) -> None:
    """Refuse a plain scalar's text that YAML reads as something else or refuses (an indicator
    first, a ``: `` or a comment inside)."""
    if text[:1] in NOT_PLAIN or (text[:1] in "-?:" and text[1:2] in ("", " ")) or text[:2] == "<<":
        raise Unsupported
    if text[:1] == "=" or ": " in text or " #" in text or text.endswith(":"):
        raise Unsupported


def _skip_space(text: str, at: int) -> int:
    """The first index from ``at`` that is not a space or a line break."""
    while text[at : at + 1] in (" ", "\n"):
        at += 1
    return at


def _is_item(text: str) -> bool:
    return text == "-" or text.startswith("- ")


def _is_entry(text: str) -> bool:
    """True when ``text`` is ``key: value`` or ``key:`` with a plain or single-quoted key."""
    try:
        _entry(text)
    except Unsupported:
        return False
    return True


def _entry(text: str) -> tuple[str, str]:
    """(key text, value text) of a mapping entry's line; a quoted key keeps its quotes."""
    if text[:1] == "'":
        end = closing_quote(text[1:])
        if end is None or text[end + 2 : end + 3] != ":" or text[end + 3 : end + 4] not in ("", " "):
            raise Unsupported
        return text[: end + 2], text[end + 3 :].lstrip(" ")
    key, sep, rest = text.partition(": ")
    if not sep:
        if not text.endswith(":"):
            raise Unsupported
        key, rest = text[:-1], ""
    check_plain(key)
    if key != key.rstrip(" ") or rest.startswith("#"):
        raise Unsupported
    return key, rest.lstrip(" ")


def closing_quote(body: str) -> int | None:
    """The index of the single quote that closes a single-quoted scalar's ``body`` (the text after
    its opening quote; ``''`` is a quote inside it); None when it does not close."""
    at = 0
    while True:
        at = body.find("'", at)
        if at < 0:
            return None
        if body[at + 1 : at + 2] == "'":
            at += 2
            continue
        return at


def fold(parts: list[str], *, quoted: bool) -> str:
    """Lines of a flow scalar folded as YAML folds them: each line's spaces at a line break
    dropped, one line break between two lines a space, each empty line between them a line break.
    A quoted scalar keeps the spaces before its closing quote."""
    last = len(parts) - 1
    if last == 0:
        return parts[0]
    out = [parts[0].rstrip(" ")]
    breaks = 0
    for j, part in enumerate(parts[1:], start=1):
        text = part.lstrip(" ") if quoted and j == last else part.strip(" ")
        if text == "" and j != last:
            breaks += 1
            continue
        out.append("\n" * breaks if breaks else " ")
        out.append(text)
        breaks = 0
    return "".join(out)


def lines_of(body: str) -> list[Line] | None:
    """The lines of ``body`` (empty ones counted on the next); None for a tab, a carriage return,
    a comment line, a document's start or end, or a directive."""
    if "\t" in body or "\r" in body:
        return None
    lines: list[Line] = []
    blanks = 0
    for raw in body.split("\n"):
        text = raw.strip(" ")
        if not text:
            blanks += 1
            continue
        if text[:1] == "#" or text in ("---", "...") or text.startswith(("--- ", "... ", "%")):
            return None
        lines.append((len(raw) - len(raw.lstrip(" ")), text, blanks))
        blanks = 0
    return lines


def read_lines(lines: list[Line], reader: Reader) -> list[Any] | None:
    """The block sequence that ``lines`` are, read line by line; None when they leave the subset."""
    if not lines or not _is_item(lines[0][1]):
        return None
    reader.lines = lines
    try:
        rows, end = reader.sequence(0, lines[0][0])
    except (Unsupported, RecursionError):
        return None
    return rows if end == len(lines) else None
