"""Helpers shared by the command-line tests: a clean CliRunner, the one-error-line rule,
strict JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from click.testing import CliRunner, Result

from sdpa_cli.cli import cli
from sdpa_cli.errors import ExitCode

# Rich, click and the GitHub runner read these; pin them so that neither a developer's
# shell nor a CI runner changes anything.
CLEAN_ENV: dict[str, str | None] = {
    "NO_COLOR": None,
    "FORCE_COLOR": None,
    "CLICOLOR_FORCE": None,
    "TTY_COMPATIBLE": None,
    "TTY_INTERACTIVE": None,
    "GITHUB_ACTIONS": None,
    "COLUMNS": "100",
    "LINES": "50",
}
ANSI = "\x1b["


def invoke(*args: str, env: Mapping[str, str | None] | None = None) -> Result:
    """``sdpa ARGS`` through CliRunner, with a clean environment."""
    runner = CliRunner(env={**CLEAN_ENV, **(env or {})})
    return runner.invoke(cli, list(args), catch_exceptions=False)


def assert_one_error_line(result: Result, code: int = ExitCode.BAD_INPUT) -> str:
    """The run failed with ``code``, one ``sdpa: error:`` line on stderr and nothing on stdout."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.output
    assert result.stderr.startswith("sdpa: error: ")
    assert result.stderr.endswith("\n")
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr.rstrip("\n")


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses the non-standard NaN/Infinity literals."""

    def refuse(literal: str) -> Any:
        raise AssertionError(f"non-standard JSON literal {literal}")

    return json.loads(text, parse_constant=refuse)


def decode_non_finite(node: Any) -> Any:
    """JSON's "Infinity", "-Infinity" and "NaN" strings back to floats, recursively."""
    if isinstance(node, list):
        return [decode_non_finite(n) for n in node]
    if isinstance(node, dict):
        return {k: decode_non_finite(v) for k, v in node.items()}
    if node in ("Infinity", "-Infinity", "NaN"):
        return float(node.replace("Infinity", "inf").replace("NaN", "nan"))
    return node
