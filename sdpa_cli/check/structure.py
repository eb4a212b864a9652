"""Whether a failed comparison's error looks like rounding or like a bug, and where it sits.

A faithful kernel's rounding spreads over every (batch, head) slice and every row, and
stays within a small multiple of the plain computation's error. A bug's error does
not: it is far beyond that (a mask, a layout, a scale), or confined to some slices, to
some rows (past a length), to a triangle of the weights; or the export is the
reference times a constant (a logarithm's base) or plus one. Only an error that looks
like rounding is given a ``--fudge`` that would pass it: loosening the gate over a bug
hides the bug.

Pure numpy: :class:`ErrorShape` is fed the blocks :func:`~sdpa_cli.check.relative.
relative_check` reads, and says what it saw (:meth:`ErrorShape.diagnosis`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.types import F64
from sdpa_cli.text import format_index, plural, run_text, runs, sig

ROUNDING_LIMIT = 10.0
"""The largest ``--fudge`` a report suggests: an error that needs more is no rounding."""

FIT_SHARE = 0.1
"""A constant factor or offset explains the error when what is left of it is at most
this share of its RMS."""

TRIANGLE_SHARE = 0.9
"""The share of the elements beyond their allowance that names a triangle of the
weights (above or below the diagonal)."""

NAMED_SLICES = 3
"""Slices named one by one in the words; more are counted."""

RANGES = 3
"""Runs of rows named one by one in the words; more are counted."""

KNOWN_FACTORS = {
    1.0 / math.log(2.0): "1/ln 2: a base-2 logarithm where the natural one was meant",
    math.log(2.0): "ln 2: a natural logarithm where the base-2 one was meant",
    -1.0: "the sign flipped",
}


@dataclass
class ErrorShape:
    """Counts of the elements beyond their allowance by slice, by row and (for the
    weights of a square slice) by triangle, and the sums that fit the export as
    ``c · reference + d``, gathered block by block (:meth:`add`)."""

    n_slices: int
    n_rows: int
    triangle: bool
    """Whether the elements are weights of a square slice (rows × keys, L = S)."""

    def __post_init__(self) -> None:
        self.by_slice = np.zeros(self.n_slices, np.int64)
        self.by_row = np.zeros(self.n_rows, np.int64)
        self.upper = self.lower = 0
        self.sums = np.zeros(6)  # n, Σr, Σa, Σr², Σar, Σa²

    def add(
        self, at: slice, a: F64, r: F64, finite: NDArray[np.bool_], beyond: NDArray[np.bool_]
    ) -> None:
        """One block of slices ``at``: ``a``, ``r``, ``finite`` and ``beyond`` (the
        elements past their allowance) shaped ``(k, rows, ...)`` or ``(k, rows)``."""
        k = len(a)
        if not beyond.size:
            return
        self.by_slice[at] += beyond.reshape(k, -1).sum(axis=1)
        per_row = beyond if beyond.ndim == 2 else beyond.reshape(k, self.n_rows, -1).sum(axis=2)
        self.by_row += per_row.reshape(k, self.n_rows).sum(axis=0)
        if self.triangle:
            rows, keys = np.indices(beyond.shape[-2:])
            self.upper += int(np.count_nonzero(beyond & (keys > rows)))
            self.lower += int(np.count_nonzero(beyond & (keys < rows)))
        af, rf = a[finite], r[finite]
        self.sums += np.array([af.size, rf.sum(), af.sum(), rf @ rf, af @ rf, af @ af])

    def diagnosis(
        self,
        *,
        lead: tuple[int, ...],
        need: float,
        rms: float,
        plain_rms: float | None,
        shifted: Sequence[tuple[int, ...]],
        concentrated: bool,
    ) -> dict[str, Any]:
        """What the error looks like: ``{"error": "rounding" | "structural", "where":
        words, ...}``. Structural when a slice is shifted, the error is concentrated
        in a few slices or rows (``concentrated``), or no fudge up to
        :data:`ROUNDING_LIMIT` would pass it (``need``)."""
        structural = bool(shifted) or concentrated or need > ROUNDING_LIMIT
        out: dict[str, Any] = {"error": "structural" if structural else "rounding"}
        if plain_rms:
            out["times_plain_rms"] = rms / plain_rms
        slices = [
            [int(i) for i in np.unravel_index(k, lead)] if lead else []
            for k in np.flatnonzero(self.by_slice)
        ]
        for at in shifted:
            if list(at) not in slices:
                slices.append(list(at))
        out["slices"] = sorted(slices)
        rows = [int(i) for i in np.flatnonzero(self.by_row)]
        out["rows"] = [list(run) for run in runs(rows)]
        places = [self._slices_words(out["slices"]), _rows_words(rows, self.n_rows)]
        triangle = self._triangle_words()
        if triangle:
            out["triangle"] = triangle
            places.append(triangle)
        named = [p for p in places if p]
        words = "in " + ", ".join(named) if named else ""
        fit = self._fit(rms)
        if fit is not None:
            out["fit"] = fit
            words += ("; " if words else "") + fit["words"]
        out["where"] = words
        return out

    def _slices_words(self, slices: list[list[int]]) -> str:
        if not slices:
            return ""
        if len(slices) == self.n_slices:
            return "every (batch, head) slice" if self.n_slices > 1 else ""
        named = ", ".join(format_index(tuple(s)) for s in slices[:NAMED_SLICES])
        more = "" if len(slices) <= NAMED_SLICES else ", …"
        return f"{plural(len(slices), 'slice')} of {self.n_slices:,} ({named}{more})"

    def _triangle_words(self) -> str:
        total = self.upper + self.lower
        beyond = int(self.by_row.sum())
        if not self.triangle or not beyond:
            return ""
        if self.upper >= TRIANGLE_SHARE * beyond:
            return "above the diagonal (keys after the query)"
        if self.lower >= TRIANGLE_SHARE * beyond:
            return "below the diagonal (keys before the query)"
        if total == 0:
            return "on the diagonal"
        return ""

    def _fit(self, rms: float) -> dict[str, Any] | None:
        """The export as ``c · reference + d`` by least squares, when that leaves at
        most :data:`FIT_SHARE` of the error's RMS and is not the identity."""
        n, sr, sa, srr, sar, saa = (float(x) for x in self.sums)
        if n < 2 or rms <= 0:
            return None
        var_r = srr - sr * sr / n
        if var_r <= 0:
            return None
        c = (sar - sr * sa / n) / var_r
        d = (sa - c * sr) / n
        # Σ (a − c r − d)², expanded over the sums
        left = saa - 2 * c * sar - 2 * d * sa + c * c * srr + 2 * c * d * sr + n * d * d
        residual = math.sqrt(max(left, 0.0) / n)
        if residual > FIT_SHARE * rms:
            return None
        scale = math.sqrt(max(srr / n, 0.0))
        offset = abs(d) > FIT_SHARE * rms
        factor = abs(c - 1.0) * scale > FIT_SHARE * rms
        if not (offset or factor):
            return None
        known = next(
            (why for k, why in KNOWN_FACTORS.items() if math.isclose(c, k, rel_tol=1e-3)), None
        )
        terms = []
        if factor:
            terms.append(f"{sig(c, 4)}× the reference" + (f" ({known})" if known else ""))
        else:
            terms.append("the reference")
        if offset:
            terms.append(f"{'plus' if d > 0 else 'minus'} {sig(abs(d), 3)}")
        return {
            "factor": c,
            "offset": d,
            "words": "the export is " + " ".join(terms) + " throughout",
        }


def _rows_words(rows: list[int], n: int) -> str:
    """``rows 96–127``, ``row 3``, ``every row``, ``57 of 128 rows``."""
    if not rows:
        return ""
    if len(rows) == n:
        return "every row"
    found = runs(rows)
    if len(found) > RANGES:
        return f"{len(rows):,} of {n:,} rows"
    named = ", ".join(run_text(a, b) for a, b in found)
    return f"{'row' if len(rows) == 1 else 'rows'} {named} of {n:,}"


def slice_line(by_slice: Sequence[Mapping[str, Any]]) -> str | None:
    """Per (batch, head) slice at a glance, whether one head or all are off: ``by
    slice, RMS error ÷ the plain computation's: worst [0, 1] 3.5e+03×, median 1.1×,
    best 0.9× (of 8)`` (two digits, as the RMS errors); None for one slice, or where
    the plain computation was not needed."""
    ratios = [
        (s["rms_error"] / s["plain_rms_error"], s["index"])
        for s in by_slice
        if s.get("plain_rms_error")
    ]
    if len(ratios) < 2:
        return None
    ratios.sort(key=lambda x: x[0])
    worst, median, best = ratios[-1], ratios[len(ratios) // 2], ratios[0]
    return (
        f"by slice, RMS error ÷ the plain computation's: worst {format_index(tuple(worst[1]))} "
        f"{sig(worst[0], 2)}×, median {sig(median[0], 2)}×, best {sig(best[0], 2)}× "
        f"(of {len(by_slice):,})"
    )
