"""The backward pass's gradient-health records, described once (:data:`GRAD_RECORDS`).

Per query row of a block: ‖dA‖ and ‖dS‖ over the keys it attends to, the gain
1 − Σ A² (‖dS‖ ≤ (1 − Σ A²)·‖dA‖), the top weight and the weight on every other key,
the top key (−1 where none) and the number of attended keys; per key: the largest
weight any row gives it and whether any row may attend to it. Each is one
:class:`GradRecord`, its rule over one block (:class:`HealthBlock`) and, for a key's,
how the values of two blocks of rows combine (a row is one block's).

Both backward blocks (:mod:`sdpa_cli.engine.grad_block`) read every record through
:func:`read_health`: the per-stage block from its stages, the lean block from the
online pass's weights, which also knows each row's top key and top weight. The
gradient's ``n_visible`` and ``argmax`` are the attended keys' (−1 where none), not the
forward statistics'.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.types import F64


class HealthBlock:
    """What the records read from one block of the backward pass.

    Args:
        a: ``(rows, keys)`` the weights A (0 at keys a row does not attend to).
        top: ``(rows,)`` each row's top key, an index into the block's keys.
        attended: ``(rows, keys)`` the keys each row attends to; None: every key.
        key0: the block's first key.
        max_weight: ``(rows,)`` each row's top weight when the forward pass knows it
            (else read from A).
        da: ``(rows, keys)`` dA, while it is there (the lean block forms dS over it).
        ds: ``(rows, keys)`` dS, once formed.
    """

    def __init__(
        self,
        a: F64,
        top: NDArray[np.intp],
        attended: NDArray[np.bool_] | None,
        key0: int,
        *,
        max_weight: F64 | None = None,
        da: F64 | None = None,
        ds: F64 | None = None,
    ) -> None:
        self.a, self.top, self.attended, self.key0 = a, top, attended, key0
        self.da, self.ds = da, ds
        self._max_weight = max_weight

    @cached_property
    def max_weight(self) -> F64:
        if self._max_weight is not None:
            return self._max_weight
        n_rows, n_keys = self.a.shape
        return self.a.max(axis=1) if n_keys else np.zeros(n_rows)

    @cached_property
    def n_visible(self) -> NDArray[np.int64]:
        n_rows, n_keys = self.a.shape
        if self.attended is None:
            return np.full(n_rows, n_keys, dtype=np.int64)
        counts: NDArray[np.int64] = self.attended.sum(axis=1).astype(np.int64)
        return counts

    @cached_property
    def off_top(self) -> tuple[F64, F64]:
        """Per row: the weight off the top key, and 1 − Σ A² (:func:`off_top`)."""
        return off_top(self.a, self.top, self.max_weight)


@dataclass(frozen=True)
class GradRecord:
    """One gradient-health record: its rule over a block, as both backward blocks
    read it."""

    name: str
    dtype: type[np.generic]
    axis: Literal["row", "key"]
    """Per query row ``(*lead, L)``, or per key ``(*lead, S)``."""
    description: str
    rule: Callable[[HealthBlock], NDArray[Any]]
    reads_da: bool = False
    """Read while dA is there (the lean block forms dS over it)."""
    merge: Callable[[NDArray[Any], NDArray[Any]], Any] | None = None
    """A key's record: the values of two blocks of rows, into the first (in place)."""


def _key_weight(b: HealthBlock) -> F64:
    n_rows, n_keys = b.a.shape
    if not n_rows:
        return np.zeros(n_keys)
    a_seen = b.a if b.attended is None else np.where(b.attended, b.a, 0.0)
    return a_seen.max(axis=0)  # type: ignore[no-any-return]


def _key_seen(b: HealthBlock) -> NDArray[np.bool_]:
    n_rows, n_keys = b.a.shape
    if b.attended is None:
        return np.full(n_keys, n_rows > 0, dtype=np.bool_)
    return np.asarray(b.attended.any(axis=0), dtype=np.bool_)


def _largest_into(whole: F64, block: F64) -> None:
    np.maximum(whole, block, out=whole)


def _any_into(whole: NDArray[np.bool_], block: NDArray[np.bool_]) -> None:
    whole |= block


def _da_norm(b: HealthBlock) -> F64:
    assert b.da is not None
    return seen_norm(b.da, b.attended)


def _ds_norm(b: HealthBlock) -> F64:
    assert b.ds is not None
    return seen_norm(b.ds, b.attended)


GRAD_RECORDS: tuple[GradRecord, ...] = (
    GradRecord(
        "da_norm", np.float64, "row", "‖dA‖ over the attended keys", _da_norm, reads_da=True
    ),
    GradRecord("ds_norm", np.float64, "row", "‖dS‖ over the attended keys", _ds_norm),
    GradRecord(
        "gain",
        np.float64,
        "row",
        "1 − Σ A², the bound on ‖dS‖ / ‖dA‖ (0 for a row that attends to nothing)",
        lambda b: np.where(b.n_visible > 0, b.off_top[1], 0.0),
    ),
    GradRecord("max_weight", np.float64, "row", "the top weight", lambda b: b.max_weight),
    GradRecord(
        "rest",
        np.float64,
        "row",
        "the weight on every key but the top one (1 − max weight, without rounding)",
        lambda b: b.off_top[0],
    ),
    GradRecord(
        "argmax",
        np.int64,
        "row",
        "the top key; −1 for a row that attends to nothing (no key to name)",
        lambda b: np.where(b.n_visible > 0, b.top + b.key0, -1).astype(np.int64),
    ),
    GradRecord("n_visible", np.int64, "row", "the keys the row attends to", lambda b: b.n_visible),
    GradRecord(
        "key_weight",
        np.float64,
        "key",
        "the largest weight the key gets from a row that attends to it",
        _key_weight,
        merge=_largest_into,
    ),
    GradRecord(
        "key_seen",
        np.bool_,
        "key",
        "whether any row may attend to the key",
        _key_seen,
        merge=_any_into,
    ),
)
"""Every gradient-health record, as :class:`HealthRecords` lists them."""


def read_health(block: HealthBlock, *, reads_da: bool | None = None) -> dict[str, NDArray[Any]]:
    """The records of ``block``: every one (None), or those that read dA (True) or
    the others (False)."""
    return {
        r.name: r.rule(block) for r in GRAD_RECORDS if reads_da is None or r.reads_da == reads_da
    }


def record_bytes(rows: int, keys: int) -> int:
    """What the records of ``rows`` query rows and ``keys`` keys take."""
    size = {"row": rows, "key": keys}
    return sum(size[r.axis] * np.dtype(r.dtype).itemsize for r in GRAD_RECORDS)


class HealthRecords:
    """The records the findings read, by name, from :attr:`health` (a block's, or the
    whole pass's)."""

    health: Mapping[str, NDArray[Any]]

    @property
    def da_norm(self) -> F64:
        return self.health["da_norm"]

    @property
    def ds_norm(self) -> F64:
        return self.health["ds_norm"]

    @property
    def gain(self) -> F64:
        return self.health["gain"]

    @property
    def max_weight(self) -> F64:
        return self.health["max_weight"]

    @property
    def rest(self) -> F64:
        """The weight on every key but the top one (1 − max weight, without rounding)."""
        return self.health["rest"]

    @property
    def argmax(self) -> NDArray[np.int64]:
        return self.health["argmax"]

    @property
    def n_visible(self) -> NDArray[np.int64]:
        return self.health["n_visible"]

    @property
    def key_weight(self) -> F64:
        """The largest weight each key gets from the rows."""
        return self.health["key_weight"]

    @property
    def key_seen(self) -> NDArray[np.bool_]:
        """Whether any row may attend to each key."""
        return self.health["key_seen"]


PRECISE_BELOW = 1e-4
"""Rows whose 1 − Σ A² falls below this are recomputed without the cancellation."""


def off_top(a: F64, top: NDArray[np.intp], max_weight: F64) -> tuple[F64, F64]:
    """Per row: the weight off the top key, and 1 − Σ A² (the Jacobian's norm bound).

    1 − Σ A² = Σ A (1 − A); for a nearly one-hot row the top key's 1 − A_top is taken
    as the weight on the other keys, since 1 − 0.99999999 keeps only rounding. The
    cheap forms serve every other row.
    """
    rest = 1.0 - max_weight
    gain = 1.0 - np.einsum("ij,ij->i", a, a)
    with np.errstate(invalid="ignore"):
        close = np.flatnonzero(gain < PRECISE_BELOW)
    if close.size and a.shape[1]:
        others = a[close]
        others[np.arange(close.size), top[close]] = 0.0
        rest[close] = others.sum(axis=1)
        gain[close] = max_weight[close] * rest[close] + np.sum(others * (1.0 - others), axis=1)
    return rest, gain


NORM_SLICES = 1 << 20
"""Elements above which :func:`norm` of a tensor goes one (batch, head) slice at a time."""


def norm(x: NDArray[Any], axis: int | tuple[int, ...] | None = None) -> Any:
    """The 2-norm along ``axis``, scaled by the largest magnitude first: the squares of
    a vanishing row's dS (~1e-200) would underflow to 0 and hide it."""
    x = np.asarray(x)
    if x.ndim > 2 and axis in (None, (-2, -1)) and x.size > NORM_SLICES:
        # slice by slice: the temporaries are a slice's, not the whole tensor's
        per = np.empty(x.shape[:-2])
        for at in np.ndindex(*per.shape):
            per[at] = norm(x[at])
        return per if axis is not None else norm(per)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        mags = np.abs(x)
        top = np.max(mags, axis=axis, keepdims=True, initial=0.0)
        safe = np.where((top > 0) & np.isfinite(top), top, 1.0)
        total = np.sqrt(np.sum(np.square(mags / safe), axis=axis, keepdims=True)) * safe
        total = np.where(np.isfinite(top), total, top)  # inf stays inf, NaN NaN
        return np.squeeze(total, axis=axis) if axis is not None else total.reshape(())[()]


def row_norm(x: F64) -> F64:
    """:func:`norm` of each row of ``(rows, keys)``: the plain sum of squares, and the
    scaled one for the rows whose squares could underflow or overflow."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        squares = np.einsum("ij,ij->i", x, x)
        total: F64 = np.sqrt(squares)
        # NaN compares False: such rows, and zero rows, take the careful path too
        again = np.flatnonzero(~((squares > 1e-250) & (squares < 1e250)))
    if again.size:
        total[again] = norm(x[again], axis=1)
    return total


def seen_norm(x: F64, attended: NDArray[np.bool_] | None) -> F64:
    """:func:`row_norm` over the keys each row attends to (``attended`` None: every
    key): a finite mask value gives a fully masked row uniform weights, yet its
    logits were replaced and pass nothing back."""
    return row_norm(x if attended is None else np.where(attended, x, 0.0))
