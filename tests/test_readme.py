"""What README.md shows a user holds for the code: its example table rows load and validate."""

from __future__ import annotations

import re
from pathlib import Path

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
