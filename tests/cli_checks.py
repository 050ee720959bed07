"""Helpers shared by the CLI tests: the one-line error assertion and the isolated table paths."""

from __future__ import annotations

from pathlib import Path

import pytest


def assert_one_line_error(result, code: int = 2) -> str:
    """The command failed with ``code`` and exactly one ``error: ...`` line on stderr, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    return lines[0]


def isolate_tables(mp: pytest.MonkeyPatch, root: Path) -> None:
    """No user or shared table interferes (the spawned ranks inherit the environment)."""
    mp.setenv("FO_TUNE_TABLE_DIR", str(root / "tables"))
    mp.setenv("XDG_DATA_HOME", str(root / "xdg"))
    mp.delenv("FO_TUNE_DEBUG", raising=False)
