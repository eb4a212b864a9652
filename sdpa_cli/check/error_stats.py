"""Polygraphy's error statistics of an export, and ``--max-error``'s gate on them.

Mean, median, p90, p99 and max of the absolute and the relative error over the pairs
finite on both sides, and per (batch, head) slice the cosine similarity. The arrays
are read a block of slices at a time (:func:`slice_blocks`): what is kept whole is
one float32 number per element for the quantiles, not the float64 temporaries.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.records import Check
from sdpa_cli.engine.types import F64
from sdpa_cli.text import sig

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

BLOCK_ELEMENTS = 1 << 20
"""Elements read at a time: a few float64 temporaries of 8 MiB."""


def by_slice(x: NDArray[Any], slices: int) -> NDArray[Any]:
    """``x`` as ``(slices of it, *its trailing slices axes)``: a view (one slice when
    it has no more axes than that)."""
    a = np.asarray(x)
    lead = a.shape[: max(a.ndim - slices, 0)]
    return a.reshape((math.prod(lead), *a.shape[len(lead) :]))


def slice_blocks(n_slices: int, slice_size: int) -> Iterator[slice]:
    """Consecutive ranges of slices of about :data:`BLOCK_ELEMENTS` elements."""
    step = max(1, BLOCK_ELEMENTS // max(slice_size, 1))
    for s0 in range(0, n_slices, step):
        yield slice(s0, min(s0 + step, n_slices))


class ErrorFigures:
    """The statistics gathered block by block (:meth:`add`), read at the end
    (:meth:`figures`)."""

    def __init__(self, n_elements: int, n_slices: int) -> None:
        self.abs_values = np.empty(n_elements, dtype=np.float32)
        self.rel_values = np.empty(n_elements, dtype=np.float32)
        self.count = 0
        self.sums = {"abs": 0.0, "rel": 0.0}
        self.maxima = {"abs": 0.0, "rel": 0.0}
        self.dot = np.zeros(n_slices)
        self.norm_a = np.zeros(n_slices)
        self.norm_r = np.zeros(n_slices)

    def add(self, at: slice, a: F64, r: F64, finite: NDArray[np.bool_]) -> None:
        """One block of slices ``at``: ``a`` and ``r`` in float64, ``(k, ...)``."""
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            diff = np.abs(a - r)[finite]
            mag = np.abs(r)[finite]
            rel = np.divide(diff, mag, out=np.zeros_like(diff), where=mag > 0)
            rel[(mag == 0) & (diff > 0)] = np.inf  # a zero reference missed by anything
            n = diff.size
            self.abs_values[self.count : self.count + n] = diff
            self.rel_values[self.count : self.count + n] = rel
            self.count += n
            for kind, values in (("abs", diff), ("rel", rel)):
                self.sums[kind] += float(values.sum())
                self.maxima[kind] = max(self.maxima[kind], float(np.max(values, initial=0.0)))
            aa = np.where(finite, a, 0.0).reshape(len(a), -1)
            rr = np.where(finite, r, 0.0).reshape(len(r), -1)
            self.dot[at] = np.einsum("ij,ij->i", aa, rr)
            self.norm_a[at] = np.einsum("ij,ij->i", aa, aa)
            self.norm_r[at] = np.einsum("ij,ij->i", rr, rr)

    def figures(self, lead: tuple[int, ...]) -> dict[str, Any]:
        """The statistics; ``lead`` the slices' shape (for the cosine's index)."""
        out: dict[str, Any] = {}
        for kind, values in (("abs", self.abs_values), ("rel", self.rel_values)):
            kept = values[: self.count]
            figures = {"mean": self.sums[kind] / self.count if self.count else 0.0}
            qs = np.quantile(kept, list(STATS_QUANTILES.values())) if self.count else None
            for i, label in enumerate(STATS_QUANTILES):
                figures[label] = float(qs[i]) if qs is not None else 0.0
            figures["max"] = self.maxima[kind]
            out[kind] = figures
        with np.errstate(divide="ignore", invalid="ignore"):
            norms = np.sqrt(self.norm_a) * np.sqrt(self.norm_r)
            cos = np.where(norms > 0, self.dot / np.where(norms > 0, norms, 1.0), 1.0)
        worst: list[int] = []
        if cos.size and lead:
            worst = [int(i) for i in np.unravel_index(int(np.argmin(cos)), lead)]
        elif cos.size:
            worst = []
        out["cosine"] = {"min": float(np.min(cos, initial=1.0)), "min_at": worst}
        return out


def error_stats(actual: NDArray[Any], reference: NDArray[Any], slices: int) -> dict[str, Any]:
    """The statistics of ``actual`` against ``reference`` (same shape), the slices being
    the leading axes but the last ``slices``."""
    a_view, r_view = by_slice(actual, slices), by_slice(reference, slices)
    lead = np.shape(actual)[: max(np.ndim(actual) - slices, 0)]
    size = math.prod(a_view.shape[1:])
    figures = ErrorFigures(a_view.size, len(a_view))
    for at in slice_blocks(len(a_view), size):
        a = np.asarray(a_view[at], dtype=np.float64)
        r = np.asarray(r_view[at], dtype=np.float64)
        figures.add(at, a, r, np.isfinite(a) & np.isfinite(r))
    return figures.figures(tuple(lead))


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
