"""``sdpa explain`` rendered as golden text at width 80 with color off, and the helpers
that draw its bars and wrap its notes.

Regenerate the golden files with ``SDPA_REGEN_GOLDEN=1`` and review the diff: a change
in a golden file is a change in what users read. The seed values the goldens must show
are checked here too, so a regeneration cannot quietly bless a wrong number.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
from golden_files import check_golden
from rich.console import Console
from rich.text import Text

from sdpa_cli.diagnosis.explain import explain, slice_at
from sdpa_cli.diagnosis.explained import Explanation
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.options import OPTION_NAMES, parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.files.cases import load_case
from sdpa_cli.render.common import View, note_text
from sdpa_cli.render.explain import render_explain
from sdpa_cli.render.scorecard import BARS, bar, diverging_bar

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 80


def sample_spec(name: str, **overrides: object) -> AttentionSpec:
    case = load_case(str(ROOT / "samples" / name), OPTION_NAMES)
    options = parse_options({**case.options, **overrides})
    t = case.tensors
    return build_spec(t["q"], t["k"], t["v"], options=options, names={n: "" for n in t})


def random_spec(**options: object) -> AttentionSpec:
    """A small fixed-seed (H=2, L=4, S=5, E=3, Ev=2) input."""
    rng = np.random.default_rng(20240611)
    return build_spec(
        rng.normal(size=(2, 4, 3)),
        rng.normal(size=(2, 5, 3)),
        rng.normal(size=(2, 5, 2)),
        options=parse_options(options),
        names={n: "" for n in "qkv"},
    )


def explanation(
    spec: AttentionSpec, *, query: int | None = None, scales: bool = False, head: int = 0
) -> Explanation:
    """What ``sdpa explain`` builds: the whole trace and diagnosis, then the slice."""
    result = trace(spec, stages=())
    rows = range(query, query + 1) if query is not None else range(min(spec.L, 16))
    return explain(
        spec,
        result.stats,
        diagnose(result),
        slice_at(spec, 0, head),
        rows,
        query=query,
        scales=scales,
        key_limit=16,
    )


def render_text(ex: Explanation, *, walk: bool) -> str:
    console = Console(file=io.StringIO(), width=WIDTH, color_system=None, no_color=True)
    view = View(stages=(), max_rows=16, precision=4, width=WIDTH)
    console.print(render_explain(ex, view, walk=walk))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in out.splitlines()) + "\n"


def causal() -> str:
    return render_text(explanation(sample_spec("causal.yaml")), walk=True)


def scorecard_q0() -> str:
    return render_text(explanation(sample_spec("scorecard.yaml"), query=0), walk=False)


def four_scores_q0() -> str:
    return render_text(explanation(sample_spec("four_scores.yaml"), query=0), walk=False)


def scale_comparison() -> str:
    return render_text(explanation(sample_spec("scale_comparison.yaml"), scales=True), walk=False)


def softcap_dropout() -> str:
    spec = random_spec(causal=True, softcap=1.5, dropout=0.25, seed=7)
    return render_text(explanation(spec, head=1), walk=True)


CASES = {
    "explain_causal_80.txt": causal,
    "explain_scorecard_q0_80.txt": scorecard_q0,
    "explain_four_scores_q0_80.txt": four_scores_q0,
    "explain_scale_comparison_80.txt": scale_comparison,
    "explain_softcap_dropout_80.txt": softcap_dropout,
}


@pytest.mark.parametrize("golden", sorted(CASES))
def test_explain_renders_as_the_golden_text(golden: str) -> None:
    text = CASES[golden]()
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    check_golden(golden, text)


# --- the numbers the goldens must show (seeds 001, 002 and 003, worked by hand) --------------


def row_of(text: str, label: str) -> list[str]:
    """The cells of the first table line starting with ``label``."""
    line = next(x for x in text.splitlines() if x.split()[:1] == [label])
    return line.split()[1:]


def test_causal_walk_shows_seed_002_row_2() -> None:
    text = causal()
    weights = text.split("weights  softmax over keys")[1].split("output  weights · V")[0]
    # softmax([2.1213, 4.2426, 6.3640]) = [0.012669, 0.105686, 0.881645]
    assert row_of(weights, "q2")[:3] == ["0.0127", "0.1057", "0.8816"]
    assert row_of(weights, "q1")[:3] == ["0.1956", "0.8044", "masked"]
    assert row_of(weights, "q0")[:3] == ["1.0000", "masked", "masked"]
    output = text.split("output  weights · V")[1]
    assert row_of(output, "q2") == ["2.8690", "0.0000"]
    assert row_of(output, "q1") == ["1.8044", "0.0000"]
    # The mask picture: ■ visible, · hidden, lower triangle.
    assert "q0 ■··\nq1 ■■·\nq2 ■■■\n" in text
    assert "Causal (upper-left) hid 3 of 9 scores (33.3%)" in " ".join(text.split())


def test_scorecard_shows_seed_003() -> None:
    text = scorecard_q0()
    # Exact weights 0.881645, 0.105686, 0.012669: 0.88165 rounds down to 0.8816.
    assert row_of(text, "k0")[:4] == ["5.0000", "3.5355", "1.0000", "0.8816"]
    assert row_of(text, "k1")[:4] == ["2.0000", "1.4142", "0.1199", "0.1057"]
    assert row_of(text, "k2")[:4] == ["-1.0000", "-0.7071", "0.0144", "0.0127"]
    assert "q0·k2 = 2·0 + 1·(-1) = -1" in text
    assert re.search(r"^q0 +output +  = \[8\.8291, 0\.8582\]$", text, flags=re.MULTILINE)
    assert "Z = Σ e^(x − m) = 1.1342 (Σ e^x = 38.9196)" in " ".join(text.split())


def test_a_scorecards_negative_factors_are_parenthesised_first_or_second() -> None:
    # Regression: a negative first factor read "0.3·0.5 + -0.49·(-0.46)", a sign after
    # a plus; every negative factor is now in parentheses and "+" joins every term.
    spec = build_spec(
        np.array([[0.3, -0.49]]),
        np.array([[0.5, -0.46], [-1.0, 2.0], [0.0, -0.0]]),
        np.eye(3, 2),
        names={n: "" for n in "qkv"},
    )
    text = render_text(explanation(spec, query=0), walk=False)
    assert "q0·k0 = 0.3·0.5 + (-0.49)·(-0.46) = 0.3754" in text
    assert "q0·k1 = 0.3·(-1) + (-0.49)·2 = -1.28" in text
    assert "q0·k2 = 0.3·0 + (-0.49)·(-0) = 0" in text
    assert "+ -" not in text


def test_a_cut_scorecard_lists_the_visible_keys_heaviest_first_and_counts_them() -> None:
    # Regression: "the heaviest 16 keys" were k0..k15 in key order, masked ones among
    # them, each with a contribution line "0.000000 · v6".
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((40, 4)) for _ in range(3))
    spec = build_spec(
        q, k, v, options=parse_options({"causal": True}), names={n: "" for n in "qkv"}
    )
    text = render_text(explanation(spec, query=5), walk=False)
    table = text.split("\nkey ")[1].split("\n…")[0].splitlines()[1:]
    assert [row.split()[0] for row in table] == ["k4", "k2", "k3", "k0", "k1", "k5"]
    assert not any("masked" in row for row in table)
    assert (
        " ".join(text.split()).count(
            "… only 6 of the 40 keys are visible: all listed, heaviest first; the 34 masked keys "
            "hold weight 0.0000 together"
        )
        == 1
    )
    contributions = text.split("output row\n")[1].splitlines()
    assert [line.split()[0] for line in contributions[:7]] == [
        "k4",
        "k2",
        "k3",
        "k0",
        "k1",
        "k5",
        "rest",
    ]


def test_a_cut_scorecard_without_a_mask_says_how_many_of_all_keys_it_lists() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((40, 4)) for _ in range(3))
    spec = build_spec(q, k, v, names={n: "" for n in "qkv"})
    text = " ".join(render_text(explanation(spec, query=30), walk=False).split())
    assert (
        "… the heaviest 16 of the 40 keys listed, heaviest first; the other 24 hold weight 0.1458 together"
        in text
    )


def test_four_scores_show_seed_001() -> None:
    text = four_scores_q0()
    weights = [row_of(text, f"k{j}")[3] for j in range(4)]
    assert weights == ["0.1557", "0.0945", "0.6980", "0.0518"]
    assert "(Σ e^x = 17.4543)" in text
    # V is the identity, so the output repeats the weights.
    assert re.search(r"output +  = \[0\.1557, 0\.0945, 0\.6980, 0\.0518\]$", text, re.MULTILINE)


def test_scale_comparison_shows_seed_002_example_3() -> None:
    text = scale_comparison()
    tables = text.split("weights  ")[1:]
    assert [t.splitlines()[0] for t in tables] == [
        "none (×1)",
        "1/√d_k = 0.125",
        "1/d_k = 0.01562",
    ]
    assert row_of(tables[0], "q0")[:3] == ["2.57e-56", "1.60e-28", "1.0000"]
    assert row_of(tables[1], "q0")[:3] == ["1.12e-07", "0.0003", "0.9997"]
    assert row_of(tables[2], "q0")[:3] == ["0.0900", "0.2447", "0.6652"]
    assert row_of(text, "verdict") == ["saturated", "saturated", "balanced"]
    assert "Balanced under 1/d_k; the standard 1/√d_k is saturated here" in text


def test_softcap_dropout_walk_has_every_stage_in_order() -> None:
    text = softcap_dropout()
    titles = [
        "raw scores  Q·Kᵀ",
        "scaled scores",
        "soft-capped  C · tanh(scaled / C)",
        "masked logits",
        "weights  softmax over keys",
        "after dropout  kept weights / (1 − p)",
        "output  dropped · V",  # the dropped weights, not the weights, times V
    ]
    positions = [text.index(t) for t in titles]
    assert positions == sorted(positions)
    assert "biased" not in text
    assert "── head 1 · 4 rows ─" in text
    assert "Dropout p = 0.25 (seed 7)" in " ".join(text.split())


def test_softcap_dropout_golden_numbers_match_numpy() -> None:
    """The capped, dropped and output values shown equal numpy's, to the 4 digits shown."""
    spec = random_spec(causal=True, softcap=1.5, dropout=0.25, seed=7)
    ex = explanation(spec, head=1)
    q, k, v = (np.asarray(a, dtype=np.float64)[1] for a in (spec.q, spec.k, spec.v))
    capped = 1.5 * np.tanh(q @ k.T / math.sqrt(3) / 1.5)
    visible = np.tril(np.ones((4, 5), dtype=bool))
    e = np.where(visible, np.exp(capped - capped.max(axis=1, keepdims=True)), 0.0)
    weights = e / e.sum(axis=1, keepdims=True)
    stage = {s.name: s.values for s in ex.stages}
    np.testing.assert_allclose(stage["capped"], capped, rtol=1e-12)
    np.testing.assert_allclose(stage["weights"], weights, rtol=1e-12, atol=1e-15)
    dropped = stage["dropout"]
    kept = dropped != 0
    np.testing.assert_allclose(dropped[kept], weights[kept] / 0.75, rtol=1e-12)
    np.testing.assert_allclose(stage["output"], dropped @ v, rtol=1e-12, atol=1e-15)
    text = softcap_dropout()
    table = text.split("soft-capped  C · tanh(scaled / C)")[1].split("masked logits")[0]
    assert row_of(table, "q3") == [f"{x:.4f}" for x in capped[3]]


# --- the helpers ---------------------------------------------------------------------------


def eighths(drawn: str) -> int:
    """The length of a bar in eighths of a cell."""
    return sum(8 if c == "█" else BARS.index(c) for c in drawn)


@pytest.mark.parametrize(
    ("x", "top", "width", "expected"),
    [
        (1.0, 1.0, 4, 32),
        (0.5, 1.0, 4, 16),
        (0.25, 1.0, 3, 6),
        (1 / 32, 1.0, 4, 1),
        (3 / 32, 1.0, 4, 3),
        (0.9, 1.0, 1, 7),
        (7.0, 2.0, 5, 40),  # capped at the width
        (0.8816454, 0.8816454, 14, 112),
        (0.1056857, 0.8816454, 14, 13),
        (0.0126689, 0.8816454, 14, 2),
    ],
)
def test_bar_length_is_in_eighths(x: float, top: float, width: int, expected: int) -> None:
    drawn = bar(x, top, width)
    assert eighths(drawn) == expected
    assert len(drawn) == math.ceil(expected / 8)
    assert drawn == drawn.rstrip()
    assert " " not in drawn
    # Whole cells first, then at most one partial cell.
    assert set(drawn[:-1]) <= {"█"}


@pytest.mark.parametrize(
    ("x", "top"),
    [(0.0, 1.0), (-0.5, 1.0), (1.0, 0.0), (math.nan, 1.0), (math.inf, 1.0), (-math.inf, 1.0)],
)
def test_bar_is_empty_for_nothing_to_draw(x: float, top: float) -> None:
    assert bar(x, top, 10) == ""


def test_bar_draws_a_sliver_for_a_tiny_nonzero_value() -> None:
    assert bar(1e-9, 1.0, 14) == BARS[1]


@pytest.mark.parametrize("x", [-1.0, -0.4, -0.01])
def test_negative_bars_end_at_the_axis_on_its_left(x: float) -> None:
    width = 12
    text = diverging_bar(x, -1.0, 2.0, width).plain
    assert len(text) == width
    axis = round(width * 1.0 / 3.0)  # the share of the negative side
    left, right = text[:axis], text[axis:]
    assert right.strip() == ""
    assert left.strip(), "a negative value always draws something"
    assert left == left.strip().rjust(axis)  # flush against the axis
    halves = round(-x * axis * 2)  # drawn to half a cell: ▐ is a half, ▕ a sliver
    drawn = left.strip()
    assert drawn == ("▐" if halves % 2 else "") + "█" * (halves // 2) or (
        halves == 0 and drawn == "▕"
    )


@pytest.mark.parametrize("x", [0.05, 1.0, 2.0])
def test_positive_bars_start_at_the_axis_on_its_right(x: float) -> None:
    width = 12
    text = diverging_bar(x, -1.0, 2.0, width).plain
    assert len(text) == width
    axis = round(width * 1.0 / 3.0)
    left, right = text[:axis], text[axis:]
    assert left == " " * axis
    assert right.rstrip() == bar(x, 2.0, width - axis)
    assert not right.startswith(" ")


def test_diverging_bar_without_negatives_has_no_left_side() -> None:
    assert diverging_bar(1.0, 0.0, 1.0, 6).plain == "██████"
    assert diverging_bar(0.5, 0.0, 1.0, 6).plain == "███   "


@pytest.mark.parametrize(("lo", "hi", "x"), [(0.0, 0.0, 0.0), (-1.0, 1.0, math.nan)])
def test_diverging_bar_blank_when_nothing_to_draw(lo: float, hi: float, x: float) -> None:
    assert diverging_bar(x, lo, hi, 7).plain == " " * 7


def test_diverging_bar_colors_negative_and_positive_apart() -> None:
    neg = diverging_bar(-1.0, -1.0, 1.0, 8)
    pos = diverging_bar(1.0, -1.0, 1.0, 8)
    (neg_span,) = [s for s in neg.spans if neg.plain[s.start : s.end].strip()]
    (pos_span,) = [s for s in pos.spans if pos.plain[s.start : s.end].strip()]
    assert str(neg_span.style) != str(pos_span.style)


NOTE = (
    "Softmax over each row: e^(x − row max) / Σ e^(x − row max), so every weight is in "
    "[0, 1] and each row with a visible key sums to 1 (largest deviation 2.2e-16)."
)


@pytest.mark.parametrize("width", [30, 45, 80])
@pytest.mark.parametrize(("indent", "first"), [(2, None), (9, 0), (0, 4)])
def test_note_text_wraps_indents_and_leaves_no_trailing_space(
    width: int, indent: int, first: int | None
) -> None:
    text = note_text(NOTE, width, indent, first=first)
    assert isinstance(text, Text)
    lines = text.plain.split("\n")
    assert len(lines) > 1
    for n, line in enumerate(lines):
        assert len(line) <= width, line
        assert line == line.rstrip(), repr(line)
        lead = indent if n or first is None else first
        assert line[:lead] == " " * lead
        assert line[lead] != " "
    assert " ".join(text.plain.split()) == " ".join(NOTE.split())  # nothing lost or added


def test_note_text_never_breaks_a_word_or_a_hyphenated_number() -> None:
    text = note_text("range −6.31e-05 … 5.055e-05 over the slice-wide scores", 30)
    words = set(text.plain.split())
    assert {"−6.31e-05", "5.055e-05", "slice-wide"} <= words


def test_note_text_style_covers_the_text() -> None:
    from rich.style import Style

    style = Style(dim=True)
    text = note_text("a short note", 80, style=style)
    assert text.plain == "  a short note"
    assert text.style == style


def test_note_text_under_30_columns_still_wraps_at_30() -> None:
    text = note_text(NOTE, 10)
    assert max(len(line) for line in text.plain.split("\n")) <= 30
    assert max(len(line) for line in text.plain.split("\n")) > 10
