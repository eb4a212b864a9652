"""Low-precision formats: their limits, rounding to them, and emulated arithmetic.

Rounding is never written by hand: a value is rounded to a format by casting it
there and back (numpy for float16/float32, ``ml_dtypes`` for bfloat16 and float8).
The limits below are read off the same casts, so the diagnostics' "would overflow"
and "would flush to zero" agree with what a cast does, value for value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.types import F64
from sdpa_cli.names import FORMATS as FORMATS

CHECKED = ("float16", "bfloat16", "float8_e4m3fn")
"""Formats every run checks for overflow and underflow, whatever the inputs' dtype."""


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a format name (bfloat16 and float8 come from ml_dtypes)."""
    if name in ("float64", "float32", "float16"):
        return np.dtype(name)
    dt: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
    return dt


def is_float(dtype: np.dtype[Any]) -> bool:
    """Whether a dtype holds floating-point numbers: numpy's, or ml_dtypes' bfloat16 and
    float8 (whose numpy kind is ``V``)."""
    return dtype.kind == "f" or dtype.name in FORMATS


@dataclass(frozen=True)
class Format:
    """The limits of one floating-point format, as casts to it behave.

    Attributes:
        name: ``float16``, ``bfloat16``, ...
        max: the largest finite value.
        overflow_at: about where magnitudes start to round to inf (or NaN, for
            float8 e4m3fn, which has no inf): halfway past ``max``.
        tiny: the smallest positive (subnormal) value; about half of it rounds to zero.
        normal: the smallest positive normal value.
        eps: spacing of the format at 1.0 (2^-mantissa bits).
    """

    name: str
    max: float
    overflow_at: float
    tiny: float
    normal: float
    eps: float

    @property
    def unit_roundoff(self) -> float:
        """Largest relative error of one rounding to nearest: eps / 2."""
        return self.eps / 2

    @property
    def exp_limit(self) -> float:
        """exp(x) overflows this format for x above this: log(max)."""
        return math.log(self.max)

    def overflows(self, x: F64) -> NDArray[np.bool_]:
        """Which finite values would become inf (or NaN) when stored in this format.

        Decided by the cast itself for magnitudes between ``max`` and twice it
        (ml_dtypes rounds float64 to bfloat16 through float32, so a threshold alone
        could differ); twice ``max`` and above overflows every format (a finite mask
        value added to every hidden score is all of them: no cast each).
        """
        with np.errstate(invalid="ignore"):
            mag = np.abs(x)
            hit = np.isfinite(x) & (mag > self.max)
            near = hit & (mag < 2 * self.max)
        if near.any():
            hit[near] = ~np.isfinite(round_to(x[near], self.name))
        return hit

    def flushes(self, x: F64) -> NDArray[np.bool_]:
        """Which non-zero values would become zero when stored in this format."""
        with np.errstate(invalid="ignore"):
            hit = (x != 0) & (np.abs(x) <= self.tiny)
        if hit.any():
            hit[hit] = round_to(x[hit], self.name) == 0
        return hit  # type: ignore[no-any-return]

    def headroom(self, absmax: float) -> float:
        """Powers of two between the largest magnitude seen and the format's max."""
        if not absmax > 0 or not math.isfinite(absmax):
            return math.inf if absmax == 0 else -math.inf
        return math.log2(self.max / absmax)


@cache
def fmt(name: str) -> Format:
    """The :class:`Format` of a name in :data:`FORMATS`, measured by casting."""
    if name == "float64":
        fi64 = np.finfo(np.float64)
        return Format(name, float(fi64.max), math.inf, 5e-324, float(fi64.tiny), float(fi64.eps))
    dt = numpy_dtype(name)
    fi = ml_dtypes.finfo(dt)  # type: ignore[no-untyped-call]
    top = float(fi.max)
    ulp = 2.0 ** (math.frexp(top)[1] - 1 - int(fi.nmant))
    return Format(
        name=name,
        max=top,
        overflow_at=top + ulp / 2,
        tiny=float(fi.smallest_subnormal),
        normal=float(fi.smallest_normal),
        eps=float(fi.eps),
    )


def round_to(x: F64, name: str) -> F64:
    """``x`` rounded to the format ``name`` (to nearest, ties to even), back in float64.

    Values beyond the format's range become ±inf (NaN for float8 e4m3fn, which has
    no infinity), as a cast does.
    """
    if name == "float64":
        return x
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x).astype(numpy_dtype(name)).astype(np.float64)


def matmul(a: F64, b: F64, accumulate: str) -> F64:
    """``a @ b`` (a: (n, k), b: (k, m)) summed in the format ``accumulate``.

    float64 and float32 use BLAS in that dtype (float32 is how tensor cores
    accumulate). A narrower accumulator rounds after every fused multiply-add,
    one term of the inner axis at a time, as a kernel accumulating in that format
    does: products of two 16-bit numbers are exact in float64, so only the sums round.
    """
    if accumulate in ("float64", "float32"):
        dt = np.dtype(accumulate)
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(np.asarray(a, dt) @ np.asarray(b, dt), np.float64)
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(a.shape[1]):
            acc = round_to(acc + a[:, t, None] * b[None, t, :], accumulate)
    return acc


def row_sum(x: F64, name: str) -> F64:
    """Sum over the last axis in the format ``name``: pairwise, rounding each level.

    A pairwise (tree) reduction is what GPU reductions do; in float64 and float32
    numpy's own pairwise sum is used.
    """
    if name in ("float64", "float32"):
        dt = np.dtype(name)
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(np.asarray(x, dt).sum(axis=-1, keepdims=True), np.float64)
    part = x
    with np.errstate(over="ignore", invalid="ignore"):
        while part.shape[-1] > 1:
            n = part.shape[-1]
            even = part[..., : n - n % 2]
            pairs = round_to(even[..., 0::2] + even[..., 1::2], name)
            part = np.concatenate([pairs, part[..., n - n % 2 :]], axis=-1) if n % 2 else pairs
    if part.shape[-1] == 0:
        return np.zeros((*x.shape[:-1], 1))
    return part
