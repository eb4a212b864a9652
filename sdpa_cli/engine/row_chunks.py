"""What a row statistic's rules read and return (:mod:`sdpa_cli.engine.row_stats`
describes the statistics themselves, in the frames set out there).

A block of keys of some query rows (:class:`Chunk`: the lean pass makes one per key
block, the per-stage path one of a whole block's weights, :func:`block_chunk`); the
running max's rise (:class:`Rescale`); each row's normaliser once every key is in
(:class:`Final`); a block of final weights (:class:`Settled`); and the form of a
statistic's entry (:class:`RowStatistic`), with how closely its producers agree
(:class:`Tolerance`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision
from sdpa_cli.engine.arrays import astype, contiguous, namespace_of, numpy_dtype, to_host
from sdpa_cli.engine.block import Block, native_dtype
from sdpa_cli.engine.spec import AttentionSpec

Partial = tuple[NDArray[Any], ...]
"""A statistic's partial result over some keys: one or more ``(rows,)`` arrays."""


class Chunk:
    """What an online statistic reads from one block of keys of some query rows, in
    its producer's frame (see :mod:`sdpa_cli.engine.row_stats`); costly views are
    computed on first use, so a statistic that needs none costs nothing.

    Args:
        e: ``(rows, keys)`` e = exp(x − m) at visible keys, 0 at hidden ones.
        log_e: ``(rows, keys)`` log e = x − m at visible keys, any finite number where
            e is 0 (so that e · log e is 0); or a function that computes it.
        seen: ``(rows,)`` the visible keys of each row.
        top: ``(rows,)`` each row's largest key, an index into the chunk.
        rank: ``(rows,)`` how the producer ranks that key against another chunk's
            (the lean pass: its logit, −inf for a row that sees no key of the chunk;
            the per-stage path: its weight).
        key0: the index of the chunk's first key.
        hidden_mass: ``(rows,)`` the e the row puts on keys it does not see.
        e_top: ``(rows,)`` e at each row's top key, when the producer has it.
        rows: ``np.arange(rows)``, when the producer has it.
    """

    def __init__(
        self,
        e: NDArray[Any],
        log_e: NDArray[Any] | Callable[[], NDArray[Any]],
        seen: NDArray[np.int64],
        top: NDArray[np.intp],
        rank: NDArray[Any],
        key0: int,
        hidden_mass: NDArray[Any],
        *,
        e_top: NDArray[Any] | None = None,
        rows: NDArray[np.intp] | None = None,
    ) -> None:
        self.e, self._log_e = e, log_e
        self.seen, self.top, self.rank = seen, top, rank
        self.key0, self.hidden_mass = key0, hidden_mass
        self.xp = namespace_of(e)
        self.rows = self.xp.arange(e.shape[0]) if rows is None else rows
        # what the producer has is kept as it is (the cached properties are not run)
        if not callable(log_e):
            self.log_e = log_e
        if e_top is not None:
            self.e_top = e_top

    @cached_property
    def log_e(self) -> NDArray[Any]:
        return self._log_e() if callable(self._log_e) else self._log_e

    @cached_property
    def e_top(self) -> NDArray[Any]:
        """``(rows,)`` e at each row's top key (0 for a chunk of no key)."""
        if not self.e.shape[1]:
            zeros: NDArray[Any] = self.xp.zeros(self.e.shape[0], numpy_dtype(self.e))
            return zeros
        return self.at(self.top)

    def at(self, keys: NDArray[np.intp]) -> NDArray[Any]:
        """``(rows,)`` e at one key of each row (an index into the chunk)."""
        flat, index = self._flat(keys)
        return flat[index]  # type: ignore[no-any-return]

    @contextmanager
    def top_set_aside(self) -> Iterator[NDArray[Any]]:
        """:attr:`e` with each row's top key's e set to 0 for the ``with`` block, then
        put back: what the rest of the row holds, with no copy of the chunk."""
        flat, index = self._flat(self.top)
        kept = flat[index]
        flat[index] = 0
        try:
            yield self.e
        finally:
            flat[index] = kept

    def _flat(self, keys: NDArray[np.intp]) -> tuple[NDArray[Any], Any]:
        """:attr:`e` and the index of one key of each row in it: flat where e is
        contiguous (one gather, not a gather per axis)."""
        if contiguous(self.e):
            return self.e.reshape(-1), self.rows * self.e.shape[1] + keys
        return self.e, (self.rows, keys)


class Rescale:
    """The lean pass's running max rising from m_old to m_new (row by row; α = 1 and
    δ = 0 where it stays). A plain class: one is made per key block.

    Args:
        alpha: exp(m_old − m_new); 0 where no key was seen yet (m_old = −inf).
        delta: m_old − m_new ≤ 0; −inf where no key was seen yet.
        total: ℓ_old = Σ exp(x − m_old) over the keys so far.
    """

    __slots__ = ("alpha", "delta", "total")

    def __init__(self, alpha: NDArray[Any], delta: NDArray[Any], total: NDArray[Any]) -> None:
        self.alpha, self.delta, self.total = alpha, delta, total


class Final:
    """What a statistic finishes with: each row's normaliser in its producer's frame.

    Args:
        total: ``(rows,)`` ℓ = Σ e, 0 for a row with no weight.
        log_total: ``(rows,)`` log ℓ without the frame's constant c (see
            :mod:`sdpa_cli.engine.row_stats`), in the producer's float dtype; any value
            where ℓ is 0.
        uniform: the rows the producer knows to be uniform over every key, none of
            them visible (a finite mask value): all their weight is on hidden keys;
            None: no such row.
        smallest: computes ``(rows,)`` each row's smallest visible weight in exact
            arithmetic (what a settled statistic's prefilter reads).
    """

    def __init__(
        self,
        total: NDArray[Any],
        log_total: NDArray[Any],
        uniform: NDArray[np.bool_] | None,
        smallest: Callable[[], NDArray[Any]],
    ) -> None:
        self.total, self.log_total, self.uniform = total, log_total, uniform
        self.xp = xp = namespace_of(total)
        self.seen: NDArray[np.bool_] = total != 0  # NaN counts as seen: the value shows it
        # a row with no weight divides by 1: its partial results are 0
        self.safe: NDArray[Any] = astype(xp.where(self.seen, total, 1), total.dtype)
        self._smallest = smallest

    @cached_property
    def smallest(self) -> NDArray[Any]:
        return self._smallest()


class Settled:
    """A block of final weights w = e / ℓ of some rows, what a settled statistic reads.

    Args:
        w: ``(rows, keys)`` the weights in exact arithmetic (the float64 reference's
            under an emulated format).
        counted: ``(rows, keys)`` the keys whose weight no mask makes 0 (visible, with
            a finite logit); None: every key.
    """

    def __init__(self, w: NDArray[Any], counted: NDArray[np.bool_] | None) -> None:
        self.w, self.counted = w, counted
        self._flushed: dict[str, NDArray[np.bool_]] = {}

    def flushed(self, fmt: str) -> NDArray[np.bool_]:
        """The weights that would flush to zero in ``fmt``: counted, not above the
        format's smallest subnormal, and either already 0 (below float32's or float64's
        own range, so the count does not depend on the run's precision) or rounding to 0."""
        if fmt not in self._flushed:
            f = precision.fmt(fmt)
            w = self.w
            hit = (w <= f.tiny) & ((w == 0) | _flushes(f, w))
            self._flushed[fmt] = hit if self.counted is None else hit & self.counted
        return self._flushed[fmt]


def _flushes(f: precision.Format, w: Any) -> Any:
    """:meth:`Format.flushes <sdpa_cli.engine.precision.Format.flushes>` on any
    namespace's array: the few candidates (not above the smallest subnormal) are
    rounded on the host, by the one rounding every format has."""
    if namespace_of(w) is not np:
        hit = (w != 0) & (w.abs() <= f.tiny)
        if bool(hit.any()):
            hit[hit.clone()] = namespace_of(w).asarray(f.flushes(to_host(w[hit])))
        return hit
    return f.flushes(w)


@dataclass(frozen=True)
class Tolerance:
    """How closely the two producers agree on a statistic, in units of the
    computation's machine epsilon: |lean − per-stage| ≤ abs·ε + rel·ε·|per-stage|."""

    rel: float = 0.0
    abs: float = 0.0

    @property
    def exact(self) -> bool:
        return self.rel == 0 and self.abs == 0


@dataclass(frozen=True)
class RowStatistic:
    """One per-row statistic: its rules, as both producers run them.

    An online statistic has ``chunk`` (and ``rescale`` when its partial result is in
    the frame's units); a settled one has ``settle`` and ``reads``. Every rule returns
    a new partial result and leaves its arguments as they were.
    """

    name: str
    dtype: type[np.generic]
    """What :class:`~sdpa_cli.engine.stats.Stats` keeps it in."""
    description: str
    empty: Callable[[int, np.dtype[Any], Any], Partial]
    """The partial result over no key, for n rows in the producer's dtype, in a
    namespace's arrays (:mod:`~sdpa_cli.engine.arrays`)."""
    combine: Callable[[Partial, Partial], Partial]
    """Two partial results over disjoint keys, in the same frame: the second's keys
    after the first's."""
    finish: Callable[[Partial, Final], NDArray[Any]]
    """``(rows,)`` the statistic from the partial result over every key."""
    chunk: Callable[[Chunk], Partial] | None = None
    """What one block of keys contributes."""
    rescale: Callable[[Partial, Rescale], Partial] | None = None
    """The partial result carried into the new frame when the running max rises
    (None: it does not depend on the frame)."""
    settle: Callable[[Settled, str | None], Partial] | None = None
    """What one block of final weights contributes (for a format, with ``per_format``)."""
    reads: Callable[[Final, str | None], NDArray[np.bool_]] | None = None
    """The rows whose final weights a settled statistic must read (the others finish
    from the empty partial result)."""
    per_format: bool = False
    """One value per narrow format the run checks (``underflow[float16]``, ...)."""
    tolerance: Tolerance = field(default_factory=Tolerance)

    def columns(self, formats: tuple[str, ...]) -> Iterator[tuple[str, str | None]]:
        """The statistic's columns and their formats (None: one column, its name)."""
        if not self.per_format:
            yield self.name, None
            return
        for d in formats:
            yield column(self.name, d), d


def column(name: str, fmt: str) -> str:
    """The column of a per-format statistic: ``underflow[float16]``."""
    return f"{name}[{fmt}]"


def block_chunk(
    spec: AttentionSpec, block: Block, logits_finite: Callable[[], bool]
) -> tuple[Chunk, NDArray[Any]]:
    """The per-stage path's one chunk, a whole block's weights as shown over the
    visible keys, e = w (renormalised over them where hidden keys hold weight), and
    each row's log ℓ in its frame: the top logit's where the weights are the exact
    softmax of the logits, else the LSE's. ``logits_finite`` says whether every visible
    masked logit of the block is finite (cached by the caller)."""
    w = block.weights
    n, n_keys = w.shape
    seen = np.full(n, n_keys, np.int64) if block.all_visible else block.visible.sum(axis=1)
    hidden = np.zeros(n, w.dtype)
    finite_hidden = not math.isinf(spec.options.effective_mask_value)
    exact = native_dtype(spec) is not None
    if (
        n_keys
        and not block.all_visible
        and (finite_hidden or block.sentinel is not None or not exact)
    ):
        # Over the visible keys only: a finite mask value (or a float mask's sentinel,
        # added) leaves weight on hidden keys, which is not what a row attends to; how
        # much it leaves is kept apart.
        if finite_hidden or block.sentinel is not None:
            hidden = np.where(block.visible, 0.0, w).sum(axis=1)
        w = np.where(block.visible, w, 0.0)
        total = w.sum(axis=1, keepdims=True)
        keep = 1.0 if block.sink is None else 1.0 - block.sink[:, None]
        w = w / np.where(total > 0, total, 1.0) * keep
        exact = False
    if block.sink is not None:
        # With sinks a row's weights sum to 1 − p_sink: the statistics read them as they
        # are (a row mostly on the sink is neither saturated nor uniform), and the
        # entropy's log w is taken weight by weight (the gap below assumes a sum of 1).
        exact = False
    if not w.flags.writeable:  # a rule may set a key aside in place (Chunk.top_set_aside)
        w = w.copy()
    top = np.argmax(w, axis=1) if n_keys else np.zeros(n, np.intp)
    w_top = w[np.arange(n), top] if n_keys else np.zeros(n, w.dtype)

    exact = exact and bool(n_keys)
    with np.errstate(divide="ignore"):  # a row with no weight: any log ℓ
        log_total = -np.log(w_top) if exact else np.zeros(n, w.dtype)

    def log_e() -> NDArray[Any]:
        if exact:
            # x − x_top: a row dot instead of a log per weight (log w = log e − log ℓ)
            s = block.masked
            gap: NDArray[Any] = s - s[np.arange(n), top][:, None]
            if not block.all_visible or not logits_finite():
                # A hidden key (−inf, weight 0) adds 0 · (most negative number) = 0.
                np.maximum(gap, np.finfo(gap.dtype).min, out=gap)
            return gap
        logs = np.zeros_like(w)
        return np.log(w, out=logs, where=w > 0)

    # the weight ranks the top key: the chunk is the whole block
    return Chunk(w, log_e, seen, top, w_top, block.keys.start, hidden), log_total
