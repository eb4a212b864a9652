"""What the gradient-health findings read of a whole gradient, gathered slice by slice.

The backward pass finishes dQ, dK and dV one slice of their operand's leading axes at a
time (:func:`~sdpa_cli.engine.grad.backward`'s ``on_slice``): a :class:`GradSummary`
told each slice keeps its norm, its non-finite values and its magnitudes against the
formats, so that judging a gradient never needs it whole (``sdpa grad`` keeps only the
slices it shows). d(bias) and d(sinks), summed to the end, are read whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision
from sdpa_cli.engine.grad import OPERAND, SLICED, Gradients
from sdpa_cli.engine.grad_block import norm
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import loaded_index
from sdpa_cli.engine.types import Index
from sdpa_cli.names import GRADIENTS

RANGE_FORMATS = ("float16", "bfloat16")
"""Formats every gradient's range is measured against (training keeps gradients in one)."""

CHUNK = 1 << 17
"""Elements of a slice read at a time: each temporary 1 MiB, whatever the slice's size
(they are made while the pass holds its blocks, at its peak)."""


@dataclass(frozen=True)
class GradRange:
    """One gradient's magnitudes against a format: what overflows, what goes subnormal
    (losing precision), what flushes to zero."""

    name: str
    dtype: str
    max_abs: float
    nonzero: int
    overflow: int
    subnormal: int
    flush: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "gradient": self.name,
            "dtype": self.dtype,
            "max_abs": self.max_abs,
            "nonzero": self.nonzero,
            "overflow": self.overflow,
            "subnormal": self.subnormal,
            "flush_to_zero": self.flush,
        }


@dataclass
class GradTally:
    """One gradient, read so far: per-slice norms, non-finite values (the first by its
    index in the operand as loaded), and magnitudes against each format."""

    name: str
    norms: dict[Index, float] = field(default_factory=dict)
    nonfinite: int = 0
    nans: int = 0
    first_bad: Index | None = None
    max_abs: float = 0.0
    nonzero: int = 0
    tallies: dict[str, list[int]] = field(default_factory=dict)
    """Per format: values that overflow, go subnormal, flush to zero."""

    def norm(self) -> float:
        """The whole gradient's 2-norm: the norm of its slices' norms."""
        return float(norm(np.array(list(self.norms.values())))) if self.norms else 0.0


class GradSummary:
    """Gradients judged slice by slice (:meth:`add`), in any order.

    Args:
        spec: the computation (to name a value by its index in the file).
        dtype: the training format (``--dtype``); the gradients' range is measured
            against it (when narrower than float32) and float16 and bfloat16.
    """

    def __init__(self, spec: AttentionSpec, dtype: str) -> None:
        self.spec = spec
        narrow = dtype not in ("float64", "float32", *RANGE_FORMATS)
        self.formats = (dtype, *RANGE_FORMATS) if narrow else RANGE_FORMATS
        self.tallies: dict[str, GradTally] = {}

    def add(self, name: str, index: Index, values: NDArray[Any]) -> None:
        """Read slice ``index`` of gradient ``name`` (of dQ, dK, dV: the slice of its
        operand's leading axes; of d(bias) and d(sinks): ``()``, the whole)."""
        t = self.tallies.setdefault(
            name, GradTally(name, tallies={d: [0, 0, 0] for d in self.formats})
        )
        t.norms[index] = float(norm(values))
        for i0, chunk in _chunks(values):
            finite = np.isfinite(chunk)
            if not finite.all():
                t.nonfinite += int(finite.size - np.count_nonzero(finite))
                t.nans += int(np.count_nonzero(np.isnan(chunk)))
                self._nonfinite(t, name, index, values, i0 + int(np.argmin(finite)))
            mags = np.abs(chunk[finite])
            nonzero = mags[mags > 0]
            t.max_abs = max(t.max_abs, float(mags.max(initial=0.0)))
            t.nonzero += int(nonzero.size)
            for d in self.formats:
                f = precision.fmt(d)
                tally = t.tallies[d]
                tally[0] += int(np.count_nonzero(f.overflows(nonzero)))
                tally[1] += int(np.count_nonzero((nonzero < f.normal) & (nonzero >= f.tiny / 2)))
                tally[2] += int(np.count_nonzero(nonzero < f.tiny / 2))

    def _nonfinite(
        self, t: GradTally, name: str, index: Index, values: NDArray[Any], first: int
    ) -> None:
        """Note element ``first`` (flat in ``values``), the first non-finite value of a
        chunk: the first in the file's order of the slice, maybe of the gradient (loaded
        indices in one shape compare as tuples in C order)."""
        operand = OPERAND[name]
        if name in SLICED:
            at = tuple(int(i) for i in np.unravel_index(first, values.shape))
            where = loaded_index(self.spec, operand, (*index, *at))
        else:  # read whole: as loaded it is only reshaped
            shape = self.spec.as_loaded(operand, values).shape
            where = tuple(int(i) for i in np.unravel_index(first, shape))
        if t.first_bad is None or where < t.first_bad:
            t.first_bad = where

    def in_order(self) -> Iterator[GradTally]:
        """Each gradient read, in :data:`~sdpa_cli.names.GRADIENTS`' order (the
        pass finishes them in an order the shapes decide)."""
        return (self.tallies[n] for n in GRADIENTS if n in self.tallies)

    def ranges(self) -> Iterator[GradRange]:
        """Each gradient's magnitudes against each format."""
        for t in self.in_order():
            for d in self.formats:
                yield GradRange(t.name, d, t.max_abs, t.nonzero, *t.tallies[d])

    def norm(self, name: str) -> float:
        """The 2-norm of gradient ``name`` (NaN if it was never read)."""
        t = self.tallies.get(name)
        return t.norm() if t is not None else math.nan

    def slice_norm(self, name: str, index: Index) -> float:
        """The 2-norm of slice ``index`` of gradient ``name``."""
        return self.tallies[name].norms[index]


def summarise(grads: Gradients, dtype: str) -> GradSummary:
    """A summary of whole gradients (every slice kept), read slice by slice."""
    summary = GradSummary(grads.spec, dtype)
    for name in grads.present():
        values = grads.tensor(name)
        assert values is not None
        if name in SLICED:
            for index in np.ndindex(*values.shape[:-2]):
                oi = tuple(int(i) for i in index)
                summary.add(name, oi, values[oi])
        else:
            summary.add(name, (), values)
    return summary


def add_summed(summary: GradSummary, grads: Gradients) -> None:
    """Read the gradients summed to the end of the pass (d(bias), d(sinks)) into a
    summary the pass told of dQ, dK and dV slice by slice."""
    for name in grads.present():
        if name not in SLICED:
            values = grads.tensor(name)
            assert values is not None
            summary.add(name, (), values)


def _chunks(values: NDArray[Any]) -> Iterator[tuple[int, NDArray[Any]]]:
    """``values`` flattened, :data:`CHUNK` elements at a time, with each chunk's start."""
    flat = values.reshape(-1)
    for i0 in range(0, flat.size, CHUNK):
        yield i0, flat[i0 : i0 + CHUNK]
