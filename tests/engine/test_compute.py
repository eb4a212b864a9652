"""The numpy engine against the loop reference, the seeds' worked examples and by-hand checks.

Every expectation is derived here or in ``reference.py`` (loops with ``math.exp``),
never copied from sdpa's own output.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from reference import Stages, attention, mix

from sdpa_cli.engine.block import attend_block, softmax
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import Trace, trace
from sdpa_cli.errors import SpecError
from sdpa_cli.names import STAGES

F64 = NDArray[np.float64]
RTOL = 1e-12
ATOL = 1e-12
FINFO_MIN = float(np.finfo(np.float64).min)


def normal(seed: int, *shape: int) -> F64:
    return np.random.default_rng(seed).normal(size=shape)


def run(
    q: NDArray[Any],
    k: NDArray[Any],
    v: NDArray[Any],
    *,
    bias: NDArray[Any] | None = None,
    mask: NDArray[Any] | None = None,
    **options: Any,
) -> tuple[Trace, Stages]:
    """sdpa's trace and the loop reference for the same inputs and options."""
    spec = build_spec(q, k, v, bias=bias, mask=mask, options=Options(**options))
    return trace(spec), attention(q, k, v, bias=bias, mask=mask, **options)


def assert_matches(got: Trace, want: Stages) -> None:
    """Every stage sdpa computed equals the reference's, to float64 rounding."""
    np.testing.assert_array_equal(got.visible, want.visible)
    for name in STAGES:
        actual = got.stage(name)
        if actual is None or name == "dropped":
            continue
        np.testing.assert_allclose(actual, getattr(want, name), rtol=RTOL, atol=ATOL, err_msg=name)


# --- every option against the loop reference ---

OPTION_CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "scale-dk": {"scale": "dk"},
    "scale-none": {"scale": "none"},
    "scale-number": {"scale": 0.3},
    "temperature": {"temperature": 0.7},
    "softcap": {"scale": "none", "softcap": 1.5},
    "alibi": {"alibi": True},
    "causal-upper-left": {"causal": True},
    "causal-lower-right": {"causal": True, "causal_align": "lower-right"},
    "window": {"window": (1, 2)},
    "window-lower-right": {"window": (2, 0), "causal_align": "lower-right"},
    "key-lengths-one": {"key_lengths": (2,)},
    "key-lengths-per-item": {"key_lengths": (1, 3)},
    "mask-value-finite": {"causal": True, "causal_align": "lower-right", "mask_value": -1e9},
    "mask-value-finfo-min": {"window": (0, 0), "mask_value": FINFO_MIN},
}


@pytest.mark.parametrize(("L", "S"), [(4, 4), (3, 5), (5, 3)])
@pytest.mark.parametrize("options", OPTION_CASES.values(), ids=OPTION_CASES.keys())
def test_option_matches_loop_reference(options: dict[str, Any], L: int, S: int) -> None:
    q, k, v = normal(1, 2, 3, L, 3), normal(2, 2, 3, S, 3), normal(3, 2, 3, S, 2)
    got, want = run(q, k, v, **options)
    assert_matches(got, want)
    assert (got.capped is None) == ("softcap" not in options)
    assert (got.biased is None) == ("alibi" not in options)


MASK_SHAPES = {
    "full": (2, 3, 4, 5),
    "L-S": (4, 5),
    "keys-only": (5,),
    "per-batch": (2, 1, 4, 5),
    "per-head-row": (3, 4, 1),
    "head-keys": (1, 3, 1, 5),
    "extra-leading-1": (1, 1, 2, 3, 4, 5),
}


@pytest.mark.parametrize("shape", MASK_SHAPES.values(), ids=MASK_SHAPES.keys())
@pytest.mark.parametrize("kind", ["bool", "bool-true-masked", "float", "bias"])
def test_masks_and_bias_broadcast_like_the_reference(kind: str, shape: tuple[int, ...]) -> None:
    q, k, v = normal(4, 2, 3, 4, 3), normal(5, 2, 3, 5, 3), normal(6, 2, 3, 5, 2)
    rng = np.random.default_rng(7)
    extra: dict[str, Any] = {}
    if kind.startswith("bool"):
        extra["mask"] = rng.random(shape) > 0.4
        if kind == "bool-true-masked":
            extra["mask_true_means"] = "masked"
    elif kind == "float":
        extra["mask"] = rng.normal(size=shape) * 3
    else:
        extra["bias"] = rng.normal(size=shape)
    got, want = run(q, k, v, **extra)
    assert_matches(got, want)


def test_bool_mask_true_means_masked_is_the_complement() -> None:
    q, k, v = normal(8, 3, 2), normal(9, 4, 2), normal(10, 4, 2)
    mask = np.array([[True, False, True, True], [False, False, True, False], [True] * 4])
    attend, _ = run(q, k, v, mask=mask)
    hidden, _ = run(q, k, v, mask=~mask, mask_true_means="masked")
    np.testing.assert_array_equal(attend.visible, mask)
    np.testing.assert_array_equal(hidden.visible, mask)
    np.testing.assert_array_equal(attend.weights, hidden.weights)


COMBINED: dict[str, dict[str, Any]] = {
    "everything-additive": {
        "scale": 0.4,
        "temperature": 1.3,
        "softcap": 2.5,
        "alibi": True,
        "causal": True,
        "causal_align": "lower-right",
        "window": (2, 1),
        "key_lengths": (4, 6),
    },
    "finite-mask-value": {
        "scale": "dk",
        "alibi": True,
        "window": (1, 1),
        "key_lengths": (5,),
        "mask_value": -1e9,
    },
}


@pytest.mark.parametrize("options", COMBINED.values(), ids=COMBINED.keys())
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_options_combined_match_loop_reference(options: dict[str, Any], mask_kind: str) -> None:
    q, k, v = normal(11, 2, 4, 5, 3), normal(12, 2, 4, 6, 3), normal(13, 2, 4, 6, 2)
    rng = np.random.default_rng(14)
    mask = rng.random((4, 1, 6)) > 0.3 if mask_kind == "bool" else rng.normal(size=(4, 1, 6))
    bias = rng.normal(size=(2, 1, 5, 6))
    got, want = run(q, k, v, bias=bias, mask=mask, **options)
    assert_matches(got, want)
    assert got.capped is not None or "softcap" not in options
    assert got.biased is not None


# --- grouped-query attention and broadcasting ---


@pytest.mark.parametrize("G", [1, 2, 3, 6])
def test_grouped_query_attention_matches_reference(G: int) -> None:
    q, k, v = normal(15, 2, 6, 3, 4), normal(16, 2, G, 5, 4), normal(17, 2, G, 5, 3)
    got, want = run(q, k, v, causal=True, alibi=True)
    assert got.spec.lead == (2, 6)
    assert_matches(got, want)


def test_grouped_query_head_h_reads_kv_head_h_div_group() -> None:
    """By hand: with H = 6 query heads and G = 2 kv heads, head h reads kv head h // 3."""
    q, k, v = normal(18, 2, 6, 3, 4), normal(19, 2, 2, 5, 4), normal(20, 2, 2, 5, 3)
    whole = trace(build_spec(q, k, v))
    assert whole.output is not None
    for h in range(6):
        g = h // 3
        one = trace(build_spec(q[:, h], k[:, g], v[:, g]))
        assert one.output is not None
        np.testing.assert_allclose(whole.output[:, h], one.output, rtol=RTOL, atol=ATOL)


BROADCASTS = {
    "q-2d-kv-4d": ((3, 4), (2, 3, 5, 4), (2, 3, 5, 2)),
    "q-4d-kv-2d": ((2, 3, 3, 4), (5, 4), (5, 2)),
    "q-one-head-kv-heads": ((2, 1, 3, 4), (2, 4, 5, 4), (2, 4, 5, 2)),
    "extra-leading-axis": ((4, 1, 1, 3, 4), (2, 3, 5, 4), (1, 3, 5, 2)),
    "v-broadcast-heads": ((2, 3, 3, 4), (2, 3, 5, 4), (2, 1, 5, 2)),
    "batch-broadcast": ((1, 3, 3, 4), (2, 1, 5, 4), (2, 1, 5, 2)),
}


@pytest.mark.parametrize("shapes", BROADCASTS.values(), ids=BROADCASTS.keys())
def test_leading_axes_broadcast_like_pytorch(
    shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
) -> None:
    q, k, v = (normal(21 + n, *shape) for n, shape in enumerate(shapes))
    got, want = run(q, k, v, alibi=True)
    lead = np.broadcast_shapes(shapes[0][:-2], shapes[1][:-2], shapes[2][:-2])
    assert got.spec.lead == lead
    assert_matches(got, want)


def test_regression_query_with_one_head_broadcasts_over_kv_heads() -> None:
    """Q (B, 1, L, E) against K/V (B, 4, S, E) broadcasts to 4 heads, as in PyTorch.

    It used to be refused as grouped-query attention with "4 heads not dividing 1".
    """
    q, k, v = normal(30, 2, 1, 3, 4), normal(31, 2, 4, 5, 4), normal(32, 2, 4, 5, 2)
    got = trace(build_spec(q, k, v))
    assert got.output is not None
    for h in range(4):
        one = trace(build_spec(q[:, 0], k[:, h], v[:, h]))
        assert one.output is not None
        np.testing.assert_allclose(got.output[:, h], one.output, rtol=RTOL, atol=ATOL)


def test_one_dimensional_query_is_one_row() -> None:
    q, k, v = normal(33, 3), normal(34, 4, 3), normal(35, 4, 2)
    got, want = run(q, k, v)
    assert got.spec.weights_shape == (1, 4)
    assert_matches(got, want)
    assert got.output is not None
    np.testing.assert_allclose(got.output, want.output, rtol=RTOL)


# --- rows with nothing to attend to, empty axes ---


def test_row_with_no_visible_key_gets_zero_weights_and_zero_output() -> None:
    q, k, v = normal(36, 2, 3, 4), normal(37, 2, 5, 4), normal(38, 2, 5, 3) + 10
    mask = np.ones((3, 5), dtype=bool)
    mask[1] = False
    got, _ = run(q, k, v, mask=mask)
    assert got.weights is not None
    assert got.output is not None
    assert np.all(got.weights[:, 1] == 0.0)
    assert np.all(got.output[:, 1] == 0.0)
    np.testing.assert_allclose(got.weights[:, [0, 2]].sum(-1), 1.0, rtol=1e-15)


@pytest.mark.parametrize(
    "options",
    [
        {"key_lengths": (0,)},
        {"causal": True, "causal_align": "lower-right"},  # L = 5 > S = 3: rows 0, 1 see nothing
        {"window": (0, 0), "causal_align": "lower-right"},
    ],
)
def test_options_that_hide_whole_rows_give_zeros(options: dict[str, Any]) -> None:
    q, k, v = normal(39, 5, 2), normal(40, 3, 2), normal(41, 3, 2) + 5
    got, want = run(q, k, v, **options)
    assert_matches(got, want)
    assert got.weights is not None
    assert got.output is not None
    assert got.visible is not None
    empty = ~got.visible.any(-1)
    assert empty.any()
    assert np.all(got.weights[empty] == 0.0)
    assert np.all(got.output[empty] == 0.0)


def test_float_mask_of_minus_inf_over_a_whole_row_gives_zeros() -> None:
    q, k, v = normal(42, 3, 2), normal(43, 4, 2), normal(44, 4, 2)
    mask = np.zeros((3, 4))
    mask[2] = -math.inf
    got, want = run(q, k, v, mask=mask)
    assert_matches(got, want)
    assert got.output is not None
    assert np.all(got.output[2] == 0.0)


@pytest.mark.parametrize("mask_value", [-1e9, FINFO_MIN])
def test_finite_mask_value_makes_a_hidden_row_uniform(mask_value: float) -> None:
    q, k, v = normal(45, 3, 2), normal(46, 5, 2), normal(47, 5, 3)
    mask = np.ones((3, 5), dtype=bool)
    mask[0] = False
    mask[2, 1:] = False
    got, want = run(q, k, v, mask=mask, mask_value=mask_value)
    assert_matches(got, want)
    assert got.weights is not None
    assert got.output is not None
    np.testing.assert_allclose(got.weights[0], np.full(5, 1 / 5), rtol=1e-15)
    np.testing.assert_allclose(got.output[0], v.mean(axis=0), rtol=1e-13)
    # A row with a visible key puts nothing on the hidden ones: exp(−1e9 − max) is 0.
    np.testing.assert_array_equal(got.weights[2], [1.0, 0.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(got.output[2], v[0])


def test_no_keys_gives_empty_weights_and_zero_output() -> None:
    q, k, v = normal(48, 2, 3, 4), np.zeros((2, 0, 4)), np.zeros((2, 0, 5))
    got = trace(build_spec(q, k, v, options=Options(causal=True)))
    assert got.weights is not None
    assert got.output is not None
    assert got.weights.shape == (2, 3, 0)
    np.testing.assert_array_equal(got.output, np.zeros((2, 3, 5)))


def test_no_queries_gives_empty_stages() -> None:
    q, k, v = np.zeros((2, 0, 4)), normal(49, 2, 3, 4), normal(50, 2, 3, 5)
    got = trace(build_spec(q, k, v, options=Options(causal=True, dropout=0.5)))
    assert got.weights is not None
    assert got.output is not None
    assert got.dropped is not None
    assert got.weights.shape == (2, 0, 3)
    assert got.dropped.shape == (2, 0, 3)
    assert got.output.shape == (2, 0, 5)


def test_zero_key_dim_gives_uniform_weights() -> None:
    q, k, v = np.zeros((3, 0)), np.zeros((4, 0)), normal(51, 4, 2)
    got, want = run(q, k, v)
    assert_matches(got, want)
    assert got.weights is not None
    np.testing.assert_allclose(got.weights, np.full((3, 4), 0.25), rtol=1e-15)


def test_softmax_of_empty_and_all_minus_inf_rows() -> None:
    np.testing.assert_array_equal(softmax(np.zeros((2, 0))), np.zeros((2, 0)))
    np.testing.assert_array_equal(softmax(np.full((1, 3), -math.inf)), np.zeros((1, 3)))


def test_softmax_subtracts_the_row_max_so_large_logits_do_not_overflow() -> None:
    """exp(1000) overflows float64; softmax([1000, 999]) must still be finite and exact."""
    got = softmax(np.array([[1000.0, 999.0, -math.inf]]))
    e = math.exp(-1.0)
    np.testing.assert_allclose(got, [[1 / (1 + e), e / (1 + e), 0.0]], rtol=1e-15)


# --- blocking ---


def test_any_blocking_gives_the_same_numbers_including_dropout() -> None:
    """Rows per block 1, 3 and the default agree; masks and dropout are position-exact.

    The values agree to a few ulps rather than bitwise: BLAS picks a different kernel
    (gemv for one row, gemm for several), which sums the E products in another order.
    """
    q, k, v = normal(52, 2, 3, 7, 4), normal(53, 2, 1, 9, 4), normal(54, 2, 1, 9, 2)
    bias = normal(55, 3, 7, 9)
    options = Options(
        causal=True,
        causal_align="lower-right",
        window=(4, 1),
        alibi=True,
        softcap=3.0,
        key_lengths=(8, 9),
        dropout=0.25,
        seed=7,
    )
    spec = build_spec(q, k, v, bias=bias, options=options)
    traces = [trace(spec, rows=rows) for rows in (1, None, 3)]
    first = traces[0]
    assert first.dropped is not None
    assert first.weights is not None
    for other in traces[1:]:
        assert other.dropped is not None
        np.testing.assert_array_equal(other.visible, first.visible)
        np.testing.assert_array_equal(other.dropped == 0, first.dropped == 0)
        for name in STAGES:
            a, b = first.stage(name), other.stage(name)
            assert a is not None
            assert b is not None
            np.testing.assert_allclose(b, a, rtol=1e-14, atol=1e-15, err_msg=name)


def test_attend_block_equals_the_rows_of_the_whole_trace() -> None:
    q, k, v = normal(56, 2, 6, 3), normal(57, 2, 5, 3), normal(58, 2, 5, 2)
    spec = build_spec(q, k, v, options=Options(causal=True, dropout=0.5, seed=3))
    whole = trace(spec)
    assert whole.dropped is not None
    assert whole.output is not None
    block = attend_block(spec, (1,), slice(2, 5))
    assert block.dropped is not None
    assert whole.visible is not None
    np.testing.assert_array_equal(block.visible, whole.visible[1, 2:5])
    np.testing.assert_array_equal(block.dropped == 0, whole.dropped[1, 2:5] == 0)
    np.testing.assert_allclose(block.output, whole.output[1, 2:5], rtol=1e-14, atol=1e-15)


# --- dropout ---


def dropout_trace(seed: int, p: float = 0.3, shape_seed: int = 60) -> Trace:
    q, k, v = normal(shape_seed, 2, 8, 3), normal(shape_seed + 1, 2, 10, 3), normal(61, 2, 10, 4)
    return trace(build_spec(q, k, v, options=Options(dropout=p, seed=seed)))


def test_dropout_is_reproducible_with_the_same_seed() -> None:
    a, b = dropout_trace(seed=5), dropout_trace(seed=5)
    assert a.dropped is not None
    assert b.dropped is not None
    np.testing.assert_array_equal(a.dropped, b.dropped)


def test_dropout_differs_with_another_seed() -> None:
    a, b = dropout_trace(seed=5), dropout_trace(seed=6)
    assert a.dropped is not None
    assert b.dropped is not None
    assert not np.array_equal(a.dropped == 0, b.dropped == 0)


def test_dropout_keep_pattern_depends_on_position_not_values() -> None:
    a, b = dropout_trace(seed=5, shape_seed=60), dropout_trace(seed=5, shape_seed=70)
    assert a.dropped is not None
    assert b.dropped is not None
    assert a.weights is not None
    assert np.all(a.weights > 0)  # so a zero in `dropped` means dropped
    np.testing.assert_array_equal(a.dropped == 0, b.dropped == 0)


def test_dropout_keeps_inverted_weights_and_mixes_them() -> None:
    p = 0.3
    got = dropout_trace(seed=9, p=p)
    assert got.dropped is not None
    assert got.weights is not None
    assert got.output is not None
    kept = got.dropped != 0
    assert np.all(got.weights > 0)
    np.testing.assert_allclose(got.dropped[kept], got.weights[kept] / (1 - p), rtol=1e-15)
    v = normal(61, 2, 10, 4)
    np.testing.assert_allclose(got.output, mix(got.dropped, v), rtol=RTOL, atol=ATOL)
    # Dropout acts after the softmax: the weights are those of the run without it.
    plain = dropout_trace(seed=9, p=0.0)
    assert plain.dropped is None
    assert plain.weights is not None
    np.testing.assert_array_equal(got.weights, plain.weights)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_a_fraction_close_to_one_minus_p(p: float) -> None:
    q, k, v = np.zeros((4, 50, 2)), np.zeros((4, 500, 2)), np.ones((4, 500, 1))
    got = trace(build_spec(q, k, v, options=Options(dropout=p, seed=123)))
    assert got.dropped is not None
    n = got.dropped.size
    kept = np.count_nonzero(got.dropped) / n
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 5 * sigma
    # Inverted dropout: each kept weight is (1/S) / (1 − p), so outputs average to 1.
    assert got.output is not None
    assert abs(got.output.mean() - 1.0) < 5 * sigma / (1 - p)


# --- heads: split (..., L, d_model) and merge back ---


def split(a: F64, n: int) -> F64:
    """By hand: (B, L, D) → (B, n, L, D/n)."""
    B, L, D = a.shape
    return a.reshape(B, L, n, D // n).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("alibi", [False, True])
def test_heads_split_and_merge_like_doing_it_by_hand(alibi: bool) -> None:
    n = 3
    q, k, v = normal(62, 2, 4, 6), normal(63, 2, 5, 6), normal(64, 2, 5, 9)
    got = trace(build_spec(q, k, v, options=Options(heads=n, alibi=alibi, causal=True)))
    want = attention(split(q, n), split(k, n), split(v, n), alibi=alibi, causal=True)
    assert got.spec.lead == (2, n)
    assert got.spec.E == 2
    assert got.spec.Ev == 3
    assert_matches(got, want)
    merged = want.output.transpose(0, 2, 1, 3).reshape(2, 4, 9)
    assert got.merged_output is not None
    np.testing.assert_allclose(got.merged_output, merged, rtol=RTOL, atol=ATOL)


def test_heads_on_two_dimensional_inputs() -> None:
    q, k, v = normal(65, 3, 8), normal(66, 4, 8), normal(67, 4, 4)
    got = trace(build_spec(q, k, v, options=Options(heads=2)))
    assert got.merged_output is not None
    assert got.merged_output.shape == (3, 4)
    for h in range(2):
        one = attention(q[:, 4 * h : 4 * h + 4], k[:, 4 * h : 4 * h + 4], v[:, 2 * h : 2 * h + 2])
        np.testing.assert_allclose(
            got.merged_output[:, 2 * h : 2 * h + 2], one.output, rtol=RTOL, atol=ATOL
        )


# --- the seeds' worked examples, derived again here ---


def exact_softmax(scores: list[float]) -> list[float]:
    top = max(scores)
    e = [math.exp(s - top) for s in scores]
    return [x / sum(e) for x in e]


def weights_and_output(q: Any, k: Any, v: Any, **options: Any) -> tuple[F64, F64]:
    arrays = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    got = trace(build_spec(*arrays, options=Options(**options)))
    assert got.weights is not None
    assert got.output is not None
    return got.weights, got.output


def test_seed_001_softmax_of_four_scores() -> None:
    scores = [1.0, 0.5, 2.5, -0.1]
    weights, output = weights_and_output([1.0], [[s] for s in scores], np.eye(4), scale="none")
    total = sum(math.exp(s) for s in scores)
    expected = [math.exp(s) / total for s in scores]
    np.testing.assert_allclose(weights[0], expected, rtol=1e-14)
    np.testing.assert_allclose(output[0], expected, rtol=1e-14)  # V = I: output = weights
    # The seed's numbers, right to their printed rounding.
    assert [round(math.exp(s), 3) for s in scores] == [2.718, 1.649, 12.182, 0.905]
    assert round(total, 3) == 17.454
    assert round(math.exp(2.5) / weights[0, 2], 3) == 17.454  # Σexp recovered from sdpa
    np.testing.assert_array_equal(np.round(weights[0], 3), [0.156, 0.094, 0.698, 0.052])
    assert round(float(weights.sum()), 3) == 1.000


QKV_002 = [[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]


def test_seed_002_causal_rows_0_and_1() -> None:
    weights, output = weights_and_output(QKV_002, QKV_002, QKV_002, causal=True)
    root2 = math.sqrt(2)
    a1 = exact_softmax([2 / root2, 4 / root2])
    np.testing.assert_allclose(weights[0], [1.0, 0.0, 0.0], rtol=1e-15)
    np.testing.assert_allclose(weights[1], [*a1, 0.0], rtol=1e-14)
    np.testing.assert_allclose(output[1], [a1[0] + 2 * a1[1], 0.0], rtol=1e-14)
    np.testing.assert_array_equal(np.round(weights[1], 3), [0.196, 0.804, 0.0])
    np.testing.assert_array_equal(np.round(output[1], 3), [1.804, 0.0])
    # The seed's intermediate numbers: e^1.414 ≈ 4.11, e^2.828 ≈ 16.92, sum ≈ 21.03.
    e1, e2 = math.exp(2 / root2), math.exp(4 / root2)
    assert (round(e1, 2), round(e2, 2), round(e1 + e2, 2)) == (4.11, 16.92, 21.03)


def test_regression_seed_002_causal_row_2_is_not_the_printed_0_063_0_262_0_675() -> None:
    """The seed prints A[2] = [0.063, 0.262, 0.675] and O[2] = [2.612, 0]: a slip.

    Row 2 sees scores 3·[1, 2, 3]/√2 = [2.121, 4.243, 6.364]; the gaps of 2.121 make
    the softmax [0.012669, 0.105686, 0.881645] and O[2] = Σ_j A[2, j]·(j + 1) = 2.868977.
    """
    weights, output = weights_and_output(QKV_002, QKV_002, QKV_002, causal=True)
    a2 = exact_softmax([3 * x / math.sqrt(2) for x in (1, 2, 3)])
    o2 = a2[0] * 1 + a2[1] * 2 + a2[2] * 3
    np.testing.assert_allclose(weights[2], a2, rtol=1e-14)
    np.testing.assert_allclose(output[2], [o2, 0.0], rtol=1e-14)
    np.testing.assert_array_equal(np.round(weights[2], 6), [0.012669, 0.105686, 0.881645])
    assert round(float(output[2, 0]), 6) == 2.868977
    assert np.abs(weights[2] - [0.063, 0.262, 0.675]).max() > 0.1
    assert abs(float(output[2, 0]) - 2.612) > 0.2


def seed_002_example_3(scale: str) -> tuple[F64, list[float]]:
    """Raw scores [0, 64, 128] with d_k = 64: q = e_1 and k_j = s_j·e_1 in 64 dims."""
    raw = [0.0, 64.0, 128.0]
    q = np.zeros(64)
    q[0] = 1.0
    k = np.zeros((3, 64))
    k[:, 0] = raw
    weights, _ = weights_and_output(q, k, np.eye(3), scale=scale)
    factor = {"none": 1.0, "sqrt-dk": 1 / math.sqrt(64), "dk": 1 / 64}[scale]
    return weights[0], exact_softmax([s * factor for s in raw])


def test_seed_002_no_scaling_saturates() -> None:
    weights, expected = seed_002_example_3("none")
    np.testing.assert_allclose(weights, expected, rtol=1e-13)
    np.testing.assert_allclose(weights, [0.0, 0.0, 1.0], atol=1e-27)  # e^-64 ≈ 1.6e-28


def test_seed_002_sqrt_dk_scaling_is_still_peaked() -> None:
    weights, expected = seed_002_example_3("sqrt-dk")
    np.testing.assert_allclose(weights, expected, rtol=1e-13)
    assert f"{weights[0]:.2e}" == "1.12e-07"
    assert (round(float(weights[1]), 6), round(float(weights[2]), 5)) == (0.000335, 0.99966)
    assert (round(float(weights[1]), 4), round(float(weights[2]), 4)) == (0.0003, 0.9997)
    # The seed's denominator: 1 + 2981 + 8.89e6.
    assert (round(math.exp(8)), f"{math.exp(16):.2e}") == (2981, "8.89e+06")


def test_seed_002_dk_scaling_spreads_out() -> None:
    weights, expected = seed_002_example_3("dk")
    np.testing.assert_allclose(weights, expected, rtol=1e-13)
    np.testing.assert_array_equal(np.round(weights, 4), [0.0900, 0.2447, 0.6652])
    np.testing.assert_array_equal(np.round(weights, 3), [0.090, 0.245, 0.665])
    assert (round(math.e, 3), round(math.exp(2), 3)) == (2.718, 7.389)


def test_seed_003_scorecard_end_to_end() -> None:
    """q = [2, 1], K = [[2, 1], [1, 0], [0, −1]], V = [[10, 0], [0, 8], [1, 1]].

    The seed prints the output as [8.81, 0.89] because it mixes the values with the
    weights already rounded to [0.88, 0.11, 0.01]; mixed at full precision it is
    [8.8291, 0.8582].
    """
    q = [2.0, 1.0]
    k = [[2.0, 1.0], [1.0, 0.0], [0.0, -1.0]]
    v = [[10.0, 0.0], [0.0, 8.0], [1.0, 1.0]]
    got = trace(build_spec(np.array(q), np.array(k), np.array(v)))
    assert got.raw is not None
    assert got.scaled is not None
    assert got.weights is not None
    assert got.output is not None
    raw = [sum(a * b for a, b in zip(q, kj, strict=True)) for kj in k]
    assert raw == [5.0, 2.0, -1.0]
    scaled = [s / math.sqrt(2) for s in raw]
    w = exact_softmax(scaled)
    out = [sum(w[j] * v[j][c] for j in range(3)) for c in range(2)]
    np.testing.assert_array_equal(got.raw[0], raw)
    np.testing.assert_allclose(got.scaled[0], scaled, rtol=1e-15)
    np.testing.assert_allclose(got.weights[0], w, rtol=1e-14)
    np.testing.assert_allclose(got.output[0], out, rtol=1e-14)
    np.testing.assert_array_equal(np.round(got.scaled[0], 4), [3.5355, 1.4142, -0.7071])
    np.testing.assert_array_equal(np.round(got.scaled[0], 2), [3.54, 1.41, -0.71])
    np.testing.assert_array_equal(np.round(got.weights[0], 4), [0.8816, 0.1057, 0.0127])
    np.testing.assert_array_equal(np.round(got.weights[0], 2), [0.88, 0.11, 0.01])
    np.testing.assert_array_equal(np.round(got.output[0], 4), [8.8291, 0.8582])
    # The seed's [8.81, 0.89]: the rounded weights mixed.
    rounded = [0.88, 0.11, 0.01]
    seed_out = [sum(rounded[j] * v[j][c] for j in range(3)) for c in range(2)]
    np.testing.assert_allclose(seed_out, [8.81, 0.89], rtol=1e-12)
    assert np.abs(got.output[0] - [8.81, 0.89]).max() > 0.02


def test_trace_keeps_only_the_stages_asked_for() -> None:
    x = np.arange(12.0).reshape(3, 4)
    t = trace(build_spec(x, x, x), stages=("weights",))
    assert t.weights is not None
    for stage in ("raw", "scaled", "masked", "output"):
        assert t.stage(stage) is None
    np.testing.assert_allclose(t.weights.sum(-1), 1.0)


def test_a_trace_that_cannot_fit_in_memory_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sdpa_cli.engine.trace as compute
    from sdpa_cli.files import limits

    x = np.ones((1, 2, 64, 8))
    spec = build_spec(x, x, x)
    # Two stages of (1, 2, 64, 64) float64, the boolean mask, and the statistics of the
    # 2 · 64 rows: 2·65536 + 8192 + 128·ROW_STATS_BYTES bytes.
    need = 2 * 8 * 2 * 64 * 64 + 2 * 64 * 64 + 2 * 64 * compute.ROW_STATS_BYTES
    monkeypatch.setattr(limits, "available_memory", lambda: need - 1)
    with pytest.raises(SpecError) as info:
        trace(spec, stages=("weights", "raw"))
    assert info.value.where == "scores (1, 2, 64, 64)"
    assert "needs 0.0 GiB" in info.value.problem
    assert "fewer --stages" in info.value.problem
    monkeypatch.setattr(limits, "available_memory", lambda: need)
    assert trace(spec, stages=("weights", "raw")).weights is not None
