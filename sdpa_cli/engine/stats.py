"""Statistics gathered block by block as the engine runs: what the diagnostics read.

Per query row (arrays of shape ``(*lead, L)``): every statistic of
:data:`~sdpa_cli.engine.row_stats.ROW_STATISTICS` (visible keys, the largest weight and
its key, the entropy, per format the weights that would flush to zero, ...). Per stage
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

from sdpa_cli.engine import positions, precision, row_stats
from sdpa_cli.engine.block import Block, native_dtype
from sdpa_cli.engine.fp8 import FP8_OUTPUT, runs_fp8
from sdpa_cli.engine.records import (
    OVERFLOW_STAGES,
    Moments,
    Records,
    largest,
    offset_index,
    product_moments,
)
from sdpa_cli.engine.row_stats import RowStats
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index


class _Extremes:
    """The largest and smallest element of each stage array of a block (over the
    visible keys, when given), each computed once: two cheap reductions that show at
    once whether a stage is all finite and how large it gets, so that the common case
    needs no further pass."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], tuple[float, float]] = {}

    def __call__(
        self, values: F64, visible: NDArray[np.bool_] | None = None
    ) -> tuple[float, float]:
        key = (id(values), id(visible))
        if key not in self._seen:
            if visible is None:
                hi = float(np.max(values, initial=-math.inf))
                lo = float(np.min(values, initial=math.inf))
            else:
                hi = float(np.max(values, where=visible, initial=-math.inf))
                lo = float(np.min(values, where=visible, initial=math.inf))
            self._seen[key] = (hi, lo)
        return self._seen[key]

    def scaled_from(self, block: Block, factor: float, visible: NDArray[np.bool_] | None) -> None:
        """The scaled scores' extremes from the raw ones, with no pass: scaled is raw ·
        factor rounded element by element in the block's dtype, and rounding is
        monotonic, so its extremes are the raw extremes times factor, rounded the same."""
        hi, lo = self(block.raw, visible)
        f = block.raw.dtype.type(factor)
        a, b = float(block.raw.dtype.type(hi) * f), float(block.raw.dtype.type(lo) * f)
        self._seen[(id(block.scaled), id(visible))] = (max(a, b), min(a, b))

    def finite(self, values: F64, visible: NDArray[np.bool_] | None = None) -> bool:
        """Whether every (visible) value is finite: none at all counts as finite."""
        hi, lo = self(values, visible)
        return (math.isfinite(hi) and math.isfinite(lo)) or (hi == -math.inf and lo == math.inf)


@dataclass
class Stats:
    """Everything the diagnostics need, accumulated over blocks.

    :meth:`measure` reads one block (thread-safe: its rows are its own) and returns
    its :class:`Records`; :meth:`merge` folds them in, in block order, so "first"
    means first in C order however the blocks were scheduled. :meth:`observe` does both.
    """

    spec: AttentionSpec
    checked: tuple[str, ...]
    narrow: tuple[str, ...]
    rows: RowStats
    """Every row statistic of :data:`~sdpa_cli.engine.row_stats.ROW_STATISTICS`,
    ``(*lead, L)`` each; the properties below name the ones the findings read."""
    records: Records
    """The per-stage records of every block so far, merged in block order."""
    moments: Moments
    _bad_keys: dict[tuple[str, Index], NDArray[np.bool_]] = field(default_factory=dict)

    @property
    def n_visible(self) -> NDArray[np.int32]:
        return self.rows["n_visible"]

    @property
    def max_weight(self) -> F64:
        return self.rows["max_weight"]

    @property
    def argmax(self) -> NDArray[np.int32]:
        return self.rows["argmax"]

    @property
    def entropy(self) -> F64:
        return self.rows["entropy"]

    @property
    def underflow(self) -> dict[str, NDArray[np.int32]]:
        return self.rows.per_format("underflow")

    @property
    def lost(self) -> dict[str, F64]:
        return self.rows.per_format("lost")

    @property
    def hidden_weight(self) -> F64:
        """Per row, the weight on keys it does not see (a finite mask value's, a float
        mask sentinel's): 0 where hidden keys get none."""
        return self.rows["hidden_weight"]

    @property
    def empty_rows(self) -> NDArray[np.bool_]:
        """Rows with no visible key the findings judge: not those past
        ``--query-lengths``, which are absent, not masked (:mod:`positions`)."""
        empty: NDArray[np.bool_] = (self.n_visible == 0) & ~positions.absent_rows(self.spec)
        return empty

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
        return cls(
            spec=spec,
            checked=checked,
            narrow=narrow,
            rows=RowStats.zeros(rows, narrow),
            records=Records.empty(spec, checked, narrow),
            moments=Moments(),
        )

    def observe(self, block: Block, reference: Block) -> None:
        """Add one block (:meth:`measure`, then :meth:`merge`); the slice's score
        moments when the block is its first."""
        self.merge(self.measure(block, reference))
        if block.rows.start == 0:
            self.add_moments(block.lead_index, emulate=reference is block)

    def merge(self, records: Records) -> None:
        """Fold in a block's records, in block order."""
        self.records.merge(records)

    def add_moments(self, lead: Index, *, emulate: bool = True) -> None:
        """Fold in the slice's score moments (:meth:`slice_moments`)."""
        self.moments.merge(self.slice_moments(lead, emulate=emulate))

    def slice_moments(self, lead: Index, *, emulate: bool = False, xp: Any = np) -> Moments:
        """The moments of the slice's scaled scores (from Q and K: see
        :func:`product_moments`), as the float64 reference computes them (``emulate``:
        from Q and K rounded to the emulated format). Thread-safe: a visitor of the
        block driver computes them with the slice's first block. ``xp``: the namespace
        that computes them (:mod:`~sdpa_cli.engine.arrays`)."""
        spec = self.spec
        o = spec.options
        q = np.asarray(spec.q[spec.operand_index("q", lead)], dtype=np.float64)
        k = np.asarray(spec.k[spec.operand_index("k", lead)], dtype=np.float64)
        if emulate and o.emulated:
            q, k = precision.round_to(q, o.dtype), precision.round_to(k, o.dtype)
        return product_moments(q, k, spec.factor, xp)

    def add_all_moments(self) -> None:
        """Every slice's score moments, as the float64 reference computes them."""
        for lead in np.ndindex(*self.spec.lead):
            self.add_moments(tuple(int(x) for x in lead), emulate=False)

    def measure(self, block: Block, reference: Block) -> Records:
        """One block: ``block`` as shown (emulated or not), ``reference`` in float64
        (or the block itself). Writes the block's rows; returns its records.

        Row statistics and non-finite values come from what is shown; what *would*
        overflow or flush to zero comes from the reference values. Every check starts
        with a reduction or two and reads the block again only when that shows
        something to find.
        """
        rec = Records.empty(self.spec, self.checked, self.narrow)
        lead, rows, keys = block.lead_index, block.rows, block.keys
        at: tuple[int | slice, ...] = (*lead, rows)
        base: Index = (*lead, rows.start, keys.start)
        out_base: Index = (*lead, rows.start, 0)
        ext = _Extremes()
        ref_ext = ext if reference is block else _Extremes()
        spec = self.spec
        if native_dtype(spec) is not None and not spec.options.prescale and block.raw.size:
            factor = spec.factor
            if not (math.isnan(factor) or math.isinf(factor)):
                for e, b in ((ext, block), (ref_ext, reference)):
                    e.scaled_from(b, factor, None if b.all_visible else b.visible)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
            found = row_stats.per_stage(
                spec, block, reference, self.narrow, lambda: ext.finite(block.masked)
            )
            self.write_rows(at, found)
            self._overflow(reference, rec, base, out_base, ref_ext)
            self._logits(reference, rec, base, ref_ext)
            self._nonfinite(block, rec, base, out_base, ext)
            self._hidden_bad(block, rec, base)
            if rec.errors:
                self._errors(block, reference, rec, base, out_base)
        return rec

    def write_rows(self, at: tuple[int | slice, ...], rows: RowStats) -> None:
        """Keep a block's row statistics (thread-safe: its rows are its own)."""
        for name, values in rows.items():
            self.rows[name][at] = values

    # --- stages: magnitudes and overflow (reference values) -----------------------------

    def _overflow(
        self, reference: Block, rec: Records, base: Index, out_base: Index, ext: _Extremes
    ) -> None:
        visible = None if reference.all_visible else reference.visible
        previous: dict[str, NDArray[np.bool_]] = {}  # overflow at the last logit stage
        smallest_max = min(precision.fmt(d).max for d in self.checked)
        for stage in OVERFLOW_STAGES:
            values = getattr(reference, stage)
            is_output = stage == "output"
            where = None if is_output else visible
            at_base = out_base if is_output else base
            record = rec.absmax[stage]
            if ext.finite(values, where):
                # Every value that counts is finite: the record is the two extremes
                # (the headroom reads the largest, not where it is).
                hi, lo = ext(values, where)
                block_max = max(abs(hi), abs(lo)) if hi >= lo else 0.0
                record.count += int(values.size if where is None else np.count_nonzero(where))
                record.extreme = max(record.extreme, block_max)
            else:
                sel = np.isfinite(values)
                if where is not None:
                    sel &= where
                block_max = record.add_max(sel, at_base, values)
            if block_max <= smallest_max:
                previous.clear()
                continue
            for d in self.checked:
                if block_max <= precision.fmt(d).max:
                    previous.pop(d, None)
                    continue  # nothing here can overflow this format
                hits = precision.fmt(d).overflows(values)
                if where is not None:
                    hits &= where
                rec.overflow[(stage, d)].add(hits, at_base, values)
                # New at this stage: not already out of range at the stage before.
                before = previous.get(d)
                rec.fresh_overflow[(stage, d)].add(
                    hits if before is None or is_output else hits & ~before, at_base
                )
                if not is_output:
                    previous[d] = hits

    def _logits(self, reference: Block, rec: Records, base: Index, ext: _Extremes) -> None:
        """exp without the max subtracted, and a finite mask value added to the logits."""
        spec = self.spec
        o = spec.options
        logits = reference.masked
        hi, _ = ext(logits, None if reference.all_visible else reference.visible)
        limit = min(precision.fmt(d).exp_limit for d in self.narrow)
        if math.isnan(hi) or hi > limit:
            finite_visible = reference.visible & np.isfinite(logits)
            top = float(logits[finite_visible].max()) if finite_visible.any() else -math.inf
            for d in self.narrow:
                # exp(x) with no max subtracted first: the naive softmax.
                if top > precision.fmt(d).exp_limit:
                    hits = finite_visible & (logits > precision.fmt(d).exp_limit)
                    rec.exp_overflow[d].add(hits, base, logits)
        sentinel = reference.sentinel
        if sentinel is not None:
            # A float mask's sentinel, added to the logits (as every kernel adds the
            # mask): beyond a narrow format the sum is −inf there.
            for d in self.narrow:
                hits = sentinel & precision.fmt(d).overflows(logits)
                rec.sentinel_add_overflow[d].add(hits, base, logits)
        if math.isfinite(o.effective_mask_value) and not reference.all_visible:
            hidden = ~reference.unreplaced
            if hidden.any():
                # Kernels that *add* a finite mask value to the logits (HF's finfo.min,
                # which is each format's own: −65504 in float16).
                pre = reference.logits_before("masked")
                for d in self.narrow:
                    added = np.where(hidden, pre + o.mask_value_in(d), 0.0)
                    hits = hidden & precision.fmt(d).overflows(added)
                    rec.mask_add_overflow[d].add(hits, base, added)

    # --- non-finite values as shown, stage by stage -------------------------------------

    def _nonfinite(
        self, block: Block, rec: Records, base: Index, out_base: Index, ext: _Extremes
    ) -> None:
        visible = None if block.all_visible else block.visible
        for stage, record in rec.nonfinite.items():
            values = getattr(block, stage)
            if stage in ("biased", "masked"):
                hi, _ = ext(values, visible)
                if not (math.isnan(hi) or hi == math.inf):
                    continue  # −inf is how they hide a key
                bad = np.isnan(values) | (values == math.inf)
            elif stage in ("weights", "dropped"):
                if _clean_logits(block, ext, visible):
                    continue  # a softmax of finite (or −inf) logits has no NaN
                hi, lo = ext(values)
                if not (math.isnan(hi) or math.isnan(lo)):
                    continue
                bad = np.isnan(values)
            elif stage == "output":
                if ext.finite(values):
                    continue
                bad = ~np.isfinite(values)
            else:
                if ext.finite(values, visible):
                    continue
                bad = ~np.isfinite(values)
            if visible is not None and stage not in ("weights", "dropped", "output"):
                bad &= visible
            record.add(bad, out_base if stage == "output" else base)

    # --- K or V non-finite at hidden keys --------------------------------------------------

    def _hidden_bad(self, block: Block, rec: Records, base: Index) -> None:
        spec = self.spec
        keys = block.keys
        skipped = keys.start > 0 or keys.stop < spec.S
        if block.all_visible and not skipped:
            return
        for name in ("k", "v"):
            bad_keys = self._bad(name, block.lead_index)
            if not bad_keys.any():
                continue
            n = block.masked.shape[0]
            # Keys the block did not compute are hidden from all of its rows.
            hidden = np.ones((n, spec.S), dtype=np.bool_)
            hidden[:, keys] = ~block.visible
            rec.hidden_bad[name].add(hidden & bad_keys[None, :], (*base[:-1], 0))

    # --- the emulated run against float64 -------------------------------------------------

    def _errors(
        self, block: Block, reference: Block, rec: Records, base: Index, out_base: Index
    ) -> None:
        visible = block.visible
        for stage, err in rec.errors.items():
            shown, ref = getattr(block, stage), getattr(reference, stage)
            if shown is None or ref is None:
                continue
            at_base = out_base if stage == "output" else base
            both = np.isfinite(shown) & np.isfinite(ref)
            new_bad = np.isfinite(ref) & ~np.isfinite(shown)
            if stage not in ("output", "weights", "dropped"):
                both &= visible
                if stage != "masked":  # a mask value can overflow too (−1e9 in float16)
                    new_bad &= visible
            err.new_nonfinite.add(new_bad, at_base)
            diff = np.where(both, np.abs(shown - ref), 0.0)
            mag = np.where(both, np.abs(ref), 0.0)
            if diff.size:
                top, top_at = largest(diff, at_base)
                if top > err.max_abs:
                    err.max_abs, err.max_abs_at = top, top_at
                err.ref_absmax = max(err.ref_absmax, float(mag.max()))
                row_rel = diff.max(axis=1) / np.where(mag.max(axis=1) > 0, mag.max(axis=1), np.inf)
                i = int(np.argmax(row_rel))
                if row_rel[i] > err.max_row_rel:
                    err.max_row_rel = float(row_rel[i])
                    err.max_row_rel_at = offset_index(at_base, (i, int(np.argmax(diff[i]))))

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
        factor = self.spec.factor
        return self.moments.std / factor


def _clean_logits(block: Block, ext: _Extremes, visible: NDArray[np.bool_] | None) -> bool:
    """Whether the masked logits hold no NaN and no +inf (−inf hides a key)."""
    hi, _ = ext(block.masked, visible)
    return not (math.isnan(hi) or hi == math.inf)


def input_dtypes(spec: AttentionSpec) -> tuple[str, ...]:
    """The low-precision formats Q, K and V arrived in (float16, float32, ...)."""
    names = {str(getattr(spec, n).dtype) for n in ("q", "k", "v")}
    return tuple(d for d in precision.FORMATS[1:] if d in names)


def working_formats(spec: AttentionSpec) -> tuple[str, ...]:
    """The formats this computation really runs in: the inputs' and ``--dtype``'s. An
    FP8 kernel with descales (:func:`~sdpa_cli.engine.fp8.runs_fp8`) keeps its scores
    in float32 and stores its output in bfloat16: its FP8 holds no score to overflow."""
    if runs_fp8(spec):
        return (FP8_OUTPUT,)
    formats = list(input_dtypes(spec))
    if spec.options.emulated:
        formats.append(spec.options.dtype)
    return tuple(dict.fromkeys(formats))
