"""A float64 reference held in 2 bytes a value (and a bit): its difference from the
export, in float16, scaled per slice.

An export's error is far smaller than its values, so the reference is kept as
``export + difference``, the difference rounded to float16 after scaling by a power of
two per (batch, head) slice that brings the slice's largest to 2¹⁵: each error is kept
to 2⁻¹¹ of itself (or to 2⁻⁴⁰ of its slice's largest, below float16's normal range),
three significant digits of the error, and the reference to far more than its own
format's. Where the export is not finite, or off by more than the reference's own
magnitude (a broken element), the reference itself is kept so, to 2⁻¹¹ of its value,
and a bit says so. The exported gradients' checks hold their references so
(:mod:`~sdpa_cli.check.gradients`): the backward pass hands its slices over one at a
time, and dQ, dK and dV in float64 would be four times float16 exports.

It reads as the float64 array it stands for, a contiguous run of slices or of flat
elements at a time: ``shape``, ``reshape`` and indexing, which is what the comparisons
use (:func:`~sdpa_cli.check.compare.compare`,
:func:`~sdpa_cli.check.error_stats.by_slice`), and whole through ``numpy.asarray``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.types import F64

TOP = 15
"""A slice's largest difference is scaled to under 2**TOP (float16 reaches 65504)."""

RUN = 1 << 16
"""Values read at a time when a slice is put: temporaries of 512 KiB."""


class _View:
    """The float64 array a :class:`Residual` stands for, read as ``shape`` (its
    elements in C order, any shape of them)."""

    def __init__(self, of: Residual, shape: tuple[int, ...]) -> None:
        self.of, self.shape = of, tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def reshape(self, *shape: Any) -> _View:
        want = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return _View(self.of, _resolved(tuple(int(x) for x in want), self.size))

    def __getitem__(self, index: Any) -> F64:
        if index is Ellipsis:
            return self.of.flat(0, self.size).reshape(self.shape)
        if isinstance(index, slice):  # a run along the first axis
            start, stop, step = index.indices(self.shape[0] if self.shape else 1)
            if step != 1:
                raise IndexError("a Residual is read in contiguous runs")
            inner = math.prod(self.shape[1:])
            stop = max(stop, start)
            values = self.of.flat(start * inner, stop * inner)
            return values.reshape(stop - start, *self.shape[1:])
        whole_index = isinstance(index, tuple) and len(index) == len(self.shape)
        if whole_index and all(isinstance(i, (int, np.integer)) for i in index):
            at = int(np.ravel_multi_index(index, self.shape))
            return self.of.flat(at, at + 1).reshape(())
        if isinstance(index, (int, np.integer)):
            return self[(int(index),)] if self.ndim == 1 else self[slice(index, index + 1)][0]
        raise IndexError(f"a Residual is not read at {index!r}")

    def __array__(self, dtype: Any = None, copy: Any = None) -> F64:
        whole = self[...]
        return whole if dtype is None else whole.astype(dtype)


class Residual(_View):
    """The reference of an export ``(n slices, m values each)`` kept as the export
    plus a scaled float16 difference; filled a slice at a time (:meth:`put`), read as
    the float64 array it stands for (:class:`_View`: ``reshape``, indexing)."""

    def __init__(self, export: NDArray[Any], slices: int) -> None:
        super().__init__(self, tuple(export.shape))
        lead = self.shape[: max(len(self.shape) - slices, 0)]
        self.m = math.prod(self.shape[len(lead) :])
        """Values a slice."""
        self.n = max(math.prod(lead), 1)
        """How many slices."""
        self._export = np.asarray(export).reshape(-1)  # a view where it is contiguous
        self._difference = np.zeros(self.size, np.float16)
        # a bit an element: the value held is the reference itself (scaled by its own)
        self._itself = np.zeros((self.size + 7) // 8, np.uint8)
        self._scale = np.ones((2, self.n))  # the differences', the references'

    def put(self, k: int, count: int, reference: F64) -> None:
        """The reference of slices ``k`` to ``k + count`` (any shape of their values),
        a slice at a time, in runs of :data:`RUN` values (two passes: the scales, then
        the values): a few small temporaries beside the backward pass's own."""
        r_all = np.asarray(reference).reshape(count, self.m)
        for j in range(count):
            base = (k + j) * self.m
            largest = np.zeros(2)
            for lo in range(0, self.m, RUN):
                kept, itself = self._kept(base + lo, r_all[j, lo : lo + RUN])
                for which, where in ((0, ~itself), (1, itself)):
                    sizes = np.abs(kept[where & np.isfinite(kept)])
                    largest[which] = max(largest[which], float(np.max(sizes, initial=0.0)))
            scale = np.where(largest > 0, np.ldexp(1.0, np.frexp(largest)[1] - TOP), 1.0)
            self._scale[:, k + j] = scale
            for lo in range(0, self.m, RUN):
                kept, itself = self._kept(base + lo, r_all[j, lo : lo + RUN])
                hi = base + lo + len(kept)
                with np.errstate(over="ignore", invalid="ignore"):
                    self._difference[base + lo : hi] = np.where(
                        itself, kept / scale[1], kept / scale[0]
                    ).astype(np.float16)
                self._mark(base + lo, itself)

    def _kept(self, lo: int, reference: F64) -> tuple[F64, NDArray[np.bool_]]:
        """What is kept of the reference values from element ``lo`` on (unscaled), and
        where it is the reference itself."""
        a = np.asarray(self._export[lo : lo + len(reference)], np.float64)
        r = np.asarray(reference, np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            d = r - a
            # the reference itself where the export is not finite, or off by more than
            # the reference's own magnitude (its difference would not keep it)
            itself = ~np.isfinite(a) | ~(np.abs(d) <= np.abs(r))
        return np.where(itself, r, d), itself

    def _mark(self, lo: int, itself: NDArray[np.bool_]) -> None:
        """Set the bits of the elements from ``lo`` on."""
        hi = lo + len(itself)
        b0, b1 = lo // 8, (hi + 7) // 8
        bits = np.unpackbits(self._itself[b0:b1])
        bits[lo - 8 * b0 : hi - 8 * b0] = itself
        self._itself[b0:b1] = np.packbits(bits)

    def flat(self, lo: int, hi: int) -> F64:
        """Elements ``lo`` to ``hi`` in C order, float64."""
        if hi <= lo:
            return np.zeros(0)
        a = np.asarray(self._export[lo:hi], np.float64)
        first, last = lo // self.m, (hi - 1) // self.m + 1
        start = lo - first * self.m
        scales = np.repeat(self._scale[:, first:last], self.m, axis=1)[:, start : start + hi - lo]
        b0 = lo // 8
        itself = np.unpackbits(self._itself[b0 : (hi + 7) // 8])[lo - 8 * b0 :][: hi - lo]
        held = self._difference[lo:hi].astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            out: F64 = np.where(itself.astype(bool), held * scales[1], a + held * scales[0])
        return out


def _resolved(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """``shape`` with its one -1 worked out for ``size`` elements.

    Raises:
        ValueError: a shape of another size.
    """
    if -1 in shape:
        known = math.prod(x for x in shape if x != -1)
        shape = tuple((size // known if known else 0) if x == -1 else x for x in shape)
    if math.prod(shape) != size:
        raise ValueError(f"cannot read {size} values as {shape}")
    return shape


Readable = NDArray[Any] | _View
"""What the comparisons read a chunk at a time: an array, or a reference so held."""
