"""Rows over spans of one axis (a dense table's M, an MoE table's tokens per rank) and the rule
every merge of such rows follows (``put_row``): a new row takes only its own span; an older row it
overlaps keeps the rest, with its settings (trimmed, split in two, or gone when the new row
covers all of it); where the new row yields to an older one (a predicted row to a measured one),
the older row keeps all of its span and the new row goes in over what is left. Every part is
narrowed to the values its rows may hold (multiples of ``step``: a ``reduce_scatter`` or
``all_gather`` row's M is a multiple of the world size); a part that holds none is dropped, and so
is a part of 0 alone (``LEAST_HI``). So a merge loses no value a table covered (but 0 tokens where
only that is left of an MoE row), and writes no two rows of one key over the same value.

A span is ``(lo, hi)``, both ends included.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

Span = tuple[int, int]
R = TypeVar("R")
# The least upper end a part keeps: an MoE row's bucket holds up to at least 1 token (the copy
# engine sizes its buffers by it), so a part of 0 tokens alone is dropped (a call whose ranks hold
# no token then runs the no-overlap path); a dense row's Ms start at 1.
LEAST_HI = 1


def narrowed(lo: int, hi: int, step: int) -> Span | None:
    """``[lo, hi]`` narrowed to the multiples of ``step`` inside it (``step`` 1: as it is); None
    when it holds none, or ends below ``LEAST_HI``."""
    lo, hi = -(-lo // step) * step, hi // step * step
    return (lo, hi) if lo <= hi and hi >= LEAST_HI else None


def span_outside(span: Span, cut: Span, step: int = 1) -> list[Span]:
    """The parts of ``span`` outside ``cut``: ``[span]`` when they do not overlap, else the part
    below ``cut`` and the part above it that exist, each ``narrowed`` to ``step``."""
    (lo, hi), (cut_lo, cut_hi) = span, cut
    if hi < cut_lo or cut_hi < lo:
        return [span]
    parts = [narrowed(lo, cut_lo - 1, step), narrowed(cut_hi + 1, hi, step)]
    return [part for part in parts if part is not None and part[0] >= lo and part[1] <= hi]


class SpanRows(Generic[R]):
    """The rows of one key (a dense table's (N, K), an MoE table's experts' shape) whose spans do
    not overlap, sorted by span (``rows``); ``span`` gives a row's span. Finding the rows that
    overlap a span is a bisection."""

    __slots__ = ("rows", "span")

    def __init__(self, rows: Iterable[R], span: Callable[[R], Span]) -> None:
        self.span = span
        self.rows: list[R] = sorted(rows, key=span)

    def _between(self, cut: Span) -> tuple[int, int]:
        """[i, j): the positions of the rows overlapping ``cut`` (disjoint spans sorted by their
        start are sorted by their end too)."""
        i = bisect_left(self.rows, cut[0], key=lambda row: self.span(row)[1])
        j = bisect_right(self.rows, cut[1], key=lambda row: self.span(row)[0])
        return i, max(i, j)

    def overlapping(self, cut: Span) -> list[R]:
        i, j = self._between(cut)
        return self.rows[i:j]

    def cut(self, cut: Span, respan: Callable[[R, Span], R], step: int = 1) -> None:
        """Every row overlapping ``cut`` becomes its parts outside it (``span_outside``), each made
        by ``respan(row, part)``."""
        i, j = self._between(cut)
        parts = [
            respan(row, part) for row in self.rows[i:j] for part in span_outside(self.span(row), cut, step)
        ]
        self.rows[i:j] = parts

    def insert(self, row: R) -> None:
        """Add ``row``, whose span no row overlaps (``cut`` it first)."""
        self.rows.insert(bisect_left(self.rows, self.span(row), key=self.span), row)


def spans_outside(span: Span, cuts: Sequence[Span], step: int = 1) -> list[Span]:
    """The parts of ``span`` outside every one of ``cuts`` (sorted by their start): ``span_outside``
    of each cut in turn, in one sweep (O(len(cuts)), where cutting one at a time is quadratic in
    them): ``[span]`` when none overlaps it, else the gaps between them, each ``narrowed``."""
    lo, hi = span
    parts: list[Span] = []
    at, touched = lo, False
    for cut_lo, cut_hi in cuts:
        if cut_hi < lo or hi < cut_lo:
            continue
        touched = True
        if at < cut_lo:
            parts.append((at, cut_lo - 1))
        at = max(at, cut_hi + 1)
    if not touched:
        return [span]
    if at <= hi:
        parts.append((at, hi))
    return [part for part in (narrowed(a, b, step) for a, b in parts) if part is not None]


def put_row(
    row: R,
    into: SpanRows[R],
    beside: Sequence[SpanRows[R]] = (),
    *,
    respan: Callable[[R, Span], R],
    step: int = 1,
    yields_to: Callable[[R], bool] | None = None,
) -> list[R]:
    """Put ``row`` into ``into`` by the merge rule (see the module docstring): the rows of ``into``
    and of ``beside`` (other rows of its key, kept apart: a dense table's exact rows beside its
    ranges) that it overlaps keep their parts outside it, except the rows ``yields_to`` names,
    which keep all of theirs while ``row`` goes in over the parts of its span they leave (each
    ``narrowed`` to ``step``). ``respan(row, span)`` is a row with another span and the same
    settings. Returns the rows put in: ``[row]``, its parts, or [] when the rows it yields to
    cover it. Linear in the rows it overlaps (a predicted range over thousands of measured rows
    goes in as thousands of parts), plus one splice per ``SpanRows``."""
    own = into.span(row)
    pieces = [own]
    if yields_to is not None:
        kept = sorted(
            rows.span(old) for rows in (into, *beside) for old in rows.overlapping(own) if yields_to(old)
        )
        pieces = spans_outside(own, kept, step) if kept else pieces
    placed = [row if piece == own else respan(row, piece) for piece in pieces]
    starts, ends = [lo for lo, _ in pieces], [hi for _, hi in pieces]
    for rows in (into, *beside):
        i, j = rows._between(own)
        window: list[R] = []
        for old in rows.rows[i:j]:
            lo, hi = rows.span(old)
            a, b = bisect_left(ends, lo), bisect_right(starts, hi)
            if a >= b:  # no piece overlaps it (a row ``row`` yields to)
                window.append(old)
                continue
            window.extend(respan(old, part) for part in spans_outside((lo, hi), pieces[a:b], step))
        if rows is into:
            window = sorted([*window, *placed], key=rows.span)
        rows.rows[i:j] = window
    return placed
