"""The diagnose step: every finding kind on a hand-built case, and no false alarms.

Each case is small enough to work out by hand. Expected numbers (weights, entropies,
standard deviations, counts of values that overflow or flush to zero) come from the
formulas written out here in float64 numpy, never from sdpa's own output. Inputs of
key dim E = 1 with ``scale: none`` make the logits equal to Q·K, so a case's logits
can be read off its Q and K.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from sdpa_cli.diagnosis.findings import Diagnosis, Finding, Thresholds
from sdpa_cli.diagnosis.rows import row_flags
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace

F64 = NDArray[np.float64]

FLOAT16_MAX = 65504.0
BFLOAT16_MAX = (2 - 2**-7) * 2.0**127
FLOAT8_E4M3FN_MAX = 448.0


# --- helpers ------------------------------------------------------------------------------


def run(
    q: NDArray[Any],
    k: NDArray[Any],
    v: NDArray[Any] | None = None,
    *,
    bias: NDArray[Any] | None = None,
    mask: NDArray[Any] | None = None,
    thresholds: Thresholds | None = None,
    **options: Any,
) -> Diagnosis:
    """Diagnose attention over q, k, v (v defaults to ones) with options as a case file gives them."""
    if v is None:
        v = np.ones((*k.shape[:-1], 2), dtype=k.dtype)
    spec = build_spec(q, k, v, bias=bias, mask=mask, options=parse_options(options))
    return diagnose(trace(spec), thresholds)


def col(*values: float) -> F64:
    """A column (n, 1): Q or K with key dim E = 1."""
    return np.array(values, dtype=np.float64).reshape(-1, 1)


def of(d: Diagnosis, kind: str, **fields: Any) -> list[Finding]:
    """The findings of ``kind`` whose attributes equal ``fields``."""
    return [
        f
        for f in d.findings
        if f.kind == kind and all(getattr(f, n) == want for n, want in fields.items())
    ]


def only(d: Diagnosis, kind: str, **fields: Any) -> Finding:
    found = of(d, kind, **fields)
    assert len(found) == 1, [f.to_dict() for f in d.findings]
    return found[0]


def softmax64(logits: F64) -> F64:
    """Row softmax in float64, written out: exp(x − max) / Σ."""
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def entropy64(w: F64) -> F64:
    """−Σ w log w over the last axis, with 0 log 0 = 0."""
    logs = np.log(np.where(w > 0, w, 1.0))
    return -(w * logs).sum(axis=-1)  # type: ignore[no-any-return]


def two_key_max_weight(gap: float) -> float:
    """The larger weight of a row of two logits ``gap`` apart: 1 / (1 + e^−gap)."""
    return 1.0 / (1.0 + math.exp(-gap))


# --- saturated ------------------------------------------------------------------------------


def test_saturated_row_is_a_warning_with_its_index_and_max_weight() -> None:
    """Row [1, 0, 1] has logits [0, 7]: max weight 1/(1+e^−7) = 0.99909 ≥ 0.99, a gap
    two random logits reach once in erfc(3.5) = 1 / 1.3 million rows."""
    q = np.full((2, 1, 2, 1), 0.5)  # other rows: logits [0, 3.5], max weight 0.971
    q[1, 0, 1, 0] = 1.0
    k = col(0.0, 7.0)
    d = run(q, k, scale="none")
    f = only(d, "saturated")
    assert f.severity == "warning"
    assert f.stage == "weights"
    assert f.index == (1, 0, 1)
    assert f.dtype is None
    assert f.count is None
    assert f.details["max_weight"] == pytest.approx(two_key_max_weight(7.0), rel=1e-12)
    assert f.details["key"] == 1
    assert f.details["visible"] == 2
    assert d.counts["saturated"] == 1


def test_a_row_with_one_visible_key_is_not_saturated() -> None:
    """Causal row 0 sees one key: its weight 1.0 is no choice between keys."""
    q = col(1.0, 1.0, 1.0)
    k = col(0.0, 0.5, 1.0)
    d = run(q, k, scale="none", causal=True)
    assert "saturated" not in d.counts
    assert of(d, "saturated") == []


def three_key_max_weight(gap: float) -> float:
    """The largest weight of logits [0, 0, gap]: 1 / (1 + 2e^−gap)."""
    return 1.0 / (1.0 + 2 * math.exp(-gap))


@pytest.mark.parametrize(
    ("gap", "saturated"),
    [(5.2, False), (5.4, True)],  # over 3 keys 0.99 is at gap log(2 · 99) = 5.288
)
def test_default_saturation_boundary(gap: float, saturated: bool) -> None:
    assert (three_key_max_weight(gap) >= 0.99) is saturated  # the premise, by hand
    d = run(col(1.0), col(0.0, 0.0, gap), scale="none")
    assert bool(of(d, "saturated")) is saturated


@pytest.mark.parametrize(("offset", "saturated"), [(-1e-6, True), (1e-6, False)])
def test_saturation_threshold_moves_the_boundary(offset: float, saturated: bool) -> None:
    """A threshold just below the row's max weight flags it; just above does not."""
    w = three_key_max_weight(3.0)  # 0.9094, far from the default
    d = run(
        col(1.0), col(0.0, 0.0, 3.0), scale="none", thresholds=Thresholds(saturation=w + offset)
    )
    assert bool(of(d, "saturated")) is saturated


@pytest.mark.parametrize(
    ("gap", "saturated"),
    [(4.7, False), (6.0, False), (6.1, True)],
)
def test_over_two_keys_one_hot_needs_a_gap_random_logits_rarely_reach(
    gap: float, saturated: bool
) -> None:
    """Two logits of unit variance differ by N(0, 2): a gap ≥ g comes in erfc(g / 2) of
    rows. 4.7 (weight 0.991, past 0.99) comes once in 1,100 rows, and the second query
    of every causal head sees 2 keys; a row is one-hot over 2 keys only past the gap
    random rows reach once in 50,000, 2 · erfc⁻¹(2e-5) = 6.03 (weight 0.9976)."""
    assert two_key_max_weight(gap) >= 0.99
    assert (math.erfc(gap / 2) < 2e-5) is saturated  # 8.9e-4, 2.2e-5, 1.6e-5
    d = run(col(1.0), col(0.0, gap), scale="none")
    assert bool(of(d, "saturated")) is saturated


# --- near_uniform -----------------------------------------------------------------------------


def test_identical_keys_give_a_near_uniform_row_with_entropy_log_n() -> None:
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 1, 2, 8))
    k = np.tile(rng.normal(size=(1, 8)), (4, 1))  # 4 identical keys
    d = run(q, k)
    found = of(d, "near_uniform")
    assert [f.index for f in found] == [(0, 0, 0), (0, 0, 1)]
    for f in found:
        assert f.severity == "info"
        assert f.stage == "weights"
        assert f.details["entropy"] == pytest.approx(math.log(4), rel=1e-12)
        assert f.details["normalized_entropy"] == pytest.approx(1.0, rel=1e-12)
        assert f.details["max_weight"] == pytest.approx(0.25, rel=1e-12)
        assert f.details["visible"] == 4


def chi2_cdf_even(x: float, k: int) -> float:
    """P(χ²ₖ ≤ x) for even k, by hand: 1 − e^(−x/2) Σ_{i < k/2} (x/2)^i / i!."""
    y = x / 2
    return 1 - math.exp(-y) * sum(y**i / math.factorial(i) for i in range(k // 2))


@pytest.mark.parametrize(("offset", "flagged"), [(-1e-6, True), (1e-6, False)])
def test_uniform_threshold_is_respected(offset: float, flagged: bool) -> None:
    """65 logits evenly spread over [0, 2]: normalized entropy 0.9627, below the
    default 0.98; random logits over 65 keys are as flat in P(χ²₆₄ ≤ 2 · 65 · (log 65 − H))
    = 3.3e-8 of rows, so a threshold below the row flags it."""
    keys = np.linspace(0.0, 2.0, 65)
    w = softmax64(keys)
    normalized = float(entropy64(w)) / math.log(65)
    assert normalized == pytest.approx(0.9627, abs=1e-4)
    assert chi2_cdf_even(2 * 65 * (1 - normalized) * math.log(65), 64) == pytest.approx(
        3.3e-8, rel=0.01
    )
    assert of(run(col(1.0), col(*keys), scale="none"), "near_uniform") == []
    d = run(col(1.0), col(*keys), scale="none", thresholds=Thresholds(uniform=normalized + offset))
    assert bool(of(d, "near_uniform")) is flagged


@pytest.mark.parametrize(
    ("gap", "flagged"),
    [(0.1, False), (1e-5, True)],
)
def test_over_two_keys_near_uniform_needs_logits_closer_than_random_ones_come(
    gap: float, flagged: bool
) -> None:
    """Two logits 0.1 apart (weights 0.475, 0.525): entropy 0.9964 of log 2, past 0.98,
    as flat as two random logits of unit variance are in erf(0.1 / 2) = 5.6 % of rows
    (their gap is N(0, 2)); 1e-5 apart, in 5.6e-6 of rows: flagged."""
    normalized = float(entropy64(softmax64(np.array([0.0, gap])))) / math.log(2)
    assert normalized >= 0.98
    assert (math.erf(gap / 2) < 2e-5) is flagged
    d = run(col(1.0), col(0.0, gap), scale="none")
    assert bool(of(d, "near_uniform")) is flagged


# --- fully_masked ------------------------------------------------------------------------------


def test_causal_lower_right_with_more_queries_than_keys_leaves_rows_without_keys() -> None:
    """L = 4, S = 2, lower-right: query i sees keys j ≤ i − 2, so rows 0 and 1 see none."""
    q = np.ones((1, 1, 4, 2))
    k = np.ones((1, 1, 2, 2))
    d = run(q, k, causal=True, causal_align="lower-right")
    found = of(d, "fully_masked")
    assert [f.index for f in found] == [(0, 0, 0), (0, 0, 1)]
    for f in found:
        assert f.severity == "warning"
        assert f.stage == "masked"
        assert "zeros" in f.message
        assert "mean of V" not in f.message
    assert d.counts["fully_masked"] == 2


def test_fully_masked_row_with_a_finite_mask_value_says_mean_of_v() -> None:
    q = np.ones((1, 1, 4, 2))
    k = np.ones((1, 1, 2, 2))
    d = run(q, k, causal=True, causal_align="lower-right", mask_value="-1e9")
    found = of(d, "fully_masked")
    assert [f.index for f in found] == [(0, 0, 0), (0, 0, 1)]
    assert all("mean of V" in f.message for f in found)


def test_a_mask_value_beyond_float16_in_float16_logits_is_an_error() -> None:
    # masked_fill(-1e9) on float16 logits is -inf there
    h = np.float16
    q, k = np.ones((1, 1, 3, 2), dtype=h), np.ones((1, 1, 3, 2), dtype=h)
    d = run(q, k, causal=True, mask_value="-1e9")
    f = only(d, "overflow", stage="masked", dtype="float16")
    assert f.severity == "error"
    assert "-1e+09 is −inf in float16" in f.message


def test_jax_keeps_its_mask_value_in_float32_logits_whatever_the_inputs() -> None:
    # jax.nn.dot_product_attention promotes float16 logits to float32 before masking
    h = np.float16
    q, k = np.ones((1, 1, 3, 2), dtype=h), np.ones((1, 1, 3, 2), dtype=h)
    d = run(q, k, causal=True, framework="jax")
    assert not [f for f in d.findings if f.stage == "masked"]


def test_key_length_zero_masks_every_row_of_that_batch_item() -> None:
    q = np.ones((2, 1, 3, 2))
    k = np.ones((2, 1, 4, 2))
    d = run(q, k, key_lengths=[0, 4])
    assert [f.index for f in of(d, "fully_masked")] == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]


def test_boolean_mask_with_an_all_false_row() -> None:
    mask = np.ones((3, 4), dtype=bool)
    mask[2] = False
    d = run(np.ones((3, 2)), np.ones((4, 2)), mask=mask)
    f = only(d, "fully_masked")
    assert f.index == (2,)
    assert f.severity == "warning"


# --- heads -----------------------------------------------------------------------------------

HEAD_KEYS = col(0.0, 1.0, 2.0, 3.0)


def head_queries(*rows_per_head: tuple[float, ...]) -> F64:
    """Q (1, H, 4, 1) from each head's four query values (E = 1)."""
    return np.array(rows_per_head, dtype=np.float64).reshape(1, len(rows_per_head), 4, 1)


def test_dead_collapsed_and_healthy_heads_and_their_summaries() -> None:
    """Head 0: q = 0, uniform rows. Head 1: q = 20, one-hot rows. Head 2: in between."""
    q = head_queries((0, 0, 0, 0), (20, 20, 20, 20), (0.3, 0.6, 0.9, 1.2))
    d = run(q, HEAD_KEYS, scale="none")

    logits = q @ HEAD_KEYS.T  # (1, 3, 4, 4)
    w = softmax64(logits)
    ent = entropy64(w)
    assert [h.index for h in d.heads] == [(0, 0), (0, 1), (0, 2)]
    for h in range(3):
        summary = d.heads[h]
        assert summary.rows == 4
        assert summary.mean_entropy == pytest.approx(ent[0, h].mean(), rel=1e-12, abs=1e-15)
        assert summary.mean_normalized_entropy == pytest.approx(
            (ent[0, h] / math.log(4)).mean(), rel=1e-12, abs=1e-15
        )
        assert summary.mean_max_weight == pytest.approx(w[0, h].max(axis=-1).mean(), rel=1e-12)

    dead = only(d, "dead_head")
    assert (dead.index, dead.severity, dead.stage, dead.count) == ((0, 0), "warning", "weights", 4)
    collapsed = only(d, "collapsed_head")
    assert (collapsed.index, collapsed.severity, collapsed.stage, collapsed.count) == (
        (0, 1),
        "warning",
        "weights",
        4,
    )
    # the healthy head: no row of it is flagged either
    assert [f for f in d.findings if f.index is not None and f.index[:2] == (0, 2)] == []


@pytest.mark.parametrize(("fraction", "flagged"), [(0.9, False), (0.75, True)])
def test_head_fraction_threshold_for_dead_heads(fraction: float, flagged: bool) -> None:
    """Three of four rows uniform: 75 % — dead at head_fraction 0.75, not at 0.9."""
    q = head_queries((0, 0, 0, 1.2))
    d = run(q, HEAD_KEYS, scale="none", thresholds=Thresholds(head_fraction=fraction))
    assert bool(of(d, "dead_head")) is flagged
    assert d.counts["near_uniform"] == 3


@pytest.mark.parametrize(("fraction", "flagged"), [(0.9, False), (0.75, True)])
def test_head_fraction_threshold_for_collapsed_heads(fraction: float, flagged: bool) -> None:
    q = head_queries((20, 20, 20, 1.2))
    d = run(q, HEAD_KEYS, scale="none", thresholds=Thresholds(head_fraction=fraction))
    assert bool(of(d, "collapsed_head")) is flagged
    assert d.counts["saturated"] == 3


# --- nonfinite -------------------------------------------------------------------------------


def test_nan_in_q_is_reported_at_the_input_then_where_it_appears() -> None:
    q = np.ones((2, 1, 3, 4))
    q[1, 0, 2, 3] = np.nan
    q[1, 0, 2, 1] = np.nan
    k = np.ones((2, 1, 5, 4))
    v = np.ones((2, 1, 5, 3))
    d = run(q, k, v)
    found = of(d, "nonfinite")
    assert [f.stage for f in found] == ["input", "raw", "output"]
    first, raw, out = found
    assert first.severity == "error"
    assert first.index == (1, 0, 2, 1)  # Q as loaded, the first NaN in C order
    assert first.count == 2
    assert first.details["tensor"] == "q"
    assert "2 NaN" in first.message
    assert raw.index == (1, 0, 2, 0)
    assert raw.count == 5  # the whole row of S = 5 scores
    assert out.index == (1, 0, 2, 0)
    assert out.count == 3  # the whole output row of Ev = 3
    assert all(f.severity == "error" for f in found)


def test_inf_in_v_is_reported_at_the_input_and_first_appears_in_the_output() -> None:
    v = np.ones((4, 2))
    v[3, 1] = np.inf
    d = run(np.ones((3, 2)), np.ones((4, 2)), v)
    found = of(d, "nonfinite")
    assert [f.stage for f in found] == ["input", "output"]
    assert found[0].index == (3, 1)
    assert found[0].count == 1
    assert found[0].details["tensor"] == "v"
    assert "1 inf" in found[0].message
    assert found[1].index == (0, 1)  # column 1 of every row: inf · positive weight
    assert found[1].count == 3


def test_huge_finite_inputs_overflow_float64_at_the_raw_scores() -> None:
    """1e200 · 1e200 = inf in float64: no bad input, the raw scores are the first stage."""
    d = run(col(1e200), col(1e200, 1.0))
    found = of(d, "nonfinite")
    assert [f.stage for f in found] == ["raw", "output"]
    assert found[0].index == (0, 0)
    assert found[0].count == 1
    assert found[0].hint is not None


def test_minus_inf_in_a_bias_or_float_mask_is_legitimate_masking() -> None:
    hide = np.zeros((2, 3))
    hide[0, 2] = -np.inf
    hide[1, 0] = -np.inf
    as_bias = run(np.ones((2, 2)), np.ones((3, 2)), bias=hide)
    assert of(as_bias, "nonfinite") == []
    as_mask = run(np.ones((2, 2)), np.ones((3, 2)), mask=hide)
    assert of(as_mask, "nonfinite") == []


def test_nan_in_a_bias_is_flagged_where_it_is_in_the_file() -> None:
    bias = np.zeros((1, 2, 3))
    bias[0, 1, 2] = np.nan
    d = run(np.ones((2, 2)), np.ones((3, 2)), bias=bias)
    found = of(d, "nonfinite")
    assert found[0].stage == "input"
    assert found[0].index == (0, 1, 2)
    assert found[0].details["tensor"] == "bias"
    assert found[1].stage == "biased"  # first produced where the bias is added
    assert found[1].index == (1, 2)
    assert found[-1].stage == "output"


def test_plus_inf_in_a_float_mask_is_flagged() -> None:
    mask = np.zeros((2, 3))
    mask[1, 1] = np.inf
    d = run(np.ones((2, 2)), np.ones((3, 2)), mask=mask)
    f = of(d, "nonfinite", stage="input")
    assert [(x.index, x.count, x.details["tensor"]) for x in f] == [((1, 1), 1, "mask")]


def test_nan_location_under_heads_is_the_location_in_the_file() -> None:
    q = np.zeros((2, 4))  # L = 2, two heads of E = 2
    q[1, 3] = np.nan
    d = run(q, np.ones((3, 4)), np.ones((3, 4)), heads=2)
    assert of(d, "nonfinite", stage="input")[0].index == (1, 3)


# --- overflow --------------------------------------------------------------------------------

# Raw scores [[90000, 300, 600], [300, 1, 2]]: float16 overflows at 1, float8 e4m3fn at 2.
Q_BIG = col(300.0, 1.0)
K_BIG = col(300.0, 1.0, 2.0)


def test_raw_scores_beyond_float16_in_a_float64_run_warn() -> None:
    d = run(Q_BIG, K_BIG)  # E = 1: the default scale is 1
    f = only(d, "overflow", stage="raw", dtype="float16")
    assert f.severity == "warning"
    assert f.count == 1
    assert f.index == (0, 0)
    assert f.details["largest"] == 90000.0
    assert f.details["headroom_bits"] == pytest.approx(math.log2(FLOAT16_MAX / 90000.0))
    e4m3 = only(d, "overflow", stage="raw", dtype="float8_e4m3fn")
    assert e4m3.severity == "info"
    assert e4m3.count == 2
    assert of(d, "overflow", stage="raw", dtype="bfloat16") == []
    # the logits equal the raw scores here: their overflow is an echo, not listed again
    assert of(d, "overflow", stage="scaled") == []
    assert of(d, "overflow", stage="masked") == []


def test_a_scale_above_one_overflows_the_logits_but_not_the_raw_scores() -> None:
    """Raw scores [40000, 0] fit float16; scaled by 2 the first is 80000."""
    d = run(col(200.0), col(200.0, 0.0), scale=2.0)
    assert of(d, "overflow", stage="raw", dtype="float16") == []
    f = only(d, "overflow", stage="scaled", dtype="float16")
    assert (f.severity, f.count, f.index) == ("warning", 1, (0, 0))
    assert f.details["largest"] == 80000.0


def test_a_bias_that_pushes_logits_beyond_float16_overflows_at_masked() -> None:
    """Logits [40000, 0] plus a bias [30000, 0]: 70000 overflows float16 only once biased."""
    bias = np.array([[30000.0, 0.0]])
    d = run(col(200.0), col(200.0, 0.0), bias=bias)
    assert of(d, "overflow", stage="raw", dtype="float16") == []
    assert of(d, "overflow", stage="scaled", dtype="float16") == []
    f = only(d, "overflow", stage="masked", dtype="float16")
    assert (f.severity, f.count, f.index) == ("warning", 1, (0, 0))
    assert f.details["largest"] == 70000.0


def test_a_bias_that_moves_the_overflow_to_another_key_is_reported() -> None:
    """Raw [70000, 0]; bias [−70000, +70000]: logits [0, 70000], a new overflow at key 1."""
    bias = np.array([[-70000.0, 70000.0]])
    d = run(col(1.0), col(70000.0, 0.0), bias=bias)
    assert only(d, "overflow", stage="raw", dtype="float16").index == (0, 0)
    assert only(d, "overflow", stage="masked", dtype="float16").index == (0, 1)


def test_raw_scores_beyond_bfloat16_are_info() -> None:
    d = run(col(1e20), col(1e20, 0.0))  # 1e40 > 3.39e38
    assert BFLOAT16_MAX < 1e40
    f = only(d, "overflow", stage="raw", dtype="bfloat16")
    assert (f.severity, f.count, f.index) == ("info", 1, (0, 0))
    assert only(d, "overflow", stage="raw", dtype="float16").severity == "warning"


def test_float16_overflow_is_an_error_when_the_inputs_are_float16() -> None:
    h = np.float16
    d = run(Q_BIG.astype(h), K_BIG.astype(h), np.ones((3, 2), dtype=h))
    assert only(d, "overflow", stage="raw", dtype="float16").severity == "error"
    assert only(d, "overflow", stage="raw", dtype="float8_e4m3fn").severity == "info"


def test_float16_overflow_is_an_error_when_float16_is_emulated() -> None:
    d = run(Q_BIG, K_BIG, dtype="float16")
    f = only(d, "overflow", stage="raw", dtype="float16")
    assert (f.severity, f.count) == ("error", 1)
    assert only(d, "overflow", stage="raw", dtype="float8_e4m3fn").severity == "info"


def test_bfloat16_overflow_is_an_error_when_bfloat16_is_emulated() -> None:
    d = run(col(1e20), col(1e20, 0.0), dtype="bfloat16")
    assert only(d, "overflow", stage="raw", dtype="bfloat16").severity == "error"
    assert only(d, "overflow", stage="raw", dtype="float16").severity == "warning"


def test_float8_e4m3fn_overflows_after_rounding_past_448() -> None:
    """460 rounds to 448 (the next e4m3 value would be 480, the midpoint is 464); 470 overflows."""
    d = run(col(1.0), col(460.0, 470.0))
    f = only(d, "overflow", stage="raw", dtype="float8_e4m3fn")
    assert f.count == 1
    assert f.index == (0, 1)
    assert f.details["largest"] == 470.0
    assert of(run(col(1.0), col(460.0, 0.0)), "overflow", dtype="float8_e4m3fn") == []


def test_output_beyond_float16() -> None:
    v = np.full((3, 2), 70000.0)
    d = run(np.zeros((2, 1)), np.zeros((3, 1)), v)
    f = only(d, "overflow", stage="output", dtype="float16")
    assert (f.severity, f.count, f.index) == ("warning", 4, (0, 0))


def test_mask_value_minus_1e9_is_minus_inf_in_float16() -> None:
    mask = np.array([[True, False]])
    d = run(col(1.0), col(0.0, 1.0), mask=mask, mask_value="-1e9")
    f = only(d, "overflow", stage="masked", dtype="float16")
    assert f.severity == "warning"
    assert f.index is None
    assert f.count is None
    assert "-1e+09" in f.message
    # with nothing hidden, the mask value is never used
    nothing_hidden = run(col(1.0), col(0.0, 1.0), mask_value="-1e9")
    assert of(nothing_hidden, "overflow", stage="masked") == []


def test_finfo_min_plus_negative_logits_overflows_float16() -> None:
    """Hidden logits −100 and −1: −65504 − 100 rounds to −inf in float16, −65505 to −65504."""
    mask = np.array([[True, False, False]])
    logits = np.array([0.0, -100.0, -1.0])
    added = (logits + -FLOAT16_MAX)[1:]
    with np.errstate(over="ignore"):
        expected = int(np.isinf(added.astype(np.float16)).sum())
    assert expected == 1
    d = run(col(1.0), col(*logits), mask=mask, mask_value="finfo-min", dtype="float16")
    f = only(d, "overflow", stage="masked", dtype="float16")
    assert "plus the logits" in f.message
    assert f.severity == "error"  # float16 is the working format
    assert f.count == expected
    assert f.index == (0, 1)


@pytest.mark.parametrize(("logit", "overflows"), [(11.0, False), (11.1, True)])
def test_exp_without_max_subtraction_overflows_float16_above_log_65504(
    logit: float, overflows: bool
) -> None:
    assert (logit > math.log(FLOAT16_MAX)) is overflows  # log(65504) = 11.0898
    d = run(col(1.0), col(logit, 0.0))
    found = of(d, "overflow", stage="weights", dtype="float16")
    assert bool(found) is overflows
    if overflows:
        assert (found[0].severity, found[0].count, found[0].index) == ("warning", 1, (0, 0))
        assert found[0].details["limit"] == pytest.approx(math.log(FLOAT16_MAX))


@pytest.mark.parametrize(("logit", "overflows"), [(88.0, False), (89.0, True)])
def test_exp_overflow_in_an_emulated_bfloat16_run_is_an_error(
    logit: float, overflows: bool
) -> None:
    assert (logit > math.log(BFLOAT16_MAX)) is overflows  # log(3.39e38) = 88.72
    d = run(col(1.0), col(logit, 0.0), dtype="bfloat16")
    found = of(d, "overflow", stage="weights", dtype="bfloat16")
    assert [(f.severity, f.count) for f in found] == ([("error", 1)] if overflows else [])
    # float16's exp limit is far lower: its finding stands either way, as a warning
    assert only(d, "overflow", stage="weights", dtype="float16").severity == "warning"


def test_headroom_is_log2_of_the_format_max_over_the_largest_magnitude() -> None:
    d = run(col(3.0, -5.0), col(7.0, 2.0))  # raw [[21, 6], [−35, −10]]
    assert d.headroom["float16"]["raw"] == pytest.approx(math.log2(FLOAT16_MAX / 35.0), rel=1e-12)
    assert d.headroom["bfloat16"]["raw"] == pytest.approx(math.log2(BFLOAT16_MAX / 35.0), rel=1e-12)
    assert d.headroom["float8_e4m3fn"]["scaled"] == pytest.approx(
        math.log2(FLOAT8_E4M3FN_MAX / 35.0), rel=1e-12
    )


# --- underflow -------------------------------------------------------------------------------


def test_weights_that_flush_to_zero_in_float16_are_counted_per_row() -> None:
    q = col(1.0, 0.5, 2.0)
    k = col(0.0, -20.0, -21.0, -5.0)
    w64 = softmax64(q @ k.T)
    flushed = (w64 != 0) & (w64.astype(np.float16) == 0)
    per_row = flushed.sum(axis=-1)
    assert per_row.tolist() == [2, 0, 2]  # e^−20 ≈ 2e−9 < 2^−25; e^−10 ≈ 4.5e−5 is not

    d = run(q, k, scale="none")
    found = of(d, "underflow", dtype="float16")
    assert [f.index for f in found] == [(0,), (2,)]
    for f in found:
        assert f.index is not None
        i = f.index[0]
        assert f.severity == "info"
        assert f.stage == "weights"
        assert f.count == per_row[i]
        assert f.details["lost_weight"] == pytest.approx(w64[i][flushed[i]].sum(), rel=1e-12)


def test_underflow_in_an_emulated_bfloat16_run() -> None:
    """e^−100 ≈ 3.7e−44 is below half of bfloat16's smallest subnormal (9.2e−41)."""
    q, k = col(1.0, 1.0), col(0.0, -100.0, -1.0)
    w64 = softmax64(q @ k.T)
    bf16_tiny = 2.0**-133
    flushed = (w64 != 0) & (w64 <= bf16_tiny / 2)
    d = run(q, k, scale="none", dtype="bfloat16")
    found = of(d, "underflow", dtype="bfloat16")
    per_row = flushed.sum(axis=-1)
    assert per_row.tolist() == [1, 1]
    assert [(f.index, f.count, f.severity) for f in found] == [
        ((0,), per_row[0], "info"),
        ((1,), per_row[1], "info"),
    ]
    assert found[0].details["lost_weight"] == pytest.approx(w64[0][flushed[0]].sum(), rel=1e-12)


def many_tiny_weights() -> tuple[F64, F64]:
    """Two keys at logit 0, 99 998 at −17: each tiny weight ≈ 2.1e−8 flushes, together ≈ 2e−3."""
    k = np.full((100_000, 1), -17.0)
    k[:2] = 0.0
    return col(1.0), k


def test_underflow_losing_much_weight_in_a_float16_run_warns() -> None:
    q, k = many_tiny_weights()
    w64 = softmax64(q @ k.T)
    flushed = (w64 != 0) & (w64.astype(np.float16) == 0)
    lost = float(w64[flushed].sum())
    assert lost >= 1e-3

    h = np.float16
    d = run(q.astype(h), k.astype(h), np.ones((100_000, 1), dtype=h), scale="none")
    f = only(d, "underflow", dtype="float16")
    assert f.severity == "warning"
    assert f.count == int(flushed.sum()) == 99_998
    assert f.details["lost_weight"] == pytest.approx(lost, rel=1e-9)

    # the same weights in a float64 run only inform
    d64 = run(q, k, np.ones((100_000, 1)), scale="none")
    assert only(d64, "underflow", dtype="float16").severity == "info"


# --- unscaled --------------------------------------------------------------------------------


def normal_qk(seed: int, L: int = 64, S: int = 64, E: int = 64) -> tuple[F64, F64]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(1, 2, L, E)), rng.normal(size=(1, 2, S, E))


def test_omitted_scale_is_flagged_with_the_observed_and_predicted_std() -> None:
    q, k = normal_qk(3)
    raw_std = float(np.std(q @ np.swapaxes(k, -1, -2)))
    predicted = math.sqrt(64) * float(np.std(q)) * float(np.std(k))
    assert raw_std == pytest.approx(8.0, rel=0.15)

    d = run(q, k, scale="none")
    f = only(d, "unscaled")
    assert f.severity == "warning"
    assert f.stage == "scaled"
    assert "omitted" in f.message
    assert f.details["raw_std"] == pytest.approx(raw_std, rel=1e-9)
    assert f.details["predicted_raw_std"] == pytest.approx(predicted, rel=1e-12)
    assert f.details["effective_scale"] == 1.0


def test_scale_applied_twice_is_flagged() -> None:
    q, k = normal_qk(4)
    f = only(run(q, k, scale="dk"), "unscaled")
    assert f.severity == "warning"
    assert "twice" in f.message
    assert f.details["effective_scale"] == pytest.approx(1 / 64)


def test_the_default_scale_is_not_flagged() -> None:
    q, k = normal_qk(5)
    assert of(run(q, k), "unscaled") == []


# --- mask_suspect ----------------------------------------------------------------------------


def test_float_mask_of_zeros_and_ones_is_suspect() -> None:
    mask = np.tril(np.ones((3, 3)))  # a boolean causal mask cast to float
    d = run(np.ones((3, 2)), np.ones((3, 2)), mask=mask)
    f = only(d, "mask_suspect")
    assert (f.severity, f.stage, f.count) == ("warning", "input", 6)
    assert f.details["tensor"] == "mask"


def test_an_integer_mask_of_zeros_and_ones_is_called_integer_and_read_as_numbers() -> None:
    # Regression: an int64 0/1 mask (Hugging Face's attention_mask) was "the float mask".
    mask = np.tril(np.ones((3, 3), dtype=np.int64))
    d = run(np.ones((3, 2)), np.ones((3, 2)), mask=mask)
    f = only(d, "mask_suspect")
    assert (f.severity, f.stage, f.count) == ("warning", "input", 6)
    assert f.message == (
        "the integer (int64) mask (--mask) holds only 0 and 1: it is read as numbers added "
        "to the logits, +1 to some, not as a boolean mask, so it hides no key"
    )
    assert f.hint == (
        "PyTorch's SDPA refuses an integer mask. A boolean mask cast to numbers? Pass it "
        "as bool (True = may attend), or as 0 / −inf"
    )
    assert "float" not in f.message


def test_a_float_mask_of_zeros_and_ones_is_called_float() -> None:
    d = run(np.ones((3, 2)), np.ones((3, 2)), mask=np.tril(np.ones((3, 3))))
    assert only(d, "mask_suspect").message.startswith("the float mask (--mask) holds only 0 and 1")


def test_inverted_causal_boolean_mask_hides_the_diagonal() -> None:
    mask = ~np.tril(np.ones((4, 4), dtype=bool))  # True above the diagonal only
    d = run(np.ones((4, 2)), np.ones((4, 2)), mask=mask)
    f = only(d, "mask_suspect")
    assert f.severity == "warning"
    assert "diagonal" in f.message
    assert f.details["hidden_fraction"] == pytest.approx(1 - 6 / 16)


def test_local_window_boolean_mask_that_keeps_the_diagonal_is_info() -> None:
    i = np.arange(16)
    mask = np.abs(i[:, None] - i[None, :]) <= 1  # a band: 46 of 256 visible
    d = run(np.ones((16, 2)), np.ones((16, 2)), mask=mask)
    f = only(d, "mask_suspect")
    assert f.severity == "info"
    assert f.details["hidden_fraction"] == pytest.approx(1 - 46 / 256)


def test_finite_mask_value_with_fully_masked_rows_is_suspect() -> None:
    q = np.ones((1, 1, 4, 2))
    k = np.ones((1, 1, 2, 2))
    d = run(q, k, causal=True, causal_align="lower-right", mask_value="-1e9")
    f = only(d, "mask_suspect")
    assert (f.severity, f.stage, f.count) == ("warning", "masked", 2)
    assert of(run(q, k, causal=True, causal_align="lower-right"), "mask_suspect") == []


@pytest.mark.parametrize("tensor", ["k", "v"])
def test_nonfinite_k_or_v_at_padded_keys_is_suspect(tensor: str) -> None:
    """Key lengths 2 of S = 4: rows 2 and 3 of K (or V) are padding holding NaN."""
    k = np.ones((1, 1, 4, 2))
    v = np.ones((1, 1, 4, 3))
    (k if tensor == "k" else v)[0, 0, 2:] = np.nan
    d = run(np.ones((1, 1, 3, 2)), k, v, key_lengths=[2])
    f = only(d, "mask_suspect", details={"tensor": tensor})
    assert f.severity == "warning"
    assert f.index == (0, 0, 0, 2)
    assert f.count == 3 * 2  # every query row × the two hidden keys
    assert f.details["tensor"] == tensor


# --- no false alarms ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "causal"),
    [
        ((2, 8, 128, 64), (2, 8, 128, 64), False),
        ((1, 4, 512, 64), (1, 4, 512, 64), True),
        ((2, 4, 32, 64), (2, 4, 96, 64), False),  # cross-attention L ≠ S
        ((1, 8, 64, 64), (1, 2, 64, 64), False),  # grouped-query: 8 query heads, 2 K/V heads
    ],
)
def test_normal_inputs_with_the_default_scale_raise_no_warning(
    q_shape: tuple[int, ...], kv_shape: tuple[int, ...], causal: bool, dtype: type
) -> None:
    rng = np.random.default_rng(2024)
    q: NDArray[Any] = rng.normal(size=q_shape).astype(dtype)
    k: NDArray[Any] = rng.normal(size=kv_shape).astype(dtype)
    v: NDArray[Any] = rng.normal(size=kv_shape).astype(dtype)
    d = run(q, k, v, causal=causal)
    loud = [f.to_dict() for f in d.findings if f.severity != "info"]
    assert loud == []
    assert d.worst() in (None, "info")


# --- listing and counting ---------------------------------------------------------------------

FIVE_ONE_HOT = (col(10.0, 20.0, 30.0, 40.0, 50.0), col(0.0, 1.0))


def test_max_findings_caps_the_listing_but_not_the_count() -> None:
    q, k = FIVE_ONE_HOT
    d = run(q, k, scale="none", thresholds=Thresholds(max_findings=2))
    assert [f.index for f in of(d, "saturated")] == [(0,), (1,)]
    assert d.counts["saturated"] == 5
    assert d.truncated


def test_nothing_is_truncated_under_the_cap() -> None:
    q, k = FIVE_ONE_HOT
    d = run(q, k, scale="none", thresholds=Thresholds(max_findings=5))
    assert len(of(d, "saturated")) == 5
    assert not d.truncated


def test_max_findings_zero_lists_no_row_and_says_so() -> None:
    q, k = FIVE_ONE_HOT
    d = run(q, k, scale="none", thresholds=Thresholds(max_findings=0))
    assert of(d, "saturated") == []
    assert d.counts["saturated"] == 5
    assert d.truncated


def test_findings_do_not_depend_on_the_block_size() -> None:
    """Statistics are gathered block by block: one row at a time finds the same things."""
    rng = np.random.default_rng(7)
    q = rng.normal(size=(2, 2, 7, 4)) * 30
    k = rng.normal(size=(2, 2, 9, 4)) * 30
    v = rng.normal(size=(2, 2, 9, 3)) * 3e4
    q[1, 1, 3, 2] = np.nan
    k[0, 1, 8] = np.nan
    options = parse_options({"causal": True, "key_lengths": [8, 5], "mask_value": "-1e9"})
    spec = build_spec(q, k, v, options=options)

    def summary(d: Diagnosis) -> list[tuple[Any, ...]]:
        return [(f.kind, f.severity, f.index, f.stage, f.dtype, f.count) for f in d.findings]

    whole = diagnose(trace(spec))
    assert {"nonfinite", "overflow", "mask_suspect", "saturated"} <= set(whole.counts)
    for rows in (1, 3):
        blocked = diagnose(trace(spec, rows=rows))
        assert summary(blocked) == summary(whole)
        assert blocked.counts == whole.counts


# --- the JSON contract -------------------------------------------------------------------------


def test_to_dict_has_only_the_contract_keys_that_are_set() -> None:
    assert list(Finding("saturated", "info", "m").to_dict()) == ["kind", "severity", "message"]
    full = Finding(
        "overflow",
        "error",
        "m",
        hint="h",
        index=(0, 1),
        stage="raw",
        dtype="float16",
        count=3,
        details={"largest": 1.0},
    ).to_dict()
    assert full == {
        "kind": "overflow",
        "severity": "error",
        "message": "m",
        "hint": "h",
        "index": [0, 1],
        "stage": "raw",
        "dtype": "float16",
        "count": 3,
        "details": {"largest": 1.0},
    }
    assert list(full)[:3] == ["kind", "severity", "message"]


def test_every_finding_of_a_finite_case_is_strict_json() -> None:
    mask = np.ones((2, 1, 3, 3), dtype=bool)
    mask[0, 0, 1] = False
    q = np.full((2, 1, 3, 1), 300.0)
    k = np.concatenate([np.full((2, 1, 1, 1), 300.0), np.zeros((2, 1, 2, 1))], axis=-2)
    d = run(q, k, mask=mask, mask_value="-1e9", key_lengths=[3, 2])
    kinds = {f.kind for f in d.findings}
    assert {"overflow", "fully_masked", "mask_suspect", "saturated"} <= kinds
    contract = ["kind", "severity", "message", "hint", "index", "stage", "dtype", "count"]
    for f in d.findings:
        out = f.to_dict()
        assert list(out)[:3] == ["kind", "severity", "message"]
        assert set(out) <= {*contract, "details"}
        assert out["severity"] in ("info", "warning", "error")
        json.dumps(out, allow_nan=False)


# --- row flags -------------------------------------------------------------------------------


def test_row_flags_mark_one_hot_uniform_no_keys_and_nan_rows() -> None:
    """Rows: q = 0 (uniform), q = 10 (one-hot), no key, q = 1 (plain), q = NaN."""
    q = col(0.0, 10.0, 1.0, 1.0, np.nan).reshape(1, 1, 5, 1)
    k = col(0.0, 1.0, 2.0, 3.0)
    mask = np.ones((5, 4), dtype=bool)
    mask[2] = False
    spec = build_spec(q, k, np.ones((4, 1)), mask=mask, options=parse_options({"scale": "none"}))
    flags = row_flags(trace(spec).stats, Thresholds(), (0, 0))
    assert flags == {
        0: ("uniform", "info"),
        1: ("one-hot", "warning"),
        2: ("no keys", "warning"),
        4: ("NaN", "error"),
    }


def test_row_flags_mark_underflow_only_in_a_working_format() -> None:
    q, k = many_tiny_weights()
    spec = build_spec(q, k, np.ones((100_000, 1)), options=parse_options({"scale": "none"}))
    stats = trace(spec).stats
    assert row_flags(stats, Thresholds(), ()) == {}
    assert row_flags(stats, Thresholds(), (), ("float16",)) == {0: ("underflow f16", "warning")}


# --- emulation -------------------------------------------------------------------------------


def test_emulation_reports_the_first_stage_that_overflowed() -> None:
    assert run(Q_BIG, K_BIG).emulation is None
    emulation = run(Q_BIG, K_BIG, dtype="float16").emulation
    assert emulation is not None
    assert emulation.dtype == "float16"
    first = emulation.first_problem
    assert first is not None
    assert (first.stage, first.problem, first.new_nonfinite) == ("raw", "overflowed", 1)


def test_raw_std_survives_a_large_common_offset() -> None:
    """Scores of 1e8 ± a few: the std the unscaled check reads is the spread, not the
    rounding error of E[x²] − E[x]² (the statistics merge blocks pairwise)."""
    q = np.array([[1e4, 1.0], [1e4, 2.0], [1e4, -1.0]])
    k = np.array([[1e4, 0.3], [1e4, -2.0], [1e4, 1.5]])
    spec = build_spec(q, k, np.eye(3), options=parse_options({"scale": "none"}))
    result = trace(spec, rows=1)  # one row per block: the merge is exercised
    assert result.stats.raw_std == pytest.approx(float(np.std(q @ k.T)), rel=1e-9)
