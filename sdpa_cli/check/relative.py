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
factor, plus :data:`~sdpa_cli.check.shift.MEAN_SHARE` of its RMS error, plus six standard errors of the
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

from sdpa_cli.check.compare import Judgement, compare
from sdpa_cli.check.error_stats import Blocks, ErrorFigures, by_slice, pairs
from sdpa_cli.check.records import Check
from sdpa_cli.check.residual import Readable
from sdpa_cli.check.shift import rms, shifted_slices
from sdpa_cli.check.structure import ErrorShape
from sdpa_cli.engine import precision
from sdpa_cli.engine.types import F64
from sdpa_cli.text import ceil_sig, format_index, percent, plural, sig


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


def _allowed(floor: F64, plain_err: F64 | None) -> tuple[F64, F64 | None]:
    """Each element's allowance before the factor, max(its slice's largest |plain
    error|, its floor) (slices on the first axis), and that largest plain error per
    slice (None without the plain computation: the floor alone, > 0)."""
    if plain_err is None:
        return floor, None
    axes = tuple(range(1, plain_err.ndim))
    largest = np.max(np.abs(plain_err), axis=axes, keepdims=True, initial=0.0)
    return np.maximum(largest, floor), largest


def error_ratio(a: F64, r: F64, plain: F64 | None, judgement: Judgement, *, rows: bool) -> F64:
    """|a − r| ÷ the rule's allowance for each element of slices ``(k, *slice)``
    (what is above 1 fails): the picture of where an export's error sits. NaN where a
    side is not finite; ``plain`` NaN where it was not needed (there the floor alone
    is the allowance, the least it can be: the ratio shown is then an upper bound)."""
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(a) & np.isfinite(r)
        err = np.where(finite, a - r, 0.0)
        plain_err = None
        if plain is not None:
            plain_err = np.where(finite & np.isfinite(plain), plain - r, 0.0)
        allowed, _ = _allowed(_floor(r, rows, judgement), plain_err)
        ratio = np.abs(err) / (judgement.factor * allowed)
    return np.where(finite, ratio, np.nan)


def needs_plain(
    actual: F64, reference: Readable, judgement: Judgement, *, rows: bool, slices: int
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
        shifted, _ = shifted_slices(err, None, floor, finite, slices, judgement.factor)
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
    rule = RelativeRule(name, np.shape(actual), judgement, rows=rows, slices=slices)
    a_view, r_view = by_slice(actual, slices), by_slice(reference, slices)
    p_view = None if plain is None else by_slice(plain, slices)
    t_view = None if terms is None else by_slice(terms, slices)
    for at, a, r, finite in pairs(a_view, r_view):
        rule.add(
            at,
            a,
            r,
            finite,
            None if p_view is None else np.asarray(p_view[at], np.float64),
            None if t_view is None else np.asarray(t_view[at], np.float64),
        )
    return rule.check(actual, reference, label, equal_nan, lambda: pairs(a_view, r_view))


class RelativeRule:
    """:func:`relative_check` gathered a block of slices at a time, in any order
    (:meth:`add`), and read at the end (:meth:`check`): for a caller that computes the
    reference or the plain computation slice by slice (the gradients', a backward pass
    at a time) and cannot keep them whole."""

    def __init__(
        self, name: str, shape: tuple[int, ...], judgement: Judgement, *, rows: bool, slices: int
    ) -> None:
        self.name, self.judgement, self.rows, self.slices = name, judgement, rows, slices
        self.lead = tuple(shape[: max(len(shape) - slices, 0)])
        tail = tuple(shape[len(self.lead) :])
        n = math.prod(self.lead)
        self.figures = ErrorFigures(n, math.prod(shape))
        self.tally = _Tally()
        self.shifted: list[tuple[tuple[int, ...], float, float]] = []
        self.slice_rms, self.slice_plain = np.zeros(n), np.zeros(n)
        self.row_rms = np.zeros((n, *tail[:-1])) if slices > 1 else np.zeros(0)
        self.row_plain = np.zeros_like(self.row_rms)
        self.slice_allowed = np.zeros(n)
        square = len(tail) == 2 and tail[0] == tail[1]
        self.spread = ErrorShape(n, tail[0] if tail else 1, triangle=name == "weights" and square)

    def _index(self, k: int, within: tuple[int, ...] = ()) -> tuple[int, ...]:
        head = tuple(int(i) for i in np.unravel_index(k, self.lead)) if self.lead else ()
        return (*head, *within)

    def add(
        self,
        at: slice,
        a: F64,
        r: F64,
        finite: NDArray[np.bool_],
        plain: F64 | None,
        terms: F64 | None = None,
    ) -> None:
        """The slices ``at`` (of the leading axes, flattened; each added once):
        ``a``, ``r`` in float64 shaped ``(k, *slice)``, ``finite`` where both are;
        ``plain`` (NaN where not needed) and ``terms`` likewise, or None."""
        judgement, slices, tally = self.judgement, self.slices, self.tally
        self.figures.add(at, a, r, finite)  # first: its pieces' temporaries come and go alone
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.where(finite, a - r, 0.0)
            # the plain computation's error; None where it was not needed anywhere (0:
            # what it adds below is nothing, and is not computed)
            plain_err, known = None, 0
            if plain is not None:
                known_at = finite & np.isfinite(plain)  # NaN: the plain computation was not needed
                plain_err, known = np.where(known_at, plain - r, 0.0), int(known_at.sum())
            floor = _floor(r, self.rows, judgement)
            if terms is not None:
                floor = np.maximum(floor, judgement.floor_ulps * ulp(terms, judgement.export))
            # |err| / (factor · max(the slice's largest |plain err|, floor)); err is 0
            # where a side is not finite, so the ratio is 0 there
            axes = tuple(range(1, err.ndim))
            allowed, largest = _allowed(floor, plain_err)
            ratio = np.abs(err)
            ratio /= judgement.factor * allowed
        beyond = ratio > 1.0
        tally.beyond += int(np.count_nonzero(beyond))
        self.spread.add(at, a, r, finite, beyond)
        # the largest floor of each slice (of its elements: none where it has none)
        widest = np.max(floor, axis=axes, initial=0.0) if err.size else np.zeros(len(err))
        if largest is not None:
            widest = np.maximum(largest.reshape(-1), widest.reshape(-1))
        self.slice_allowed[at] = judgement.factor * widest.reshape(-1)
        top = float(np.max(ratio, initial=0.0))
        if top > tally.ratio:
            local = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            tally.ratio = top
            tally.worst = self._index(at.start + int(local[0]), tuple(int(i) for i in local[1:]))
            tally.worst_allowed = float(abs(err[local]) / top)
        found, most = shifted_slices(err, plain_err, floor, finite, slices, judgement.factor)
        self.shifted += [(self._index(at.start + k[0]), mean, ok) for k, mean, ok in found]
        tally.shift_ratio = max(tally.shift_ratio, most)
        counts = np.maximum(finite.reshape(len(a), -1).sum(axis=1), 1)
        self.slice_rms[at] = rms(err.reshape(len(a), -1), counts)
        per_row = np.maximum(finite.sum(axis=-1), 1) if slices > 1 else None
        if per_row is not None:
            self.row_rms[at] = rms(err, per_row)
        flat_err = err.ravel()
        tally.squares += float(flat_err @ flat_err)
        tally.finite += int(finite.sum())
        if plain_err is not None:  # else its RMS errors stay 0, as they were made
            self.slice_plain[at] = rms(plain_err.reshape(len(a), -1), counts)
            if per_row is not None:
                self.row_plain[at] = rms(plain_err, per_row)
            flat_plain = plain_err.ravel()
            tally.plain_squares += float(flat_plain @ flat_plain)
            tally.known += known

    def check(
        self, actual: F64, reference: Readable, label: str, equal_nan: bool, again: Blocks
    ) -> Check:
        """The check of every slice added: ``actual`` and ``reference`` whole (read a
        chunk at a time: a reference may be held as a
        :class:`~sdpa_cli.check.residual.Residual`), ``again`` their blocks once more,
        for the quantiles."""
        judgement, tally, lead = self.judgement, self.tally, self.lead
        shifted = sorted(self.shifted)
        m = compare(actual, reference, 0.0, math.inf, equal_nan=equal_nan)  # non-finite only
        need = tally.ratio * judgement.factor
        worst_at, worst_allowed = m.worst_at, None
        if worst_at is None and tally.beyond:
            worst_at, worst_allowed = tally.worst, tally.worst_allowed
        mismatch = replace(
            m,
            mismatched=m.mismatched + tally.beyond,
            worst_at=worst_at,
            worst_actual=None if worst_at is None else float(np.asarray(actual)[worst_at]),
            worst_reference=None if worst_at is None else float(reference[worst_at]),
            passing_atol=None,
            passing_rtol=None,
            passing_factor=need,
            worst_allowed=worst_allowed,
        )
        bad_slices, _ = outliers(
            self.slice_rms.reshape(lead or (1,)),
            self.slice_plain.reshape(lead or (1,)),
            judgement.factor,
        )
        bad_rows: list[dict[str, Any]] = []
        n_rows = 0
        if self.slices > 1:
            shape = (*(lead or (1,)), *self.row_rms.shape[1:])
            bad_rows, n_rows = outliers(
                self.row_rms.reshape(shape), self.row_plain.reshape(shape), judgement.factor
            )
        plain_rms = math.sqrt(tally.plain_squares / tally.known) if tally.known else None
        rms_all = math.sqrt(tally.squares / tally.finite) if tally.finite else 0.0
        stats = self.figures.figures(lead, again)
        for k, entry in enumerate(stats["by_slice"]):
            entry.update(
                rms_error=float(self.slice_rms[k]),
                plain_rms_error=float(self.slice_plain[k]),
                allowed=float(self.slice_allowed[k]),
                beyond=int(self.spread.by_slice[k]),
            )
        details: dict[str, Any] = {
            "error_stats": stats,
            "plain_rms_error": plain_rms,
            "rms_error": rms_all,
            "factor_needed": need,
            "shift_ratio": tally.shift_ratio,
            "outlier_slices": bad_slices,
            "outlier_rows": bad_rows,
            "shifted_slices": [
                {"index": list(i), "mean_error": mean, "allowed": allow}
                for i, mean, allow in shifted
            ],
        }
        failed = bool(mismatch.mismatched or shifted)
        diagnosis = None
        if failed:
            diagnosis = self.spread.diagnosis(
                lead=lead,
                need=need,
                rms=rms_all,
                plain_rms=plain_rms,
                shifted=[i for i, _, _ in shifted],
                concentrated=bool(bad_rows or bad_slices),
            )
            details["diagnosis"] = diagnosis
            if diagnosis["error"] == "structural":
                mismatch = replace(mismatch, passing_factor=None)
        summary = _summary(
            mismatch, tally.beyond, need, rms_all, plain_rms, shifted, judgement, diagnosis
        )
        # A constant factor or offset over the whole export is the bug's name: its
        # largest rows are only the largest values, not where it sits.
        fitted = diagnosis is not None and "fit" in diagnosis
        if failed and not fitted:
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
            f"{self.name}.close",
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
