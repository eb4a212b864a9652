"""The element checks of an export, each a :class:`~sdpa_cli.check.records.Check`: finite,
close to the reference, weights on the simplex (in [0, 1], rows summing to 1 over the
keys they may attend to), outputs inside V's range over those keys, and the LSE
consistent with the weights."""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import Tolerance, compare, mismatch_summary
from sdpa_cli.check.exports import merged_index
from sdpa_cli.check.records import Check
from sdpa_cli.check.residual import Readable
from sdpa_cli.engine.block import Block
from sdpa_cli.engine.masks import Documents, document_of
from sdpa_cli.engine.records import argmax_index
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.text import format_index, plural, sig


def finite_check(name: str, values: F64, label: str) -> Check:
    bad = ~np.isfinite(values)
    n = int(bad.sum())
    if not n:
        return Check(f"{name}.finite", "pass", f"all {values.size:,} finite", file=label)
    at = argmax_index(bad)
    nan = int(np.isnan(values).sum())
    return Check(
        f"{name}.finite",
        "fail",
        f"{n:,} of {values.size:,} not finite ({nan:,} NaN, {n - nan:,} inf); first at {format_index(at)}",
        index=at,
        file=label,
        details={"nonfinite": n, "nan": nan, "inf": n - nan},
    )


def close_check(
    name: str, actual: F64, reference: Readable, tol: Tolerance, label: str, equal_nan: bool
) -> Check:
    m = compare(actual, reference, tol.rtol, tol.atol, equal_nan=equal_nan)
    return Check(
        f"{name}.close",
        "fail" if m.mismatched else "pass",
        mismatch_summary(m, tol),
        index=m.worst_at,
        file=label,
        tolerance=tol,
        mismatch=m,
    )


def weights_range(w: F64, tol: Tolerance, label: str) -> Check:
    """Every weight in [0, 1] (up to atol)."""
    with np.errstate(invalid="ignore"):
        bad = np.isfinite(w) & ((w < -tol.atol) | (w > 1 + tol.atol))
    n = int(bad.sum())
    if not n:
        return Check("weights.range", "pass", "all in [0, 1]", file=label)
    at = argmax_index(bad)
    return Check(
        "weights.range",
        "fail",
        f"{n:,} of {w.size:,} outside [0, 1]; first {sig(w[at], 6)} at {format_index(at)}",
        index=at,
        file=label,
        details={"outside": n, "first_value": float(w[at])},
    )


def weights_rows(
    w: F64,
    support: NDArray[np.bool_],
    tol: Tolerance,
    label: str,
    documents: Documents | None = None,
) -> Check:
    """Rows sum to 1 over the keys they may attend to, the others get nothing; a row
    with nothing to attend to sums to 0.

    ``support`` is where the computation can put weight: the visible keys, and the
    hidden ones a finite mask value still weighs (a row with no visible key is
    spread over every key under -1e9). With packed ``documents``, weight on another document's key is named as leakage between
    the two documents.
    """
    any_support = np.asarray(support.any(axis=-1))
    with np.errstate(invalid="ignore"):
        sums = np.where(support, w, 0.0).sum(axis=-1)
        target = np.where(any_support, 1.0, 0.0)
        leaked = np.where(support, 0.0, np.abs(w)).max(axis=-1, initial=0.0)
        off = np.abs(sums - target)
        bad_sum = np.isfinite(sums) & (off > tol.atol + tol.rtol)
        bad_leak = leaked > tol.atol
    bad = bad_sum | bad_leak
    n_rows = int(np.prod(sums.shape))
    n = int(bad.sum())
    if not n:
        empty = n_rows - int(any_support.sum())
        largest = float(off[np.isfinite(off)].max(initial=0.0))
        summary = f"all {n_rows:,} rows sum to 1 (largest |Σ − 1| {sig(largest, 3)})"
        if empty:
            summary = (
                f"{n_rows - empty:,} rows sum to 1 (largest |Σ − 1| {sig(largest, 3)}); "
                f"{empty:,} with no key to attend to sum to 0"
            )
        return Check("weights.rows", "pass", summary, file=label)
    details: dict[str, Any] = {
        "rows_off": n,
        "bad_sums": int(bad_sum.sum()),
        "leaking_rows": int(bad_leak.sum()),
    }
    crossing = None if documents is None else _crossing(w, support, tol, documents)
    if crossing is not None:
        row, weight, dq, dk = crossing
        what = f"weight {sig(weight, 3)} crosses from document {dq} into document {dk} at"
        summary = f"{what} {format_index(row)}"
        details["documents"] = [dq, dk]
    else:
        row = argmax_index(bad)
        if bad_sum[row]:
            what = f"sums to {sig(sums[row], 6)}, not {sig(target[row], 6)}"
        else:
            what = f"puts {sig(leaked[row], 3)} on hidden keys"
        summary = f"row {format_index(row)} {what}"
    return Check(
        "weights.rows",
        "fail",
        f"{n:,} of {n_rows:,} rows off: {summary}",
        index=row,
        file=label,
        details=details,
    )


def _crossing(
    w: F64,
    support: NDArray[np.bool_],
    tol: Tolerance,
    documents: Documents,
) -> tuple[Index, float, int, int] | None:
    """The first row's largest weight on another document's key, above ``tol.atol``:
    its element index, the weight, the query's document and the key's (None: none)."""
    L, S = w.shape[-2:]
    dq = document_of(documents.cu_q, np.arange(L, dtype=np.int64))
    dk = document_of(documents.cu_k, np.arange(S, dtype=np.int64))
    across = (dq[:, None] != dk[None, :]) & ~support
    with np.errstate(invalid="ignore"):
        leaked = np.where(across, np.abs(w), 0.0)
        rows = leaked.max(axis=-1, initial=0.0) > tol.atol
    if not rows.any():
        return None
    row = argmax_index(rows)
    j = int(np.argmax(leaked[row]))
    return (*row, j), float(w[(*row, j)]), int(dq[row[-1]]), int(dk[j])


def v_range(
    v: F64,
    support: NDArray[np.bool_] | None,
    n_rows: int,
    running: tuple[F64, F64] | None = None,
) -> tuple[F64, F64]:
    """Per row and column, the smallest and largest of ``v`` (the block's keys, (keys,
    Ev)) over the keys the row may attend to (``support``, (rows, keys); None: every
    one); 0 for a row with none.

    Rows that see a prefix of the keys (causal, padding) or a suffix read running
    minima and maxima, O(keys·Ev) in all; only other rows (windows, arbitrary masks)
    reduce over their keys a few rows at a time. ``running``: V's running minima and
    maxima down these keys, when the caller keeps them.
    """
    S, Ev = v.shape
    if support is None:
        if not S:
            return np.zeros((n_rows, Ev)), np.zeros((n_rows, Ev))
        return np.broadcast_to(v.min(axis=0), (n_rows, Ev)), np.broadcast_to(
            v.max(axis=0), (n_rows, Ev)
        )
    lo = np.zeros((n_rows, Ev), dtype=v.dtype)
    hi = np.zeros((n_rows, Ev), dtype=v.dtype)
    if S == 0:
        return lo, hi
    vis = np.asarray(support, dtype=np.bool_)
    count = vis.sum(axis=-1)
    first = np.argmax(vis, axis=-1)
    last = S - 1 - np.argmax(vis[:, ::-1], axis=-1)
    contiguous = (count > 0) & (count == last - first + 1)
    prefix = contiguous & (first == 0)
    suffix = contiguous & (last == S - 1) & ~prefix
    if prefix.any():
        low, high = running or (np.minimum.accumulate(v, axis=0), np.maximum.accumulate(v, axis=0))
        lo[prefix] = low[last[prefix]]
        hi[prefix] = high[last[prefix]]
    if suffix.any():
        lo[suffix] = np.minimum.accumulate(v[::-1], axis=0)[::-1][first[suffix]]
        hi[suffix] = np.maximum.accumulate(v[::-1], axis=0)[::-1][first[suffix]]
    rest = np.flatnonzero((count > 0) & ~prefix & ~suffix)
    step = max(1, (1 << 21) // max(1, S * Ev))
    for j in range(0, rest.size, step):
        rows = rest[j : j + step]
        sel = vis[rows][:, :, None]
        lo[rows] = np.where(sel, v[None], np.inf).min(axis=1)
        hi[rows] = np.where(sel, v[None], -np.inf).max(axis=1)
    return lo, hi


def block_support(block: Block) -> NDArray[np.bool_] | None:
    """Where a block can put weight: its visible keys (a float mask's −inf hides too),
    and hidden keys a finite mask value still weighs (−1 leaves them weight; −1e9
    spreads a row with no visible key over every key). None: every key of the block."""
    if block.all_visible and float(np.min(block.masked, initial=np.inf)) > -math.inf:
        return None
    return weighable(block.visible, block.masked, block.weights)


def weighable(
    visible: NDArray[np.bool_], masked: NDArray[Any], weights: NDArray[Any]
) -> NDArray[np.bool_]:
    """The visible keys a logit of −inf does not hide, and any key holding weight."""
    with np.errstate(invalid="ignore"):
        support: NDArray[np.bool_] = visible & (masked != -math.inf)
        support |= weights > 0
    return support


class VBounds:
    """Per output element, V's range over the keys its row weighs, kept a (batch, head)
    slice at a time: one row, the slice's extremes, while every row of it weighs every
    key (no mask: a row for the whole slice, not L of them); a row per query once a
    block weighs fewer. Blocks of one slice may be put from several threads."""

    def __init__(self, rows: int, dtype: np.dtype[Any], sinks: bool) -> None:
        self._rows, self._dtype, self._sinks = rows, dtype, sinks
        self._by_slice: dict[Index, tuple[NDArray[Any], NDArray[Any]]] = {}
        self._lock = threading.Lock()

    def put(self, lead: Index, rows: slice, lo: NDArray[Any], hi: NDArray[Any]) -> None:
        """The bounds of ``rows`` of slice ``lead``: ``(n, Ev)``, or ``(Ev,)`` where
        the rows weigh every key (the slice's extremes)."""
        lo, hi = np.asarray(lo), np.asarray(hi)
        if self._sinks:  # the sink's share of a row reads no V: 0 is in range
            lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
        with self._lock:
            held = self._by_slice.get(lead)
            compact = held is not None and len(held[0]) == 1
            if lo.ndim == 1 and (held is None or compact):  # every key: the slice's one row
                if held is None:
                    self._by_slice[lead] = (
                        lo[None].astype(self._dtype),
                        hi[None].astype(self._dtype),
                    )
                return
            if held is None or len(held[0]) == 1:  # a row per query from now on
                shape = (self._rows, lo.shape[-1])
                full = (np.empty(shape, self._dtype), np.empty(shape, self._dtype))
                if held is not None:  # the rows put so far weighed every key
                    full[0][...], full[1][...] = held
                held = self._by_slice[lead] = full
            held[0][rows], held[1][rows] = lo, hi

    def __getitem__(self, lead: Index) -> tuple[NDArray[Any], NDArray[Any]]:
        """Slice ``lead``'s bounds, ``(L, Ev)`` or one row broadcast over them (a
        slice of no query rows, which no block put: bounds of no element)."""
        if not self._rows and lead not in self._by_slice:
            nothing = np.zeros((1, 1), self._dtype)
            return nothing, nothing
        return self._by_slice[lead]


def output_range(
    spec: AttentionSpec, out: F64, v_bounds: VBounds, tol: Tolerance, label: str, merged: bool
) -> Check:
    """Each output inside the per-column range of V over the row's visible keys: it is
    a convex combination of those rows of V."""
    if spec.options.dropout > 0:
        return Check(
            "output.range",
            "pass",
            "skipped: dropout rescales the weights, so the output may leave V's range",
            file=label,
            details={"skipped": True},
        )
    n = 0
    first: Index | None = None
    first_value = 0.0
    bounds = (0.0, 0.0)
    for lead in np.ndindex(*spec.lead):
        # in float64: the bounds are stored in V's own format, the slack is not
        o = out[lead]
        lo, hi = (np.broadcast_to(np.asarray(b, np.float64), o.shape) for b in v_bounds[lead])
        slack = tol.atol + tol.rtol * np.maximum(np.abs(lo), np.abs(hi))
        with np.errstate(invalid="ignore"):
            bad = np.isfinite(o) & ((o < lo - slack) | (o > hi + slack))
        k = int(bad.sum())
        if k and first is None:
            i, c = argmax_index(bad)
            first = (*lead, i, c)
            first_value = float(o[i, c])
            bounds = (float(lo[i, c]), float(hi[i, c]))
        n += k
    if not n:
        return Check(
            "output.range", "pass", "every value inside V's range over its visible keys", file=label
        )
    assert first is not None
    at = merged_index(spec, first) if merged else first
    return Check(
        "output.range",
        "fail",
        f"{n:,} of {out.size:,} outside V's range over the visible keys; "
        f"{sig(first_value, 6)} at {format_index(at)} is outside "
        f"[{sig(bounds[0], 6)}, {sig(bounds[1], 6)}]",
        index=at,
        file=label,
        details={"outside": n, "first_value": first_value, "range": list(bounds)},
    )


def lse_weights(
    masked: F64,
    lse: F64,
    lse_dtype: np.dtype[Any],
    w: F64,
    visible: NDArray[np.bool_],
    tol: Tolerance,
    label: str,
    equal_nan: bool,
) -> Check:
    """The exported weights equal exp(logit − exported LSE) on rows with a key to attend to.

    A row whose LSE is so large that one step of its own format exceeds rtol (−1e9 +
    log S in float32, under a finite mask value) cannot pin its weights to the
    tolerance: such rows are counted, not judged.
    """
    rows = np.asarray(visible.any(axis=-1)) & np.isfinite(lse)
    fmt = lse_dtype if lse_dtype.kind == "f" else np.dtype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        step = np.spacing(np.abs(np.where(rows, lse, 0.0)).astype(fmt)).astype(np.float64)
        coarse = rows & (step > tol.rtol)
        rows &= ~coarse
        implied = np.exp(masked - np.where(rows, lse, 0.0)[..., None])
    implied = np.where(rows[..., None], implied, w)  # rows not judged: compared to themselves
    m = compare(w, implied, tol.rtol, tol.atol, equal_nan=equal_nan)
    skipped = int(coarse.sum())
    note = (
        f" ({plural(skipped, 'row')} with an LSE too coarse in {fmt} not judged)" if skipped else ""
    )
    summary = (
        f"the exported weights equal exp(logit − LSE){note}"
        if not m.mismatched
        else f"weights ≠ exp(logit − LSE): {mismatch_summary(m, tol)}{note}"
    )
    return Check(
        "lse.weights",
        "fail" if m.mismatched else "pass",
        summary,
        index=m.worst_at,
        file=label,
        tolerance=tol,
        mismatch=m,
        details={"rows_not_judged": skipped},
    )
