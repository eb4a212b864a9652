"""The kernel-relative judgement (``sdpa_cli.check.relative``): an export against the
plain computation in its format, element by element and slice by slice."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest

from sdpa_cli.check import error_stats as error_stats_module
from sdpa_cli.check.compare import Judgement, compare
from sdpa_cli.check.error_stats import error_limit_check, error_stats
from sdpa_cli.check.records import failure_lines
from sdpa_cli.check.relative import relative_check, ulp
from sdpa_cli.check.structure import slice_line


@pytest.mark.parametrize(
    ("x", "fmt", "spacing"),
    [
        (1.0, "bfloat16", 2.0**-7),
        (1.5, "bfloat16", 2.0**-7),
        (0.75, "float16", 2.0**-11),
        (1000.0, "float16", 0.5),
        (0.0, "float16", 2.0**-24),
        (1.0, "float32", 2.0**-23),
    ],
)
def test_ulp_is_the_formats_spacing_at_that_magnitude(x: float, fmt: str, spacing: float) -> None:
    assert ulp(np.array([x, -x]), fmt).tolist() == [spacing, spacing]


def judged(actual: np.ndarray, reference: np.ndarray, plain: np.ndarray, **kw: Any):  # type: ignore[no-untyped-def]
    return relative_check(
        "output",
        actual,
        reference,
        plain,
        Judgement("float16", **kw),
        "out.npy",
        False,
        rows=True,
        slices=2,
    )


def noisy_case(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (1, 4, 64, 16) reference; the plain computation off by ~1e-2 (a few float16
    ulps at the rows' scale), the export by half as much (independent noise)."""
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=(1, 4, 64, 16))
    plain = ref + rng.normal(scale=1e-2, size=ref.shape)
    export = ref + rng.normal(scale=5e-3, size=ref.shape)
    return export, ref, plain


def test_an_export_no_worse_than_the_plain_computation_passes() -> None:
    export, ref, plain = noisy_case()
    c = judged(ref + 0.5 * (plain - ref), ref, plain)
    assert c.status == "pass", c.summary
    assert c.details["rms_error"] == pytest.approx(0.5 * c.details["plain_rms_error"])
    assert c.details["factor_needed"] == pytest.approx(0.5)  # half the plain error
    assert c.details["shifted_slices"] == []
    assert judged(export, ref, plain, factor=1000.0).status == "pass"


def test_an_element_three_times_the_slices_largest_plain_error_fails_there() -> None:
    """Each element is allowed twice the plain computation's largest error in its
    (batch, head) slice: one element three times it fails, and is named."""
    _, ref, plain = noisy_case()
    export = ref + 0.5 * (plain - ref)
    at = (0, 2, 10, 3)
    largest = float(np.max(np.abs(plain[0, 2] - ref[0, 2])))
    export[at] = ref[at] + 3.0 * largest
    c = judged(export, ref, plain, floor_ulps=0.0)
    assert c.status == "fail"
    assert c.mismatch is not None
    assert c.mismatch.mismatched == 1
    assert c.mismatch.worst_at == at
    assert c.details["factor_needed"] == pytest.approx(3.0)
    assert "would pass at 3×" in c.summary
    export[at] = ref[at] + 1.9 * largest  # within twice the slice's largest
    assert judged(export, ref, plain, floor_ulps=0.0).status == "pass"


def test_the_floor_admits_an_element_the_plain_computation_got_exactly() -> None:
    """Where the plain computation lands on the reference, an element may still be a
    floor (2 float16 ulp at the row's scale, 2**-10 each at 1.0) times the factor off."""
    ref = np.full((1, 1, 2, 4), 1.0)
    plain = ref.copy()  # exact by chance
    one_off = ref.copy()
    one_off[0, 0, 1, 2] += 4 * 2.0**-10
    assert judged(one_off, ref, plain).status == "pass"
    one_off[0, 0, 1, 2] += 2.0**-10
    assert judged(one_off, ref, plain).status == "fail"
    # every element two ulp off the same way is a shift, not rounding
    c = judged(ref + 2 * 2.0**-10, ref, plain)
    assert c.status == "fail"
    assert c.mismatch is not None
    assert c.mismatch.mismatched == 0
    assert [s["index"] for s in c.details["shifted_slices"]] == [[0, 0]]


def test_a_head_shifted_by_twice_its_rounding_error_is_named() -> None:
    _, ref, plain = noisy_case(1)
    export = ref + 0.5 * (plain - ref)
    rms = float(np.sqrt(np.mean((export - ref) ** 2)))
    export[0, 1] += 2 * rms
    c = judged(export, ref, plain)
    assert c.mismatch is not None
    assert c.mismatch.mismatched == 0  # every element within twice the largest plain error
    assert c.status == "fail"
    assert [s["index"] for s in c.details["shifted_slices"]] == [[0, 1]]
    assert c.details["shifted_slices"][0]["mean_error"] == pytest.approx(2 * rms, rel=0.05)
    assert "1 slice shifted: [0, 1]" in c.summary


def test_error_stats_are_polygraphys_figures() -> None:
    ref = np.array([[[1.0, 2.0, 4.0, 8.0]]])
    actual = ref + np.array([[[0.1, -0.2, 0.4, 0.0]]])
    stats = error_stats(actual, ref, 2)
    assert stats["abs"]["mean"] == pytest.approx(0.175)
    assert stats["abs"]["median"] == pytest.approx(0.15)
    assert stats["abs"]["max"] == pytest.approx(0.4)
    assert stats["rel"]["max"] == pytest.approx(0.1)
    cos = float(actual.ravel() @ ref.ravel() / np.linalg.norm(actual) / np.linalg.norm(ref))
    assert stats["cosine"]["min"] == pytest.approx(cos)
    assert stats["cosine"]["min_at"] == [0]


@pytest.mark.parametrize("kept", [True, False], ids=["errors-kept", "bits-histograms"])
@pytest.mark.parametrize("seed", range(4))
def test_error_quantiles_read_by_their_bits_equal_numpys(
    seed: int, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # above KEEP_ELEMENTS the quantiles are found from two histograms of the float32
    # errors' bits, never holding them all; below, from the errors kept: both exactly
    # np.quantile of those float32 errors, on data with ties, exact matches (0), a zero
    # reference missed (inf) and NaN pairs left out
    if not kept:
        monkeypatch.setattr(error_stats_module, "KEEP_ELEMENTS", 0)
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=(3, 5, 37, 11))
    actual = ref + rng.normal(size=ref.shape) * 10.0 ** rng.integers(-9, -2, size=ref.shape)
    actual[rng.random(ref.shape) < 0.2] = ref[rng.random(ref.shape) < 0.2][:1]
    exact = rng.random(ref.shape) < 0.1
    actual[exact] = ref[exact]
    ref[0, 0, 0, :3] = 0.0
    actual[1, 2, 3, 4] = np.nan
    stats = error_stats(actual, ref, 2)
    finite = np.isfinite(actual) & np.isfinite(ref)
    diff = np.abs(actual - ref)[finite]
    mag = np.abs(ref)[finite]
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(mag > 0, diff / mag, np.where(diff > 0, np.inf, 0.0))
    for kind, values in (("abs", diff), ("rel", rel)):
        want = np.quantile(values.astype(np.float32), [0.5, 0.9, 0.99])
        got = [stats[kind][q] for q in ("median", "p90", "p99")]
        assert got == [float(x) for x in want], kind


@pytest.mark.parametrize("piece", [5, 37 * 11, 3 * 37 * 11])
def test_error_stats_read_in_pieces_equal_one_read(
    piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pieces inside a slice, a slice's rows, several slices: the same figures
    rng = np.random.default_rng(5)
    ref = rng.normal(size=(3, 5, 37, 11))
    actual = ref + rng.normal(size=ref.shape) * 1e-4
    actual[2, 1] += rng.normal(size=(37, 11)) * 0.1  # one slice with a lower cosine
    monkeypatch.setattr(error_stats_module, "KEEP_ELEMENTS", 0)  # the histograms' path
    whole = error_stats(actual, ref, 2)
    monkeypatch.setattr(error_stats_module, "PIECE", piece)
    pieces = error_stats(actual, ref, 2)
    for kind in ("abs", "rel"):
        for stat in ("median", "p90", "p99", "max"):
            assert pieces[kind][stat] == whole[kind][stat]
        assert pieces[kind]["mean"] == pytest.approx(whole[kind]["mean"], rel=1e-12)
    assert pieces["cosine"]["min"] == pytest.approx(whole["cosine"]["min"], rel=1e-12)
    assert pieces["cosine"]["min_at"] == whole["cosine"]["min_at"] == [2, 1]


def test_one_bad_row_is_named_not_its_slice() -> None:
    export, ref, plain = noisy_case(2)
    export = ref + 0.5 * (plain - ref)
    export[0, 3, 17] = np.roll(export[0, 3, 17], 1)
    c = judged(export, ref, plain)
    assert c.status == "fail"
    assert [r["index"] for r in c.details["outlier_rows"]] == [[0, 3, 17]]
    assert "the error is in row [0, 3, 17]" in c.summary


def test_a_whole_bad_head_is_named_as_its_slice() -> None:
    export, ref, plain = noisy_case(3)
    export = ref + 0.5 * (plain - ref)
    export[0, 2] = ref[0, 2] * 1.05
    c = judged(export, ref, plain)
    assert c.status == "fail"
    assert [r["index"] for r in c.details["outlier_slices"]] == [[0, 2]]
    assert len(c.details["outlier_rows"]) == 5  # the worst five of its 64 rows
    assert "the error is in slice [0, 2]" in c.summary


def test_a_faithful_export_names_nothing() -> None:
    _, ref, plain = noisy_case(4)
    c = judged(ref + 0.5 * (plain - ref), ref, plain)
    assert c.details["outlier_rows"] == []
    assert c.details["outlier_slices"] == []


def test_error_limits_fail_on_the_statistic_beyond_them() -> None:
    ref = np.array([[[1.0, 2.0, 4.0, 8.0]]])
    stats = error_stats(ref + np.array([[[0.1, -0.2, 0.4, 0.0]]]), ref, 2)
    ok = error_limit_check("output", stats, (("abs_max", 0.5), ("cosine_min", 0.99)), "o")
    assert ok.status == "pass"
    assert ok.summary == "abs_max 0.4 ≤ 0.5; cosine_min 1 − 0.00108 ≥ 0.99"
    bad = error_limit_check("output", stats, (("abs_p99", 0.1), ("rel_max", 0.2)), "o")
    assert bad.status == "fail"
    assert bad.summary == "abs_p99 0.394 > 0.1"  # 0.2 + 0.97 · (0.4 − 0.2), linear


def test_the_figures_the_rule_reads_first_are_those_of_a_plain_comparison() -> None:
    # rtol 0, atol inf (the rule's own first look) takes a shorter path than any
    # other tolerance: its figures must be the same ones
    rng = np.random.default_rng(7)
    r = rng.standard_normal((3, 5, 7))
    r[1, 2, 3] = 0.0
    a = r + rng.standard_normal(r.shape) * 1e-3
    a[0, 0, 0] = np.nan
    short = compare(a, r, 0.0, math.inf)
    long = compare(a, r, 0.0, 1e300)
    for field in ("total", "mismatched", "max_abs", "max_abs_at", "max_rel", "max_rel_at"):
        assert getattr(short, field) == getattr(long, field), field
    assert short.max_rel == math.inf  # the zero reference, missed
    assert short.max_abs == float(np.nanmax(np.abs(a - r)))
    assert short.nan_mismatches == 1
    assert short.worst_at == (0, 0, 0)
    assert short.passing_atol is None  # no tolerance passes a NaN
    a[0, 0, 0] = r[0, 0, 0]
    assert compare(a, r, 0.0, math.inf).passing_atol == short.max_abs


# --- rounding or structure ----------------------------------------------------------------


def weights_case(seed: int, rows_off: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float32 weights of (1, 2, 9, 9) slices near uniform: the reference, and the plain
    computation and an export whose every row is the reference's times (1 + δᵢ), δᵢ a
    fraction of 2**-24 (``rows_off`` for the export): a row's normaliser rounded, all
    its weights moving with it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=0.05, size=(1, 2, 9, 9))  # near uniform, as at random init
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    ref = e / e.sum(axis=-1, keepdims=True)
    plain_off = np.array([0.5, -0.75, 0.25, -0.25, 1.0, -1.0, 0.5, -0.5, 0.25])
    plain = ref * (1.0 + plain_off[:, None] * 2.0**-24)  # its rows' sums unbiased
    export = ref * (1.0 + rows_off[:, None] * 2.0**-24)
    return export, ref, plain


def judged_weights(export: np.ndarray, ref: np.ndarray, plain: np.ndarray):  # type: ignore[no-untyped-def]
    return relative_check(
        "weights",
        export,
        ref,
        plain,
        Judgement("float32", factor=4.0),
        "w.npy",
        False,
        rows=True,
        slices=2,
    )


def test_a_rows_normaliser_rounding_is_no_shift() -> None:
    """Nine rows of weights, each a few ulp off as a whole, mostly one way (as a
    faithful float32 kernel's normalisers may round in a random-init BERT): the slice's
    mean error is known only as well as its nine rows' means vary, so no slice is
    called shifted. The same weights all moved by 8 ulp more are."""
    # each row's sum − 1 in a random-init BERT's float32 weights, in units of 2**-24
    nudges = np.array([0.625, 1.25, 0.25, 1.0, 0.25, -0.375, 0.5, 1.5, 0.25])
    c = judged_weights(*weights_case(0, nudges))
    assert c.status == "pass", c.summary
    c = judged_weights(*weights_case(0, nudges + 8.0))
    assert c.status == "fail"
    assert c.details["diagnosis"]["error"] == "structural"


def test_a_bug_is_told_where_it_sits_and_offered_no_fudge() -> None:
    """The rows from 40 on of head 2 wrong by 20%: structural, in 1 slice, rows 40–63;
    neither the summary nor the report suggests a --fudge."""
    _, ref, plain = noisy_case(5)
    export = ref + 0.5 * (plain - ref)
    export[0, 2, 40:] *= 1.2
    c = judged(export, ref, plain)
    assert c.status == "fail"
    d = c.details["diagnosis"]
    assert d["error"] == "structural"
    assert d["slices"] == [[0, 2]]
    assert d["rows"] == [[40, 63]]
    assert "not rounding: in 1 slice of 4 ([0, 2]), rows 40–63 of 64" in c.summary
    assert "would pass" not in c.summary
    assert c.mismatch is not None
    assert c.mismatch.passing_factor is None
    text = "\n".join(failure_lines(c))
    assert "--fudge" in text  # said only as what not to reach for
    assert "would pass with" not in text


def test_rounding_a_little_past_the_factor_is_offered_its_fudge() -> None:
    """Every element 3× the plain computation's error, spread over every slice and
    row: that looks like rounding, and the report says which --fudge passes it."""
    _, ref, plain = noisy_case(6)
    c = judged(ref + 3.0 * (plain - ref), ref, plain, floor_ulps=0.0)
    assert c.status == "fail"
    assert c.details["diagnosis"]["error"] == "rounding"
    assert "would pass with: --fudge 3" in "\n".join(failure_lines(c))


def test_each_slice_has_its_error_statistics_and_allowance() -> None:
    """JSON's per-(batch, head) figures: one entry per slice, the bad head's cosine
    lowest and its RMS error far above its plain computation's."""
    _, ref, plain = noisy_case(7)
    export = ref + 0.5 * (plain - ref)
    export[0, 1] = np.roll(ref[0, 1], 1, axis=-1)  # its features rolled by one
    c = judged(export, ref, plain)
    by_slice = c.details["error_stats"]["by_slice"]
    assert [s["index"] for s in by_slice] == [[0, 0], [0, 1], [0, 2], [0, 3]]
    bad = by_slice[1]
    assert bad["cosine"] == min(s["cosine"] for s in by_slice)
    assert bad["rms_error"] > 10 * bad["plain_rms_error"]
    assert bad["abs_max"] == pytest.approx(float(np.max(np.abs(export[0, 1] - ref[0, 1]))))
    good = by_slice[0]
    assert good["rms_error"] == pytest.approx(0.5 * good["plain_rms_error"])
    assert good["beyond"] == 0 < bad["beyond"]
    assert good["allowed"] >= 2 * float(np.max(np.abs(plain[0, 0] - ref[0, 0])))
    line = slice_line(by_slice)
    assert line is not None
    assert line.startswith("by slice, RMS error ÷ the plain computation's: worst [0, 1] ")


def test_the_worst_element_shows_what_it_was_allowed() -> None:
    _, ref, plain = noisy_case(8)
    export = ref + 0.5 * (plain - ref)
    at = (0, 3, 5, 7)
    export[at] += 1.0
    c = judged(export, ref, plain)
    assert c.mismatch is not None
    assert c.mismatch.worst_at == at
    largest = float(np.max(np.abs(plain[0, 3] - ref[0, 3])))
    assert c.mismatch.worst_allowed == pytest.approx(2.0 * largest)
    assert any(
        line.startswith("at the worst element: |Δ| ") and ", allowed " in line
        for line in failure_lines(c)
    )


def test_a_quantile_between_two_infinite_relative_errors_is_inf() -> None:
    """A zero reference missed has an infinite relative error; numpy's interpolation
    between two of them is inf − inf (NaN, and a RuntimeWarning): the p99 is inf."""
    ref = np.zeros((1, 1, 4, 8))
    ref[..., :2] = 1.0
    actual = ref + 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = error_stats(actual, ref, 2)
    assert stats["rel"]["p99"] == math.inf
    assert stats["rel"]["median"] == math.inf  # 24 of 32 are infinite


def test_a_constant_factor_is_named_and_its_largest_rows_are_not_called_where_it_sits() -> None:
    """The export 3× the reference: a few rows 100× larger than the others have the
    largest errors, but the factor is the bug, over every row."""
    rng = np.random.default_rng(3)
    ref = rng.normal(size=(1, 4, 64, 16))
    ref[:, :, 5] *= 100.0
    plain = ref + rng.normal(scale=1e-3, size=ref.shape)
    check = judged(ref * 3.0, ref, plain)
    assert check.status == "fail"
    assert check.details["diagnosis"]["fit"]["factor"] == pytest.approx(3.0)
    assert check.details["outlier_rows"]  # the large rows stand out by their RMS error
    assert "the error is in" not in check.summary
