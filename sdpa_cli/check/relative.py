"""The default judgement of ``sdpa check``: an export against the plain computation.

A kernel in float16 or bfloat16 is judged as the FlashAttention and PyTorch kernel
tests judge their own: by how far it strays from the float64 (or float32) reference
compared with how far the same computation done plainly in the export's format
strays (the emulation ``--dtype`` runs: inputs, scores and output in the format,
softmax and accumulation in float32, as Hugging Face's eager attention computes).
Element by element, an export passes when

    |export − reference| ≤ factor · max(max over its slice of |plain − reference|, floor)

(the plain computation's largest error in the element's (batch, head) slice, as the
FlashAttention tests compare the largest errors: the kernel's errors and the plain
computation's are rounding of different sums, so element by element, or even row
by row in float32, either may be the larger), where the floor is ``FLOOR_ULPS`` unit in the last place of the format at the
output row's scale (the largest |reference| of the row): where the plain
computation happens to land exactly on the reference, a faithful kernel may still
round differently. Per (batch, head) slice the mean signed error must also stay
within what rounding allows (the plain computation's own mean error times the
factor, plus ``MEAN_SHARE`` of its RMS error, plus six standard errors of the
export's mean): a whole head shifted by a few of its own rounding errors passes
element by element, and fails here.

Pure numpy: arrays in, :class:`~sdpa_cli.check.records.Check` out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import Tolerance, compare
from sdpa_cli.check.records import Check
from sdpa_cli.engine import precision
from sdpa_cli.engine.records import argmax_index
from sdpa_cli.engine.types import F64
from sdpa_cli.text import ceil_sig, format_index, percent, plural, sig

FACTOR = 2.0
"""How much worse than the plain computation an element may be (``--fudge``), in the
16- and 8-bit formats: there the plain computation rounds its logits and weights to
the format, which kernels accumulating in float32 do not, so a faithful kernel's error
is well under it (0.25 to 1 of it, measured), and twice is a margin."""

FACTORS = {"float32": 4.0}
"""The factor where it differs: in float32 a kernel's errors and the plain
computation's are the same kind (the rounding of sums taken in other orders), and
their largest per slice differ by up to 2.1×, measured on PyTorch's kernels."""


def factor_for(export: str, fudge: float | None) -> float:
    """``--fudge`` when given, else the export format's factor."""
    return fudge if fudge is not None else FACTORS.get(export, FACTOR)


FLOOR_ULPS = 2.0
"""The floor of each element's allowance, in units in the last place of the format at
the row's scale."""

MEAN_SHARE = 0.1
"""A slice's mean signed error may reach this share of the plain computation's RMS
error (plus six standard errors of the mean) before the slice is called shifted."""

STATS_QUANTILES = {"median": 0.5, "p90": 0.9, "p99": 0.99}

ERROR_STATS = (
    *(
        f"{kind}_{stat}"
        for kind in ("abs", "rel")
        for stat in ("mean", "median", "p90", "p99", "max")
    ),
    "cosine_min",
)
"""What ``--max-error`` may limit: each at most its value, ``cosine_min`` at least."""


@dataclass(frozen=True)
class Judgement:
    """How an export is judged against the plain computation in its format."""

    export: str
    factor: float = FACTOR
    floor_ulps: float = FLOOR_ULPS

    @property
    def tolerance(self) -> Tolerance:
        """The rule as the report names it (no single rtol/atol: 0 and 0)."""
        source = (
            f"kernel: ≤ {sig(self.factor, 6)}× the plain {self.export} computation's largest "
            f"error in the (batch, head) slice, floor {sig(self.floor_ulps, 6)} ulp of the row's scale"
        )
        return Tolerance(0.0, 0.0, source, factor=self.factor)


def ulp(x: F64, name: str) -> F64:
    """The spacing of the format ``name`` at magnitude ``|x|`` (its smallest subnormal
    step at 0)."""
    f = precision.fmt(name)
    with np.errstate(divide="ignore", invalid="ignore"):
        _, e = np.frexp(np.abs(x))
    spacing = np.ldexp(f.eps, e - 1)
    # below the smallest normal number (0 included) the step is the subnormal one
    out: F64 = np.where(np.abs(x) < f.normal, f.tiny, np.maximum(spacing, f.tiny))
    return out


def _floor(reference: F64, rows: bool, judgement: Judgement) -> F64:
    """Each element's floor, broadcastable to ``reference``: ``floor_ulps`` ulp of its
    row's largest |reference| (the output and weights, rows on the last axis; shape
    ``(..., 1)``), or of its own and at least of 1 (the LSE)."""
    mags = np.abs(reference)
    if rows and reference.ndim:
        mags = np.max(mags, axis=-1, keepdims=True, initial=0.0)
    if not np.isfinite(mags).all():  # rows holding NaN or inf: their finite values' scale
        full = np.where(np.isfinite(reference), np.abs(reference), 0.0)
        mags = np.max(full, axis=-1, keepdims=True, initial=0.0) if rows else full
    if not rows:  # an LSE is m + log Σ: its rounding is at the scale of its terms, ≥ 1
        mags = np.maximum(mags, 1.0)
    return judgement.floor_ulps * ulp(mags, judgement.export)


def error_stats(actual: F64, reference: F64, slices: int) -> dict[str, Any]:
    """Polygraphy's error statistics over the finite pairs: mean, median, p90, p99
    and max of the absolute and the relative error, and per (batch, head) slice
    (the leading axes but the last ``slices``) the cosine similarity."""
    a = np.asarray(actual, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    finite = np.isfinite(a) & np.isfinite(r)
    every = bool(finite.all())
    diff = np.abs(a - r).ravel() if every else np.abs(a - r)[finite]
    mag = np.abs(r).ravel() if every else np.abs(r)[finite]
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.divide(diff, mag, out=np.zeros_like(diff), where=mag > 0)
        rel[(mag == 0) & (diff > 0)] = np.inf  # a zero reference missed by anything
    out: dict[str, Any] = {}
    for kind, values in (("abs", diff), ("rel", rel)):
        figures = {"mean": float(np.mean(values)) if values.size else 0.0}
        qs = np.quantile(values, list(STATS_QUANTILES.values())) if values.size else None
        for i, label in enumerate(STATS_QUANTILES):
            figures[label] = float(qs[i]) if qs is not None else 0.0
        figures["max"] = float(np.max(values, initial=0.0))
        out[kind] = figures
    lead = a.shape[: a.ndim - slices] if a.ndim > slices else ()
    aa = a if every else np.where(finite, a, 0.0)
    rr = r if every else np.where(finite, r, 0.0)
    aa, rr = (x.reshape((*lead, -1)) if lead else x.reshape((1, -1)) for x in (aa, rr))
    with np.errstate(divide="ignore", invalid="ignore"):
        dot = np.einsum("...i,...i->...", aa, rr)
        norms = np.linalg.norm(aa, axis=-1) * np.linalg.norm(rr, axis=-1)
        cos = np.where(norms > 0, dot / np.where(norms > 0, norms, 1.0), 1.0)
    worst = argmax_index(-cos) if cos.size else ()
    out["cosine"] = {"min": float(np.min(cos, initial=1.0)), "min_at": list(worst)}
    return out


def _by_slice(
    finite: NDArray[np.bool_], axes: int, *arrays: F64
) -> tuple[NDArray[np.int64], list[F64]]:
    """Each array (zero where ``finite`` is False) grouped by its leading index (the
    trailing ``axes`` flattened: a view), and how many finite elements each group
    holds (at least 1)."""
    lead = finite.shape[: finite.ndim - axes]
    n = np.maximum(finite.reshape((*lead, -1)).sum(axis=-1), 1)
    return n, [x.reshape((*lead, -1)) for x in arrays]


def _rms(x: F64, n: NDArray[np.int64]) -> F64:
    out: F64 = np.sqrt(np.einsum("...i,...i->...", x, x) / n)
    return out


def _shifted_slices(
    err: F64,
    plain: F64,
    floor: F64,
    finite: NDArray[np.bool_],
    slices: int,
    factor: float,
) -> tuple[list[tuple[tuple[int, ...], float, float]], float]:
    """The (batch, head) slices whose mean signed error is beyond what rounding allows,
    as (index, mean error, allowance), and the largest ratio of a slice's mean error
    to its allowance; ``plain`` is the plain computation's error and ``floor`` each
    element's floor."""
    if err.ndim <= slices:
        return [], 0.0
    n, (e, p) = _by_slice(finite, slices, err, plain)
    mean = e.sum(axis=-1) / n
    spread = np.sqrt(np.maximum(np.einsum("...i,...i->...", e, e) / n - mean * mean, 0.0))
    plain_mean = np.abs(p.sum(axis=-1) / n)
    plain_rms = _rms(p, n)
    # the floor's RMS over the slice (a row's floor stands for its elements)
    floor_rms = np.sqrt(np.mean(np.square(floor), axis=tuple(range(-slices, 0))))
    # The plain computation's own bias (times the factor), a share of its RMS error,
    # and six standard errors of the export's mean; in a slice of a few elements the
    # spread is not known, and the floor stands in for it (weighing 1/√n).
    allowed = (
        factor * plain_mean
        + MEAN_SHARE * plain_rms
        + 6.0 * np.maximum(spread, floor_rms / np.sqrt(n)) / np.sqrt(n)
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(allowed > 0, np.abs(mean) / allowed, np.where(mean != 0, np.inf, 0.0))
    out = []
    for at in zip(*np.nonzero(ratio > 1.0), strict=True):
        idx = tuple(int(x) for x in at)
        out.append((idx, float(mean[idx]), float(allowed[idx])))
    return out, float(np.max(ratio, initial=0.0))


def needs_plain(
    actual: F64, reference: F64, judgement: Judgement, *, rows: bool, slices: int
) -> NDArray[np.bool_]:
    """Per row (the array's shape without its last axis when ``rows``, else its own),
    whether the rule must read the plain computation there. Without it the rule's
    allowance is at least ``factor`` × the floor for each element, and six standard
    errors for a slice's mean: a row whose every element, and whose slice, passes that
    passes the rule whatever the plain computation's error, so a faithful kernel's
    export rarely needs the plain computation at all."""
    a = np.asarray(actual, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(a) & np.isfinite(r)
        err = np.where(finite, a - r, 0.0)
        floor = _floor(r, rows, judgement)
        beyond = finite & (np.abs(err) > judgement.factor * floor)
    need: NDArray[np.bool_] = np.array(beyond.any(axis=-1) if rows else beyond)
    zero = np.zeros_like(err)
    shifted, _ = _shifted_slices(err, zero, floor, finite, slices, judgement.factor)
    for idx, _, _ in shifted:
        need[idx] = True  # a slice's shift is judged against its whole plain computation
    return need


OUTLIER_RATIO = 8.0
"""A row (or slice) is named when its RMS error is this many times the median row's
(slice's), and more than the factor times its own plain computation's."""


def outliers(
    err: F64, plain_err: F64, finite: NDArray[np.bool_], axes: int, factor: float
) -> tuple[list[dict[str, Any]], int]:
    """The rows (``axes`` = 1) or (batch, head) slices (``axes`` = 2) whose error is far
    above the others' (:data:`OUTLIER_RATIO`), worst first, at most five, and how many
    there are: real bugs live in one head or one row."""
    if err.ndim <= axes:
        return [], 0
    n, (e, p) = _by_slice(finite, axes, err, plain_err)
    rms, plain_rms = _rms(e, n), _rms(p, n)
    median = float(np.median(rms)) if rms.size else 0.0
    far = (rms > OUTLIER_RATIO * median) & (rms > factor * plain_rms)
    order = sorted(zip(*np.nonzero(far), strict=True), key=lambda at: -float(rms[at]))
    named = [
        {
            "index": [int(x) for x in at],
            "rms_error": float(rms[at]),
            "times_median": float(rms[at] / median) if median > 0 else math.inf,
        }
        for at in order[:5]
    ]
    return named, len(order)


def relative_check(
    name: str,
    actual: F64,
    reference: F64,
    plain: F64,
    judgement: Judgement,
    label: str,
    equal_nan: bool,
    *,
    rows: bool,
    slices: int,
) -> Check:
    """``name.close`` under the kernel-relative rule (the module's docstring).

    ``rows``: judge each element at its row's scale (last axis); ``slices``: the
    trailing axes of one (batch, head) slice (2 for the output, 1 for the LSE)."""
    m = compare(actual, reference, 0.0, math.inf, equal_nan=equal_nan)  # non-finite only
    a = np.asarray(actual, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    p = np.asarray(plain, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(a) & np.isfinite(r)
        err = np.where(finite, a - r, 0.0)
        # NaN: the plain computation was not needed there (needs_plain)
        known = finite & np.isfinite(p)
        plain_err = np.where(known, p - r, 0.0)
        floor = _floor(r, rows, judgement)
        # ratio = |err| / (factor · max(the slice's largest |plain err|, floor)); err
        # is 0 where a side is not finite, so the ratio is 0 there
        axes = tuple(range(-min(slices, plain_err.ndim), 0)) if plain_err.ndim else None
        row_plain = np.max(np.abs(plain_err), axis=axes, keepdims=True, initial=0.0)
        ratio = np.abs(err)
        ratio /= judgement.factor * np.maximum(row_plain, floor)
    count = int(np.count_nonzero(ratio > 1.0))
    need = float(np.max(ratio, initial=0.0)) * judgement.factor
    shifted, shift_ratio = _shifted_slices(err, plain_err, floor, finite, slices, judgement.factor)
    worst_at = m.worst_at
    if worst_at is None and count:
        worst_at = argmax_index(ratio)
    mismatch = replace(
        m,
        mismatched=m.mismatched + count,
        worst_at=worst_at,
        worst_actual=None if worst_at is None else float(a[worst_at]),
        worst_reference=None if worst_at is None else float(r[worst_at]),
        passing_atol=None,
        passing_rtol=None,
        passing_factor=need,
    )
    bad_slices, _ = outliers(err, plain_err, finite, slices, judgement.factor)
    bad_rows, n_rows = (
        outliers(err, plain_err, finite, slices - 1, judgement.factor) if slices > 1 else ([], 0)
    )
    stats = error_stats(a, r, slices)
    plain_rms = float(np.sqrt(np.mean(plain_err[known] ** 2))) if known.any() else None
    rms = float(np.sqrt(np.mean(err[finite] ** 2))) if finite.any() else 0.0
    details: dict[str, Any] = {
        "error_stats": stats,
        "plain_rms_error": plain_rms,
        "rms_error": rms,
        "factor_needed": need,
        "shift_ratio": shift_ratio,
        "outlier_slices": bad_slices,
        "outlier_rows": bad_rows,
        "shifted_slices": [
            {"index": list(i), "mean_error": mean, "allowed": allow} for i, mean, allow in shifted
        ],
    }
    failed = bool(mismatch.mismatched or shifted)
    summary = _summary(mismatch, count, need, rms, plain_rms, shifted, judgement)
    if failed:
        # A few rows name the bug better than their slice; many rows, the slice.
        by_row = bool(bad_rows) and (n_rows <= len(bad_rows) or not bad_slices)
        named = bad_rows if by_row else bad_slices
        if named:
            what = "row" if by_row else "slice"
            worst = named[0]
            summary += (
                f"; the error is in {what} {format_index(tuple(worst['index']))} "
                f"({sig(worst['times_median'], 3)}× the median {what}'s)"
            )
    return Check(
        f"{name}.close",
        "fail" if failed else "pass",
        summary,
        index=worst_at if mismatch.mismatched else (shifted[0][0] if shifted else None),
        file=label,
        tolerance=judgement.tolerance,
        mismatch=mismatch,
        details=details,
    )


def _summary(
    m: Any,
    count: int,
    need: float,
    rms: float,
    plain_rms: float | None,
    shifted: list[tuple[tuple[int, ...], float, float]],
    judgement: Judgement,
) -> str:
    """One line: how the export's error compares with the plain computation's (when
    the rule needed it)."""
    if plain_rms is None:
        errors = f"RMS error {sig(rms, 3)}"
    else:
        errors = (
            f"RMS error {sig(rms, 3)}, "
            f"the plain {judgement.export} computation's {sig(plain_rms, 3)}"
        )
    parts = []
    if m.mismatched:
        parts.append(
            f"{m.mismatched:,} of {m.total:,} ({percent(m.fraction)}) beyond "
            f"{sig(judgement.factor, 6)}× the plain computation's largest error in their slice (would "
            f"pass at {ceil_sig(need)}×)"
        )
    if shifted:
        i, mean, allowed = shifted[0]
        parts.append(
            f"{plural(len(shifted), 'slice')} shifted: {format_index(i)} by "
            f"{sig(mean, 3)} on average, where rounding allows {sig(allowed, 3)}"
        )
    if not parts and plain_rms is None:
        ulps = sig(judgement.factor * judgement.floor_ulps, 6)
        return (
            f"all {m.total:,} within {ulps} ulp of their row's scale (no plain "
            f"{judgement.export} computation needed); {errors}"
        )
    if not parts:
        return (
            f"all {m.total:,} within {sig(judgement.factor, 6)}× the plain computation's "
            f"largest error; {errors}"
        )
    return "; ".join(parts) + f"; {errors}"


def stat_value(stats: dict[str, Any], name: str) -> float:
    """One of :data:`ERROR_STATS` read from :func:`error_stats`' figures."""
    kind, stat = name.split("_", 1)
    return float(stats[kind][stat])


def error_limit_check(
    name: str, stats: dict[str, Any], limits: tuple[tuple[str, float], ...], label: str
) -> Check:
    """``name.error``: the error statistics against ``--max-error``'s limits (each at
    most its value; ``cosine_min`` at least)."""
    parts, broken = [], []
    for stat, limit in limits:
        value = stat_value(stats, stat)
        ok = value >= limit if stat == "cosine_min" else value <= limit
        sign = ("≥" if ok else "<") if stat == "cosine_min" else ("≤" if ok else ">")
        shown = sig(value, 3)
        if stat == "cosine_min" and 0.99 < value < 1:  # near 1, what matters is 1 − it
            shown = f"1 − {sig(1 - value, 3)}"
        text = f"{stat} {shown} {sign} {sig(limit, 6)}"
        parts.append(text)
        if not ok:
            broken.append(text)
    return Check(
        f"{name}.error",
        "fail" if broken else "pass",
        "; ".join(broken or parts),
        file=label,
        details={"error_stats": stats, "limits": dict(limits)},
    )
