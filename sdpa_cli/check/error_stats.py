"""Polygraphy's error statistics of an export, and ``--max-error``'s gate on them.

Mean, median, p90, p99 and max of the absolute and the relative error over the pairs
finite on both sides, and per (batch, head) slice the cosine similarity. The arrays
are read a block of slices at a time (:func:`slice_blocks`), and nothing the size of
the arrays is kept: the quantiles are those of the errors rounded to float32, found
exactly by their bits. A non-negative float32's bit pattern orders as its value, so a
histogram of the top 16 bits (the first pass, with the sums) names the bin holding
each order statistic, and a histogram of the low 16 bits of that bin's values (a
second pass over the arrays) names the value itself; numpy's linear interpolation
between the two order statistics around each quantile follows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import relative_error
from sdpa_cli.check.records import Check
from sdpa_cli.check.residual import Readable
from sdpa_cli.engine.types import F64
from sdpa_cli.text import sig

STATS_QUANTILES = {"median": 0.5, "p90": 0.9, "p99": 0.99}

BLOCK_ELEMENTS = 1 << 20
"""Elements read at a time: a few float64 temporaries of 8 MiB."""


def by_slice(x: Readable, slices: int) -> Any:
    """``x`` as ``(slices of it, *its trailing slices axes)``: a view (one slice when
    it has no more axes than that). An array-like with ``shape`` and ``reshape`` (a
    :class:`~sdpa_cli.check.residual.Residual`) is reshaped as it is."""
    a = x if hasattr(x, "reshape") and hasattr(x, "shape") else np.asarray(x)
    lead = a.shape[: max(a.ndim - slices, 0)]
    return a.reshape((math.prod(lead), *a.shape[len(lead) :]))


def slice_blocks(n_slices: int, slice_size: int) -> Iterator[slice]:
    """Consecutive ranges of slices of about :data:`BLOCK_ELEMENTS` elements."""
    step = max(1, BLOCK_ELEMENTS // max(slice_size, 1))
    for s0 in range(0, n_slices, step):
        yield slice(s0, min(s0 + step, n_slices))


Blocks = Callable[[], Iterator[tuple[slice, F64, F64, NDArray[np.bool_]]]]
"""Reads the arrays again, block by block: ``(slices, a, r, finite)`` as :meth:`ErrorFigures.add` takes them."""

KEEP_ELEMENTS = 1 << 21
"""Up to this many elements (16 MiB of float32 errors, two kinds) the errors are kept
and their quantiles read directly; above, from the histograms, in bounded memory."""

HIGH = 1 << 16
"""Bins of the first histogram: the top 16 bits of a float32."""


def _errors(a: F64, r: F64, finite: NDArray[np.bool_]) -> tuple[F64, F64, F64, F64]:
    """The absolute and the relative error of a piece ``(k, m)``, shaped as it with 0
    at the pairs not finite on both sides (per slice), and of its finite pairs alone
    (flat: what the statistics count)."""
    every = bool(finite.all())  # the common case: no copy through the mask
    if not every:
        a, r = np.where(finite, a, 0.0), np.where(finite, r, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        d = np.abs(a - r)
        rel = relative_error(d, np.abs(r))
    return d, rel, (d.ravel() if every else d[finite]), (rel.ravel() if every else rel[finite])


PIECE = 1 << 18
"""Elements whose errors are computed at a time: a few float64 temporaries of 2 MiB."""


def _pieces(
    a: F64, r: F64, finite: NDArray[np.bool_]
) -> Iterator[tuple[slice, F64, F64, NDArray[np.bool_]]]:
    """A block ``(k, ...)`` as ``(k', m)`` pieces of about :data:`PIECE` elements: the
    slices ``k'`` they belong to, and those slices' elements, a range of them at a time."""
    k = len(a)
    a2, r2, f2 = a.reshape(k, -1), r.reshape(k, -1), finite.reshape(k, -1)
    m = a2.shape[1]
    rows = max(1, PIECE // max(m, 1))
    step = PIECE if rows == 1 else max(m, 1)
    for s0 in range(0, k, rows):
        part = slice(s0, min(s0 + rows, k))
        for c0 in range(0, max(m, 1), step):
            cols = slice(c0, c0 + step)
            yield part, a2[part, cols], r2[part, cols], f2[part, cols]


def _bits(values: F64) -> NDArray[np.uint32]:
    """Non-negative values rounded to float32, as bits that order as the values do."""
    with np.errstate(over="ignore"):
        return values.astype(np.float32).view(np.uint32)


def _order_statistic(k: int, high: NDArray[np.int64], b: int, low: NDArray[np.int64]) -> float:
    """The ``k``-th smallest float32 (from 0): ``high`` the cumulative counts of the top
    16 bits, ``b`` its bin there, ``low`` the counts of the low 16 bits within it."""
    before = int(high[b - 1]) if b else 0
    bits = (b << 16) | int(np.searchsorted(np.cumsum(low), k - before, side="right"))
    return float(np.array(bits, np.uint32).view(np.float32))


def pairs(
    a_view: NDArray[Any], r_view: NDArray[Any]
) -> Iterator[tuple[slice, F64, F64, NDArray[np.bool_]]]:
    """Two arrays as slices (:func:`by_slice`), a block of them at a time
    (:func:`slice_blocks`), in float64, with the pairs finite on both sides."""
    for at in slice_blocks(len(a_view), math.prod(a_view.shape[1:])):
        a = np.asarray(a_view[at], dtype=np.float64)
        r = np.asarray(r_view[at], dtype=np.float64)
        yield at, a, r, np.isfinite(a) & np.isfinite(r)


class ErrorFigures:
    """The statistics gathered block by block (:meth:`add`), read at the end
    (:meth:`figures`, which reads the blocks once more for the quantiles)."""

    def __init__(self, n_slices: int, n_elements: int) -> None:
        self.count = 0
        self.sums = {"abs": 0.0, "rel": 0.0}
        self.maxima = {"abs": 0.0, "rel": 0.0}
        self.high = {"abs": np.zeros(HIGH, np.int64), "rel": np.zeros(HIGH, np.int64)}
        self.kept: dict[str, NDArray[np.float32]] | None = None
        if n_elements <= KEEP_ELEMENTS:  # small: the errors themselves, no second read
            self.kept = {k: np.empty(n_elements, np.float32) for k in ("abs", "rel")}
        self.dot = np.zeros(n_slices)
        self.slice_count = np.zeros(n_slices, np.int64)
        self.slice_sum = np.zeros(n_slices)
        self.slice_max = np.zeros(n_slices)
        self.slice_max_rel = np.zeros(n_slices)
        self.norm_a = np.zeros(n_slices)
        self.norm_r = np.zeros(n_slices)

    def add(self, at: slice, a: F64, r: F64, finite: NDArray[np.bool_]) -> None:
        """One block of slices ``at`` (each added once): ``a`` and ``r`` in float64,
        ``(k, ...)``, read a piece of :data:`PIECE` elements at a time."""
        for piece, pa, pr, pf in _pieces(a, r, finite):
            d, rel_all, diff, rel = _errors(pa, pr, pf)
            for kind, values in (("abs", diff), ("rel", rel)):
                self.sums[kind] += float(values.sum())
                self.maxima[kind] = max(self.maxima[kind], float(np.max(values, initial=0.0)))
                if self.kept is not None:
                    self.kept[kind][self.count : self.count + values.size] = values
                else:
                    self.high[kind] += np.bincount(_bits(values) >> 16, minlength=HIGH)
            self.count += diff.size
            rows = np.arange(len(pa)) + at.start + piece.start
            self.slice_count[rows] += pf.sum(axis=1)
            self.slice_sum[rows] += d.sum(axis=1)
            np.maximum.at(self.slice_max, rows, d.max(axis=1, initial=0.0))
            np.maximum.at(self.slice_max_rel, rows, rel_all.max(axis=1, initial=0.0))
            aa, rr = (pa, pr) if pf.all() else (np.where(pf, pa, 0.0), np.where(pf, pr, 0.0))
            self.dot[at][piece] += np.einsum("ij,ij->i", aa, rr)
            self.norm_a[at][piece] += np.einsum("ij,ij->i", aa, aa)
            self.norm_r[at][piece] += np.einsum("ij,ij->i", rr, rr)

    def _quantiles(self, again: Blocks) -> dict[str, list[float]]:
        """Per kind, :data:`STATS_QUANTILES` of the float32 errors, as ``np.quantile``
        computes them (linear interpolation), from the histograms and one more read."""
        where = {}  # kind → (cumulative counts of the top 16 bits, each rank's bin)
        for kind in ("abs", "rel"):
            cum = np.cumsum(self.high[kind])
            ranks = []
            for q in STATS_QUANTILES.values():
                h = (self.count - 1) * q
                ranks += [math.floor(h), min(math.floor(h) + 1, self.count - 1)]
            bins = {k: int(np.searchsorted(cum, k, side="right")) for k in ranks}
            where[kind] = (cum, bins)
        low = {
            kind: {b: np.zeros(HIGH, np.int64) for b in set(w[1].values())}
            for kind, w in where.items()
        }
        marked = {kind: np.zeros(HIGH, dtype=np.bool_) for kind in low}
        for kind, bins_of in low.items():
            marked[kind][list(bins_of)] = True
        for _, a, r, finite in again():
            for _, pa, pr, pf in _pieces(a, r, finite):
                for kind, values in zip(("abs", "rel"), _errors(pa, pr, pf)[2:], strict=True):
                    bits = _bits(values)
                    few = bits[marked[kind][bits >> 16]]  # one pass: the needed bins' values
                    top = few >> 16
                    for b, hist in low[kind].items():
                        hist += np.bincount(few[top == b] & 0xFFFF, minlength=HIGH)
        out: dict[str, list[float]] = {}
        for kind, (cum, bins) in where.items():
            qs = []
            for q in STATS_QUANTILES.values():
                h = (self.count - 1) * q
                k = math.floor(h)
                pair = [
                    _order_statistic(j, cum, bins[j], low[kind][bins[j]])
                    for j in (k, min(k + 1, self.count - 1))
                ]
                # a float64 array of one quantile, as numpy is given three: the same promotion
                at = np.array([h - k])
                with np.errstate(invalid="ignore"):  # inf and inf: inf, not NaN
                    found = np.quantile(np.array(pair, np.float32), at)[0]
                qs.append(float(np.nan_to_num(found, nan=np.inf)))
            out[kind] = qs
        return out

    def figures(self, lead: tuple[int, ...], again: Blocks) -> dict[str, Any]:
        """The statistics; ``lead`` the slices' shape (for the cosine's index),
        ``again`` the blocks read once more (for the quantiles)."""
        out: dict[str, Any] = {}
        quantiles = None
        if self.count and self.kept is not None:
            qs = list(STATS_QUANTILES.values())
            # relative errors are inf where a zero reference is missed: between two
            # of them numpy's interpolation gives inf − inf, NaN; the quantile is inf
            with np.errstate(invalid="ignore"):
                quantiles = {
                    k: [
                        float(x)
                        for x in np.nan_to_num(np.quantile(v[: self.count], qs), nan=np.inf)
                    ]
                    for k, v in self.kept.items()
                }
        elif self.count:
            quantiles = self._quantiles(again)
        for kind in ("abs", "rel"):
            figures = {"mean": self.sums[kind] / self.count if self.count else 0.0}
            for i, label in enumerate(STATS_QUANTILES):
                figures[label] = quantiles[kind][i] if quantiles is not None else 0.0
            figures["max"] = self.maxima[kind]
            out[kind] = figures
        with np.errstate(divide="ignore", invalid="ignore"):
            norms = np.sqrt(self.norm_a) * np.sqrt(self.norm_r)
            cos = np.where(norms > 0, self.dot / np.where(norms > 0, norms, 1.0), 1.0)
        worst: list[int] = []
        if cos.size and lead:
            worst = [int(i) for i in np.unravel_index(int(np.argmin(cos)), lead)]
        out["cosine"] = {"min": float(np.min(cos, initial=1.0)), "min_at": worst}
        means = self.slice_sum / np.maximum(self.slice_count, 1)
        out["by_slice"] = [
            {
                "index": [int(i) for i in np.unravel_index(k, lead)] if lead else [],
                "abs_mean": float(means[k]),
                "abs_max": float(self.slice_max[k]),
                "rel_max": float(self.slice_max_rel[k]),
                "cosine": float(cos[k]),
            }
            for k in range(len(cos))
        ]
        return out


def error_stats(actual: NDArray[Any], reference: NDArray[Any], slices: int) -> dict[str, Any]:
    """The statistics of ``actual`` against ``reference`` (same shape), the slices being
    the leading axes but the last ``slices``."""
    a_view, r_view = by_slice(actual, slices), by_slice(reference, slices)
    lead = np.shape(actual)[: max(np.ndim(actual) - slices, 0)]
    figures = ErrorFigures(len(a_view), a_view.size)
    for at, a, r, finite in pairs(a_view, r_view):
        figures.add(at, a, r, finite)
    return figures.figures(tuple(lead), lambda: pairs(a_view, r_view))


def stat_value(stats: dict[str, Any], name: str) -> float:
    """One of :data:`~sdpa_cli.names.ERROR_STATS` read from :func:`error_stats`' figures."""
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
