"""Statistics gathered block by block as the engine runs: what the diagnostics read.

Per query row (arrays of shape ``(*lead, L)``): visible keys, the largest weight and
its key, the entropy, and per format the weights that would flush to zero. Per stage
(a few numbers each): the largest magnitude, non-finite values, values that would
overflow each checked format, with the first place each happened. Nothing here
keeps a score-sized array, so the diagnostics cost little on huge inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli import precision
from sdpa_cli.compute import Block, applicable_stages
from sdpa_cli.spec import AttentionSpec

F64 = NDArray[np.float64]
Index = tuple[int, ...]

OVERFLOW_STAGES = ("raw", "scaled", "masked", "output")
"""Stages checked for overflow: QKᵀ as many kernels store it, the logits, the output."""


@dataclass
class Where:
    """How many values matched, the first (in C order of blocks) and the largest."""

    count: int = 0
    first: Index | None = None
    extreme: float = 0.0
    extreme_at: Index | None = None

    def add(self, hits: NDArray[np.bool_], base: Index, values: F64 | None = None) -> None:
        """Count ``hits`` of a (rows, cols) block whose element (0, 0) is at ``base``."""
        n = int(np.count_nonzero(hits))
        if not n:
            return
        self.count += n
        if self.first is None:
            self.first = _at(base, np.unravel_index(int(np.argmax(hits)), hits.shape))
        if values is not None:
            self._keep_largest(np.where(hits, np.abs(values), -1.0), base)

    def add_max(self, sel: NDArray[np.bool_], base: Index, values: F64) -> float:
        """Count ``sel`` and keep the largest |value| among them; return this block's."""
        self.count += int(np.count_nonzero(sel))
        top = self._keep_largest(np.where(sel, np.abs(values), -1.0), base)
        if self.first is None and top >= 0:
            self.first = self.extreme_at
        return max(top, 0.0)

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
    return float(a.flat[flat]), _at(base, np.unravel_index(flat, a.shape))


def _at(base: Index, offset: tuple[Any, ...]) -> Index:
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
        finite = picked[np.isfinite(picked)]
        self.nonfinite += int(picked.size - finite.size)
        if not finite.size:
            return
        n_b = int(finite.size)
        mean_b = float(finite.mean())
        m2_b = float(np.square(finite - mean_b).sum())
        total = self.count + n_b
        delta = mean_b - self.mean_
        self.mean_ += delta * n_b / total
        self.m2 += m2_b + delta * delta * self.count * n_b / total
        self.count = total
        self.lo = min(self.lo, float(finite.min()))
        self.hi = max(self.hi, float(finite.max()))

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


def finite_std(a: NDArray[Any]) -> float:
    """The std of the finite values of ``a`` in float64 (NaN below two values)."""
    x = np.asarray(a, dtype=np.float64)
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


@dataclass
class Stats:
    """Everything the diagnostics need, accumulated over blocks by :meth:`observe`."""

    spec: AttentionSpec
    checked: tuple[str, ...]
    narrow: tuple[str, ...]
    n_visible: NDArray[np.int32]
    max_weight: F64
    argmax: NDArray[np.int32]
    entropy: F64
    underflow: dict[str, NDArray[np.int32]]
    lost: dict[str, F64]
    absmax: dict[str, Where]
    nonfinite: dict[str, Where]
    overflow: dict[tuple[str, str], Where]
    fresh_overflow: dict[tuple[str, str], Where]
    exp_overflow: dict[str, Where]
    mask_add_overflow: dict[str, Where]
    hidden_bad: dict[str, Where]
    moments: Moments
    errors: dict[str, StageError]
    _bad_keys: dict[tuple[str, Index], NDArray[np.bool_]] = field(default_factory=dict)

    @classmethod
    def empty(cls, spec: AttentionSpec) -> Stats:
        """Statistics for ``spec`` before any block, checking the formats that matter."""
        rows = (*spec.lead, spec.L)
        working = working_formats(spec)
        checked = tuple(dict.fromkeys([*precision.CHECKED, *working]))
        # Underflow, exp and an added mask value: float16 always (the mission's concern)
        # and the formats the run uses. bfloat16 flushes only below 4.6e-41, its exp
        # overflows where float32's does, and float8 never holds logits.
        narrow = tuple(dict.fromkeys(["float16", *working]))
        stages = applicable_stages(spec)
        return cls(
            spec=spec,
            checked=checked,
            narrow=narrow,
            n_visible=np.zeros(rows, np.int32),
            max_weight=np.zeros(rows),
            argmax=np.zeros(rows, np.int32),
            entropy=np.zeros(rows),
            underflow={d: np.zeros(rows, np.int32) for d in narrow},
            lost={d: np.zeros(rows) for d in narrow},
            absmax={s: Where() for s in OVERFLOW_STAGES},
            nonfinite={s: Where() for s in stages},
            overflow={(s, d): Where() for s in OVERFLOW_STAGES for d in checked},
            fresh_overflow={(s, d): Where() for s in OVERFLOW_STAGES for d in checked},
            exp_overflow={d: Where() for d in narrow},
            mask_add_overflow={d: Where() for d in narrow},
            hidden_bad={"k": Where(), "v": Where()},
            moments=Moments(),
            errors={s: StageError() for s in stages} if spec.options.emulated else {},
        )

    def observe(self, block: Block, reference: Block) -> None:
        """Add one block: ``block`` as shown (emulated or not), ``reference`` in float64.

        Row statistics and non-finite values come from what is shown; what *would*
        overflow or flush to zero comes from the float64 values.
        """
        spec = self.spec
        lead, rows = block.lead_index, block.rows
        at: tuple[int | slice, ...] = (*lead, rows)
        base: Index = (*lead, rows.start, 0)
        visible = block.visible
        hidden = ~visible
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            # --- rows: visible keys, the largest weight, the entropy -----------------
            w = block.weights
            self.n_visible[at] = visible.sum(axis=1)
            if spec.S:
                if not visible.all():
                    # Over the visible keys only: a finite mask value leaves weight on
                    # hidden keys, which is not what a row attends to.
                    w = np.where(visible, w, 0.0)
                    total = w.sum(axis=1, keepdims=True)
                    w = w / np.where(total > 0, total, 1.0)
                self.argmax[at] = np.argmax(w, axis=1)
                self.max_weight[at] = np.max(w, axis=1)
                self.entropy[at] = -np.sum(np.where(w > 0, w * np.log(w), 0.0), axis=1)
            ref_w = reference.weights
            for d in self.narrow:
                flushed = precision.fmt(d).flushes(ref_w)
                self.underflow[d][at] = flushed.sum(axis=1)
                self.lost[d][at] = np.where(flushed, ref_w, 0.0).sum(axis=1)

            # --- stages: magnitudes and overflow (float64 values) -------------------
            previous: dict[str, NDArray[np.bool_]] = {}  # overflow at the last logit stage
            for stage in OVERFLOW_STAGES:
                values = getattr(reference, stage)
                sel = np.isfinite(values)
                if stage != "output":
                    sel &= visible
                block_max = self.absmax[stage].add_max(sel, base, values)
                for d in self.checked:
                    if block_max <= precision.fmt(d).max:
                        previous.pop(d, None)
                        continue  # nothing here can overflow this format
                    hits = precision.fmt(d).overflows(values)
                    if stage != "output":
                        hits &= visible
                    self.overflow[(stage, d)].add(hits, base, values)
                    # New at this stage: not already out of range at the stage before.
                    before = previous.get(d)
                    self.fresh_overflow[(stage, d)].add(
                        hits if before is None or stage == "output" else hits & ~before, base
                    )
                    if stage != "output":
                        previous[d] = hits
            logits = reference.masked
            finite_visible = visible & np.isfinite(logits)
            top = float(logits[finite_visible].max()) if finite_visible.any() else -math.inf
            for d in self.narrow:
                # exp(x) with no max subtracted first: the naive softmax.
                if top > precision.fmt(d).exp_limit:
                    hits = finite_visible & (logits > precision.fmt(d).exp_limit)
                    self.exp_overflow[d].add(hits, base, logits)
            o = spec.options
            if math.isfinite(o.effective_mask_value) and hidden.any():
                # Kernels that *add* a finite mask value to the logits (HF's finfo.min,
                # which is each format's own: −65504 in float16).
                pre = reference.logits_before("masked")
                for d in self.narrow:
                    added = np.where(hidden, pre + o.mask_value_in(d), 0.0)
                    hits = hidden & precision.fmt(d).overflows(added)
                    self.mask_add_overflow[d].add(hits, base, added)
            self.moments.add(reference.scaled)

            # --- non-finite values as shown, stage by stage -------------------------
            for stage, record in self.nonfinite.items():
                values = getattr(block, stage)
                if stage in ("raw", "scaled", "capped"):
                    bad = ~np.isfinite(values) & visible
                elif stage in ("biased", "masked"):
                    bad = (np.isnan(values) | (values == math.inf)) & visible
                elif stage in ("weights", "dropped"):
                    bad = np.isnan(values)
                else:
                    bad = ~np.isfinite(values)
                record.add(bad, base)

            # --- K or V non-finite at hidden keys ------------------------------------
            if hidden.any():
                for name in ("k", "v"):
                    bad_keys = self._bad(name, lead)
                    if bad_keys.any():
                        self.hidden_bad[name].add(hidden & bad_keys[None, :], base)

            # --- the emulated run against float64 -------------------------------------
            for stage, err in self.errors.items():
                shown, ref = getattr(block, stage), getattr(reference, stage)
                if shown is None or ref is None:
                    continue
                both = np.isfinite(shown) & np.isfinite(ref)
                new_bad = np.isfinite(ref) & ~np.isfinite(shown)
                if stage not in ("output", "weights", "dropped"):
                    both &= visible
                    if stage != "masked":  # a mask value can overflow too (−1e9 in float16)
                        new_bad &= visible
                err.new_nonfinite.add(new_bad, base)
                diff = np.where(both, np.abs(shown - ref), 0.0)
                mag = np.where(both, np.abs(ref), 0.0)
                if diff.size:
                    top, top_at = largest(diff, base)
                    if top > err.max_abs:
                        err.max_abs, err.max_abs_at = top, top_at
                    err.ref_absmax = max(err.ref_absmax, float(mag.max()))
                    row_rel = diff.max(axis=1) / np.where(
                        mag.max(axis=1) > 0, mag.max(axis=1), np.inf
                    )
                    i = int(np.argmax(row_rel))
                    if row_rel[i] > err.max_row_rel:
                        err.max_row_rel = float(row_rel[i])
                        err.max_row_rel_at = _at(base, (i, int(np.argmax(diff[i]))))

    def _bad(self, name: str, lead: Index) -> NDArray[np.bool_]:
        """Keys whose row of K (or V) holds NaN or inf, for one slice (cached)."""
        spec = self.spec
        op = spec.operand_index(name, lead)
        key = (name, op)
        if key not in self._bad_keys:
            rows = np.asarray(getattr(spec, name)[op], dtype=np.float64)
            self._bad_keys[key] = np.asarray(~np.isfinite(rows).all(axis=1))
        return self._bad_keys[key]

    @property
    def raw_std(self) -> float:
        """The observed standard deviation of Q Kᵀ (from the scaled logits / scale)."""
        factor = self.spec.scale / self.spec.options.temperature
        return self.moments.std / factor


def input_dtypes(spec: AttentionSpec) -> tuple[str, ...]:
    """The low-precision formats Q, K and V arrived in (float16, float32, ...)."""
    names = {str(getattr(spec, n).dtype) for n in ("q", "k", "v")}
    return tuple(d for d in precision.FORMATS[1:] if d in names)


def working_formats(spec: AttentionSpec) -> tuple[str, ...]:
    """The formats this computation really runs in: the inputs' and ``--dtype``'s."""
    formats = list(input_dtypes(spec))
    if spec.options.emulated:
        formats.append(spec.options.dtype)
    return tuple(dict.fromkeys(formats))
