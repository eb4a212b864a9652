"""Rendered tables as golden text, at fixed widths with color off.

Regenerate with ``make golden`` and review the diff: a change in a golden file is a
change in what users read.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from golden_files import check_golden
from rich.console import Console

from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.block import applicable_stages
from sdpa_cli.engine.options import OPTION_NAMES, Options, parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import shown_blocks, trace
from sdpa_cli.files.cases import load_case
from sdpa_cli.render.common import View, headroom_text, layout
from sdpa_cli.render.compute import render_compute
from sdpa_cli.text import decimals

ROOT = Path(__file__).resolve().parents[2]


def sample_spec(name: str, **overrides: object) -> AttentionSpec:
    case = load_case(str(ROOT / "samples" / name), OPTION_NAMES)
    options = parse_options({**case.options, **overrides})
    t = case.tensors
    return build_spec(t["q"], t["k"], t["v"], options=options, names={n: "" for n in t})


def render_text(spec: AttentionSpec, width: int, **view: Any) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None, no_color=True)
    stages = view.pop("stages", applicable_stages(spec))
    result = trace(spec, stages=(), summarize=stages)
    view_ = View(stages=stages, width=width, **view)
    shown = shown_blocks(spec, *layout(spec, view_)[:2])
    console.print(render_compute(result, view_, shown, diagnose(result)))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in out.splitlines()) + "\n"


CASES: dict[str, tuple[str, int, dict[str, Any], dict[str, Any]]] = {
    "scorecard_100.txt": ("scorecard.yaml", 100, {}, {}),
    "causal_80.txt": ("causal.yaml", 80, {}, {}),
    "cross_80.txt": ("cross.yaml", 80, {"stages": ("masked", "weights", "output"), "batch": 1}, {}),
    "scale_none_80.txt": ("scale_comparison.yaml", 80, {"stages": ("weights",)}, {"scale": "none"}),
    "scorecard_fp16_80.txt": ("scorecard.yaml", 80, {}, {"scale": "none", "dtype": "float16"}),
    "key_lengths_0_80.txt": (
        "causal.yaml",
        80,
        {"stages": ("weights",)},
        {"mask_value": "-1e9", "key_lengths": 0},
    ),
}


@pytest.mark.parametrize("golden", sorted(CASES))
def test_samples_render_as_the_golden_text(golden: str) -> None:
    sample, width, view, overrides = CASES[golden]
    check_golden(golden, render_text(sample_spec(sample, **overrides), width, **view))


def test_causal_table_shows_hidden_cells_as_masked_not_minus_inf() -> None:
    text = render_text(sample_spec("causal.yaml"), 80)
    assert "-inf" not in text.split("masked logits")[1]
    assert text.count("masked") >= 6  # three hidden cells in each of the masked and weights tables


@pytest.mark.parametrize("width", [60, 80, 100])
def test_no_line_is_wider_than_the_console(width: int) -> None:
    rng = np.random.default_rng(0)
    spec = build_spec(
        rng.normal(size=(2, 3, 40, 8)),
        rng.normal(size=(2, 3, 50, 8)),
        rng.normal(size=(2, 3, 50, 8)),
        options=Options(causal=True, causal_align="lower-right"),
    )
    text = render_text(spec, width, head=1)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "keys 0–" in text  # the cut is said, not hidden
    assert len(text.splitlines()) < 260  # two slices of five stages, 16 rows each


def test_large_inputs_show_a_summary_and_at_most_max_slices() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 4, 5, 4))
    text = render_text(build_spec(x, x, x), 100, max_slices=2)
    assert "whole tensor" in text
    assert text.count("── batch") == 2
    assert "10 more slices not shown" in text


def test_header_names_the_alignment_when_lengths_differ() -> None:
    x = np.ones((4, 2))
    spec = build_spec(x[:2], x, x, options=Options(causal=True, causal_align="lower-right"))
    text = render_text(spec, 100)
    assert "L ≠ S: lower-right, diagonal offset 2" in text


@pytest.mark.parametrize(
    ("x", "precision", "expected"),
    [
        (0.88164541, 4, "0.8816"),
        (-0.70710678, 3, "-0.707"),
        (1.12497423e-07, 4, "1.12e-07"),
        (0.0, 3, "0.000"),
        (2.5e7, 2, "2.5e+07"),
        (float("-inf"), 4, "-inf"),
        (float("nan"), 4, "nan"),
    ],
)
def test_fmt_keeps_tiny_weights_visible(x: float, precision: int, expected: str) -> None:
    assert decimals(x, precision) == expected


def test_a_finite_mask_value_shows_the_uniform_weight_it_leaks_not_masked() -> None:
    # Regression: hidden cells were always printed "masked", hiding the 1/3 weights that
    # a -1e9 mask value gives a row with no visible key.
    spec = sample_spec("causal.yaml", mask_value="-1e9", key_lengths=0)
    text = render_text(spec, 100, stages=("weights",), precision=3)
    weights_table = text.split("softmax over keys")[1].split("╭")[0]  # not the findings
    assert "masked" not in weights_table
    assert weights_table.count("0.333") == 9
    assert "have no visible key, yet the finite mask value -1e+09" in text
    # With the default -inf, the same rows are zero and shown as masked.
    text = render_text(sample_spec("causal.yaml", key_lengths=0), 100, stages=("weights",))
    assert text.split("softmax over keys")[1].split("╭")[0].count("masked") == 9


def precision_text(width: int = 80) -> str:
    """The precision panel of samples/fp16_overflow.yaml under --dtype float16."""
    text = render_text(sample_spec("fp16_overflow.yaml", dtype="float16"), width)
    start = text.index("╭─ precision")
    return text[start : text.index("╰", start)]


def test_precision_panel_says_inf_where_values_overflowed() -> None:
    """Regression: "max abs err 0" (over the finite elements) beside "overflowed (2)"."""
    rows = {
        line.strip(" │").split()[0]: line.strip(" │").split()
        for line in precision_text().splitlines()
        if line.strip(" │").endswith(("overflowed (2)", "overflowed (3)"))
    }
    assert set(rows) == {"raw", "scaled", "masked", "weights", "output"}
    for stage, cells in rows.items():
        assert cells[1:5] == ["inf", "[0,0]", "inf", "inf"], (stage, cells)


def test_headroom_has_no_negative_zero() -> None:
    """Regression: float16's raw headroom, −0.045 bits, printed as "-0.0"."""
    line = next(
        ln for ln in precision_text().splitlines() if ln.strip(" │").startswith("float16  ")
    )
    assert line.strip(" │").split() == ["float16", "-0.05", "+1.0", "+1.0", "+16.0"]
    assert "-0.0 " not in precision_text()


@pytest.mark.parametrize(
    ("bits", "text"),
    [
        (-0.0454, "-0.05"),
        (-0.001, "-0.001"),
        (-0.0, "+0.0"),
        (0.0, "+0.0"),
        (0.02, "+0.0"),
        (-0.06, "-0.1"),
        (3.21, "+3.2"),
        (float("inf"), "∞"),
        (float("nan"), "—"),
    ],
)
def test_headroom_text(bits: float, text: str) -> None:
    assert headroom_text(bits) == text


def test_the_whole_tensor_summary_counts_hidden_scores_apart_not_as_non_finite() -> None:
    # Regression: the masked stage holds −inf at every hidden key, yet the summary said
    # "non-finite 0" with nothing to say the −inf were left out.
    text = render_text(sample_spec("causal.yaml"), 80, max_rows=2)
    summary = text.split("whole tensor\n")[1].split("raw scores")[0]
    assert summary.splitlines() == [
        " stage         min     max     mean   non-finite   hidden",
        "──────────────────────────────────────────────────────────",
        " raw             1       9    4.167            0        3",
        " scaled     0.7071   6.364    2.946            0        3",
        " masked     0.7071   6.364    2.946            0        3",
        " weights   0.01267       1      0.5            0        3",
        " output          0   2.869   0.9456            0        —",
        "hidden: scores a mask hides (set to the mask value), not counted in min, max,",
        "mean or non-finite",
    ]


def test_hidden_scores_are_counted_where_whole_blocks_of_keys_are_skipped() -> None:
    """Summaries alone skip the key blocks a row block cannot see: the count holds."""
    x = np.random.default_rng(2).normal(size=(2, 40, 4))
    spec = build_spec(x, x, x, options=Options(causal=True))
    skipping = trace(spec, stages=(), summarize=("masked",), rows=4)
    keeping = trace(spec, stages=("masked",), summarize=("masked",), rows=4)
    assert skipping.hidden == keeping.hidden == 2 * 40 * 39 // 2
    assert skipping.summaries["masked"].nonfinite == 0


def test_a_summary_without_hidden_scores_has_no_hidden_column() -> None:
    x = np.random.default_rng(1).normal(size=(3, 4, 5, 4))
    text = render_text(build_spec(x, x, x), 100, max_slices=2)
    assert "non-finite\n" in text.split("whole tensor")[1]
    assert "hidden" not in text.split("whole tensor")[1].split("──")[0]


def test_the_header_calls_an_integer_mask_integer_not_float() -> None:
    # Regression: an int64 0/1 mask read "float, added to the logits" in the header.
    x = np.eye(3, 2)
    spec = build_spec(
        x, x, x, mask=np.tril(np.ones((3, 3), dtype=np.int64)), names={"mask": "m.npy"}
    )
    assert spec.mask_kind == "integer"
    header = " ".join(render_text(spec, 100, stages=("weights",)).split("╰")[0].split())
    assert (
        "mask m.npy (3, 3), integer (int64), its numbers added to the logits, not read as boolean"
        in header
    )
    assert "float" not in header
