"""A generated schedule table of any size, as `fo-tune search` writes one (the header in YAML, one
JSON row a line), for the tests that time loading, validating and looking up at fleet scale.

The rows are a campaign's mix over (N, K) pairs: per pair, exact rows at ``EXACT_PER_NK`` Ms
(copy-engine ring and tiled rows, Triton rows whose one group is every tile, overlap: false rows)
then ``RANGES_PER_NK`` disjoint M ranges above them; each carries the provenance a search records.
Every row is valid and plans for its shapes, so `fo-tune table validate` passes the table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from fo_kernels.fingerprint import Fingerprint
from fo_kernels.table.text import dump_table_text

# Rows per (N, K) pair: exact Ms, then M ranges above them (100 rows a pair).
EXACT_PER_NK = 90
RANGES_PER_NK = 10
# M step of the exact rows and width of each range (multiples of the world size, 2).
M_STEP = 64
RANGE_WIDTH = 1024
# The tag of a YAML string.
STR_TAG = "tag:yaml.org,2002:str"
TRITON_TILE = {"block_m": 128, "block_n": 256, "block_k": 64, "group_m": 8, "num_warps": 8, "num_stages": 3}
COPY_TILE = {**TRITON_TILE, "warp_specialize": True}


def _provenance(m: int, n: int, k: int, mode: str) -> dict[str, Any]:
    return {
        "source": "fo-tune search",
        "mode": mode,
        "date": "2026-11-30T13:00:39+00:00",
        "study": f"all_reduce-w2-bfloat16-{m}x{n}x{k}-{mode}-980ef9a1",
        "baseline": "measured",
        "measured_ms": 0.0612,
        "sequential_ms": 0.09248,
        "fallback_ms": 0.0656,
        "iqr_ms": 0.00135,
    }


def _exact_row(i: int, m: int, n: int, k: int, sm_count: int) -> dict[str, Any]:
    row: dict[str, Any] = {"problem": {"m": m, "n": n, "k": k}}
    kind = i % 4
    if kind == 0:
        row.update(engine="copy_engine", settings={"mode": "ring", "weights": [2, 2, 1, 1]})
    elif kind == 1:
        row.update(engine="copy_engine", settings={"mode": "tiled", "weights": [1], "tile": COPY_TILE})
    elif kind == 2:
        tiles = -(-m // TRITON_TILE["block_m"]) * -(-n // TRITON_TILE["block_n"])
        settings = {"tile": TRITON_TILE, "sms_free": sm_count // 2, "signal_tiles": tiles}
        row.update(engine="triton", settings={**settings, "groups": [1], "layout": "tile_major"})
    else:
        row["overlap"] = False
    row["provenance"] = _provenance(m, n, k, "predict" if i % 3 else "hybrid")
    return row


def _range_row(j: int, n: int, k: int) -> dict[str, Any]:
    lo = EXACT_PER_NK * M_STEP + 1 + j * RANGE_WIDTH
    problem = {"m_min": lo + lo % 2, "m_max": lo + RANGE_WIDTH - 2, "n": n, "k": k}
    settings = {"mode": "ring", "weights": [3, 2, 1]}
    return {
        "problem": problem,
        "engine": "copy_engine",
        "settings": settings,
        "provenance": _provenance(problem["m_min"], n, k, "hybrid"),
    }


def big_table_rows(count: int, sm_count: int) -> list[dict[str, Any]]:
    """``count`` rows as a table file holds them (see the module docstring), sorted; Triton rows
    leave half of ``sm_count`` free."""
    rows: list[dict[str, Any]] = []
    pair = 0
    while len(rows) < count:
        n, k = 1024 + 64 * (pair // 32), 1024 + 128 * (pair % 32)
        rows.extend(_exact_row(i, (i + 1) * M_STEP, n, k, sm_count) for i in range(EXACT_PER_NK))
        rows.extend(_range_row(j, n, k) for j in range(RANGES_PER_NK))
        pair += 1
    return rows[:count]


def big_table_header(fingerprint: Fingerprint) -> dict[str, Any]:
    """The header of an all_reduce bfloat16 table for ``fingerprint``."""
    return {
        "schema_version": 2,
        "kind": "fo-tune-schedule-table",
        "fingerprint": fingerprint.to_dict(),
        "collective": "all_reduce",
        "world_size": fingerprint.world_size,
        "dtype": "bfloat16",
    }


def write_big_table(path: Path, fingerprint: Fingerprint, count: int) -> Path:
    """Write a ``count``-row all_reduce bfloat16 table for ``fingerprint`` (world size 2) at
    ``path`` with the writer ``save_table`` uses; returns ``path``."""
    header = big_table_header(fingerprint)
    text = dump_table_text(
        yaml.safe_dump(header, sort_keys=False), big_table_rows(count, fingerprint.sm_count)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def block_style_text(data: dict[str, Any]) -> str:
    """``data`` (a table: the rows last) in YAML's block style as ``yaml.safe_dump(data,
    sort_keys=False)`` writes it, an object met twice written once with an anchor and then as its
    alias, in seconds for 100,000 rows where PyYAML's emitter takes minutes; for the rows
    ``big_table_rows`` makes (mappings, lists and scalars, no string that needs double quotes or
    wrapping)."""
    seen: dict[int, int] = {}

    def count(node: Any) -> None:
        if isinstance(node, (dict, list)):
            seen[id(node)] = seen.get(id(node), 0) + 1
            if seen[id(node)] == 1:
                for item in node.values() if isinstance(node, dict) else node:
                    count(item)

    count(data)
    anchors: dict[int, str] = {}
    texts: dict[tuple[type, Any], str] = {}
    resolver = yaml.resolver.Resolver()  # how YAML reads a plain scalar: quoted unless a string

    def scalar(value: Any) -> str:
        key = (type(value), value)
        if key not in texts:
            if isinstance(value, str):
                tag = resolver.resolve(yaml.ScalarNode, value, (True, False))
                quoted = tag != STR_TAG or value.strip() != value or ": " in value or " #" in value
                texts[key] = "'" + value.replace("'", "''") + "'" if quoted else value
            elif isinstance(value, float):
                texts[key] = yaml.safe_dump(value).removesuffix("\n...\n")
            else:
                texts[key] = json.dumps(value)
        return texts[key]

    def node(value: Any, indent: int, out: list[str], lead: str) -> None:
        """``value`` after ``lead`` (``key:`` or ``-``) at ``indent``, in ``out``'s lines."""
        if isinstance(value, (dict, list)) and value:
            if id(value) in anchors:
                out.append(f"{lead} *{anchors[id(value)]}")
                return
            anchor = ""
            if seen[id(value)] > 1:
                anchors[id(value)] = f"id{len(anchors) + 1:03d}"
                anchor = f" &{anchors[id(value)]}"
            out.append(f"{lead}{anchor}")
            if isinstance(value, dict):
                for key, item in value.items():
                    node(item, indent + 2, out, f"{' ' * (indent + 2)}{key}:")
            else:  # a sequence in a mapping sits at the key's indentation, as PyYAML writes it
                for item in value:
                    node(item, indent, out, f"{' ' * indent}-")
            return
        empty = "{}" if isinstance(value, dict) else "[]" if isinstance(value, list) else scalar(value)
        out.append(f"{lead} {empty}")

    header = yaml.safe_dump({key: item for key, item in data.items() if key != "rows"}, sort_keys=False)
    lines = [header.rstrip("\n"), "rows:"]
    for row in data["rows"]:
        first = len(lines)
        node(row, 0, lines, "-")
        lines[first] = "- " + lines[first + 1].lstrip(" ") if lines[first] == "-" else lines[first]
        del lines[first + 1]
    return "\n".join(lines) + "\n"
