"""``sdpa check`` and ``assert_attention_close``: exports judged against a reference.

Every expected number here is worked out by hand (dyadic values, so float64 holds
them exactly), comes from the float64 loop oracle of ``tests/reference.py``, from
``numpy.isclose``, or from PyTorch when it can be imported; never from sdpa's own
output. The rule under test is the one of ``torch.testing.assert_close``: an element
passes when ``|actual − reference| ≤ atol + rtol·|reference|``.

Low-precision exports are made two ways: by rounding a float64 reference to float16
or bfloat16 (``ml_dtypes``, always available), and, when PyTorch is importable, by
running ``torch.nn.functional.scaled_dot_product_attention`` in those formats.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from numpy.typing import NDArray
from reference import Stages, attention

from sdpa_cli import assert_attention_close
from sdpa_cli.check.compare import DTYPE_TOLERANCES, compare, measured_tolerance
from sdpa_cli.check.records import Check, CheckReport, Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.engine.block import softmax, softmax_lse
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError
from sdpa_cli.names import KINDS

F64 = NDArray[np.float64]
BOUNDED = settings(max_examples=30, deadline=None)


def _import_torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:  # pragma: no cover - PyTorch is optional
        return None


torch: Any = _import_torch()
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")

# PyTorch's own floors (test/test_transformers.py default_rtol/default_atol) and
# assert_close's float64 default, written out here as (rtol, atol).
PYTORCH_FLOORS = {
    "float16": (1e-3, 1e-3),
    "bfloat16": (1.6e-2, 1e-3),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
}
STRICT_RTOL, STRICT_ATOL = 1.3e-6, 1e-5
"""float32's floors: what a float16 or bfloat16 export must not pass."""


# --- helpers --------------------------------------------------------------------------


def normal(seed: int, *shape: int) -> F64:
    return np.random.default_rng(seed).normal(size=shape)


def check(
    q: NDArray[Any],
    k: NDArray[Any],
    v: NDArray[Any],
    exports: Mapping[str, NDArray[Any]] | None = None,
    settings: CheckSettings | None = None,
    *,
    mask: NDArray[Any] | None = None,
    thresholds: Thresholds | None = None,
    **options: Any,
) -> CheckReport:
    """``sdpa check`` on in-memory arrays; each export is labelled ``<name>.npy``."""
    spec = build_spec(q, k, v, mask=mask, options=parse_options(options))
    expected = [Expected(name, values, f"{name}.npy") for name, values in (exports or {}).items()]
    return run_checks(spec, expected, settings, thresholds)


def by_name(report: CheckReport) -> dict[str, Check]:
    return {c.name: c for c in report.checks}


def statuses(report: CheckReport) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


def loop_lse(masked: F64) -> F64:
    """log Σ exp per row by Python floats: m + log Σ exp(x − m); −inf for a row of −inf."""
    out = np.empty(masked.shape[:-1])
    for index in np.ndindex(*masked.shape[:-1]):
        row = masked[index].tolist()
        top = max(row)
        if top == -math.inf:
            out[index] = -math.inf
        else:
            out[index] = top + math.log(sum(math.exp(x - top) for x in row))
    return out


def causal_case() -> tuple[F64, F64, F64, Stages]:
    """Q (2, 3, 4), K (2, 5, 4), V (2, 5, 3), causal upper-left, and its float64 oracle.

    Query row i sees keys 0..i: row 0 sees key 0 only, keys 3 and 4 are never seen.
    """
    q, k, v = normal(1, 2, 3, 4), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    return q, k, v, attention(q, k, v, causal=True)


# --- compare: hand-made arrays --------------------------------------------------------


def test_compare_counts_and_locates_every_figure_on_a_hand_made_array() -> None:
    """rtol 1/8, atol 1/16: allowed = 1/16 + |r|/8 per element; dyadic values, exact.

    r = [[1, 2, 0], [−4, 8, 0.5]] and |Δ| = [[1/8, 1/2, 3/32], [3/4, 1, 0]] against
    allowed [[3/16, 5/16, 1/16], [9/16, 17/16, 1/8]]: three elements fail, (0, 1) by
    the largest ratio 8/5; the zero reference at (0, 2) has an infinite relative
    difference; the smallest atol that passes is max(|Δ| − |r|/8) = 1/4.
    """
    r = np.array([[1.0, 2.0, 0.0], [-4.0, 8.0, 0.5]])
    a = np.array([[1.125, 2.5, 0.09375], [-4.75, 9.0, 0.5]])
    m = compare(a, r, rtol=0.125, atol=0.0625)
    assert m.total == 6
    assert m.mismatched == 3
    assert m.fraction == 0.5
    assert (m.nan_mismatches, m.inf_mismatches) == (0, 0)
    assert (m.max_abs, m.max_abs_at) == (1.0, (1, 1))
    assert (m.max_rel, m.max_rel_at) == (math.inf, (0, 2))
    assert m.worst_at == (0, 1)
    assert (m.worst_actual, m.worst_reference) == (2.5, 2.0)
    assert m.passing_atol == 0.25
    assert m.passing_rtol == math.inf  # no rtol rescues a zero reference missed by 3/32


def test_passing_atol_and_rtol_are_the_smallest_that_pass() -> None:
    """r = [1, 2, −4, 8], |Δ| = [1/8, 1/2, 3/4, 1], rtol 1/8, atol 1/16.

    Smallest atol: max(|Δ| − |r|/8) = 1/4, reached at indices 1 and 2 both.
    Smallest rtol: max((|Δ| − 1/16)/|r|) = (7/16)/2 = 7/32, reached at index 1 only.
    """
    r = np.array([1.0, 2.0, -4.0, 8.0])
    a = np.array([1.125, 2.5, -4.75, 9.0])
    m = compare(a, r, rtol=0.125, atol=0.0625)
    assert m.mismatched == 2
    assert m.passing_atol == 0.25
    assert m.passing_rtol == 7 / 32
    assert compare(a, r, rtol=0.125, atol=0.25).mismatched == 0
    below = compare(a, r, rtol=0.125, atol=0.25 * (1 - 1e-9))
    assert below.mismatched == 2
    assert compare(a, r, rtol=7 / 32, atol=0.0625).mismatched == 0
    below = compare(a, r, rtol=7 / 32 * (1 - 1e-9), atol=0.0625)
    assert (below.mismatched, below.worst_at) == (1, (1,))


def test_passing_atol_passes_on_seeded_random_arrays() -> None:
    """Used as atol, the reported smallest atol passes; a hair less does not."""
    rng = np.random.default_rng(7)
    tried = 0
    for _ in range(200):
        r = rng.normal(size=12)
        a = r + rng.normal(size=12) * 10.0 ** rng.uniform(-7, -1)
        rtol, atol = 10.0 ** rng.uniform(-7, -2), 10.0 ** rng.uniform(-7, -2)
        m = compare(a, r, rtol, atol)
        if not m.mismatched:
            continue
        tried += 1
        assert m.passing_atol is not None
        assert m.passing_atol > atol
        assert compare(a, r, rtol, m.passing_atol).mismatched == 0
        assert compare(a, r, rtol, m.passing_atol * (1 - 1e-9)).mismatched > 0
    assert tried > 50


def test_non_finite_mismatches_are_counted_apart_and_come_first() -> None:
    """NaN on either side fails (unless both are NaN and equal_nan); an infinity
    passes only against the same infinity. Finite differences ignore those pairs."""
    nan, inf = math.nan, math.inf
    a = np.array([nan, 1.0, inf, -inf, nan, inf, 3.0])
    r = np.array([1.0, nan, inf, inf, nan, 5.0, 3.5])
    m = compare(a, r, rtol=0.0, atol=0.25)
    assert m.mismatched == 6  # all but the matching +inf pair
    assert m.nan_mismatches == 3  # indices 0, 1, 4
    assert m.inf_mismatches == 2  # −inf vs inf, inf vs 5
    assert (m.max_abs, m.max_abs_at) == (0.5, (6,))  # the one finite pair
    assert m.worst_at == (0,)  # a non-finite mismatch before any finite one
    assert m.worst_actual is not None
    assert math.isnan(m.worst_actual)
    assert m.worst_reference == 1.0
    assert (m.passing_atol, m.passing_rtol) == (None, None)  # no tolerance passes NaN

    same_nan = compare(a, r, rtol=0.0, atol=0.25, equal_nan=True)
    assert (same_nan.mismatched, same_nan.nan_mismatches) == (5, 2)


def test_a_zero_reference_makes_the_relative_difference_infinite() -> None:
    a = np.array([[0.0, 0.0], [1e-9, 0.0]])
    r = np.zeros((2, 2))
    m = compare(a, r, rtol=1e-3, atol=0.0)
    assert (m.mismatched, m.worst_at) == (1, (1, 0))
    assert (m.max_rel, m.max_rel_at) == (math.inf, (1, 0))
    assert m.passing_rtol == math.inf
    assert m.passing_atol == 1e-9
    assert compare(a, r, rtol=1e-3, atol=1e-9).mismatched == 0


def test_identical_arrays_have_nothing_to_report() -> None:
    r = normal(5, 3, 4)
    m = compare(r, r.copy(), rtol=0.0, atol=0.0)
    assert (m.mismatched, m.max_abs, m.max_rel, m.worst_at) == (0, 0.0, 0.0, None)
    assert (m.passing_atol, m.passing_rtol) == (0.0, 0.0)


def test_mismatch_to_dict_lists_indices_and_the_fraction() -> None:
    m = compare(np.array([[1.0, 3.0]]), np.array([[1.0, 2.0]]), rtol=0.0, atol=0.5)
    d = m.to_dict()
    assert d["worst_at"] == [0, 1]
    assert d["max_abs_at"] == [0, 1]
    assert d["fraction"] == 0.5
    assert d["mismatched"] == 1


# --- compare: agreement with numpy and PyTorch ------------------------------------------

SPECIAL = st.sampled_from([0.0, math.nan, math.inf, -math.inf])
TOLERANCES = st.sampled_from([0.0, 1e-6, 1e-3, 1e-2]) | st.floats(0.0, 0.1)


@st.composite
def comparisons(draw: st.DrawFn) -> tuple[F64, F64, float, float, bool]:
    """An actual/reference pair a small (or non-finite) step apart, tolerances, equal_nan."""
    n = draw(st.integers(1, 12))
    ref = draw(arrays(np.float64, n, elements=st.floats(-100, 100) | SPECIAL))
    step = draw(arrays(np.float64, n, elements=st.just(0.0) | st.floats(-0.1, 0.1) | SPECIAL))
    with np.errstate(invalid="ignore"):
        actual = ref + step
    return actual, ref, draw(TOLERANCES), draw(TOLERANCES), draw(st.booleans())


@BOUNDED
@given(comparisons())
def test_compare_agrees_with_numpy_isclose(case: tuple[F64, F64, float, float, bool]) -> None:
    a, r, rtol, atol, equal_nan = case
    m = compare(a, r, rtol, atol, equal_nan=equal_nan)
    bad = ~np.isclose(a, r, rtol=rtol, atol=atol, equal_nan=equal_nan)
    assert m.mismatched == int(bad.sum())
    either_nan = np.isnan(a) | np.isnan(r)
    both_nan = np.isnan(a) & np.isnan(r)
    assert m.nan_mismatches == int((either_nan & ~(both_nan & equal_nan)).sum())
    infinite = (np.isinf(a) | np.isinf(r)) & ~either_nan
    assert m.inf_mismatches == int((infinite & (a != r)).sum())
    finite = np.isfinite(a) & np.isfinite(r)
    with np.errstate(invalid="ignore"):
        assert m.max_abs == float(np.abs(a - r)[finite].max(initial=0.0))
    assert (m.worst_at is None) == (m.mismatched == 0)
    if m.worst_at is not None:
        assert bad[m.worst_at]


def torch_passes(a: F64, r: F64, rtol: float, atol: float, equal_nan: bool) -> bool:
    try:
        torch.testing.assert_close(
            torch.from_numpy(a), torch.from_numpy(r), rtol=rtol, atol=atol, equal_nan=equal_nan
        )
    except AssertionError:
        return False
    return True


@needs_torch
@BOUNDED
@given(comparisons())
def test_compare_passes_exactly_when_torch_assert_close_passes(
    case: tuple[F64, F64, float, float, bool],
) -> None:
    a, r, rtol, atol, equal_nan = case
    m = compare(a, r, rtol, atol, equal_nan=equal_nan)
    assert (m.mismatched == 0) is torch_passes(a, r, rtol, atol, equal_nan)


# --- measured_tolerance ------------------------------------------------------------------


def test_dtype_defaults_are_pytorchs_floors() -> None:
    for name, floors in PYTORCH_FLOORS.items():
        assert DTYPE_TOLERANCES[name] == floors


def test_measured_tolerance_is_fudge_times_the_naive_deviation() -> None:
    """|ref − naive| = [0, 1/4, 1/2]: atol 2·1/2 = 1; relative [0, 1/8, 1/8]: rtol 2·1/8."""
    tol = measured_tolerance(
        np.array([1.0, 2.0, 4.0]), np.array([1.0, 2.25, 3.5]), "float16", fudge=2.0
    )
    assert (tol.rtol, tol.atol) == (0.25, 1.0)
    assert "measured" in tol.source
    assert "float16" in tol.source


@pytest.mark.parametrize("dtype", list(PYTORCH_FLOORS))
def test_measured_tolerance_never_goes_below_fudge_times_the_floors(dtype: str) -> None:
    ref = normal(4, 5)
    rtol0, atol0 = PYTORCH_FLOORS[dtype]
    tol = measured_tolerance(ref, ref.copy(), dtype, fudge=3.0)
    assert tol.rtol == pytest.approx(3 * rtol0, rel=1e-15)
    assert tol.atol == pytest.approx(3 * atol0, rel=1e-15)


def test_a_zero_reference_falls_back_to_the_unfudged_default_rtol() -> None:
    """As PyTorch's get_tolerances: a relative deviation over 1e30 (x/0) → the default rtol."""
    tol = measured_tolerance(np.array([0.0, 1.0]), np.array([1e-3, 1.0]), "float32", fudge=2.0)
    assert tol.rtol == 1.3e-6  # the float32 floor itself, not twice it
    assert tol.atol == pytest.approx(2e-3, rel=1e-15)


def test_measured_tolerance_ignores_pairs_that_are_not_finite() -> None:
    ref = np.array([1.0, math.inf, math.nan, 2.0, -math.inf])
    naive = np.array([1.5, 1.0, 3.0, 2.0, -math.inf])
    tol = measured_tolerance(ref, naive, "bfloat16", fudge=2.0)
    assert (tol.rtol, tol.atol) == (1.0, 1.0)  # from the pair (1, 1.5) only


# --- CheckSettings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [
        ({"rtol": 1e-3}, "--rtol/--atol"),
        ({"atol": 1e-3}, "--rtol/--atol"),
        ({"rtol": -1e-3, "atol": 0.0}, "--rtol"),
        ({"rtol": math.inf, "atol": 0.0}, "--rtol"),
        ({"rtol": 0.0, "atol": math.nan}, "--atol"),
        ({"tolerance": "loose"}, "--tolerance"),
        ({"tolerance": "measured", "rtol": 1e-3, "atol": 1e-3}, "--tolerance"),
        ({"fudge": 0.5}, "--fudge"),
        ({"fudge": math.nan}, "--fudge"),
        ({"reference": "float16"}, "--reference"),
        ({"fail_on": ("overflow", "overflw")}, "--fail-on"),
        ({"fail_on_severity": "fatal"}, "--fail-on-severity"),
    ],
)
def test_invalid_settings_name_the_option(kwargs: dict[str, Any], where: str) -> None:
    with pytest.raises(SpecError) as caught:
        CheckSettings(**kwargs)
    assert caught.value.where == where


def test_valid_settings_are_accepted() -> None:
    CheckSettings(rtol=0.0, atol=0.0, reference="float32", fudge=1.0)
    CheckSettings(tolerance="measured", fail_on=KINDS, fail_on_severity="info")
    CheckSettings(fail_on=())


def test_an_unknown_fail_on_kind_lists_the_kinds() -> None:
    with pytest.raises(SpecError, match="overflw") as caught:
        CheckSettings(fail_on=("overflw",))
    assert all(kind in caught.value.problem for kind in KINDS)


# --- export format and reference -----------------------------------------------------------


def bf16(a: F64) -> NDArray[Any]:
    return a.astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(
    ("inputs", "exports", "options", "export", "reference"),
    [
        ("float64", {"output": "float64"}, {}, "float64", "float64"),
        ("float64", {"output": "float32"}, {}, "float32", "float64"),
        ("float64", {"output": "float16"}, {}, "float16", "float32"),
        ("float64", {"output": "bfloat16"}, {}, "bfloat16", "float32"),
        ("float32", {"output": "float64"}, {}, "float32", "float64"),
        ("float16", {"output": "float32"}, {}, "float16", "float32"),
        ("float64", {"output": "float16", "weights": "float32"}, {}, "float16", "float32"),
        ("float64", {"output": "float64"}, {"dtype": "bfloat16"}, "bfloat16", "float32"),
        ("float64", {"output": "float32"}, {"dtype": "float16"}, "float16", "float32"),
    ],
)
def test_export_format_is_the_narrowest_unless_dtype_says(
    inputs: str, exports: dict[str, str], options: dict[str, Any], export: str, reference: str
) -> None:
    """--dtype when given, else the narrowest of the exports and Q/K/V; the reference is
    float32 for 16-bit exports, float64 otherwise; under --tolerance dtype the
    tolerances are that format's floors."""
    q, k, v = (normal(s, 2, 3, 4).astype(inputs) for s in (1, 2, 3))
    oracle = attention(q, k, v)
    values = {"output": oracle.output, "weights": oracle.weights}
    arrays_ = {
        name: bf16(values[name]) if dt == "bfloat16" else values[name].astype(dt)
        for name, dt in exports.items()
    }
    report = check(q, k, v, arrays_, CheckSettings(tolerance="dtype"), **options)
    assert (report.export_dtype, report.reference) == (export, reference)
    tol = by_name(report)["output.close"].tolerance
    assert tol is not None
    assert (tol.rtol, tol.atol) == PYTORCH_FLOORS[export]
    assert tol.source == f"{export} defaults"
    assert report.passed


def test_the_reference_format_can_be_chosen() -> None:
    q, k, v, oracle = causal_case()
    report = check(
        q, k, v, {"output": oracle.output.astype(np.float16)}, CheckSettings(reference="float64")
    )
    assert (report.export_dtype, report.reference) == ("float16", "float64")


def test_given_tolerances_replace_the_defaults() -> None:
    q, k, v, oracle = causal_case()
    report = check(q, k, v, {"output": oracle.output}, CheckSettings(rtol=0.5, atol=0.25))
    tol = by_name(report)["output.close"].tolerance
    assert tol is not None
    assert (tol.rtol, tol.atol, tol.source) == (0.5, 0.25, "given")


# --- output ----------------------------------------------------------------------------------


def test_the_oracle_output_passes_every_output_check() -> None:
    q, k, v, oracle = causal_case()
    report = check(q, k, v, {"output": oracle.output}, causal=True)
    assert statuses(report) == {
        "output.finite": "pass",
        "output.range": "pass",
        "output.close": "pass",
        "findings": "pass",
    }
    assert report.passed
    assert report.failed == ()
    close = by_name(report)["output.close"]
    assert close.mismatch is not None
    assert close.mismatch.total == 2 * 3 * 3
    assert close.index is None
    assert close.file == "output.npy"


def test_output_finite_counts_nan_and_inf_and_names_the_first() -> None:
    q, k, v, oracle = causal_case()
    out = oracle.output.copy()
    out[0, 2, 1] = math.nan
    out[1, 1, 1] = math.inf
    out[1, 2, 0] = -math.inf
    report = check(q, k, v, {"output": out}, causal=True)
    finite = by_name(report)["output.finite"]
    assert finite.status == "fail"
    assert finite.index == (0, 2, 1)
    assert dict(finite.details) == {"nonfinite": 3, "nan": 1, "inf": 2}
    close = by_name(report)["output.close"].mismatch
    assert close is not None
    assert (close.mismatched, close.nan_mismatches, close.inf_mismatches) == (3, 1, 2)
    assert close.worst_at == (0, 2, 1)


def test_an_output_outside_vs_range_fails_range_and_close_at_its_index() -> None:
    """Causal row 0 sees key 0 alone: its output must equal V[0], a range of one point."""
    q, k, v, oracle = causal_case()
    out = oracle.output.copy()
    out[1, 0, 2] += 0.5
    report = check(q, k, v, {"output": out}, causal=True)
    assert not report.passed
    assert [c.name for c in report.failed] == ["output.range", "output.close"]
    rng = by_name(report)["output.range"]
    assert rng.index == (1, 0, 2)
    assert rng.details["outside"] == 1
    assert rng.details["range"] == [v[1, 0, 2], v[1, 0, 2]]
    assert rng.details["first_value"] == out[1, 0, 2]
    close = by_name(report)["output.close"]
    assert close.index == (1, 0, 2)
    assert close.mismatch is not None
    assert close.mismatch.mismatched == 1
    assert close.mismatch.max_abs == pytest.approx(0.5, rel=1e-12)


def test_output_range_counts_every_value_outside_and_names_the_first() -> None:
    """Row 2 sees keys 0..2: above the largest V[:3, c] or below the smallest fails."""
    q, k, v, oracle = causal_case()
    out = oracle.output.copy()
    out[0, 2, 1] = v[0, :3, 1].max() + 0.1
    out[1, 2, 0] = v[1, :3, 0].min() - 0.1
    out[1, 1, 2] = v[1, :2, 2].max()  # on the edge: inside
    rng = by_name(check(q, k, v, {"output": out}, causal=True))["output.range"]
    assert rng.status == "fail"
    assert rng.details["outside"] == 2
    assert rng.index == (0, 2, 1)
    assert rng.details["range"] == [v[0, :3, 1].min(), v[0, :3, 1].max()]


def test_output_close_fails_on_a_small_error_that_stays_inside_vs_range() -> None:
    q, k, v, oracle = causal_case()
    out = oracle.output.copy()
    out[1, 2, 1] += 1e-4
    out[0, 1, 0] -= 3e-4
    report = check(q, k, v, {"output": out}, causal=True)
    assert [c.name for c in report.failed] == ["output.close"]
    m = by_name(report)["output.close"].mismatch
    assert m is not None
    assert (m.mismatched, m.worst_at, m.max_abs_at) == (2, (0, 1, 0), (0, 1, 0))


def test_dropout_skips_the_range_check() -> None:
    q, k, v, oracle = causal_case()
    rng = by_name(check(q, k, v, {"output": 10 * oracle.output}, causal=True, dropout=0.5))
    assert rng["output.range"].status == "pass"
    assert rng["output.range"].details == {"skipped": True}


def heads_case() -> tuple[F64, F64, F64, F64]:
    """Inputs (B=2, L=3 or S=4, d_model=6) read as 2 heads of 3, and the oracle's split output."""
    q, k, v = normal(11, 2, 3, 6), normal(12, 2, 4, 6), normal(13, 2, 4, 6)

    def split(a: F64) -> F64:
        return a.reshape(2, -1, 2, 3).transpose(0, 2, 1, 3)

    return q, k, v, attention(split(q), split(k), split(v), causal=True).output


def test_a_merged_output_under_heads_is_reported_in_the_files_layout() -> None:
    """Merged (B, L, heads·Ev): head 1, column 1 is column 3 + 1 = 4 of the file."""
    q, k, v, split = heads_case()
    merged = split.transpose(0, 2, 1, 3).reshape(2, 3, 6)
    assert check(q, k, v, {"output": merged}, causal=True, heads=2).passed
    merged[1, 0, 4] += 1.0
    report = check(q, k, v, {"output": merged}, causal=True, heads=2)
    assert by_name(report)["output.range"].index == (1, 0, 4)
    assert by_name(report)["output.close"].index == (1, 0, 4)


def test_a_split_output_under_heads_is_reported_in_the_split_layout() -> None:
    q, k, v, split = heads_case()
    out = split.copy()
    assert check(q, k, v, {"output": out}, causal=True, heads=2).passed
    out[1, 1, 0, 1] += 1.0
    report = check(q, k, v, {"output": out}, causal=True, heads=2)
    assert by_name(report)["output.range"].index == (1, 1, 0, 1)
    assert by_name(report)["output.close"].index == (1, 1, 0, 1)


def test_an_export_of_the_wrong_shape_names_the_file_and_the_layouts() -> None:
    q, k, v, split = heads_case()
    with pytest.raises(SpecError) as caught:
        check(q, k, v, {"output": split[:, :, :2]}, causal=True, heads=2)
    assert caught.value.where == "output.npy"
    assert "(2, 3, 6) or (2, 2, 3, 3)" in caught.value.problem


def test_leading_ones_in_an_export_are_accepted() -> None:
    q, k, v, oracle = causal_case()
    assert check(q, k, v, {"output": oracle.output[None]}, causal=True).passed


def test_an_unknown_export_name_is_a_spec_error() -> None:
    q, k, v, oracle = causal_case()
    with pytest.raises(SpecError, match="unknown export"):
        check(q, k, v, {"scores": oracle.weights})


# --- weights ---------------------------------------------------------------------------------


def test_the_oracle_weights_pass_every_weights_check() -> None:
    q, k, v, oracle = causal_case()
    report = check(q, k, v, {"weights": oracle.weights}, causal=True)
    assert statuses(report) == {
        "weights.finite": "pass",
        "weights.range": "pass",
        "weights.rows": "pass",
        "weights.close": "pass",
        "findings": "pass",
    }


def test_weights_finite_counts_and_names_the_first() -> None:
    q, k, v, oracle = causal_case()
    w = oracle.weights.copy()
    w[1, 2, 0] = math.inf
    w[0, 1, 1] = math.nan
    finite = by_name(check(q, k, v, {"weights": w}, causal=True))["weights.finite"]
    assert finite.status == "fail"
    assert finite.index == (0, 1, 1)
    assert dict(finite.details) == {"nonfinite": 2, "nan": 1, "inf": 1}


def test_weights_outside_zero_one_fail_the_range_even_when_the_row_sums_to_one() -> None:
    q, k, v, oracle = causal_case()
    w = oracle.weights.copy()
    w[0, 1, :2] = [-0.25, 1.25]  # row 1 sees keys 0 and 1: still sums to 1
    report = check(q, k, v, {"weights": w}, causal=True)
    checks = by_name(report)
    assert checks["weights.range"].status == "fail"
    assert checks["weights.range"].index == (0, 1, 0)
    assert dict(checks["weights.range"].details) == {"outside": 2, "first_value": -0.25}
    assert checks["weights.rows"].status == "pass"
    m = checks["weights.close"].mismatch
    assert m is not None
    assert m.mismatched == 2


def test_a_row_that_does_not_sum_to_one_fails_the_rows_check() -> None:
    q, k, v, oracle = causal_case()
    w = oracle.weights.copy()
    w[1, 2] *= 0.9
    rows = by_name(check(q, k, v, {"weights": w}, causal=True))["weights.rows"]
    assert rows.status == "fail"
    assert rows.index == (1, 2)
    assert dict(rows.details) == {"rows_off": 1, "bad_sums": 1, "leaking_rows": 0}
    assert "row [1, 2] sums to 0.9, not 1" in rows.summary


def test_weight_on_a_hidden_key_fails_the_rows_check() -> None:
    """Row 1 sees keys 0 and 1; key 3 is hidden and must get nothing."""
    q, k, v, oracle = causal_case()
    w = oracle.weights.copy()
    w[1, 1, 3] = 0.3
    report = check(q, k, v, {"weights": w}, causal=True)
    rows = by_name(report)["weights.rows"]
    assert rows.index == (1, 1)
    assert dict(rows.details) == {"rows_off": 1, "bad_sums": 0, "leaking_rows": 1}
    assert "puts 0.3 on hidden keys" in rows.summary
    assert by_name(report)["weights.close"].index == (1, 1, 3)


def no_key_case() -> tuple[F64, F64, F64]:
    """L = 4, S = 2, causal lower-right: rows 0 and 1 see no key, row 3 sees both."""
    return normal(21, 1, 4, 4), normal(22, 1, 2, 4), normal(23, 1, 2, 3)


def test_rows_without_keys_are_zero_under_the_default_mask_value() -> None:
    q, k, v = no_key_case()
    oracle = attention(q, k, v, causal=True, causal_align="lower-right")
    assert np.all(oracle.weights[0, :2] == 0.0)  # the premise
    lse = loop_lse(oracle.masked)
    exports = {"output": oracle.output, "weights": oracle.weights, "lse": lse}
    report = check(q, k, v, exports, causal=True, causal_align="lower-right")
    assert all(c.status == "pass" for c in report.checks if c.name != "findings")
    assert "2 with no key to attend to sum to 0" in by_name(report)["weights.rows"].summary

    uniform = oracle.weights.copy()
    uniform[0, :2] = 0.5
    mean = oracle.output.copy()
    mean[0, :2] = v[0].mean(axis=0)
    report = check(
        q, k, v, {"output": mean, "weights": uniform}, causal=True, causal_align="lower-right"
    )
    rows = by_name(report)["weights.rows"]
    assert rows.index == (0, 0)
    assert dict(rows.details) == {"rows_off": 2, "bad_sums": 0, "leaking_rows": 2}
    assert by_name(report)["output.range"].index == (0, 0, 0)  # outside [0, 0]
    assert by_name(report)["output.range"].details["outside"] == 6


def test_rows_without_keys_are_uniform_under_a_finite_mask_value() -> None:
    q, k, v = no_key_case()
    oracle = attention(q, k, v, causal=True, causal_align="lower-right", mask_value=-1e9)
    assert np.all(oracle.weights[0, :2] == 0.5)  # the premise
    opts: dict[str, Any] = {"causal": True, "causal_align": "lower-right", "mask_value": -1e9}
    report = check(q, k, v, {"output": oracle.output, "weights": oracle.weights}, **opts)
    assert all(c.status == "pass" for c in report.checks if c.name != "findings")

    zeros = oracle.weights.copy()
    zeros[0, :2] = 0.0
    rows = by_name(check(q, k, v, {"weights": zeros}, **opts))["weights.rows"]
    assert rows.index == (0, 0)
    assert dict(rows.details) == {"rows_off": 2, "bad_sums": 2, "leaking_rows": 0}
    assert "sums to 0, not 1" in rows.summary


# --- lse ---------------------------------------------------------------------------------------


def masked_logits() -> F64:
    """Random logits (2, 3, 5) with hidden keys at −inf and row [1, 2] fully hidden."""
    x = 4 * normal(31, 2, 3, 5)
    x[0, 1, 3:] = -math.inf
    x[1, 0, 0] = -math.inf
    x[1, 2] = -math.inf
    return x


def logsumexp(masked: F64) -> F64:
    """``log Σ_j exp(logit_j)`` per row, read off the engine's softmax by
    :func:`softmax_lse` as check reads it; −inf for a row with no visible key."""
    return softmax_lse(masked, softmax(np.asarray(masked, dtype=np.float64)))


def test_logsumexp_matches_a_float64_loop() -> None:
    x = masked_logits()
    got = logsumexp(x)
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, loop_lse(x), rtol=1e-14, atol=0)
    assert got[1, 2] == -math.inf


def test_logsumexp_does_not_overflow_on_large_logits() -> None:
    x = np.array([[1000.0, 1000.0], [-1000.0, -1001.0]])
    got = logsumexp(x)
    assert got[0] == pytest.approx(1000 + math.log(2), rel=1e-15)
    assert got[1] == pytest.approx(-1000 + math.log(1 + math.exp(-1)), rel=1e-15)


@needs_torch
def test_logsumexp_matches_torch() -> None:
    x = masked_logits()
    want = torch.logsumexp(torch.from_numpy(x), dim=-1).numpy()
    np.testing.assert_allclose(logsumexp(x), want, rtol=1e-14, atol=0)


@needs_torch
def test_an_lse_from_torch_passes_the_lse_checks() -> None:
    """torch.logsumexp over causally masked scores Q·Kᵀ/√E, as a kernel would export it."""
    q, k, v, oracle = causal_case()
    scores = torch.from_numpy(q) @ torch.from_numpy(k).transpose(-1, -2) / 2.0
    hidden = torch.ones(3, 5, dtype=torch.bool).triu(diagonal=1)
    lse = torch.logsumexp(scores.masked_fill(hidden, -math.inf), dim=-1)
    report = assert_attention_close(q, k, v, weights=oracle.weights, lse=lse, causal=True)
    assert by_name(report)["lse.close"].status == "pass"
    assert by_name(report)["lse.weights"].status == "pass"
    wrong = lse.clone()
    wrong[0, 1] -= 1e-3
    with pytest.raises(AssertionError, match=r"FAIL lse\.close") as caught:
        assert_attention_close(q, k, v, lse=wrong, causal=True)
    assert "worst element: index [0, 1]" in str(caught.value)


def test_the_oracle_lse_passes_and_a_wrong_row_fails_at_its_index() -> None:
    q, k, v, oracle = causal_case()
    lse = loop_lse(oracle.masked)
    assert lse.shape == (2, 3)
    report = check(q, k, v, {"lse": lse}, causal=True)
    assert by_name(report)["lse.close"].status == "pass"
    assert "lse.weights" not in by_name(report)  # needs the weights too

    lse[1, 2] += 0.01
    close = by_name(check(q, k, v, {"lse": lse}, causal=True))["lse.close"]
    assert close.status == "fail"
    assert close.index == (1, 2)
    assert close.mismatch is not None
    assert close.mismatch.mismatched == 1


@pytest.mark.parametrize("written", [-math.inf, math.inf])
def test_a_row_without_keys_accepts_either_infinity_as_its_lse(written: float) -> None:
    """−inf is the logsumexp of nothing; FlashAttention 2 writes +inf there."""
    q, k, v = no_key_case()
    oracle = attention(q, k, v, causal=True, causal_align="lower-right")
    lse = loop_lse(oracle.masked)
    lse[0, :2] = written
    report = check(q, k, v, {"lse": lse}, causal=True, causal_align="lower-right")
    assert by_name(report)["lse.close"].status == "pass"


@pytest.mark.parametrize("written", [math.nan, 0.0])
def test_a_row_without_keys_rejects_nan_or_a_finite_lse(written: float) -> None:
    q, k, v = no_key_case()
    oracle = attention(q, k, v, causal=True, causal_align="lower-right")
    lse = loop_lse(oracle.masked)
    lse[0, :2] = written
    close = by_name(check(q, k, v, {"lse": lse}, causal=True, causal_align="lower-right"))
    m = close["lse.close"].mismatch
    assert m is not None
    assert (m.mismatched, m.worst_at) == (2, (0, 0))
    assert m.nan_mismatches == (2 if math.isnan(written) else 0)
    assert m.inf_mismatches == (0 if math.isnan(written) else 2)


def test_lse_weights_ties_the_two_exports_together() -> None:
    """weights = exp(logit − lse): an lse 0.01 too high scales row [1, 2]'s three visible
    weights by e^−0.01; the worst of them is the largest weight."""
    q, k, v, oracle = causal_case()
    lse = loop_lse(oracle.masked)
    report = check(q, k, v, {"weights": oracle.weights, "lse": lse}, causal=True)
    assert by_name(report)["lse.weights"].status == "pass"

    lse[1, 2] += 0.01
    tie = by_name(check(q, k, v, {"weights": oracle.weights, "lse": lse}, causal=True))
    m = tie["lse.weights"].mismatch
    assert m is not None
    assert m.mismatched == 3
    assert m.worst_at == (1, 2, int(np.argmax(oracle.weights[1, 2])))
    assert m.max_abs == pytest.approx(oracle.weights[1, 2].max() * -math.expm1(-0.01), rel=1e-9)


def test_an_lse_of_the_wrong_shape_names_the_file() -> None:
    q, k, v, oracle = causal_case()
    with pytest.raises(SpecError) as caught:
        check(q, k, v, {"lse": oracle.masked[..., 0, :]}, causal=True)
    assert caught.value.where == "lse.npy"
    assert "(2, 3)" in caught.value.problem


# --- findings and the gate ---------------------------------------------------------------------


def overflow_case(dtype: str) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """E = 1, scale none: the raw score 300·300 = 90,000 is beyond float16's 65,504."""
    q = np.array([[300.0]], dtype=dtype)
    k = np.array([[300.0], [1.0]], dtype=dtype)
    v = np.array([[1.0], [2.0]], dtype=dtype)
    return q, k, v


def test_without_exports_overflow_in_float16_only_warns_for_float64_inputs() -> None:
    report = check(*overflow_case("float64"), scale="none")
    assert report.gate == ("nonfinite", "overflow")
    assert statuses(report) == {
        "findings.nonfinite": "pass",
        "findings.overflow": "pass",
        "findings": "warn",
    }
    assert report.passed
    assert "overflow" in by_name(report)["findings"].details["kinds"]


def test_without_exports_overflow_fails_for_float16_inputs() -> None:
    report = check(*overflow_case("float16"), scale="none")
    overflow = by_name(report)["findings.overflow"]
    assert overflow.status == "fail"
    assert overflow.index == (0, 0)
    assert all(f["dtype"] == "float16" for f in overflow.details["findings"])
    assert not report.passed
    assert report.export_dtype == "float16"


def test_with_exports_nothing_is_gated_unless_asked() -> None:
    q, k, v = overflow_case("float64")
    out = attention(q, k, v, scale="none").output
    report = check(q, k, v, {"output": out}, scale="none")
    assert report.gate == ()
    assert report.passed
    assert by_name(report)["findings"].status == "warn"

    gated = check(q, k, v, {"output": out}, CheckSettings(fail_on=("overflow",)), scale="none")
    overflow = by_name(gated)["findings.overflow"]
    assert overflow.status == "fail"
    # every overflow finding counts, whatever the format: float16 and float8 alike
    dtypes = {f["dtype"] for f in overflow.details["findings"]}
    assert {"float16", "float8_e4m3fn"} <= dtypes
    assert overflow.details["count"] == len(overflow.details["findings"])
    assert not gated.passed


def test_non_finite_inputs_fail_a_check_without_exports() -> None:
    q, k, v = overflow_case("float64")
    q[0, 0] = math.nan
    report = check(q, k, v, scale="none")
    nonfinite = by_name(report)["findings.nonfinite"]
    assert nonfinite.status == "fail"
    assert nonfinite.index == (0, 0)
    assert not report.passed


@pytest.mark.parametrize(("severity", "fails"), [("warning", True), ("error", False)])
def test_fail_on_severity_fails_at_or_above_it(severity: str, fails: bool) -> None:
    """The overflow case's findings are warnings (float16 overflow, a one-hot row), no errors."""
    q, k, v = overflow_case("float64")
    out = attention(q, k, v, scale="none").output
    report = check(q, k, v, {"output": out}, CheckSettings(fail_on_severity=severity), scale="none")
    gate = by_name(report)["findings.severity"]
    assert (gate.status == "fail") is fails
    assert report.passed is not fails
    # findings gated by severity are not warned about a second time
    assert by_name(report)["findings"].status == ("pass" if fails else "warn")


def test_a_gated_row_kind_counts_every_row_beyond_max_findings() -> None:
    q, k, v = no_key_case()
    report = check(
        q,
        k,
        v,
        settings=CheckSettings(fail_on=("fully_masked",)),
        thresholds=Thresholds(max_findings=1),
        causal=True,
        causal_align="lower-right",
    )
    gate = by_name(report)["findings.fully_masked"]
    assert gate.status == "fail"
    assert gate.details["count"] == 2
    assert gate.summary.startswith("2 fully_masked findings")
    assert gate.index == (0, 0)


def test_check_to_dict_is_the_json_record() -> None:
    q, k, v, oracle = causal_case()
    out = oracle.output.copy()
    out[1, 0, 2] += 0.5
    d = by_name(check(q, k, v, {"output": out}, causal=True))["output.close"].to_dict()
    assert d["name"] == "output.close"
    assert (d["passed"], d["status"]) == (False, "fail")
    assert d["index"] == [1, 0, 2]
    assert d["file"] == "output.npy"
    assert d["tolerance"] == {"rtol": 1e-7, "atol": 1e-7, "source": "float64 defaults"}
    assert d["mismatch"]["mismatched"] == 1


# --- dtype-aware tolerances on rounded exports (ml_dtypes, no PyTorch needed) -------------------


def fp16_case() -> tuple[NDArray[np.float16], NDArray[np.float16], NDArray[np.float16], F64]:
    """float16 inputs (2, 4, 16, 8), causal, and the float64 oracle's output."""
    q, k, v = (normal(s, 2, 4, 16, 8).astype(np.float16) for s in (41, 42, 43))
    return q, k, v, attention(q, k, v, causal=True).output


def test_a_correctly_rounded_float16_output_passes_the_float16_defaults() -> None:
    q, k, v, exact = fp16_case()
    rounded = exact.astype(np.float16)
    report = assert_attention_close(q, k, v, output=rounded, causal=True)
    assert (report.export_dtype, report.reference) == ("float16", "float32")
    m = by_name(report)["output.close"].mismatch
    assert m is not None
    # Rounding to nearest float16 is off by at most half an ulp: 2^-11 relative.
    assert m.max_abs <= 2**-11 * np.abs(exact).max() + 1e-6


def test_a_correctly_rounded_float16_output_fails_float32_strict_tolerances() -> None:
    q, k, v, exact = fp16_case()
    rounded = exact.astype(np.float16)
    with pytest.raises(AssertionError, match=r"FAIL output\.close") as caught:
        assert_attention_close(
            q, k, v, output=rounded, causal=True, rtol=STRICT_RTOL, atol=STRICT_ATOL
        )
    # the elements whose rounding error exceeds 1e-5 + 1.3e-6·|r|, by the oracle: most
    err = np.abs(rounded.astype(np.float64) - exact)
    beyond = int((err > 1e-5 + 1.3e-6 * np.abs(exact)).sum())
    assert beyond > exact.size // 2
    found = re.search(r"mismatched elements: ([\d,]+) / ([\d,]+)", str(caught.value))
    assert found is not None
    assert found.group(2) == f"{exact.size:,}"
    assert abs(int(found.group(1).replace(",", "")) - beyond) <= exact.size // 100


def test_a_float16_output_off_by_a_hundredth_fails_at_that_index() -> None:
    q, k, v, exact = fp16_case()
    wrong = exact.astype(np.float16)
    wrong[1, 2, 5, 3] = np.float16(exact[1, 2, 5, 3] + 1e-2)
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(q, k, v, output=wrong, causal=True)
    message = str(caught.value)
    assert "mismatched elements: 1 / 1,024" in message
    assert "worst element: index [1, 2, 5, 3]" in message
    assert "greatest absolute difference: 0.01" in message


def test_a_correctly_rounded_bfloat16_output_passes_its_defaults_and_fails_float32s() -> None:
    q, k, v, exact = causal_case()
    rounded = bf16(exact.output)
    report = check(q, k, v, {"output": rounded}, causal=True)
    assert report.export_dtype == "bfloat16"
    assert report.passed
    strict = check(
        q, k, v, {"output": rounded}, CheckSettings(rtol=STRICT_RTOL, atol=STRICT_ATOL), causal=True
    )
    assert not strict.passed

    wrong = rounded.copy()
    wrong[0, 2, 1] = bf16(np.array(exact.output[0, 2, 1] + 0.1))
    close = by_name(check(q, k, v, {"output": wrong}, causal=True))["output.close"]
    assert close.status == "fail"
    assert close.index == (0, 2, 1)
    assert close.mismatch is not None
    assert close.mismatch.mismatched == 1


def test_measured_tolerance_is_at_least_fudge_times_the_floors() -> None:
    q, k, v, exact = fp16_case()
    report = assert_attention_close(
        q, k, v, output=exact.astype(np.float16), causal=True, tolerance="measured", fudge=2.0
    )
    tol = by_name(report)["output.close"].tolerance
    assert tol is not None
    assert tol.source.startswith("measured")
    assert tol.rtol >= 2 * 1e-3
    assert tol.atol >= 2 * 1e-3


# --- real float16 and bfloat16 kernels (PyTorch on the CPU) -------------------------------------


def torch_case(dtype: Any) -> tuple[Any, Any, Any, Any]:
    """Causal (2, 4, 64, 32) attention in ``dtype`` by PyTorch's own kernel."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g).to(dtype) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return q, k, v, out


@needs_torch
def test_torch_float16_output_passes_the_float16_floors_and_not_float32s() -> None:
    q, k, v, out = torch_case(torch.float16)
    report = assert_attention_close(q, k, v, output=out, causal=True)
    assert report.export_dtype == "float16"
    with pytest.raises(AssertionError, match=r"FAIL output\.close") as caught:
        assert_attention_close(q, k, v, output=out, causal=True, rtol=STRICT_RTOL, atol=STRICT_ATOL)
    found = re.search(r"mismatched elements: ([\d,]+) / 16,384", str(caught.value))
    assert found is not None
    assert int(found.group(1).replace(",", "")) > 16384 // 2


@needs_torch
def test_torch_float16_output_misses_assert_closes_float16_defaults_as_torch_says() -> None:
    """assert_close's float16 defaults (rtol 1e-3, atol 1e-5) are tighter than the
    kernel: a few percent of the elements miss them, the same count torch reports."""
    q, k, v, out = torch_case(torch.float16)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True
    )
    torch_misses = int((~torch.isclose(out.double(), ref, rtol=1e-3, atol=1e-5)).sum())
    assert not torch_passes(out.double().numpy(), ref.numpy(), 1e-3, 1e-5, False)
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(
            q, k, v, output=out, causal=True, rtol=1e-3, atol=1e-5, reference="float64"
        )
    found = re.search(r"mismatched elements: ([\d,]+) / 16,384", str(caught.value))
    assert found is not None
    ours = int(found.group(1).replace(",", ""))
    assert ours == torch_misses
    assert 0.02 * 16384 < ours < 0.15 * 16384


@needs_torch
def test_torch_bfloat16_output_passes_measured_tolerances() -> None:
    q, k, v, out = torch_case(torch.bfloat16)
    report = assert_attention_close(q, k, v, output=out, causal=True, tolerance="measured")
    assert report.export_dtype == "bfloat16"
    tol = by_name(report)["output.close"].tolerance
    assert tol is not None
    assert tol.atol >= 2 * 1e-3
    assert tol.rtol >= 2 * 1.6e-2


@needs_torch
def test_torch_bfloat16_output_misses_the_bfloat16_floors_on_a_handful() -> None:
    """Measured on PyTorch's CPU bfloat16 kernel: a handful of elements land just outside
    rtol 1.6e-2, atol 1e-3 (the reason PyTorch's own kernel tests measure their
    tolerances). The report's figures must say so coherently, and hint at measured."""
    q, k, v, out = torch_case(torch.bfloat16)
    spec = build_spec(
        q.float().numpy(),
        k.float().numpy(),
        v.float().numpy(),
        options=parse_options({"causal": True, "dtype": "bfloat16"}),
    )
    exported = [Expected("output", out.float().numpy(), "out")]
    report = run_checks(spec, exported, CheckSettings(tolerance="dtype"))
    close = by_name(report)["output.close"]
    m = close.mismatch
    assert m is not None
    assert 1 <= m.mismatched <= 16
    assert m.passing_atol is not None
    assert m.passing_rtol is not None
    assert m.passing_atol > 1e-3
    assert m.passing_rtol > 1.6e-2
    assert m.worst_at is not None
    assert m.worst_actual is not None
    assert m.worst_reference is not None
    assert abs(m.worst_actual - m.worst_reference) > 1e-3 + 1.6e-2 * abs(m.worst_reference)
    assert out.float()[m.worst_at].item() == m.worst_actual
    assert close.hint is not None  # the measured tolerance would pass it, and says so
    assert "passes --tolerance measured" in close.hint
    # The default judgement (against the plain bfloat16 computation) passes it.
    default = by_name(run_checks(spec, exported))["output.close"]
    assert default.passed, default.summary
    assert default.tolerance is not None
    assert default.tolerance.factor == 2.0


# --- assert_attention_close -----------------------------------------------------------------------


def test_assert_attention_close_returns_the_report_when_everything_passes() -> None:
    q, k, v, oracle = causal_case()
    lse = loop_lse(oracle.masked)
    report = assert_attention_close(
        q, k, v, output=oracle.output, weights=oracle.weights, lse=lse, causal=True
    )
    assert report.passed
    assert [c.name for c in report.checks][-2:] == ["lse.weights", "findings"]


def test_assert_attention_close_raises_with_the_mismatch_report() -> None:
    q, k, v, oracle = causal_case()
    out = oracle.output.copy()
    out[1, 0, 2] += 0.5
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(q, k, v, output=out, causal=True)
    message = str(caught.value)
    assert message.startswith(
        "sdpa check: 2 of 4 checks failed, output.range and output.close "
        "(export float64, reference float64):"
    )
    assert "FAIL output.range" in message
    assert "FAIL output.close" in message
    assert "mismatched elements: 1 / 18" in message
    assert "greatest absolute difference: 0.5 at index [1, 0, 2]" in message
    assert "worst element: index [1, 0, 2]" in message
    assert "tolerance: rtol 1e-07, atol 1e-07 (float64 defaults)" in message
    assert "PASS output.finite" in message


def test_assert_attention_close_takes_options_as_keywords() -> None:
    """key_lengths=[2, 5]: batch item 0 sees keys 0 and 1 only."""
    q, k, v = normal(51, 2, 1, 3, 4), normal(52, 2, 1, 5, 4), normal(53, 2, 1, 5, 3)
    oracle = attention(q, k, v, key_lengths=(2, 5))
    assert assert_attention_close(q, k, v, weights=oracle.weights, key_lengths=[2, 5]).passed
    with pytest.raises(AssertionError, match=r"FAIL weights\.rows"):
        assert_attention_close(q, k, v, weights=attention(q, k, v).weights, key_lengths=[2, 5])


def test_assert_attention_close_raises_spec_errors_for_bad_settings() -> None:
    q, k, v, oracle = causal_case()
    with pytest.raises(SpecError) as caught:
        assert_attention_close(q, k, v, output=oracle.output, rtol=1e-3)
    assert caught.value.where == "--rtol/--atol"
    with pytest.raises(SpecError):
        assert_attention_close(q, k, v, output=oracle.output, causal="yes")


@needs_torch
def test_a_bfloat16_tensor_is_judged_as_bfloat16() -> None:
    q, k, v, oracle = causal_case()
    as_bf16 = torch.from_numpy(oracle.output).to(torch.bfloat16)
    report = assert_attention_close(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), output=as_bf16, causal=True
    )
    assert report.export_dtype == "bfloat16"
    tol = by_name(report)["output.close"].tolerance
    assert tol is not None
    assert tol.factor == 2.0
    assert "the plain bfloat16 computation" in tol.source


# --- hints: the one option a failed export agrees with -------------------------------------------


def test_an_export_without_the_causal_mask_gets_a_no_causal_hint() -> None:
    q, k, v, _ = causal_case()
    full = attention(q, k, v)  # the kernel forgot the mask
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(q, k, v, output=full.output, weights=full.weights, causal=True)
    report = check(q, k, v, {"output": full.output, "weights": full.weights}, causal=True)
    for name in ("output.close", "weights.close"):
        hint = by_name(report)[name].hint
        assert hint is not None
        assert "--no-causal" in hint
    assert "hint: the export matches the computation with --no-causal" in str(caught.value)


def test_an_export_scaled_by_one_over_e_gets_a_scale_hint() -> None:
    """Scaled by 1/E = 1/4 where 1/√E = 1/2 was asked: the logits are halved."""
    q, k, v, _ = causal_case()
    wrong = attention(q, k, v, causal=True, scale=0.25)
    close = by_name(check(q, k, v, {"output": wrong.output}, causal=True))["output.close"]
    assert close.status == "fail"
    assert close.hint is not None
    assert "--scale dk" in close.hint
    assert close.to_dict()["hint"] == close.hint


def test_a_plainly_wrong_export_gets_no_hint() -> None:
    q, k, v, oracle = causal_case()
    out = oracle.output.copy()
    out[1, 0, 2] += 0.5
    close = by_name(check(q, k, v, {"output": out}, causal=True))["output.close"]
    assert close.status == "fail"
    assert close.hint is None
    assert "hint" not in close.to_dict()


# --- properties --------------------------------------------------------------------------------------

VALUES = st.floats(-2, 2, allow_nan=False, allow_infinity=False)


@st.composite
def cases(draw: st.DrawFn, positional: bool = True) -> tuple[F64, F64, F64, F64, dict[str, Any]]:
    """Small problems (H, L, E), (H, S, E), (H, S, Ev), a boolean mask, and options."""
    H, L, S = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    E, Ev = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    q = draw(arrays(np.float64, (H, L, E), elements=VALUES))
    k = draw(arrays(np.float64, (H, S, E), elements=VALUES))
    v = draw(arrays(np.float64, (H, S, Ev), elements=VALUES))
    mask = draw(arrays(np.bool_, (H, L, S), elements=st.booleans()))
    options: dict[str, Any] = {
        "scale": draw(st.sampled_from(["sqrt-dk", "none", 0.7])),
        "softcap": draw(st.none() | st.just(5.0)),
        "mask_value": draw(st.sampled_from([-math.inf, -1e9])),
    }
    if positional:
        options["causal"] = draw(st.booleans())
        options["causal_align"] = draw(st.sampled_from(["upper-left", "lower-right"]))
        options["alibi"] = draw(st.booleans())
    return q, k, v, mask, options


@BOUNDED
@given(cases(), st.sampled_from(["float64", "float32"]))
def test_the_oracles_own_exports_pass_every_check(
    case: tuple[F64, F64, F64, F64, dict[str, Any]], dtype: str
) -> None:
    q, k, v, mask, options = case
    # the kernel saw the inputs in the export's format (the reference starts there too)
    q, k, v = (x.astype(dtype).astype(np.float64) for x in (q, k, v))
    oracle = attention(q, k, v, mask=mask, **options)
    exports = {
        "output": oracle.output.astype(dtype),
        "weights": oracle.weights.astype(dtype),
        "lse": loop_lse(oracle.masked).astype(dtype),
    }
    report = check(q, k, v, exports, mask=mask, **options)
    assert report.export_dtype == dtype
    assert report.failed == (), [c.summary for c in report.failed]


@BOUNDED
@given(cases(positional=False), st.randoms(use_true_random=False), st.booleans())
def test_permuting_keys_and_values_keeps_the_verdict(
    case: tuple[F64, F64, F64, F64, dict[str, Any]], random: Any, wrong: bool
) -> None:
    """The output does not depend on the order of the keys; the weights follow it."""
    q, k, v, mask, options = case
    oracle = attention(q, k, v, mask=mask, **options)
    out, w = oracle.output.copy(), oracle.weights.copy()
    if wrong:  # an error far beyond the float64 tolerance, at a drawn place
        out[random.randrange(out.shape[0]), random.randrange(out.shape[1]), 0] += 1e-3
    S = k.shape[1]
    perm = np.array(random.sample(range(S), S))
    plain = check(q, k, v, {"output": out, "weights": w}, mask=mask, **options)
    permuted = check(
        q,
        k[:, perm],
        v[:, perm],
        {"output": out, "weights": w[..., perm]},
        mask=mask[..., perm],
        **options,
    )
    assert plain.passed is permuted.passed is (not wrong)
    # Every check but the findings gate: the mask heuristic looks at the diagonal
    # (a self-attention mask that hides it is suspect), which moves with the keys.
    assert {n: s for n, s in statuses(plain).items() if n != "findings"} == {
        n: s for n, s in statuses(permuted).items() if n != "findings"
    }


def test_the_mask_heuristic_depends_on_the_diagonal_so_permuting_keys_can_change_it() -> None:
    """Found by hypothesis: a boolean mask hiding most keys is a warning when it also
    hides the diagonal, else info; permuting the keys moves the diagonal."""
    zeros = np.zeros((1, 3, 1))
    mask = np.array([[[True, False, False], [True, False, False], [False, True, False]]])
    plain = check(zeros, zeros, zeros, {}, mask=mask)
    perm = np.array([0, 2, 1])
    permuted = check(zeros, zeros[:, perm], zeros[:, perm], {}, mask=mask[..., perm])
    kinds = {(f.kind, f.severity) for f in plain.diagnosis.findings}
    moved = {(f.kind, f.severity) for f in permuted.diagnosis.findings}
    assert ("mask_suspect", "warning") in kinds
    assert ("mask_suspect", "info") in moved


# --- regressions (bugs found while writing these tests) -----------------------------------------


def test_passing_rtol_passes_when_used() -> None:
    """|0.37 − 0.3| = 0.07 with atol 0.01 needs rtol 0.2; computed as (Δ − atol)/|r| it
    comes out a rounding step short, and 0.01 + rtol·0.3 < Δ: the element still fails."""
    a, r = np.array([0.37]), np.array([0.3])
    m = compare(a, r, rtol=0.0, atol=0.01)
    assert m.passing_rtol is not None
    assert compare(a, r, rtol=m.passing_rtol, atol=0.01).mismatched == 0


def test_the_tolerances_the_report_suggests_do_pass() -> None:
    """Greatest |Δ| 0.0012345: the message suggests atol ≥ 0.00123, which does not pass."""
    q, k, v, oracle = causal_case()
    out = oracle.output.copy()
    out[0, 1, 1] += 0.0012345
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(q, k, v, output=out, causal=True, rtol=1e-7, atol=1e-7)
    found = re.search(r"would pass with: atol ≥ (\S+)", str(caught.value))
    assert found is not None
    assert assert_attention_close(
        q, k, v, output=out, causal=True, rtol=1e-7, atol=float(found.group(1))
    ).passed


def test_the_oracle_passes_under_a_small_finite_mask_value() -> None:
    """mask_value −1 replaces hidden logits by −1: hidden keys keep e^−1-ish weight in the
    reference itself, yet weights.rows and output.range demand they get none."""
    q, k, v = np.zeros((1, 2, 1)), np.zeros((1, 3, 1)), np.array([[[0.0], [1.0], [2.0]]])
    oracle = attention(q, k, v, causal=True, mask_value=-1.0)
    assert oracle.weights[0, 0, 2] > 0.2  # the premise: hidden key 2 gets weight
    report = check(
        q, k, v, {"output": oracle.output, "weights": oracle.weights}, causal=True, mask_value=-1.0
    )
    assert report.failed == (), [c.summary for c in report.failed]


def test_the_oracle_passes_with_a_float_mask_row_of_minus_inf_and_a_finite_mask_value() -> None:
    q, k, v = np.zeros((2, 1)), np.zeros((3, 1)), np.array([[1.0], [2.0], [3.0]])
    mask = np.array([[-math.inf, -math.inf, -math.inf], [0.0, 0.0, -math.inf]])
    oracle = attention(q, k, v, mask=mask, mask_value=-1e9)
    assert np.all(oracle.weights[0] == 0.0)  # the premise: softmax of all −inf is zeros
    report = check(
        q, k, v, {"output": oracle.output, "weights": oracle.weights}, mask=mask, mask_value=-1e9
    )
    assert report.failed == (), [c.summary for c in report.failed]


def test_rows_summary_under_a_finite_mask_value_says_rows_without_keys_sum_to_one() -> None:
    q, k, v = no_key_case()
    opts: dict[str, Any] = {"causal": True, "causal_align": "lower-right", "mask_value": -1e9}
    oracle = attention(q, k, v, **opts)
    rows = by_name(check(q, k, v, {"weights": oracle.weights}, **opts))["weights.rows"]
    assert rows.status == "pass"
    assert rows.summary.startswith("all 4 rows sum to 1")  # no-key rows are spread: they sum to 1


# --- the reference starts from the inputs the kernel saw ------------------------------------


@needs_torch
def test_float32_inputs_of_a_bfloat16_kernel_are_rounded_before_the_reference() -> None:
    """Q, K, V stored in float32, the kernel run on their bfloat16 rounding: the
    reference starts from the rounded inputs (as PyTorch's kernel tests build it), so
    the faithful export passes, and its error is the kernel's, not the inputs'."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 128, 64, generator=g) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True
    )
    spec = build_spec(
        q.numpy(),
        k.numpy(),
        v.numpy(),
        options=parse_options({"causal": True, "dtype": "bfloat16"}),
    )
    report = run_checks(spec, [Expected("output", out.float().numpy(), "out")])
    close = by_name(report)["output.close"]
    assert close.passed, close.summary
    rounded = torch.nn.functional.scaled_dot_product_attention(
        q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), is_causal=True
    )
    kernel_rms = float(((out.double() - rounded) ** 2).mean().sqrt())
    assert close.details["rms_error"] == pytest.approx(kernel_rms, rel=0.05)
    unrounded = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True
    )
    assert float(((out.double() - unrounded) ** 2).mean().sqrt()) > 1.5 * kernel_rms


def test_a_float32_bias_keeps_its_dtype_under_an_emulated_format() -> None:
    """--dtype bfloat16 --logits-dtype float32 with a float32 bias: the bias is added
    as stored (JAX keeps it in float32), not rounded to bfloat16 first."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(1, 1, 4, 8)) for _ in range(3))
    bias = (rng.normal(size=(4, 4)) * 3).astype(np.float32)
    options = parse_options({"dtype": "bfloat16", "logits_dtype": "float32"})
    t = trace(build_spec(q, k, v, bias=bias, options=options), ("scaled", "biased"))
    assert t.scaled is not None
    assert t.biased is not None
    expected = (t.scaled + bias.astype(np.float64)).astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(t.biased, expected)
    rounded_first = t.scaled + bias.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert not np.array_equal(t.biased, rounded_first.astype(np.float32).astype(np.float64))
