"""Helpers shared by the command-line tests: a clean CliRunner, the one-error-line rule,
strict JSON, and the schema hook: every JSON or YAML document a command run through
:func:`invoke` prints (or writes with ``--report``) is validated against its schema
(:mod:`sdpa_cli.schemas`), when ``jsonschema`` is installed."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from sdpa_cli.cli import cli
from sdpa_cli.errors import ExitCode
from sdpa_cli.schemas import schema

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


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment for a real ``sdpa`` process: the variables
    :data:`CLEAN_ENV` names left out (no color forced, no GitHub Actions), ``extra`` on top."""
    return {**{k: v for k, v in os.environ.items() if k not in CLEAN_ENV}, **extra}


def invoke(*args: str, env: Mapping[str, str | None] | None = None) -> Result:
    """``sdpa ARGS`` through CliRunner, with a clean environment."""
    runner = CliRunner(env={**CLEAN_ENV, **(env or {})})
    result = runner.invoke(cli, list(args), catch_exceptions=False)
    validate_output(args, result.stdout, wrote=result.exit_code in (0, 1))
    return result


def schema_name(args: Sequence[str]) -> str | None:
    """The schema of what ``sdpa ARGS`` prints as JSON or YAML (None: no document)."""
    words = [a for a in args if not a.startswith("-")]
    command = next((w for w in words if w in DOCUMENTS), None)
    if command == "report":
        after = words[words.index("report") + 1 :]
        return {"merge": "check", "model": "report-model"}.get(after[0]) if after else None
    if command == "compute" and "--frameworks" in args:
        return "frameworks"
    return None if command is None else DOCUMENTS[command]


DOCUMENTS = {
    "compute": "compute",
    "explain": "explain",
    "grad": "grad",
    "check": "check",
    "inspect": "inspect",
    "samples": "samples",
    "report": "report",
    "diff": "diff",
}
"""Command → the schema of its document (``report``'s depends on its subcommand)."""


MAX_VALIDATED = 1 << 20
"""Documents up to 1 MiB of text are validated: a test's 50 MB document (the memory
tests) would take a minute in pure-Python YAML and jsonschema, for the same shape."""


@cache
def _validator(name: str) -> Any:
    """A draft 2020-12 validator of ``name``'s schema; None without ``jsonschema``."""
    try:  # imported by name: the hook is a no-op without it (a dev extra), untyped
        jsonschema = importlib.import_module("jsonschema")
    except ImportError:
        return None
    return jsonschema.Draft202012Validator(schema(name))


def validate_document(document: Any, name: str) -> None:
    """Raise AssertionError, naming each place, unless ``document`` fits schema ``name``
    (nothing happens without ``jsonschema``)."""
    validator = _validator(name)
    if validator is None:
        return
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    assert not errors, f"not a valid {name} document: " + "; ".join(
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:200]}" for e in errors[:5]
    )


def validate_output(args: Sequence[str], stdout: str, *, wrote: bool = True) -> None:
    """The schema hook: a JSON (or, with ``--format yaml``, YAML) object on stdout, and
    the ``--report`` file (when ``wrote``: a run that exits 2 writes none), hold their
    command's schema. Every such object must carry ``schema_version``: one without it
    fails too."""
    name = schema_name(args)
    if name is None or _validator(name) is None:
        return
    yaml_format = ("yaml" in args and "--format" in args) or "--format=yaml" in args
    texts = [(stdout, yaml_format)]
    if wrote and "--report" in args:
        path = args[list(args).index("--report") + 1]
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as fh:
                texts.append((fh.read(), False))
    for text, is_yaml in texts:
        if len(text) > MAX_VALIDATED:
            continue  # a big document has the shape of the small ones validated everywhere
        try:
            document = yaml.safe_load(text) if is_yaml else json.loads(text)
        except (ValueError, yaml.YAMLError):
            continue  # a table, a message, or nothing (or a test's own file): no document
        if isinstance(document, dict):
            assert "schema_version" in document, f"a {name} document without schema_version"
            validate_document(document, name)


def assert_one_error_line(result: Result, code: int = ExitCode.BAD_INPUT) -> str:
    """The run failed with ``code``, one ``sdpa: error:`` line on stderr and nothing on stdout."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.output
    assert result.stderr.startswith("sdpa: error: ")
    assert result.stderr.endswith("\n")
    line, _, then = result.stderr.partition("\n")
    # A usage error (click's) is followed by the one line that names the command's help.
    assert not then or re.fullmatch(r"Try 'sdpa[a-z ]* --help' for help\.\n", then), result.stderr
    return line


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


def only_case(document: Any) -> Any:
    """The one case of a check report of the command line's case (``manifest`` null)."""
    assert document["manifest"] is None, document["manifest"]
    (case,) = document["cases"]
    return case


def sdpa_executable() -> str:
    """The installed ``sdpa`` console script, for tests that need a real process
    (signals, closed streams); skipped where it is not installed."""
    beside = Path(sys.executable).parent / "sdpa"
    found = str(beside) if beside.exists() else shutil.which("sdpa")
    if found is None:
        pytest.skip("the sdpa console script is not installed")
    return found
