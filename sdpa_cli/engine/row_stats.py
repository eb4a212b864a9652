"""Every per-row statistic of the forward pass, described once (:data:`ROW_STATISTICS`).

A statistic is one :class:`RowStatistic`: what it reads from a block of keys (a
:class:`Chunk`), how its partial result is carried when an online softmax's running
max rises (:class:`Rescale`), how two partial results over disjoint keys combine, and
how it finishes once each row's normaliser is known (:class:`Final`). A statistic of
the final weights themselves (what would flush to zero in a narrow format) reads them
afterwards, block by block (:class:`Settled`), for the rows its prefilter picks.

Frames. A producer reads each row's logits x against a reference m of its choosing:
log e = x − m at the row's visible keys, log ℓ = log Σ exp(x − m). It may give e and ℓ
both divided by one constant c of the row, e = exp(x − m) / c (0 at hidden keys) and
ℓ = Σ e: what the statistics finish with, the weights w = e / ℓ and log ℓ, do not
depend on c. When the reference rises from m_old to m_new, a partial result is carried
with α = exp(m_old − m_new) and δ = m_old − m_new: every e is multiplied by α, every
log e shifted by δ.

Both producers run the same rules (:class:`Fold`, :class:`Settle`, :func:`collect`):

- the lean pass (:mod:`sdpa_cli.engine.online`) folds one chunk per key block, in the
  frame of the running max (c = 1: e = exp(x − m), ℓ = Σ e);
- the per-stage path (:meth:`Stats.measure <sdpa_cli.engine.stats.Stats.measure>`)
  folds one chunk, a whole block's weights as shown (:func:`per_stage`): e = w and
  ℓ = 1 (c is the row's normaliser), with m the row's top logit where the weights are
  the exact softmax of the logits (log e = x − x_top, log ℓ = −log w_top: no log per
  weight), else m = the LSE (log e = log w, log ℓ = 0).

So a new statistic is one entry of :data:`ROW_STATISTICS` and its rules, here; it
rides along in every block's :class:`RowStats` and in
:class:`~sdpa_cli.engine.stats.Stats`, and ``tests/engine/test_row_stats.py`` holds the
two producers to each other from the entry. What the rules read and the form of an
entry are in :mod:`sdpa_cli.engine.row_chunks` (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision
from sdpa_cli.engine.arrays import astype, namespace_of, numpy_dtype
from sdpa_cli.engine.block import Block
from sdpa_cli.engine.row_chunks import (
    Chunk,
    Final,
    Partial,
    Rescale,
    RowStatistic,
    Settled,
    Tolerance,
    block_chunk,
    column,
)
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64

__all__ = [
    "ROW_STATISTICS",
    "Chunk",
    "Final",
    "Fold",
    "Rescale",
    "RowStatistic",
    "RowStats",
    "Settle",
    "Settled",
    "Tolerance",
    "collect",
    "per_stage",
]


# --- the rules ----------------------------------------------------------------------------


def _zeros(n: int, dtype: np.dtype[Any], xp: Any) -> Partial:
    return (xp.zeros(n, dtype),)


def _counts(n: int, dtype: np.dtype[Any], xp: Any) -> Partial:
    return (xp.zeros(n, np.int64),)


def _sums(n: int, dtype: np.dtype[Any], xp: Any) -> Partial:
    return (xp.zeros(n, np.float64),)


def _add(a: Partial, b: Partial) -> Partial:
    return (a[0] + b[0],)


def _scaled(p: Partial, r: Rescale) -> Partial:
    """A partial result in units of e: e_new = α · e_old."""
    return tuple(x * r.alpha for x in p)


def _as_is(p: Partial, final: Final) -> NDArray[Any]:
    return p[0]


def _per_weight(p: Partial, final: Final) -> F64:
    """A partial result in units of e (its last array), as a weight: e / ℓ, in float64."""
    weight: F64 = astype(p[-1], np.float64) / astype(final.safe, np.float64)
    return weight


def _empty_top(n: int, dtype: np.dtype[Any], xp: Any) -> Partial:
    return xp.zeros(n, np.int64), xp.full(n, -math.inf, np.float64)


def _top_key(c: Chunk) -> Partial:
    return c.top + c.key0, c.rank


def _later_top(a: Partial, b: Partial) -> Partial:
    """The first of the largest keys: the later keys' only where they rank strictly
    higher (NaN, which the per-stage path may rank, takes the later's, as argmax does)."""
    xp = namespace_of(a[0])
    return xp.where(b[1] <= a[1], a[0], b[0]), xp.maximum(a[1], b[1])


def _top_key_finish(p: Partial, final: Final) -> NDArray[np.int64]:
    """A row with no weight names key 0, whatever keys were skipped."""
    top: NDArray[np.int64] = final.xp.where(final.seen, p[0], 0)
    return top


def _top_e(c: Chunk) -> Partial:
    return (c.e_top,)


def _larger(a: Partial, b: Partial) -> Partial:
    return (namespace_of(a[0]).maximum(a[0], b[0]),)


def _spread(c: Chunk) -> Partial:
    return (c.xp.einsum("ij,ij->i", c.e, c.log_e),)


def _spread_rescale(p: Partial, r: Rescale) -> Partial:
    """Σ e·log e into the new frame: α·(Σ e·(x − m_old) + δ·ℓ_old) (a row with no key
    yet adds nothing: its δ is −inf)."""
    return (r.alpha * (p[0] + namespace_of(p[0]).where(r.total > 0, r.delta * r.total, 0)),)


def _entropy(p: Partial, final: Final) -> F64:
    """H = −Σ w log w = log ℓ − Σ e·log e / ℓ (w = exp(log e − log ℓ), whatever the
    frame's m and c)."""
    # terms ≤ 0 (a rounding below 0) are not entropy: a one-hot row has none
    xp = final.xp
    h = xp.where(final.seen, xp.maximum(final.log_total - p[0] / final.safe, 0.0), 0.0)
    entropy: F64 = xp.where(xp.isfinite(h), h, 0.0)
    return entropy


def _hidden_finish(p: Partial, final: Final) -> F64:
    weight = _per_weight(p, final)
    return weight if final.uniform is None else final.xp.where(final.uniform, 1.0, weight)


def _top_two(c: Chunk) -> Partial:
    """Each row's largest and second-largest e of the chunk (0 where there is none);
    two keys that tie at the top give the top value twice."""
    first = c.e_top
    if c.e.shape[1] < 2:
        return first, c.xp.zeros_like(first)
    with c.top_set_aside() as rest:  # one argmax over the rest, no copy
        second = c.at(c.xp.argmax(rest, axis=1))
    return first, second


def _two_of_four(a: Partial, b: Partial) -> Partial:
    """The two largest of both partial results' two largest."""
    xp = namespace_of(a[0])
    first = xp.maximum(a[0], b[0])
    second = xp.maximum(xp.minimum(a[0], b[0]), xp.maximum(a[1], b[1]))
    return first, second


def _empty_two(n: int, dtype: np.dtype[Any], xp: Any) -> Partial:
    return xp.zeros(n, dtype), xp.zeros(n, dtype)


def _may_flush(final: Final, fmt: str | None) -> NDArray[np.bool_]:
    """Rows whose smallest weight is not above the format's smallest subnormal (NaN:
    look closer)."""
    assert fmt is not None
    flushed: NDArray[np.bool_] = ~(final.smallest > precision.fmt(fmt).tiny)
    return flushed


def _flush_count(s: Settled, fmt: str | None) -> Partial:
    assert fmt is not None
    return (s.flushed(fmt).sum(axis=1),)


def _flush_mass(s: Settled, fmt: str | None) -> Partial:
    assert fmt is not None
    return (namespace_of(s.w).where(s.flushed(fmt), s.w, 0).sum(axis=1),)


COUNTS = Tolerance()
WEIGHT = Tolerance(rel=8)
"""A weight e / ℓ: ℓ summed in another order (the lean pass's key blocks)."""


ROW_STATISTICS: tuple[RowStatistic, ...] = (
    RowStatistic(
        "n_visible",
        np.int32,
        "the keys the row sees (a float mask's sentinels hide theirs)",
        empty=_counts,
        chunk=lambda c: (c.seen,),
        combine=_add,
        finish=_as_is,
        tolerance=COUNTS,
    ),
    RowStatistic(
        "max_weight",
        np.float64,
        "the largest weight: e_top / ℓ (1 / ℓ in the lean pass's frame)",
        empty=_zeros,
        chunk=_top_e,
        rescale=_scaled,
        combine=_larger,
        finish=_per_weight,
        tolerance=WEIGHT,
    ),
    RowStatistic(
        "argmax",
        np.int32,
        "the key of the largest weight, the first of tied ones; 0 for a row with no weight",
        empty=_empty_top,
        chunk=_top_key,
        combine=_later_top,
        finish=_top_key_finish,
        tolerance=COUNTS,
    ),
    RowStatistic(
        "entropy",
        np.float64,
        "−Σ w log w in nats, over the visible keys",
        empty=_zeros,
        chunk=_spread,
        rescale=_spread_rescale,
        combine=_add,
        finish=_entropy,
        # log ℓ − Σ e·log e / ℓ cancels for a nearly one-hot row: ulps of log ℓ
        tolerance=Tolerance(rel=8, abs=16),
    ),
    RowStatistic(
        "underflow",
        np.int32,
        "the visible weights that would flush to zero in the format",
        empty=_counts,
        settle=_flush_count,
        reads=_may_flush,
        combine=_add,
        finish=_as_is,
        per_format=True,
        tolerance=COUNTS,
    ),
    RowStatistic(
        "lost",
        np.float64,
        "the weight those flushed weights carry",
        empty=_sums,
        settle=_flush_mass,
        reads=_may_flush,
        combine=_add,
        finish=_as_is,
        per_format=True,
        # each weight exp(x − m) / ℓ, x − m as far below 0 as a weight that flushes: ε·|x − m|
        tolerance=Tolerance(rel=64),
    ),
    RowStatistic(
        "hidden_weight",
        np.float64,
        "the weight on keys the row does not see (a finite mask value's, a float mask "
        "sentinel's): 0 where hidden keys get none",
        empty=_zeros,
        chunk=lambda c: (c.hidden_mass,),
        rescale=_scaled,
        combine=_add,
        finish=_hidden_finish,
        tolerance=Tolerance(rel=8, abs=8),
    ),
    RowStatistic(
        "runner_up",
        np.float64,
        "the second-largest weight (the top one again where two keys tie); 0 for a row "
        "with fewer than two visible keys",
        empty=_empty_two,
        chunk=_top_two,
        rescale=_scaled,
        combine=_two_of_four,
        finish=_per_weight,
        # exp(x − m) of a key far below the top (a saturated row's): ε·|x − m|
        tolerance=Tolerance(rel=64),
    ),
)
"""Every per-row statistic, in the order :class:`RowStats` lists them."""

ONLINE = tuple(s for s in ROW_STATISTICS if s.chunk is not None)
SETTLED = tuple(s for s in ROW_STATISTICS if s.settle is not None)
assert len(ONLINE) + len(SETTLED) == len(ROW_STATISTICS), "a statistic is online or settled"


Column = tuple[RowStatistic, str, str | None]
"""A statistic, one of its columns and that column's format (None: not per format)."""


@cache
def layout(formats: tuple[str, ...]) -> tuple[Column, ...]:
    """Every column of every statistic, in :data:`ROW_STATISTICS`' order, for the
    narrow formats ``formats`` (made once per tuple of formats)."""
    return tuple((s, name, d) for s in ROW_STATISTICS for name, d in s.columns(formats))


def bytes_per_row(formats: int) -> int:
    """What :class:`~sdpa_cli.engine.stats.Stats` keeps per query row, checking
    ``formats`` narrow formats."""
    return sum(
        np.dtype(s.dtype).itemsize * (formats if s.per_format else 1) for s in ROW_STATISTICS
    )


# --- the producers' folds ----------------------------------------------------------------


class RowStats(dict[str, NDArray[Any]]):
    """Per query row, every statistic of :data:`ROW_STATISTICS` by column (a block's,
    or the whole run's ``(*lead, L)`` in :class:`~sdpa_cli.engine.stats.Stats`): a
    statistic's name, or ``name[format]`` for a per-format one (:func:`column`).

    Args:
        columns: every column, in :data:`ROW_STATISTICS`' order.
        formats: the narrow formats of the per-format statistics.
    """

    def __init__(self, columns: Mapping[str, NDArray[Any]], formats: tuple[str, ...]) -> None:
        super().__init__(columns)
        self.formats = formats

    @classmethod
    def zeros(cls, shape: tuple[int, ...], formats: tuple[str, ...]) -> RowStats:
        """Every column zero, in the dtype its statistic is kept in."""
        return cls({name: np.zeros(shape, s.dtype) for s, name, _ in layout(formats)}, formats)

    def per_format(self, name: str) -> dict[str, NDArray[Any]]:
        """A per-format statistic's columns by format (the arrays themselves)."""
        return {d: self[column(name, d)] for d in self.formats}

    @property
    def n_visible(self) -> NDArray[np.int64]:
        return self["n_visible"]

    @property
    def max_weight(self) -> F64:
        return self["max_weight"]

    @property
    def argmax(self) -> NDArray[np.int64]:
        return self["argmax"]

    @property
    def entropy(self) -> F64:
        return self["entropy"]

    @property
    def underflow(self) -> dict[str, NDArray[np.int64]]:
        return self.per_format("underflow")

    @property
    def lost(self) -> dict[str, F64]:
        return self.per_format("lost")

    @property
    def hidden_weight(self) -> F64:
        return self["hidden_weight"]


_RESCALED = tuple((s.name, s.rescale) for s in ONLINE if s.rescale is not None)
_ADDED = tuple((s.name, s.chunk, s.combine) for s in ONLINE if s.chunk is not None)


class Fold:
    """The online statistics' partial results over some query rows, folded chunk by
    chunk: :meth:`rescale` when the running max rises, then :meth:`add` the chunk."""

    def __init__(self, n: int, dtype: np.dtype[Any], xp: Any = np) -> None:
        self.parts = {s.name: s.empty(n, dtype, xp) for s in ONLINE}

    def rescale(self, r: Rescale) -> None:
        parts = self.parts
        for name, rule in _RESCALED:
            parts[name] = rule(parts[name], r)

    def add(self, chunk: Chunk) -> None:
        parts = self.parts
        for name, rule, combine in _ADDED:
            parts[name] = combine(parts[name], rule(chunk))


class Settle:
    """The settled statistics over the final weights of the rows that need them
    (:attr:`rows`, picked by each statistic's prefilter), folded block by block."""

    def __init__(self, final: Final, formats: tuple[str, ...]) -> None:
        self.n, self.formats = final.total.shape[0], formats
        self.columns = tuple(c for c in layout(formats) if c[0].settle is not None)
        self.xp = xp = final.xp
        need = xp.zeros(self.n, np.bool_)
        for s, _, d in self.columns:
            assert s.reads is not None
            need |= s.reads(final, d)
        self.rows = xp.flatnonzero(need)
        self.parts: dict[str, Partial] = {}
        self.dtype = numpy_dtype(final.total)

    def add(self, settled: Settled) -> None:
        """One block of keys' final weights of :attr:`rows`."""
        parts = self.parts
        for s, name, d in self.columns:
            assert s.settle is not None
            part = parts[name] if name in parts else s.empty(len(self.rows), self.dtype, self.xp)
            parts[name] = s.combine(part, s.settle(settled, d))

    def whole(self, s: RowStatistic, name: str) -> Partial:
        """A statistic's partial result over every row: the empty one where not read."""
        if name not in self.parts:
            return s.empty(self.n, self.dtype, self.xp)
        if len(self.rows) == self.n:
            return self.parts[name]
        full = s.empty(self.n, self.dtype, self.xp)
        for x, part in zip(full, self.parts[name], strict=True):
            x[self.rows] = part
        return full


def collect(fold: Fold, settle: Settle, final: Final) -> RowStats:
    """Every statistic finished, in :data:`ROW_STATISTICS`' order."""
    columns = {
        name: s.finish(fold.parts[name] if s.chunk is not None else settle.whole(s, name), final)
        for s, name, _ in layout(settle.formats)
    }
    return RowStats(columns, settle.formats)


# --- the per-stage path: one chunk, a whole block's weights ------------------------------


def per_stage(
    spec: AttentionSpec,
    block: Block,
    reference: Block,
    formats: tuple[str, ...],
    logits_finite: Callable[[], bool],
) -> RowStats:
    """Every statistic of a per-stage block: ``block`` as shown (emulated or not) for
    the online statistics, ``reference`` in float64 (or the block itself) for what
    would flush. ``logits_finite`` says whether every visible masked logit of the block
    is finite (cached by the caller)."""
    chunk, log_total = block_chunk(spec, block, logits_finite)
    fold = Fold(chunk.e.shape[0], chunk.e.dtype)
    fold.add(chunk)
    ref_w = reference.weights
    counted = None if reference.all_visible else reference.visible
    w_top = chunk.e_top

    def smallest() -> NDArray[Any]:
        where = True if counted is None else counted
        low: NDArray[Any] = np.min(ref_w, axis=1, where=where, initial=1.0)
        return low

    # e = w: ℓ = 1 for a row with any weight
    final = Final((w_top != 0).astype(w_top.dtype), log_total, None, smallest)
    settle = Settle(final, formats)
    if settle.rows.size:
        again = settle.rows
        keep = np.isfinite(reference.masked[again])
        settle.add(Settled(ref_w[again], keep if counted is None else keep & counted[again]))
    return collect(fold, settle, final)
