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
from sdpa_cli.check.error_stats import ErrorFigures, by_slice, pairs
from sdpa_cli.check.records import Check
from sdpa_cli.check.structure import ErrorShape
from sdpa_cli.engine import precision
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


@dataclass(frozen=True)
class Judgement:
    """How an export is judged against the plain computation in its format."""

    export: str
    factor: float = FACTOR
    floor_ulps: float = FLOOR_ULPS
    floor_of: str = "the row's scale"
    """What the floor's ulps are of, as the report names it (a gradient's: the sum of
    its terms' magnitudes, ``relative_check``'s ``terms``)."""

    @property
    def tolerance(self) -> Tolerance:
        """The rule as the report names it (no single rtol/atol: 0 and 0)."""
        source = (
            f"kernel: ≤ {sig(self.factor, 6)}× the plain {self.export} computation's largest "
            f"error in the (batch, head) slice, floor {sig(self.floor_ulps, 6)} ulp of {self.floor_of}"
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
    standard_error = np.maximum(spread, floor_rms / np.sqrt(n)) / np.sqrt(n)
    if slices > 1:
        # A row's errors share the rounding of its normaliser (a row of weights sums
        # to 1, so all of them move with it): they are not independent, and the mean
        # is known only as well as the rows' own means vary.
        standard_error = np.maximum(standard_error, _row_standard_error(err, finite, slices))
    allowed = factor * plain_mean + MEAN_SHARE * plain_rms + 6.0 * standard_error
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(allowed > 0, np.abs(mean) / allowed, np.where(mean != 0, np.inf, 0.0))
    out = []
    for at in zip(*np.nonzero(ratio > 1.0), strict=True):
        idx = tuple(int(x) for x in at)
        out.append((idx, float(mean[idx]), float(allowed[idx])))
    return out, float(np.max(ratio, initial=0.0))


def _row_standard_error(err: F64, finite: NDArray[np.bool_], slices: int) -> F64:
    """Per slice, the standard error of its mean error counted over its rows: the
    spread of the rows' mean errors over √(rows), each row weighing its elements."""
    axes = tuple(range(-(slices - 1), 0))  # a row's elements
    counts = finite.sum(axis=axes)
    sums = err.sum(axis=axes)
    k = len(err)
    counts, sums = counts.reshape(k, -1), sums.reshape(k, -1)
    n = np.maximum(counts.sum(axis=1), 1)
    rows = np.maximum(np.count_nonzero(counts, axis=1), 1)
    mean = sums.sum(axis=1) / n
    with np.errstate(divide="ignore", invalid="ignore"):
        row_mean = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
    # the rows' spread about the slice's mean, each weighing its share of the elements
    var = (counts * np.square(row_mean - mean[:, None])).sum(axis=1) / n
    out: F64 = np.sqrt(var / rows)
    return out


def needs_plain(
    actual: F64, reference: F64, judgement: Judgement, *, rows: bool, slices: int
) -> NDArray[np.bool_]:
    """Per row (the array's shape without its last axis when ``rows``, else its own),
    whether the rule must read the plain computation there. Without it the rule's
    allowance is at least ``factor`` × the floor for each element, and six standard
    errors for a slice's mean: a row whose every element, and whose slice, passes that
    passes the rule whatever the plain computation's error, so a faithful kernel's
    export rarely needs the plain computation at all. Read a block of slices at a time."""
    a_view, r_view = by_slice(actual, slices), by_slice(reference, slices)
    shape = np.shape(actual)[:-1] if rows else np.shape(actual)
    need = np.zeros((len(a_view), *a_view.shape[1:][: -1 if rows else None]), dtype=np.bool_)
    for at, a, r, finite in pairs(a_view, r_view):
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.where(finite, a - r, 0.0)
            floor = _floor(r, rows, judgement)
            beyond = np.abs(err) > judgement.factor * floor
        block: NDArray[np.bool_] = np.array(beyond.any(axis=-1) if rows else beyond)
        shifted, _ = _shifted_slices(
            err, np.zeros_like(err), floor, finite, slices, judgement.factor
        )
        for (k, *_rest), _, _ in shifted:
            block[k] = True  # a slice's shift is judged against its whole plain computation
        need[at] = block
    return need.reshape(shape)


OUTLIER_RATIO = 8.0
"""A row (or slice) is named when its RMS error is this many times the median row's
(slice's), and more than the factor times its own plain computation's."""


def outliers(rms: F64, plain_rms: F64, factor: float) -> tuple[list[dict[str, Any]], int]:
    """The rows or (batch, head) slices (``rms``, their RMS errors, any shape) whose
    error is far above the others' (:data:`OUTLIER_RATIO`), worst first, at most five,
    and how many there are: real bugs live in one head or one row."""
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


@dataclass
class _Tally:
    """What the blocks of one export add up to under the rule."""

    beyond: int = 0
    ratio: float = 0.0
    worst: tuple[int, ...] | None = None
    worst_allowed: float | None = None
    shift_ratio: float = 0.0
    squares: float = 0.0
    plain_squares: float = 0.0
    finite: int = 0
    known: int = 0


def relative_check(
    name: str,
    actual: F64,
    reference: F64,
    plain: F64 | None,
    judgement: Judgement,
    label: str,
    equal_nan: bool,
    *,
    rows: bool,
    slices: int,
    terms: F64 | None = None,
) -> Check:
    """``name.close`` under the kernel-relative rule (the module's docstring), read a
    block of slices at a time (``plain`` None: not needed anywhere).

    ``terms``: each element's sum of the magnitudes of the terms it is summed from
    (a gradient's: cancellation leaves it far smaller than its terms); the floor is
    then at least ``floor_ulps`` ulp of that, the rounding any order of the sum makes.

    ``rows``: judge each element at its row's scale (last axis); ``slices``: the
    trailing axes of one (batch, head) slice (2 for the output, 1 for the LSE);
    ``plain`` is NaN where the plain computation was not needed (:func:`needs_plain`)."""
    m = compare(actual, reference, 0.0, math.inf, equal_nan=equal_nan)  # non-finite only
    a_view, r_view = by_slice(actual, slices), by_slice(reference, slices)
    p_view = None if plain is None else by_slice(plain, slices)
    t_view = None if terms is None else by_slice(terms, slices)
    lead = tuple(np.shape(actual)[: max(np.ndim(actual) - slices, 0)])
    tail = a_view.shape[1:]
    n = len(a_view)
    figures = ErrorFigures(n, a_view.size)
    tally = _Tally()
    shifted: list[tuple[tuple[int, ...], float, float]] = []
    slice_rms, slice_plain = np.zeros(n), np.zeros(n)
    row_rms = np.zeros((n, *tail[:-1])) if slices > 1 else np.zeros(0)
    row_plain = np.zeros_like(row_rms)
    slice_allowed = np.zeros(n)
    square = len(tail) == 2 and tail[0] == tail[1]
    spread = ErrorShape(n, tail[0] if tail else 1, triangle=name == "weights" and square)

    def index(k: int, within: tuple[int, ...] = ()) -> tuple[int, ...]:
        head = tuple(int(i) for i in np.unravel_index(k, lead)) if lead else ()
        return (*head, *within)

    for at, a, r, finite in pairs(a_view, r_view):
        figures.add(at, a, r, finite)  # first: its pieces' temporaries come and go alone
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.where(finite, a - r, 0.0)
            if p_view is None:  # the plain computation was not needed anywhere
                known = np.zeros(a.shape, dtype=np.bool_)
                plain_err = np.zeros(a.shape)
            else:
                p = np.asarray(p_view[at], np.float64)
                known = finite & np.isfinite(p)  # NaN: the plain computation was not needed
                plain_err = np.where(known, p - r, 0.0)
                del p
            floor = _floor(r, rows, judgement)
            if t_view is not None:
                sums = np.asarray(t_view[at], np.float64)
                floor = np.maximum(floor, judgement.floor_ulps * ulp(sums, judgement.export))
            # |err| / (factor · max(the slice's largest |plain err|, floor)); err is 0
            # where a side is not finite, so the ratio is 0 there
            axes = tuple(range(1, err.ndim))
            largest = np.max(np.abs(plain_err), axis=axes, keepdims=True, initial=0.0)
            ratio = np.abs(err)
            ratio /= judgement.factor * np.maximum(largest, floor)
        beyond = ratio > 1.0
        tally.beyond += int(np.count_nonzero(beyond))
        spread.add(at, a, r, finite, beyond)
        widest = np.max(np.broadcast_to(floor, err.shape), axis=axes, initial=0.0)
        slice_allowed[at] = judgement.factor * np.maximum(largest.reshape(-1), widest.reshape(-1))
        top = float(np.max(ratio, initial=0.0))
        if top > tally.ratio:
            local = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            tally.ratio, tally.worst = (
                top,
                index(at.start + int(local[0]), tuple(int(i) for i in local[1:])),
            )
            tally.worst_allowed = float(abs(err[local]) / top)
        found, most = _shifted_slices(err, plain_err, floor, finite, slices, judgement.factor)
        shifted += [(index(at.start + k[0]), mean, allowed) for k, mean, allowed in found]
        tally.shift_ratio = max(tally.shift_ratio, most)
        counts = np.maximum(finite.reshape(len(a), -1).sum(axis=1), 1)
        slice_rms[at] = _rms(err.reshape(len(a), -1), counts)
        slice_plain[at] = _rms(plain_err.reshape(len(a), -1), counts)
        if slices > 1:
            per_row = np.maximum(finite.sum(axis=-1), 1)
            row_rms[at] = _rms(err, per_row)
            row_plain[at] = _rms(plain_err, per_row)
        flat_err, flat_plain = err.ravel(), plain_err.ravel()
        tally.squares += float(flat_err @ flat_err)
        tally.plain_squares += float(flat_plain @ flat_plain)
        tally.finite += int(finite.sum())
        tally.known += int(known.sum())

    need = tally.ratio * judgement.factor
    worst_at, worst_allowed = m.worst_at, None
    if worst_at is None and tally.beyond:
        worst_at, worst_allowed = tally.worst, tally.worst_allowed
    a_full, r_full = np.asarray(actual), np.asarray(reference)
    mismatch = replace(
        m,
        mismatched=m.mismatched + tally.beyond,
        worst_at=worst_at,
        worst_actual=None if worst_at is None else float(a_full[worst_at]),
        worst_reference=None if worst_at is None else float(r_full[worst_at]),
        passing_atol=None,
        passing_rtol=None,
        passing_factor=need,
        worst_allowed=worst_allowed,
    )
    bad_slices, _ = outliers(
        slice_rms.reshape(lead or (1,)), slice_plain.reshape(lead or (1,)), judgement.factor
    )
    bad_rows: list[dict[str, Any]] = []
    n_rows = 0
    if slices > 1:
        shape = (*lead, *tail[:-1]) if lead else (1, *tail[:-1])
        bad_rows, n_rows = outliers(
            row_rms.reshape(shape), row_plain.reshape(shape), judgement.factor
        )
    plain_rms = math.sqrt(tally.plain_squares / tally.known) if tally.known else None
    rms = math.sqrt(tally.squares / tally.finite) if tally.finite else 0.0
    stats = figures.figures(lead, lambda: pairs(a_view, r_view))
    for k, entry in enumerate(stats["by_slice"]):
        entry.update(
            rms_error=float(slice_rms[k]),
            plain_rms_error=float(slice_plain[k]),
            allowed=float(slice_allowed[k]),
            beyond=int(spread.by_slice[k]),
        )
    details: dict[str, Any] = {
        "error_stats": stats,
        "plain_rms_error": plain_rms,
        "rms_error": rms,
        "factor_needed": need,
        "shift_ratio": tally.shift_ratio,
        "outlier_slices": bad_slices,
        "outlier_rows": bad_rows,
        "shifted_slices": [
            {"index": list(i), "mean_error": mean, "allowed": allow} for i, mean, allow in shifted
        ],
    }
    failed = bool(mismatch.mismatched or shifted)
    diagnosis = None
    if failed:
        diagnosis = spread.diagnosis(
            lead=lead,
            need=need,
            rms=rms,
            plain_rms=plain_rms,
            shifted=[i for i, _, _ in shifted],
            concentrated=bool(bad_rows or bad_slices),
        )
        details["diagnosis"] = diagnosis
        if diagnosis["error"] == "structural":
            mismatch = replace(mismatch, passing_factor=None)
    summary = _summary(mismatch, tally.beyond, need, rms, plain_rms, shifted, judgement, diagnosis)
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


SHIFTS_NAMED = 3
"""Shifted slices a summary names one by one."""

RMS_DIGITS = 2
"""Significant digits of an RMS error in a summary (the full figure is in the JSON)."""


def _summary(
    m: Any,
    count: int,
    need: float,
    rms: float,
    plain_rms: float | None,
    shifted: list[tuple[tuple[int, ...], float, float]],
    judgement: Judgement,
    diagnosis: dict[str, Any] | None = None,
) -> str:
    """One line: how the export's error compares with the plain computation's (when
    the rule needed it), and for a failure whether it looks like rounding."""
    # Two digits: the third of a 16- or 8-bit export's RMS error is the float32
    # reference's own rounding, which moves with the CPU's BLAS kernel.
    if plain_rms is None:
        errors = f"RMS error {sig(rms, RMS_DIGITS)}"
    else:
        errors = (
            f"RMS error {sig(rms, RMS_DIGITS)}, "
            f"the plain {judgement.export} computation's {sig(plain_rms, RMS_DIGITS)}"
        )
    parts = []
    structural = diagnosis is not None and diagnosis["error"] == "structural"
    if m.mismatched:
        passing = "" if structural else f" (would pass at {ceil_sig(need)}×)"
        parts.append(
            f"{m.mismatched:,} of {m.total:,} ({percent(m.fraction)}) beyond "
            f"{sig(judgement.factor, 6)}× the plain computation's largest error in their slice{passing}"
        )
    if shifted:
        named = "; ".join(
            f"{format_index(i)} by {sig(mean, 3)} on average, where rounding allows {sig(allowed, 3)}"
            for i, mean, allowed in shifted[:SHIFTS_NAMED]
        )
        more = "; …" if len(shifted) > SHIFTS_NAMED else ""
        parts.append(f"{plural(len(shifted), 'slice')} shifted: {named}{more}")
    if structural:
        assert diagnosis is not None
        where = f": {diagnosis['where']}" if diagnosis["where"] else ""
        parts.append(f"not rounding{where}")
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
