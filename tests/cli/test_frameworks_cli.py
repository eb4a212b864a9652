"""``sdpa compute --frameworks`` and ``--as`` from the command line: tables, JSON, the
help built from the conventions' table, and bad input (one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from clirunner import assert_one_error_line, invoke, strict_json

from sdpa_cli.cli.attention import ATTENTION_OPTIONS
from sdpa_cli.errors import ExitCode
from sdpa_cli.names import FRAMEWORKS


@pytest.fixture
def case(tmp_path: Path) -> str:
    """One query row with no visible key (row 0), L = S = 3."""
    path = tmp_path / "case.yaml"
    path.write_text(
        "q: [[1, 0], [2, 0], [3, 0]]\n"
        "k: [[1, 0], [2, 0], [3, 0]]\n"
        "v: [[1, 0], [2, 0], [6, 3]]\n"
        "mask: [[false, false, false], [true, true, false], [true, true, true]]\n"
    )
    return str(path)


def test_as_choices_are_the_conventions() -> None:
    import click

    decorated = click.command()(lambda **_: None)
    for option in ATTENTION_OPTIONS:
        decorated = option(decorated)
    [param] = [p for p in decorated.params if p.name == "framework"]
    assert isinstance(param.type, click.Choice)
    assert tuple(param.type.choices) == FRAMEWORKS


def test_frameworks_table(case: str) -> None:
    result = invoke("compute", case, "--frameworks", env={"COLUMNS": "80"})
    assert result.exit_code == ExitCode.OK, result.output
    assert "Rows with no visible key: 1 of 3 rows differ, max |Δ| 3" in result.stdout
    assert result.stdout.splitlines()[-1] == (
        "the five disagree on 1 of 3 rows: rows with no visible key"
    )


def test_frameworks_json(case: str) -> None:
    result = invoke("compute", case, "--frameworks", "--format", "json")
    assert result.exit_code == ExitCode.OK, result.output
    doc = strict_json(result.stdout)
    assert list(doc)[:3] == ["schema_version", "sdpa_version", "shapes"]  # the setup, then
    assert list(doc)[-1] == "frameworks"
    answers = {a["as"]: a for a in doc["frameworks"]["answers"]}
    assert answers["jax"]["max_difference"] == 3.0  # the mean of V, (3, 1): |3 − 0|
    assert answers["onnx"]["rows_differing"] == 0
    [d] = doc["frameworks"]["disagreements"]
    assert d["groups"] == {"zeros": ["torch", "flash", "onnx"], "mean of V": ["jax", "hf"]}


def test_as_changes_the_output(case: str, tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    assert invoke("compute", case, "--as", "jax", "--save", str(out)).exit_code == 0
    np.testing.assert_allclose(np.load(out)["output"][0], [3.0, 1.0], atol=1e-12)
    assert invoke("compute", case, "--as", "torch", "--save", str(out)).exit_code == 0
    np.testing.assert_allclose(np.load(out)["output"][0], [0.0, 0.0], atol=0)


def test_bad_input_is_one_line(case: str, tmp_path: Path) -> None:
    line = assert_one_error_line(
        invoke("compute", case, "--frameworks", "--save", str(tmp_path / "x.npz")),
        ExitCode.BAD_INPUT,
    )
    assert "--frameworks" in line
    line = assert_one_error_line(invoke("compute", case, "--as", "hf", "--window", "0"))
    assert line == (
        "sdpa: error: --window: hf's sliding window counts the query itself: must be ≥ 1, got 0"
    )
    bad = invoke("compute", case, "--as", "mlx")
    assert bad.exit_code == ExitCode.BAD_INPUT
    assert "'mlx' is not one of" in bad.stderr


def test_case_file_framework_key(tmp_path: Path, case: str) -> None:
    text = Path(case).read_text() + "framework: bogus\n"
    (tmp_path / "bad.yaml").write_text(text)
    line = assert_one_error_line(invoke("compute", str(tmp_path / "bad.yaml")))
    assert "framework: expected one of torch, flash, jax, onnx, hf" in line
