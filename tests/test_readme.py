"""What README.md shows a user holds for the code: its example table rows load and validate, the
MoE plan summary it quotes is what the planner prints, and the model errors it quotes are what
`fo-tune model check` computes from the packaged calibration and files."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from cli import app
from cli_checks import H200_KEY, isolate_tables
from fo_kernels.table import load_table
from fo_tune.calibrate.calibration import load_calibration
from fo_tune.calibrate.find import packaged_calibration
from fo_tune.engines import cost_model
from fo_tune.model.check import check_files, mape
from fo_tune.tables.validate import validate_table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# A packaged table whose header (fingerprint, collective, world size, dtype) the example rows take.
PACKAGED = ROOT / "results/tables/nvidia-h200-cc90-132sm-w2-nvlink18/all_reduce-w2-bfloat16.yaml"
# The packaged measured tables and the search reports behind them, what `fo-tune model check` reads.
TABLES = sorted((ROOT / "results" / "tables" / H200_KEY).glob("*.yaml"))
REPORTS = sorted((ROOT / "results" / "search" / H200_KEY).glob("**/trials.csv"))


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


def test_model_check_errors_match_the_readme():
    """ "Measured on H200 x2"'s `fo-tune model check` numbers: the MAPE and worst error over the
    packaged measured rows, over the 14 rows every fit held out (N, K = 8192, 8192), and over the
    shipped search reports' Triton trials and their held-out M-range reports, as the packaged
    calibration prices them today."""
    text = " ".join(README.split())
    claim = re.search(
        r"MAPE ([\d.]+)% \(worst ([\d.]+)%, (\d+) rows; ([\d.]+)% on the (\d+) held out of every fit\), "
        r"over the shipped search reports' Triton trials ([\d.]+)% \((\d+) trials; ([\d.]+)% on the "
        r"(\d+) of the held-out M-range reports\)",
        text,
    )
    assert claim, "the README's model check summary moved; update this test"
    model = cost_model(load_calibration(packaged_calibration(H200_KEY, 2)))
    rows = check_files(TABLES, model)
    held = [c for c in rows if "x8192x8192" in c.item]
    trials = [c for c in check_files(REPORTS, model) if c.engine == "triton"]
    mrange = [c for c in trials if "-mrange" in c.source]
    (mean, worst), (held_mean, _), (trials_mean, _), (mrange_mean, _) = map(
        mape, (rows, held, trials, mrange)
    )
    got = (
        f"{mean:.1%}",
        f"{worst:.1%}",
        str(len(rows)),
        f"{held_mean:.1%}",
        str(len(held)),
        f"{trials_mean:.1%}",
        str(len(trials)),
        f"{mrange_mean:.1%}",
        str(len(mrange)),
    )
    assert got == tuple(f"{g}%" if "." in g else g for g in claim.groups())
