"""The README's results section says what the shipped bench CSVs say, and names only files that exist."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Measured on H200 x2"


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end > 0 else None]


def _bench_dirs(section: str) -> list[Path]:
    """The first bench folder the section names and its two reruns, in the order it names them."""
    first = re.search(r"`(results/bench/[^`]+)/bench\.csv`", section)
    assert first, "the section names no bench.csv"
    base = ROOT / first.group(1)
    reruns = re.search(r"`([\w-]+)/` and `([\w-]+)/`", section)
    assert reruns, "the section names no reruns"
    return [base, base.parent / reruns.group(1), base.parent / reruns.group(2)]


def _speedups(folder: Path) -> dict[tuple[str, str, str], float]:
    """(shape, collective, variant) -> speedup over sequential; async_tp_x: async-TP ms / fo-tune ms."""
    with (folder / "bench.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    out, ms = {}, {}
    for r in rows:
        key = (f"{r['m']}x{r['n']}x{r['k']}", r["collective"], r["variant"])
        if r["status"] == "PASS":
            out[key] = float(r["speedup_vs_sequential"])
            ms[key] = float(r["median_ms"])
    for (shape, coll, variant), t in ms.items():
        if variant == "fo_tune" and (shape, coll, "async_tp") in ms:
            out[(shape, coll, "async_tp_x")] = ms[(shape, coll, "async_tp")] / t
    return out


def test_readme_results_table_matches_the_shipped_benches():
    section = _section()
    runs = [_speedups(d) for d in _bench_dirs(section)]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+x\d+x\d+ \|", line)]
    assert len(rows) == 5, rows
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        shape = cells[0]
        columns = {
            4: ("all_reduce", "fo_tune"),
            8: ("reduce_scatter", "fo_tune"),
            9: ("reduce_scatter", "async_tp_x"),
        }
        for col, (coll, variant) in columns.items():
            shown = [float(x) for x in cells[col].split(" / ")]
            measured = [round(run[(shape, coll, variant)], 2) for run in runs]
            assert shown == measured, (shape, coll, variant, shown, measured)


def test_readme_allreduce_geomeans_match_the_shipped_benches():
    section = _section()
    runs = [_speedups(d) for d in _bench_dirs(section)]
    said = re.search(r"geomean \*\*([\d.]+) / ([\d.]+) / ([\d.]+)\*\*", section)
    assert said, "the section states no AllReduce geomeans"
    for run, text in zip(runs, said.groups(), strict=True):
        ratios = [v for (_, coll, variant), v in run.items() if (coll, variant) == ("all_reduce", "fo_tune")]
        assert len(ratios) == 5
        geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        assert f"{geomean:.3f}" == text


def test_readme_results_section_names_only_files_that_exist():
    section = _section()
    base = _bench_dirs(section)[0].parent
    named = re.findall(r"`([^`\s]+)`", section)
    folders = [n for n in named if re.fullmatch(r"[\w.-]+/", n)]
    paths = [n for n in named if n.startswith("results/")]
    assert folders and paths
    for folder in folders:
        assert (base / folder).is_dir(), folder
    for path in paths:
        assert (ROOT / path.rstrip("/")).exists(), path
