"""How flat or peaked random rows are by chance: the χ² tail against its closed forms,
the shares the docstrings quote against random rows, and random attention under a
causal mask, which raises no finding while the scale applied twice still does."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa_cli.diagnosis.chance import CHANCE, chi2_cdf, flat_chance, peaked_chance
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace


def chi2_cdf_even(x: float, k: int) -> float:
    """P(χ²ₖ ≤ x) for even k, by hand: a Poisson(x/2) count ≥ k/2,
    e^(−x/2) Σ_{i ≥ k/2} (x/2)^i / i! (summed far past the mean)."""
    y = x / 2
    return math.fsum(
        math.exp(i * math.log(y) - y - math.lgamma(i + 1)) for i in range(k // 2, k + 400)
    )


@pytest.mark.parametrize("x", [1e-12, 1e-6, 0.01, 0.5, 3.0, 20.0])
def test_one_degree_of_freedom_is_the_error_function(x: float) -> None:
    """χ²₁ is Z²: P(Z² ≤ x) = erf(√(x / 2))."""
    got = float(chi2_cdf(np.array([x]), np.array([1]))[0])
    assert got == pytest.approx(math.erf(math.sqrt(x / 2)), rel=1e-12)


@pytest.mark.parametrize("k", [2, 6, 30, 64, 126])
@pytest.mark.parametrize("share", [0.05, 0.5, 1.5])
def test_even_degrees_of_freedom_by_the_series_match_the_closed_form(k: int, share: float) -> None:
    x = share * k
    got = float(chi2_cdf(np.array([x]), np.array([k]))[0])
    assert got == pytest.approx(chi2_cdf_even(x, k), rel=1e-10, abs=1e-300)


@pytest.mark.parametrize(("x", "rel"), [(70.0, 0.06), (100.0, 0.001), (128.0, 1e-4)])
def test_from_128_degrees_on_the_cube_root_is_close(x: float, rel: float) -> None:
    """Wilson–Hilferty at k = 128 against the closed form: 7.0e-6 (5.8 % over, where
    the rule reads it: a row a little less likely flagged), 0.032 and 0.52."""
    got = float(chi2_cdf(np.array([x]), np.array([128]))[0])
    assert got == pytest.approx(chi2_cdf_even(x, 128), rel=rel)


def test_two_keys_equal_logits_are_never_by_chance() -> None:
    assert flat_chance(np.array([2, 16, 128]), np.ones(3)).tolist() == [0.0, 0.0, 0.0]
    assert peaked_chance(np.array([1.0])).tolist() == [0.0]


def test_the_default_saturation_over_two_keys_is_one_row_in_870() -> None:
    """A gap ≥ log 99 = 4.595 of two unit normals (a N(0, 2) gap): erfc(4.595 / 2)."""
    chance = float(peaked_chance(np.array([0.99]))[0])
    assert chance == pytest.approx(math.erfc(math.log(99) / 2), rel=1e-12)
    assert round(1 / chance) == 864


@pytest.mark.parametrize(
    ("n", "quoted"), [(2, 0.19), (3, 0.065), (4, 0.027), (8, 0.0017), (16, 1.3e-5)]
)
def test_random_rows_past_the_default_uniform_threshold(n: int, quoted: float) -> None:
    """The shares the module quotes: random logits of unit variance over n keys with an
    entropy ≥ 0.98 · log n, counted over 400,000 rows (16 keys: the χ² tail, which the
    counts meet to 20 % from 2 to 8 keys)."""
    if n == 16:
        assert float(flat_chance(np.array([16]), np.array([0.98]))[0]) == pytest.approx(
            quoted, rel=0.05
        )
        return
    x = np.random.default_rng(n).standard_normal((400_000, n))
    w = np.exp(x - x.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    normalized = -(w * np.log(w)).sum(axis=1) / math.log(n)
    assert float((normalized >= 0.98).mean()) == pytest.approx(quoted, rel=0.1)
    chance = float(flat_chance(np.array([n]), np.array([0.98]))[0])
    assert chance == pytest.approx(quoted, rel=0.2)


def diagnose_random(seed: int, dtype: str, **options: object) -> dict[str, int]:
    """Finding counts of attention over Q, K, V of unit normals, (2, 4, 128, 64)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 4, 128, 64)).astype(dtype) for _ in range(3))
    spec = build_spec(q, k, v, options=parse_options(options))
    return dict(diagnose(trace(spec, stages=("output",))).counts)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("seed", range(6))
def test_random_attention_under_a_causal_mask_raises_no_finding(seed: int, dtype: str) -> None:
    """Causal rows over 2, 3, 4, … keys: before, a near-uniform row over 2 keys in most
    runs (19 % of such rows) and a one-hot one over 2 keys in some (seed 3)."""
    assert diagnose_random(seed, dtype, causal=True) == {}


def test_random_attention_without_a_mask_raises_no_finding() -> None:
    assert diagnose_random(0, "float32") == {}


@pytest.mark.parametrize("causal", [False, True])
def test_the_scale_applied_twice_still_flattens_rows_and_kills_heads(causal: bool) -> None:
    """--scale dk on the same data: logits of std 1/8, every row over 128 keys near-uniform
    (entropy 0.998 of log 128); under the causal mask all but the rows over a few keys,
    still ≥ 90 % of every head's rows."""
    counts = diagnose_random(0, "float32", causal=causal, scale="dk")
    assert counts["dead_head"] == 8
    assert counts["unscaled"] == 1
    if causal:
        assert 8 * 115 <= counts["near_uniform"] < 8 * 127
    else:
        assert counts["near_uniform"] == 8 * 128


def test_chance_is_one_in_fifty_thousand() -> None:
    assert round(1 / CHANCE) == 50_000
