"""What README.md shows a user holds for the code: its example table rows load and validate, and the
MoE plan summary it quotes is what the planner prints."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from cli import app
from cli_checks import isolate_tables
from fo_kernels.table import load_table
from fo_tune.tables.validate import validate_table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# A packaged table whose header (fingerprint, collective, world size, dtype) the example rows take.
PACKAGED = ROOT / "results/tables/nvidia-h200-cc90-132sm-w2-nvlink18/all_reduce-w2-bfloat16.yaml"


def test_schedule_rows_example_validates(tmp_path):
    """The rows of "Schedules and tables" load as a table and plan for their shapes (a Triton row's
    groups sum to the shape's signal units), as `fo-tune table validate` checks them."""
    (example,) = re.findall(r"```yaml\n(.*?)```", README, re.S)
    header = PACKAGED.read_text().split("\nrows:\n", 1)[0]
    path = tmp_path / PACKAGED.name
    path.write_text(f"{header}\nrows:\n{example}")
    table = load_table(path)
    assert len(table.rows) == 3
    assert validate_table(table) == []


def test_moe_suite_plan_summary_matches_the_plan(tmp_path, monkeypatch):
    """ "The MoE tuner"'s summary of `fo-tune search -c moe --shapes suites/moe/experts.yaml` (EP 2,
    the packaged calibration): the best predicted speedup, and the tokens a rank up to which each
    model but Llama-4-Maverick's top 1 keeps the no-overlap path (that one: every bucket)."""
    isolate_tables(monkeypatch, tmp_path)
    suite = ROOT / "suites" / "moe" / "experts.yaml"
    result = CliRunner().invoke(app, ["search", "-c", "moe", "--shapes", str(suite), "--json"])
    assert result.exit_code == 0, result.output
    text = " ".join(README.split())
    claim = re.search(
        r"up to ([\d.]+)x predicted on the suite at EP 2, the no-overlap path kept up to (\d+)-(\d+) tokens",
        text,
    )
    assert claim, "the README's MoE plan summary moved; update this test"
    models: dict[tuple[int, ...], list[dict]] = {}
    for row in json.loads(result.stdout)["rows"]:
        p = row["problem"]
        models.setdefault((p["hidden"], p["intermediate"], p["experts"], p["top_k"]), []).append(row)
    kept = []
    for shape, rows in models.items():
        rows.sort(key=lambda r: r["problem"]["tokens_min"])
        first = next((i for i, r in enumerate(rows) if r["engine"] is not None), None)
        if first is None:
            assert shape[3] == 1, f"{shape} keeps the no-overlap path on every bucket"
            continue
        assert all(r["engine"] is not None for r in rows[first:]), shape
        kept.append(rows[first - 1]["problem"]["tokens_max"] if first else 0)
    best = max(
        r["provenance"]["fallback_ms"] / r["provenance"]["predicted_ms"] for rs in models.values() for r in rs
    )
    assert f"{best:.2f}" == claim.group(1)
    assert (min(kept), max(kept)) == (int(claim.group(2)), int(claim.group(3)))
