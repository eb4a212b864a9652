"""``sdpa report model``: a manifest's cases as a layer × head grid, end to end through
the command line: the numbers of hand-made heads, the JSON contract, the view in a
pipe at 80 columns, the bundled sample, and the error paths (one line, exit 2)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest
from clirunner import ANSI, assert_one_error_line, decode_non_finite, invoke, strict_json

from sdpa_cli.api.model import capture_layers
from sdpa_cli.cli.report import model as model_command
from sdpa_cli.errors import ExitCode
from sdpa_cli.names import MODEL_METRICS as METRICS

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "model" / "manifest.yaml"

MANIFEST = """\
defaults:
  k: k.npy
  v: v.npy
cases:
  - name: blocks.0.attn
    q: q.npy
    expect-output: out.npy
  - name: blocks.1.attn
    q: q.npy
    causal: true
"""


def write_case(d: Path) -> None:
    """Q, K, V of 3 heads (batch 1, L = S = 4, E = 2) and the output of the first case
    with head 2 off by 10 %: head 0 attends key 0 alone (logit 70.7 against 0), head 1
    has equal logits (Q = 0), head 2 is seeded noise."""
    q, k = np.zeros((1, 3, 4, 2)), np.zeros((1, 3, 4, 2))
    q[0, 0, :, 0] = 10.0
    k[0, 0, 0, 0] = 10.0
    rng = np.random.default_rng(9)
    q[0, 2], k[0, 2] = rng.standard_normal((4, 2)), rng.standard_normal((4, 2))
    v = rng.standard_normal((1, 3, 4, 2))
    for name, a in {"q": q, "k": k, "v": v}.items():
        np.save(d / f"{name}.npy", a)
    s = np.einsum("BHLE,BHSE->BHLS", q, k) / math.sqrt(2)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    out = np.einsum("BHLS,BHSE->BHLE", w / w.sum(axis=-1, keepdims=True), v)
    out[0, 2] *= 1.1
    np.save(d / "out.npy", out)
    (d / "m.yaml").write_text(MANIFEST, encoding="utf-8")


def model(*args: str, env: dict[str, str | None] | None = None) -> Any:
    return invoke("report", "model", *args, env=env)


def test_the_grid_of_hand_made_heads(workdir: Path) -> None:
    write_case(workdir)
    result = model("m.yaml", "--metric", "all", "--format", "json")
    assert result.exit_code == ExitCode.OK, result.output
    assert result.stderr == ""
    doc = decode_non_finite(strict_json(result.stdout))
    assert list(doc) == [
        "schema_version",
        "sdpa_version",
        "manifest",
        "cases",
        "heads",
        "metrics",
        "notable",
        "errors",
    ]
    assert doc["manifest"] == "m.yaml"
    assert doc["cases"] == ["blocks.0.attn", "blocks.1.attn"]
    assert doc["heads"] == 3
    m = doc["metrics"]
    assert list(m) == list(METRICS)
    full, causal = m["sink_mass"]
    assert full[:2] == pytest.approx([1.0, 0.25], abs=1e-12)
    assert causal[:2] == pytest.approx([1.0, 13 / 36], abs=1e-12)  # rows 1..3 see 2..4 keys
    entropy = [x for row in m["entropy"] for x in row[:2]]
    assert entropy == pytest.approx([0.0, 1.0, 0.0, 1.0], abs=1e-12)
    assert [row[:2] for row in m["saturated"]] == [[1.0, 0.0], [1.0, 0.0]]
    assert [row[:2] for row in m["near_uniform"]] == [[0.0, 1.0], [0.0, 1.0]]
    assert m["fully_masked"] == [[0.0] * 3] * 2
    assert m["error"][0] == pytest.approx([0.0, 0.0, 0.1], abs=1e-12)
    assert m["error"][1] == [None, None, None]  # no expect-output
    kinds = [(n["case"], n["head"], n["kind"]) for n in doc["notable"]]
    assert kinds == [
        ("blocks.0.attn", 0, "sink"),
        ("blocks.0.attn", 0, "saturated"),
        ("blocks.0.attn", 1, "dead"),
        ("blocks.1.attn", 0, "sink"),
        ("blocks.1.attn", 0, "saturated"),
        ("blocks.1.attn", 1, "dead"),
    ]
    assert doc["errors"] == []


def test_the_table_in_a_pipe_at_80_columns(workdir: Path) -> None:
    write_case(workdir)
    result = model("m.yaml", "--metric", "sink_mass", env={"COLUMNS": "80"})
    assert result.exit_code == ExitCode.OK, result.output
    text = result.stdout
    assert ANSI not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "case: blocks.‹case›.attn\n" in text
    assert "── sink_mass ──" in text
    assert "\ncase  h0  h1  h2\n" in text  # three characters a cell: 16 heads fit
    assert "\n0      1 .25 .16\n" in text
    assert "\n1      1 .36 .29\n" in text
    assert "    blocks.1.attn: h1 1\n" in text  # dead
    assert "── entropy ──" not in text


CALLS = """\
# Written by sdpa capture: 2 calls
calls:
  - call: 1
    name: blocks.0.attn
    layer: 7
  - call: 2
    name: blocks.1.attn
    layer: 8
"""


def test_rows_are_labelled_by_the_layers_of_a_captures_calls_yaml(workdir: Path) -> None:
    write_case(workdir)
    (workdir / "calls.yaml").write_text(CALLS, encoding="utf-8")
    text = model("m.yaml", env={"COLUMNS": "80"}).stdout
    assert "\nlayer  h0  h1  h2\n" in text
    assert "\n7       0   1 .76\n" in text
    assert "\n8       0   1 .67\n" in text
    assert "case: blocks" not in text
    assert capture_layers("m.yaml") == {"blocks.0.attn": 7, "blocks.1.attn": 8}


@pytest.mark.parametrize(
    "text",
    ["calls: [", "- 1", "calls: {a: 1}", "calls:\n  - name: x\n    layer: true\n  - layer: 1"],
)
def test_a_calls_yaml_that_does_not_read_gives_no_layers(workdir: Path, text: str) -> None:
    (workdir / "calls.yaml").write_text(text, encoding="utf-8")
    assert capture_layers("m.yaml") == {}


def test_every_metric_in_turn(workdir: Path) -> None:
    write_case(workdir)
    text = model("m.yaml", "--metric", "all").stdout
    rules = [line.split()[1] for line in text.splitlines() if line.startswith("── ")]
    assert rules == [*METRICS, "notable"]


def test_color_only_when_asked(workdir: Path) -> None:
    write_case(workdir)
    assert ANSI in model("m.yaml", "--color").stdout
    assert ANSI not in model("m.yaml", env={"NO_COLOR": "1"}).stdout


def test_thresholds_are_the_diagnostic_options(workdir: Path) -> None:
    write_case(workdir)
    doc = strict_json(model("m.yaml", "--format", "json", "--head-fraction", "1").stdout)
    assert len(doc["notable"]) == 6
    # Head 2's rows: max weight 0.56 on average, none one-hot, none nearly uniform.
    doc = strict_json(model("m.yaml", "--format", "json").stdout)
    assert (doc["metrics"]["saturated"][0][2], doc["metrics"]["near_uniform"][0][2]) == (0, 0)
    doc = strict_json(model("m.yaml", "--format", "json", "--saturation", "0.51").stdout)
    assert doc["metrics"]["saturated"][0][2] == 0.75
    # Three of its rows have an entropy past 0.5 · log 4, but random logits over 4 keys
    # are as flat in most rows: no threshold makes them near uniform.
    doc = strict_json(model("m.yaml", "--format", "json", "--uniform", "0.5").stdout)
    assert doc["metrics"]["near_uniform"][0][2] == 0


def test_the_sample_model(workdir: Path) -> None:
    doc = strict_json(model(str(SAMPLE), "--format", "json").stdout)
    assert doc["cases"] == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert [(n["case"], n["head"], n["kind"]) for n in doc["notable"]] == [
        ("model.layers.1.self_attn", 0, "sink"),
        ("model.layers.1.self_attn", 2, "dead"),
        ("model.layers.2.self_attn", 3, "saturated"),
    ]
    errors = doc["metrics"]["error"]
    assert errors[2][1] > 0.1  # the head exported with scale 1/d_k
    others = [e for i, row in enumerate(errors) for h, e in enumerate(row) if (i, h) != (2, 1)]
    assert max(others) < 1e-3  # float16 rounding


# --- errors -----------------------------------------------------------------------------------


def test_an_unreadable_case_is_named_and_its_row_left_blank(workdir: Path) -> None:
    write_case(workdir)
    with (workdir / "m.yaml").open("a", encoding="utf-8") as fh:
        fh.write("  - name: gone\n    q: missing.npy\n")
    result = model("m.yaml", "--format", "json")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr == "sdpa: error: gone: missing.npy: no such file\n"
    doc = strict_json(result.stdout)
    assert doc["cases"][-1] == "gone"
    assert doc["metrics"]["entropy"][-1] == [None, None, None]
    assert doc["errors"] == [{"case": "gone", "error": "missing.npy: no such file"}]
    table = model("m.yaml")
    assert table.exit_code == ExitCode.BAD_INPUT
    assert "not read (1 case; the errors above say why): gone" in table.stdout


def test_an_expected_output_of_the_wrong_shape_is_the_cases_error(workdir: Path) -> None:
    write_case(workdir)
    np.save(workdir / "out.npy", np.zeros((3, 4)))
    result = model("m.yaml", "--format", "json")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr.startswith("sdpa: error: blocks.0.attn: out.npy: has shape (3, 4)")
    assert strict_json(result.stdout)["cases"] == ["blocks.0.attn", "blocks.1.attn"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "sdpa: error: m.yaml: no such file"),
        (
            "[1, 2]",
            "sdpa: error: m.yaml: a manifest is a mapping with a list of cases under 'cases'",
        ),
        ("cases: []", "sdpa: error: m.yaml: lists no cases"),
        (
            "cases:\n  - q: q.npy\n    colour: red",
            "sdpa: error: m.yaml: cases[1]: colour: unknown key",
        ),
    ],
)
def test_a_bad_manifest_is_one_line(workdir: Path, text: str | None, message: str) -> None:
    if text is not None:
        (workdir / "m.yaml").write_text(text, encoding="utf-8")
    line = assert_one_error_line(model("m.yaml"))
    assert line.startswith(message)


def test_the_error_metric_needs_an_expected_output(workdir: Path) -> None:
    write_case(workdir)
    (workdir / "m.yaml").write_text(MANIFEST.replace("    expect-output: out.npy\n", ""))
    line = assert_one_error_line(model("m.yaml", "--metric", "error"))
    assert line == "sdpa: error: --metric error: no case of m.yaml has an expect-output"


def test_an_unknown_metric_is_bad_usage(workdir: Path) -> None:
    write_case(workdir)
    line = assert_one_error_line(model("m.yaml", "--metric", "perplexity"))
    assert "'perplexity' is not one of 'entropy'" in line


def test_the_metric_choices_are_the_grids_metrics() -> None:
    option = next(p for p in model_command.params if p.name == "metric")
    assert isinstance(option.type, click.Choice)
    assert tuple(option.type.choices) == (*METRICS, "all")


def test_help_names_the_exit_codes_and_an_example() -> None:
    text = invoke("report", "model", "--help").stdout
    assert "sdpa report model sample:model/manifest.yaml --metric sink_mass" in text
    assert "Exit codes: 0 every case shown" in text
