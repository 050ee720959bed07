"""Assertions shared by the CLI tests."""

from __future__ import annotations


def assert_one_line_error(result, code: int = 2) -> str:
    """The command failed with ``code`` and exactly one ``error: ...`` line on stderr, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    return lines[0]
