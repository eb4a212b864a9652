"""Format limits, rounding and the emulated arithmetic of ``sdpa_cli.engine.precision``.

Every expectation comes from a direct cast (numpy for float16/float32, ml_dtypes for
bfloat16 and float8), from the formats' published limits, or from a loop written here
one scalar at a time, never from ``precision`` itself.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from sdpa_cli.engine import precision

F64 = NDArray[np.float64]

DTYPES: dict[str, Any] = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
NARROW = [name for name in DTYPES if name != "float64"]

# The published limits: (largest finite, smallest subnormal, smallest normal, eps).
LIMITS = {
    "float64": (float(np.finfo(np.float64).max), 2.0**-1074, 2.0**-1022, 2.0**-52),
    "float32": ((2 - 2.0**-23) * 2.0**127, 2.0**-149, 2.0**-126, 2.0**-23),
    "float16": (65504.0, 2.0**-24, 2.0**-14, 2.0**-10),
    "bfloat16": ((2 - 2.0**-7) * 2.0**127, 2.0**-133, 2.0**-126, 2.0**-7),
    "float8_e4m3fn": (448.0, 2.0**-9, 2.0**-6, 2.0**-3),
    "float8_e5m2": (57344.0, 2.0**-16, 2.0**-14, 2.0**-2),
}

# Halfway between the largest finite value and the next step up: where rounding to
# nearest, ties to even, decides overflow. The largest finite values of float32,
# float16, bfloat16 and e5m2 have an odd last mantissa bit, so the tie rounds up to
# inf; e4m3fn's 448 = 1.110₂·2⁸ is even (1.111₂·2⁸ is its NaN), so 464 rounds to 448.
TIES = {
    "float32": ((2 - 2.0**-24) * 2.0**127, math.inf),
    "float16": (65520.0, math.inf),
    "bfloat16": ((2 - 2.0**-8) * 2.0**127, math.inf),
    "float8_e4m3fn": (464.0, 448.0),
    "float8_e5m2": (61440.0, math.inf),
}


def cast(x: F64, name: str) -> F64:
    """``x`` cast to the format and back to float64: the ground truth for rounding."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x).astype(DTYPES[name]).astype(np.float64)


def around(center: float, rng: np.random.Generator, n: int = 400) -> F64:
    """``center`` itself, its neighbours at relative offsets 2⁻¹ … 2⁻⁶⁰, and random
    values within a relative 2⁻ᵏ of it (k up to 30), with both signs."""
    exact = [center * (1 + s * 2.0**-k) for k in range(1, 61) for s in (-1, 1)]
    with np.errstate(over="ignore"):
        spread = center * (1 + rng.uniform(-1, 1, n) * 2.0 ** -rng.integers(0, 31, n))
    values = np.concatenate([[center], exact, spread])
    return np.concatenate([values, -values])


def probe_values(name: str, seed: int = 0) -> F64:
    """Values around every threshold of the format, log-uniform values over its whole
    range, zeros, infinities and NaN."""
    rng = np.random.default_rng(seed)
    top, tiny, normal, _ = LIMITS[name]
    centers = [top, tiny, tiny / 2, 1.5 * tiny, normal, 1.0]
    if name in TIES:
        centers.append(TIES[name][0])
    parts = [around(c, rng) for c in centers]
    lo, hi = math.log2(tiny) - 4, math.log2(top) + 1
    wide = 2.0 ** rng.uniform(lo, min(hi, 1023), 2000) * rng.choice([-1.0, 1.0], 2000)
    specials = np.array([0.0, -0.0, math.inf, -math.inf, math.nan])
    return np.concatenate([*parts, wide, specials])


# --- limits ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", DTYPES)
def test_limits_are_the_published_ones(name: str) -> None:
    f = precision.fmt(name)
    top, tiny, normal, eps = LIMITS[name]
    assert (f.max, f.tiny, f.normal, f.eps) == (top, tiny, normal, eps)
    assert f.unit_roundoff == eps / 2


@pytest.mark.parametrize("name", DTYPES)
def test_limits_equal_finfo(name: str) -> None:
    fi: Any = (
        np.finfo(DTYPES[name])
        if name in ("float64", "float32", "float16")
        else ml_dtypes.finfo(DTYPES[name])  # type: ignore[no-untyped-call]
    )
    f = precision.fmt(name)
    assert f.max == float(fi.max)
    assert f.tiny == float(fi.smallest_subnormal)
    assert f.normal == float(fi.smallest_normal)
    assert f.eps == float(fi.eps)


@pytest.mark.parametrize("name", DTYPES)
def test_limits_are_values_of_the_format_at_its_edges(name: str) -> None:
    """max and tiny survive a cast; one step beyond each does not."""
    f = precision.fmt(name)
    edges = np.array([f.max, f.tiny, f.normal, 1 + f.eps])
    np.testing.assert_array_equal(cast(edges, name), edges)
    assert cast(np.array([f.tiny / 2]), name)[0] == 0.0  # the tie rounds to even: zero
    if name != "float64":
        assert cast(np.array([f.tiny * 0.75]), name)[0] == f.tiny
        assert cast(np.array([1 + f.eps / 2]), name)[0] == 1.0  # tie to even


@pytest.mark.parametrize("name", list(TIES))
def test_overflow_threshold_is_the_tie_past_max(name: str) -> None:
    tie, rounds_to = TIES[name]
    f = precision.fmt(name)
    assert f.overflow_at == tie
    assert cast(np.array([tie]), name)[0] == rounds_to
    assert cast(np.array([(f.max + tie) / 2]), name)[0] == f.max
    # Past the tie: inf, or NaN for e4m3fn, which has no infinity.
    assert not np.isfinite(cast(np.array([tie * (1 + 2.0**-20)]), name)[0])


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn"])
def test_overflow_follows_the_cast_through_float32(name: str) -> None:
    """ml_dtypes rounds float64 to these formats through float32: within a float32 step
    of the tie, a value first rounds to the tie, then as the tie does (bfloat16: one
    float64 step below the tie becomes inf; e4m3fn: one step above becomes 448, not
    NaN). ``overflows`` says what the cast does, not what a threshold would say."""
    tie, rounds_to = TIES[name]
    near = math.nextafter(tie, 0 if rounds_to == math.inf else math.inf)
    assert cast(np.array([near]), name)[0] == rounds_to
    assert bool(precision.fmt(name).overflows(np.array([near]))[0]) is (rounds_to == math.inf)


def test_float64_never_overflows_by_rounding() -> None:
    f = precision.fmt("float64")
    assert f.overflow_at == math.inf
    x = np.array([f.max, -f.max, 1e308, f.tiny, -f.tiny])
    assert not precision.fmt("float64").overflows(x).any()
    assert not precision.fmt("float64").flushes(x).any()


# --- overflow and flush to zero, value for value -------------------------------------------


@pytest.mark.parametrize("name", DTYPES)
def test_overflows_agrees_with_a_cast_element_for_element(name: str) -> None:
    x = probe_values(name)
    want = np.isfinite(x) & ~np.isfinite(cast(x, name))
    got = precision.fmt(name).overflows(x)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, want)
    if name != "float64":
        assert want.any()
        assert (~want).any()


@pytest.mark.parametrize("name", DTYPES)
def test_flushes_agrees_with_a_cast_element_for_element(name: str) -> None:
    x = probe_values(name, seed=1)
    with np.errstate(invalid="ignore"):
        want = (x != 0) & ~np.isnan(x) & (cast(x, name) == 0)
    got = precision.fmt(name).flushes(x)
    np.testing.assert_array_equal(got, want)
    if name != "float64":
        assert want.any()
        assert (~want).any()


@pytest.mark.parametrize(
    ("name", "value", "overflows"),
    [
        ("float16", 65504.0, False),
        ("float16", 65519.99, False),
        ("float16", 65520.0, True),  # the tie rounds to even: inf
        ("float16", -65520.0, True),
        ("float8_e4m3fn", 464.0, False),  # ties to 448: e4m3fn's largest is even
        ("float8_e4m3fn", 464.01, True),  # NaN: no infinity in e4m3fn
        ("float8_e5m2", 61440.0, True),
        ("float8_e5m2", 61439.0, False),
        ("bfloat16", 3.0e38, False),
        ("bfloat16", 3.4e38, True),
        ("float32", 3.4e38, False),
        ("float32", 3.5e38, True),
        # twice the largest and beyond: decided without a cast, for every format
        ("float16", 131008.0, True),
        ("float16", -3.0e38, True),
        ("float8_e4m3fn", 896.0, True),
        ("bfloat16", -1.0e300, True),
        ("float32", 1.0e300, True),
    ],
)
def test_overflow_at_known_points(name: str, value: float, overflows: bool) -> None:
    assert bool(precision.fmt(name).overflows(np.array([value]))[0]) is overflows


@pytest.mark.parametrize("name", DTYPES)
def test_non_finite_values_neither_overflow_nor_flush(name: str) -> None:
    x = np.array([math.inf, -math.inf, math.nan, 0.0, -0.0])
    f = precision.fmt(name)
    assert not f.overflows(x).any()
    assert not f.flushes(x).any()


# --- rounding -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", DTYPES)
def test_round_to_equals_a_cast_there_and_back(name: str) -> None:
    x = probe_values(name, seed=2)
    got = precision.round_to(x, name)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, cast(x, name))


@pytest.mark.parametrize("name", NARROW)
def test_round_to_keeps_values_of_the_format_and_rounds_the_rest(name: str) -> None:
    """Casting twice changes nothing; a value between two neighbours moves to one of them."""
    x = np.random.default_rng(3).normal(size=1000)
    once = precision.round_to(x, name)
    np.testing.assert_array_equal(precision.round_to(once, name), once)
    eps = LIMITS[name][3]
    normal = np.abs(x) > 4 * LIMITS[name][2]
    rel = np.abs(once - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= eps / 2  # one rounding to nearest: at most half a step
    assert rel.max() > eps / 8  # and it did round


def test_round_to_float64_is_the_identity() -> None:
    x = np.array([0.1, 1e-320, 1.7e308, -math.inf, math.nan])
    np.testing.assert_array_equal(precision.round_to(x, "float64"), x)


# --- headroom and the exp limit ---------------------------------------------------------------


def test_headroom_counts_powers_of_two_below_max() -> None:
    f16 = precision.fmt("float16")
    assert f16.headroom(65504.0) == 0.0
    assert f16.headroom(65504.0 / 8) == pytest.approx(3.0, abs=1e-12)
    assert f16.headroom(2048.0) == pytest.approx(math.log2(65504 / 2048), abs=1e-12)
    assert f16.headroom(65504.0 * 4) == pytest.approx(-2.0, abs=1e-12)
    assert f16.headroom(0.0) == math.inf
    assert f16.headroom(math.inf) == -math.inf
    assert precision.fmt("bfloat16").headroom(1.0) == pytest.approx(128.0, abs=0.01)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_exp_limit_is_log_of_max(name: str) -> None:
    f = precision.fmt(name)
    assert f.exp_limit == pytest.approx(math.log(LIMITS[name][0]), rel=1e-15)
    # Just above the limit (by the margin to the rounding tie) exp no longer fits.
    tie = TIES[name][0]
    assert not np.isfinite(cast(np.array([math.exp(math.log(tie) * (1 + 1e-6))]), name)[0])
    assert np.isfinite(cast(np.array([math.exp(f.exp_limit * (1 - 1e-6))]), name)[0])


# --- matmul: where the sums round -----------------------------------------------------------


def fp(seed: int, shape: tuple[int, ...], name: str) -> F64:
    """Normal values already in the format, as float64."""
    return cast(np.random.default_rng(seed).normal(size=shape), name)


@pytest.mark.parametrize("inputs", ["float16", "bfloat16", "float64"])
def test_matmul_float32_is_a_float32_matmul(inputs: str) -> None:
    a, b = fp(10, (7, 33), inputs), fp(11, (33, 5), inputs)
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float64)
    got = precision.matmul(a, b, "float32")
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)


def test_matmul_float64_is_a_float64_matmul() -> None:
    a, b = fp(12, (6, 40), "float64"), fp(13, (40, 3), "float64")
    np.testing.assert_allclose(precision.matmul(a, b, "float64"), a @ b, rtol=1e-14, atol=1e-14)


def sequential(a: F64, b: F64, dtype: Any) -> F64:
    """a @ b with an accumulator in ``dtype``, rounded after every fused multiply-add,
    one scalar at a time (products of 16-bit numbers are exact in Python floats)."""
    n, k = a.shape
    m = b.shape[1]
    out = np.zeros((n, m))
    for i in range(n):
        for j in range(m):
            acc = dtype(0.0)
            for t in range(k):
                acc = dtype(float(acc) + float(a[i, t]) * float(b[t, j]))
            out[i, j] = float(acc)
    return out


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e5m2"])
def test_matmul_in_a_narrow_accumulator_rounds_after_every_term(name: str) -> None:
    a, b = fp(14, (5, 37), name), fp(15, (37, 4), name)
    want = sequential(a, b, DTYPES[name])
    np.testing.assert_array_equal(precision.matmul(a, b, name), want)


def test_float16_accumulation_stagnates_at_2048_when_adding_ones() -> None:
    """2048 + 1 = 2049 lies halfway between float16's 2048 and 2050 and rounds to the even
    2048: a float16 accumulator summing 4096 ones stops at 2048; float32 reaches 4096."""
    ones_row, ones_col = np.ones((1, 4096)), np.ones((4096, 1))
    assert precision.matmul(ones_row, ones_col, "float16")[0, 0] == 2048.0
    assert precision.matmul(ones_row, ones_col, "float32")[0, 0] == 4096.0


def test_float16_accumulation_of_a_tenth_stagnates_at_256() -> None:
    """From 256 on, float16's spacing is 0.25: adding 0.1 (< half a step) changes nothing.
    The sum of 4096 tenths (409.5...) comes out as 256 in float16, to 1e-4 in float32."""
    tenth = cast(np.array([0.1]), "float16")[0]
    a, b = np.full((1, 4096), tenth), np.ones((4096, 1))
    exact = 4096 * tenth
    assert precision.matmul(a, b, "float16")[0, 0] == 256.0
    assert abs(precision.matmul(a, b, "float32")[0, 0] - exact) < 1e-4 * exact


def test_float16_accumulation_errs_more_than_float32_on_a_long_inner_axis() -> None:
    a, b = fp(16, (8, 2048), "float16"), np.abs(fp(17, (2048, 8), "float16"))
    exact = a @ b
    err16 = np.abs(precision.matmul(a, b, "float16") - exact).max()
    err32 = np.abs(precision.round_to(precision.matmul(a, b, "float32"), "float16") - exact).max()
    assert err16 > 4 * err32


def test_matmul_with_an_empty_inner_axis_is_zero() -> None:
    for acc in ("float64", "float32", "float16"):
        got = precision.matmul(np.zeros((3, 0)), np.zeros((0, 2)), acc)
        np.testing.assert_array_equal(got, np.zeros((3, 2)))


# --- row sums: pairwise, rounding each level -------------------------------------------------


def pairwise(row: list[float], dtype: Any) -> float:
    """Sum by levels: neighbours added in pairs and rounded to ``dtype``; an odd last
    element waits for the next level."""
    level = [float(dtype(x)) for x in row]
    if not level:
        return 0.0
    while len(level) > 1:
        pairs = [float(dtype(level[i] + level[i + 1])) for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(level) - len(level) % 2 :]
    return level[0]


def halving(row: list[float], dtype: Any) -> float:
    """Sum by recursive halving, rounding every partial sum (for lengths 2ⁿ)."""
    if len(row) == 1:
        return float(dtype(row[0]))
    mid = len(row) // 2
    return float(dtype(halving(row[:mid], dtype) + halving(row[mid:], dtype)))


@pytest.mark.parametrize("S", [1, 2, 3, 7, 64, 100, 257])
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_row_sum_is_pairwise_in_the_format(S: int, name: str) -> None:
    x = cast(np.random.default_rng(S).uniform(0, 1, (4, S)), name)
    got = precision.row_sum(x, name)
    assert got.shape == (4, 1)
    want = [pairwise(row, DTYPES[name]) for row in x.tolist()]
    np.testing.assert_array_equal(got[:, 0], want)


@pytest.mark.parametrize("S", [2, 64, 1024])
def test_row_sum_of_a_power_of_two_is_a_balanced_tree(S: int) -> None:
    x = cast(np.random.default_rng(S).exponential(size=(3, S)), "float16")
    want = [halving(row, np.float16) for row in x.tolist()]
    np.testing.assert_array_equal(precision.row_sum(x, "float16")[:, 0], want)


def test_row_sum_float16_of_4096_ones_is_exact_unlike_sequential_accumulation() -> None:
    """Every level of the tree adds equal powers of two: no rounding, no stagnation."""
    assert precision.row_sum(np.ones((1, 4096)), "float16")[0, 0] == 4096.0


def test_row_sum_float16_rounds_each_level_yet_stays_close() -> None:
    """Pairwise float16 sums of 1000 tenths stay within a few float16 steps of the truth."""
    tenth = cast(np.array([0.1]), "float16")[0]
    exact = 1000 * tenth
    got = precision.row_sum(np.full((1, 1000), tenth), "float16")[0, 0]
    assert got != exact  # rounded (10 levels, each rounding)
    assert abs(got - exact) <= 10 * precision.fmt("float16").unit_roundoff * exact


def test_row_sum_of_an_empty_axis_is_zero() -> None:
    for name in ("float64", "float32", "float16"):
        got = precision.row_sum(np.zeros((2, 0)), name)
        np.testing.assert_array_equal(got, np.zeros((2, 1)))


def test_row_sum_float32_is_a_float32_sum() -> None:
    """Any float32 summation order is within n·u₃₂·Σ|x| of the exact sum, and rounded."""
    x = np.random.default_rng(20).normal(size=(5, 3000))
    got = precision.row_sum(x, "float32")[:, 0]
    exact = x.astype(np.float32).astype(np.float64).sum(axis=-1)
    bound = 3000 * 2.0**-24 * np.abs(x).sum(axis=-1)
    assert np.all(np.abs(got - exact) <= bound)
    np.testing.assert_array_equal(got, got.astype(np.float32))  # a float32 value
    np.testing.assert_allclose(got, x.astype(np.float32).sum(axis=-1), rtol=4 * 2.0**-24)


def test_row_sum_keeps_leading_axes() -> None:
    x = cast(np.random.default_rng(21).uniform(size=(2, 3, 9)), "float16")
    got = precision.row_sum(x, "float16")
    assert got.shape == (2, 3, 1)
    want = [[pairwise(row, np.float16) for row in plane] for plane in x.tolist()]
    np.testing.assert_array_equal(got[..., 0], want)
