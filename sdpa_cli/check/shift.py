"""A (batch, head) slice shifted: its mean signed error against what rounding allows.

A whole head shifted by a few of its own rounding errors passes element by element;
its mean gives it away. Per slice the mean error must stay within the plain
computation's own mean error times the factor, plus :data:`MEAN_SHARE` of its RMS
error, plus six standard errors of the export's mean (:func:`shifted_slices`).

Pure numpy, a block of slices at a time, as :mod:`~sdpa_cli.check.relative` reads them.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.types import F64

MEAN_SHARE = 0.1
"""A slice's mean signed error may reach this share of the plain computation's RMS
error (plus six standard errors of the mean) before the slice is called shifted."""


def _by_slice(
    finite: NDArray[np.bool_], axes: int, *arrays: F64
) -> tuple[NDArray[np.int64], list[F64]]:
    """Each array (zero where ``finite`` is False) grouped by its leading index (the
    trailing ``axes`` flattened: a view), and how many finite elements each group
    holds (at least 1)."""
    lead = finite.shape[: finite.ndim - axes]
    n = np.maximum(finite.reshape((*lead, -1)).sum(axis=-1), 1)
    return n, [x.reshape((*lead, -1)) for x in arrays]


def rms(x: F64, n: NDArray[np.int64]) -> F64:
    out: F64 = np.sqrt(np.einsum("...i,...i->...", x, x) / n)
    return out


def shifted_slices(
    err: F64,
    plain: F64 | None,
    floor: F64,
    finite: NDArray[np.bool_],
    slices: int,
    factor: float,
) -> tuple[list[tuple[tuple[int, ...], float, float]], float]:
    """The (batch, head) slices whose mean signed error is beyond what rounding allows,
    as (index, mean error, allowance), and the largest ratio of a slice's mean error
    to its allowance; ``plain`` is the plain computation's error (None: 0, not
    computed) and ``floor`` each element's floor."""
    if err.ndim <= slices:
        return [], 0.0
    n, (e,) = _by_slice(finite, slices, err)
    mean = e.sum(axis=-1) / n
    spread = np.sqrt(np.maximum(np.einsum("...i,...i->...", e, e) / n - mean * mean, 0.0))
    plain_mean = plain_rms = np.zeros_like(mean)
    if plain is not None:
        _, (p,) = _by_slice(finite, slices, plain)
        plain_mean, plain_rms = np.abs(p.sum(axis=-1) / n), rms(p, n)
    # the floor's RMS over the slice (a row's floor stands for its elements)
    axes = tuple(range(-slices, 0))
    squares = np.sum(np.square(floor), axis=axes)  # a slice of no values: 0
    floor_rms = np.sqrt(squares / max(1, int(np.prod([floor.shape[a] for a in axes]))))
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
