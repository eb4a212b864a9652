"""The records statistics are made of: counts with their first and largest place
(:class:`Where`), running moments (:class:`Moments`), an emulated stage's error
(:class:`StageError`), and one block's per-stage records (:class:`Records`), each
merged in block order so that "first at" never depends on scheduling.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.block import applicable_stages
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index

OVERFLOW_STAGES = ("raw", "scaled", "masked", "output")
"""Stages checked for overflow: QKᵀ as many kernels store it, the logits, the output."""


@dataclass
class Where:
    """How many values matched, the first (in C order of blocks) and the largest."""

    count: int = 0
    first: Index | None = None
    extreme: float = 0.0
    extreme_at: Index | None = None

    def add(
        self,
        hits: NDArray[np.bool_],
        base: Index,
        values: F64 | None = None,
        *,
        in_order: bool = True,
    ) -> None:
        """Count ``hits`` of a (rows, cols) block whose element (0, 0) is at ``base``.

        ``in_order``: the block comes after every block added before it, in C order
        (else, as the key blocks of one row block do, the first is the smallest index
        seen)."""
        n = int(np.count_nonzero(hits))
        if not n:
            return
        self.count += n
        if self.first is None or not in_order:
            first = offset_index(base, np.unravel_index(int(np.argmax(hits)), hits.shape))
            self.first = first if self.first is None else min(self.first, first)
        if values is not None:
            self._keep_largest(np.where(hits, np.abs(values), -1.0), base)

    def add_max(self, sel: NDArray[np.bool_], base: Index, values: F64) -> float:
        """Count ``sel`` and keep the largest |value| among them; return this block's."""
        self.count += int(np.count_nonzero(sel))
        top = self._keep_largest(np.where(sel, np.abs(values), -1.0), base)
        if self.first is None and top >= 0:
            self.first = self.extreme_at
        return max(top, 0.0)

    def merge(self, later: Where) -> None:
        """Fold in the record of a later block (in C order): its first hit counts only
        when this one has none."""
        self.count += later.count
        if self.first is None:
            self.first = later.first
        if later.extreme > self.extreme:
            self.extreme, self.extreme_at = later.extreme, later.extreme_at

    def _keep_largest(self, mags: F64, base: Index) -> float:
        """Keep the block's largest of ``mags`` if it beats the record; return it."""
        top, at = largest(mags, base)
        if top > self.extreme:
            self.extreme, self.extreme_at = top, at
        return top


def largest(a: F64, base: Index) -> tuple[float, Index | None]:
    """The largest element of a (rows, cols) block at ``base``, and its full index."""
    if not a.size:
        return -math.inf, None
    flat = int(np.argmax(a))
    return float(a.flat[flat]), offset_index(base, np.unravel_index(flat, a.shape))


def argmax_index(a: NDArray[Any]) -> Index:
    """The full index of ``a``'s largest element (of its first True, for a mask): where
    a finding, a mismatch or a probe points."""
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(a)), a.shape))


def offset_index(base: Index, offset: tuple[Any, ...]) -> Index:
    """``base`` (…, i0, 0) shifted by a (row, col) offset."""
    return (*base[:-2], base[-2] + int(offset[0]), base[-1] + int(offset[1]))


@dataclass
class Moments:
    """Count, range, mean and std of the finite values seen, and how many were not.

    Blocks are merged with Chan et al.'s pairwise update (each block's mean and sum
    of squared deviations), so a large common offset does not cancel the spread as
    E[x²] − E[x]² would.
    """

    count: int = 0
    mean_: float = 0.0
    m2: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf
    nonfinite: int = 0

    def add(self, values: F64, where: NDArray[np.bool_] | None = None) -> None:
        picked = values if where is None else values[where]
        finite = np.asarray(picked[np.isfinite(picked)], dtype=np.float64)
        self.nonfinite += int(picked.size - finite.size)
        if not finite.size:
            return
        mean_b = float(finite.mean())
        m2_b = float(np.square(finite - mean_b).sum())
        self.merge(
            Moments(int(finite.size), mean_b, m2_b, float(finite.min()), float(finite.max()))
        )

    def merge(self, other: Moments) -> None:
        """Fold in another set's moments (Chan et al.'s pairwise update)."""
        self.nonfinite += other.nonfinite
        if not other.count:
            return
        total = self.count + other.count
        delta = other.mean_ - self.mean_
        self.mean_ += delta * other.count / total
        self.m2 += other.m2 + delta * delta * self.count * other.count / total
        self.count = total
        self.lo = min(self.lo, other.lo)
        self.hi = max(self.hi, other.hi)

    @property
    def mean(self) -> float:
        return self.mean_ if self.count else math.nan

    @property
    def std(self) -> float:
        """The population std (numpy's default), NaN below two values."""
        return math.sqrt(self.m2 / self.count) if self.count >= 2 else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "min": self.lo if self.count else None,
            "max": self.hi if self.count else None,
            "mean": self.mean if self.count else None,
            "std": self.std if self.count > 1 else None,
            "count": self.count,
            "nonfinite": self.nonfinite,
        }


def product_moments(q: NDArray[Any], k: NDArray[Any], factor: float, xp: Any = np) -> Moments:
    """Mean and spread of every finite element of factor · Q Kᵀ, from Q (L, E) and
    K (S, E) alone, in O((L + S)·E²) where that is less than O(L·S·E) (and the E × E
    arrays are small), else in blocks of L·S.

    With q̄, k̄ the mean rows and A = Q − q̄, B = K − k̄ (centred), an element is
    q̄·k̄ + q̄·b_j + a_i·k̄ + a_i·b_j; the cross terms sum to zero, so the sum of squared
    deviations is L·Σ(q̄·b_j)² + S·Σ(a_i·k̄)² + ⟨AᵀA, BᵀB⟩, a sum of non-negative terms
    that no large offset cancels. A row of Q or K that is not finite makes its whole
    row or column of products non-finite; those are counted, not summed. Range (lo,
    hi) is not computed. ``xp``: the namespace that computes (a torch device's, for
    Q and K wherever they are: :mod:`~sdpa_cli.engine.arrays`).
    """
    q = xp.asarray(q, dtype=np.float64)
    k = xp.asarray(k, dtype=np.float64)
    q_ok = xp.isfinite(q).all(axis=1)
    k_ok = xp.isfinite(k).all(axis=1)
    # (views, not copies, when every row is finite: the common case)
    qf = q if q_ok.all() else q[q_ok]
    kf = k if k_ok.all() else k[k_ok]
    n_q, n_k = len(qf), len(kf)
    nonfinite = q.shape[0] * k.shape[0] - n_q * n_k
    if not n_q or not n_k:
        return Moments(nonfinite=nonfinite)
    q_bar, k_bar = qf.mean(axis=0), kf.mean(axis=0)
    a, b = qf - q_bar, kf - k_bar
    with xp.errstate(invalid="ignore", over="ignore"):  # finite inputs whose products overflow
        bq, ak = b @ q_bar, a @ k_bar
        m2 = n_q * float((bq * bq).sum()) + n_k * float((ak * ak).sum()) + _gram_product(a, b, xp)
        mean = factor * float(q_bar @ k_bar)
    return Moments(n_q * n_k, mean, factor * factor * m2, nonfinite=nonfinite)


GRAM_ELEMENTS = 1 << 20
"""The most elements an (E, E) Gram matrix, or a block of A·Bᵀ, may take: 8 MiB."""


def _gram_product(a: F64, b: F64, xp: Any = np) -> float:
    """⟨AᵀA, BᵀB⟩ = ‖A·Bᵀ‖²_F for A (L, E) and B (S, E): through the (E, E) Gram
    matrices where they are the cheaper and small; else A·Bᵀ a block of rows at a time,
    so that a file declaring a long head dimension (E = 40,000 is a 640 KB input) costs
    no E × E array (12.8 GB)."""
    n_q, e = a.shape
    n_k = b.shape[0]
    if e * e <= GRAM_ELEMENTS and (n_q + n_k) * e <= n_q * n_k:
        return float(((a.T @ a) * (b.T @ b)).sum())
    rows = max(1, GRAM_ELEMENTS // max(n_k, 1))
    total = 0.0
    for i in range(0, n_q, rows):
        block = a[i : i + rows] @ b.T
        total += float(xp.einsum("ij,ij->", block, block))
    return total


def finite_std(a: NDArray[Any]) -> float:
    """The std of the finite values of ``a`` in float64 (NaN below two values)."""
    x = np.asarray(a, dtype=np.float64)
    if np.isfinite(x).all():
        return float(x.std()) if x.size > 1 else math.nan
    x = x[np.isfinite(x)]
    return float(x.std()) if x.size > 1 else math.nan


@dataclass
class StageError:
    """An emulated stage against float64: the largest errors and new non-finite values."""

    max_abs: float = 0.0
    max_abs_at: Index | None = None
    ref_absmax: float = 0.0
    max_row_rel: float = 0.0
    max_row_rel_at: Index | None = None
    new_nonfinite: Where = field(default_factory=Where)

    def merge(self, later: StageError) -> None:
        if later.max_abs > self.max_abs:
            self.max_abs, self.max_abs_at = later.max_abs, later.max_abs_at
        self.ref_absmax = max(self.ref_absmax, later.ref_absmax)
        if later.max_row_rel > self.max_row_rel:
            self.max_row_rel, self.max_row_rel_at = later.max_row_rel, later.max_row_rel_at
        self.new_nonfinite.merge(later.new_nonfinite)


@dataclass
class Records:
    """The per-stage records of some blocks: what :meth:`Stats.measure` finds in one
    block, folded into the whole run's by :meth:`Stats.merge` in block order."""

    absmax: dict[str, Where]
    nonfinite: dict[str, Where]
    overflow: dict[tuple[str, str], Where]
    fresh_overflow: dict[tuple[str, str], Where]
    exp_overflow: dict[str, Where]
    mask_add_overflow: dict[str, Where]
    sentinel_add_overflow: dict[str, Where]
    """A float mask's sentinel plus the logits beyond a narrow format, at the keys it hides."""
    hidden_bad: dict[str, Where]
    errors: dict[str, StageError]

    @classmethod
    def empty(
        cls, spec: AttentionSpec, checked: tuple[str, ...], narrow: tuple[str, ...]
    ) -> Records:
        stages = applicable_stages(spec)
        return cls(
            absmax={s: Where() for s in OVERFLOW_STAGES},
            nonfinite={s: Where() for s in stages},
            overflow={(s, d): Where() for s in OVERFLOW_STAGES for d in checked},
            fresh_overflow={(s, d): Where() for s in OVERFLOW_STAGES for d in checked},
            exp_overflow={d: Where() for d in narrow},
            mask_add_overflow={d: Where() for d in narrow},
            sentinel_add_overflow={d: Where() for d in narrow},
            hidden_bad={"k": Where(), "v": Where()},
            errors={s: StageError() for s in stages} if spec.options.emulated else {},
        )

    def merge(self, later: Records) -> None:
        """Fold ``later``'s records into these, record by record, in block order."""
        for f in dataclasses.fields(self):
            mine = getattr(self, f.name)
            for key, record in getattr(later, f.name).items():
                mine[key].merge(record)
