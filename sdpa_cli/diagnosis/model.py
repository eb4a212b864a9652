"""``sdpa report model``: a model's attention at a glance, a grid of statistics with a
row per attention call (a case of a manifest) and a column per query head.

Per case one pass of the block driver (:func:`head_metrics`) gathers the statistics
of every query row (:class:`~sdpa_cli.engine.stats.Stats`), each row's weight on key
0 and, given the expected output, each head's error sums. The rows are then pooled
per query head over every batch item (and any axis before the batch):

    entropy       mean of H / log(visible keys)           (0 one-hot, 1 uniform)
    max_weight    mean of the row's largest weight
    saturated     share of rows one-hot                   (max weight ≥ saturation)
    near_uniform  share of rows nearly uniform            (H ≥ uniform · log(visible keys))
    fully_masked  share of all rows with no visible key
    sink_mass     mean weight on key 0, w₀ = exp(logit₀ − LSE)
    error         RMS(expected − reference) / RMS(reference), of the output

The means and the saturated and near-uniform shares are over the rows the row rules
judge, those with ≥ 2 visible keys and finite weights
(:func:`~sdpa_cli.diagnosis.rows.classify_rows`, with the same thresholds); a head
with no such row has NaN there. The error needs the case's expected output, in the
computation's layout ``(*lead, L, Ev)``; the reference is the computation in float64.

:func:`model_grid` lays the cases out (case × head) and names the notable heads:
attention sinks, dead heads and saturated heads (:data:`~sdpa_cli.names.NOTABLE_HEADS`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.pictures import pooling
from sdpa_cli.diagnosis.rows import classify_rows
from sdpa_cli.engine.arrays import NUMPY
from sdpa_cli.engine.block import Block, block_lse
from sdpa_cli.engine.driver import Place, Progress, sweep
from sdpa_cli.engine.forward import blocks_pattern, forward, lean_backend, query_block
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.types import F64
from sdpa_cli.names import MODEL_METRICS
from sdpa_cli.text import json_number

SINK_MASS = 0.5
"""A head whose rows put on average more than this weight on key 0 is an attention
sink: its queries park their weight on the first token (StreamingLLM)."""

FLAT_MAX_WEIGHT = 1.05
"""A head is dead, too, when its rows' largest weight is on average within 5 % of
1 / visible keys (mean of max weight · visible keys ≤ this): every key weighs the same."""


@dataclass(frozen=True)
class CaseHeads:
    """One attention call's statistics per query head.

    Attributes:
        metrics: metric name (:data:`~sdpa_cli.names.MODEL_METRICS`) → its value per head, shape (H,);
            ``error`` only when the expected output was given.
        rows: the rows judged per head (≥ 2 visible keys, finite weights), (H,).
        flatness: the mean over those rows of max weight · visible keys, (H,): 1
            when every key weighs the same.
    """

    metrics: Mapping[str, F64]
    rows: NDArray[np.int64]
    flatness: F64
    patterns: NDArray[np.float32] | None = None
    """With ``pool``: (H, ⌈L / pool⌉, ⌈S / pool⌉) float32, each query head's attention
    pattern, every cell the largest weight of its ``pool`` × ``pool`` (query, key)
    positions over every batch item: a sink's column, a diagonal and a lone spike keep
    their height where a mean would fade them."""
    pool: int = 1
    lengths: tuple[int, int] = (0, 0)
    """(L, S): the queries and keys a pattern pools."""
    over_allowance: F64 | None = None
    """From a check (``check --manifest --html``): per head, its largest output error
    ÷ the allowance the verdict used (above 1 fails)."""

    @property
    def heads(self) -> int:
        return len(self.rows)


PATTERN_CELLS = 1 << 22
"""The cells of every head's pattern on a model's page together: one byte each before
compression, so that a 32-layer × 32-head capture's page stays a few MB (64 × 64 cells
a head)."""

PATTERN_SIDE = (32, 256)
"""The fewest and the most cells along a pattern's side, whatever the budget."""


def pattern_pool(L: int, S: int, heads: int) -> int:
    """The pooling (positions a cell, along each axis, a power of two) for ``heads``
    patterns of ``L`` × ``S`` within :data:`PATTERN_CELLS`: 1 where they fit whole."""
    fewest, most = PATTERN_SIDE
    return pooling(L, S, min(most, max(fewest, math.isqrt(PATTERN_CELLS // max(heads, 1)))))


class HeadGather:
    """What the grid reads from each block of a pass over ``spec`` besides the rows'
    statistics: each row's weight on key 0 and, with ``pool``, each head's pattern
    (:attr:`CaseHeads.patterns`). The pass is :func:`head_metrics`' own, or a check's
    (``check --manifest --html``): one pass gives the check and the grid."""

    def __init__(self, spec: AttentionSpec, pool: int = 0) -> None:
        self.spec, self.pool = spec, pool
        self.first = np.zeros((*spec.lead, spec.L))  # each row's weight on key 0
        self.patterns = (
            np.zeros((spec.H, -(-spec.L // pool), -(-spec.S // pool)), dtype=np.float32)
            if pool
            else None
        )
        self.lock = threading.Lock()  # blocks of one head may share a group of pool rows

    def add(self, place: Place, lse: F64, pattern: F64 | None) -> None:
        """One block's rows: their LSE, and their pattern pooled over keys (``pool``)."""
        self.first[place.at] = _key0_weights(place, self.spec, lse)
        if self.patterns is None or pattern is None or not len(pattern):
            return
        pool, r0 = self.pool, place.rows.start
        g0 = r0 // pool
        starts = np.maximum(np.arange(g0, (place.rows.stop - 1) // pool + 1) * pool - r0, 0)
        rows_pooled = np.maximum.reduceat(pattern, starts, axis=0)
        head = place.lead[-1] if place.lead else 0
        with self.lock:
            view = self.patterns[head, g0 : g0 + len(rows_pooled)]
            np.maximum(view, rows_pooled, out=view)

    def add_block(self, place: Place, block: Block) -> None:
        """One per-stage block of the place's rows (a pass the lean pass did not take)."""
        pattern = blocks_pattern([block], self.spec.S, self.pool) if self.pool else None
        self.add(place, block_lse(block), pattern)

    def heads(self, stats: Stats, th: Thresholds, error: F64 | None = None) -> CaseHeads:
        """The grid's row of the pass: ``stats`` read per query head; ``error`` the
        output's relative RMS error per head, when an expected output was given."""
        spec = self.spec
        classes = classify_rows(stats, th)
        eligible = _by_head(spec, classes.eligible)
        rows = eligible.sum(axis=1)

        def mean(values: NDArray[Any]) -> F64:
            """Per head, the mean over the judged rows (NaN with none)."""
            total = np.where(eligible, _by_head(spec, values), 0.0).sum(axis=1)
            return np.where(rows > 0, total / np.maximum(rows, 1), math.nan)

        n_rows = _by_head(spec, stats.n_visible).shape[1]
        metrics = {
            "entropy": mean(classes.normalized),
            "max_weight": mean(stats.max_weight),
            "saturated": mean(classes.saturated),
            "near_uniform": mean(classes.uniform),
            "fully_masked": _by_head(spec, stats.empty_rows).sum(axis=1) / max(n_rows, 1),
            "sink_mass": mean(self.first),
        }
        if error is not None:
            metrics["error"] = error
        flatness = mean(stats.max_weight * stats.n_visible)
        chosen = {m: metrics[m] for m in MODEL_METRICS if m in metrics}
        pool = max(self.pool, 1)
        return CaseHeads(chosen, rows, flatness, self.patterns, pool, (spec.L, spec.S))


def head_metrics(
    spec: AttentionSpec,
    th: Thresholds,
    expected: NDArray[Any] | None = None,
    *,
    jobs: int = 1,
    progress: Progress | None = None,
    pool: int = 0,
) -> CaseHeads:
    """Every statistic of the grid for one computation, per query head (one pass).

    Args:
        spec: the validated computation.
        th: the row rules' thresholds (saturation, uniform).
        expected: the expected output in the computation's layout ``(*lead, L, Ev)``
            (any dtype), for the ``error`` metric; None leaves it out.
        jobs: threads computing blocks.
        progress: told the scores done after each block.
        pool: gather each head's pattern pooled ``pool`` × ``pool`` (0: none), from
            the scores the pass holds anyway (a page's picture of the head).
    """
    stats = Stats.empty(spec)
    gather = HeadGather(spec, pool)
    reference = spec.in_float64()
    H = spec.H

    def visit(place: Place) -> tuple[int, float, float, bool] | None:
        found = forward(place, spec, stats, lse=True, pool=pool)
        assert found.lse is not None
        gather.add(place, found.lse, found.pattern)
        if expected is None:
            return None
        ref = found.output if reference is spec else forward(place, reference, None).output
        head = place.lead[-1] if place.lead else 0
        return (head, *_error_sums(expected[place.at], ref))

    # Summed in block order, whatever the threads did: the same numbers every run.
    sq_err, sq_ref, bad = np.zeros(H), np.zeros(H), np.zeros(H, dtype=np.bool_)
    walk = sweep(
        spec,
        visit,
        jobs=jobs,
        rows=query_block(spec),
        progress=progress,
        backend=NUMPY if pool else lean_backend(spec),  # pooling is numpy's (forward)
    )
    for sums in walk:
        if sums is not None:
            h, e, r, b = sums
            sq_err[h] += e
            sq_ref[h] += r
            bad[h] |= b
    error = _relative_rms(sq_err, sq_ref, bad) if expected is not None else None
    return gather.heads(stats, th, error)


def error_by_head(spec: AttentionSpec, expected: NDArray[Any], reference: F64) -> F64:
    """The output's relative RMS error per query head, of whole arrays in the
    computation's layout (a check's export against its reference)."""
    H = spec.H
    sq_err, sq_ref, bad = np.zeros(H), np.zeros(H), np.zeros(H, dtype=np.bool_)
    for lead in np.ndindex(*spec.lead):
        h = lead[-1] if lead else 0
        e, r, b = _error_sums(expected[lead], reference[lead])
        sq_err[h] += e
        sq_ref[h] += r
        bad[h] |= b
    return _relative_rms(sq_err, sq_ref, bad)


def _key0_weights(place: Place, spec: AttentionSpec, lse: F64) -> F64:
    """The weight each of the place's rows puts on key 0, exp(logit₀ − LSE): logit₀ from
    a block of that one key, every step the engine takes before the softmax applied
    (scale, soft-cap, bias, mask), and the LSE of the whole row from the pass."""
    if not spec.S:
        return np.zeros(len(lse))
    one = Place(place.lead, place.rows, slice(0, 1), place.inputs).attend(spec)
    logit0 = one.masked[:, 0].astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        w0 = np.exp(logit0 - lse)
    # A row with no key has LSE −inf (and a row of NaN, NaN): it weighs nothing.
    return np.where(np.isfinite(w0), w0, 0.0)


def _error_sums(expected: NDArray[Any], reference: NDArray[Any]) -> tuple[float, float, bool]:
    """A block's Σ(expected − reference)² and Σ reference² over the pairs both finite,
    and whether a value is non-finite in one and not (the same) in the other."""
    a = np.asarray(expected, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    finite = np.isfinite(a) & np.isfinite(r)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == r) | (np.isnan(a) & np.isnan(r))
        d = np.where(finite, a - r, 0.0)
        ref = np.where(finite, r, 0.0)
        return float(np.sum(d * d)), float(np.sum(ref * ref)), bool((~finite & ~same).any())


def _relative_rms(sq_err: F64, sq_ref: F64, bad: NDArray[np.bool_]) -> F64:
    """√(Σ err² / Σ ref²) per head: the RMS error over the reference's RMS (the counts
    cancel); inf where a value is non-finite in one only, or the reference is all 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.sqrt(sq_err / sq_ref)
    ratio = np.where(sq_ref > 0, ratio, np.where(sq_err > 0, math.inf, 0.0))
    return np.where(bad, math.inf, ratio)


def _by_head(spec: AttentionSpec, a: NDArray[Any]) -> NDArray[Any]:
    """A per-row array ``(*lead, L)`` as ``(H, rows)``: every row of a query head, of
    every batch item (and any axis before it), together."""
    if not spec.lead:
        return a.reshape(1, -1)
    H = spec.H
    return np.moveaxis(a.reshape(-1, H, spec.L), 1, 0).reshape(H, -1)


# --- the grid -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GridRow:
    """One case of the grid: its name, its layer (where a capture's sidecar gives one),
    and its heads' statistics, or why it could not be read."""

    name: str
    layer: int | None = None
    heads: CaseHeads | None = None
    error: str | None = None


@dataclass(frozen=True)
class Notable:
    """A head worth a look: ``kind`` (:data:`~sdpa_cli.names.NOTABLE_HEADS`) and the value that named
    it (the sink mass; the share of near-uniform or of one-hot rows)."""

    case: str
    head: int
    kind: str
    value: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "head": self.head,
            "kind": self.kind,
            "value": json_number(self.value),
        }


@dataclass(frozen=True)
class ModelGrid:
    """The cases (rows, in manifest order) × the query heads (columns: the most any
    case has); the metrics measured; the notable heads, case by case, head by head."""

    rows: tuple[GridRow, ...]
    heads: int
    metrics: tuple[str, ...]
    """:data:`~sdpa_cli.names.MODEL_METRICS` measured: ``error`` only when some case has an expected output."""
    notable: tuple[Notable, ...]
    thresholds: Thresholds

    def values(self, metric: str) -> F64:
        """``(cases, heads)``: NaN where a case has no such head, or was not read."""
        out = np.full((len(self.rows), self.heads), math.nan)
        for i, row in enumerate(self.rows):
            if row.heads is not None and metric in row.heads.metrics:
                v = row.heads.metrics[metric]
                out[i, : len(v)] = v
        return out

    def present(self, metric: str) -> NDArray[np.bool_]:
        """``(cases, heads)``: where a case has a value (NaN included: a head with no
        row to judge); not where it has no such head, was not read, or lacks it."""
        out = np.zeros((len(self.rows), self.heads), dtype=np.bool_)
        for i, row in enumerate(self.rows):
            if row.heads is not None and metric in row.heads.metrics:
                out[i, : row.heads.heads] = True
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract: ``cases`` (names), ``heads``, ``metrics`` (metric → one
        list per case of one value per head: null where the case has no such head or
        was not read, NaN as ``"NaN"``), ``notable``, ``errors`` (the cases not read)."""
        metrics: dict[str, Any] = {}
        for m in self.metrics:
            values, present = self.values(m), self.present(m)
            metrics[m] = [
                [json_number(float(x)) if p else None for x, p in zip(vs, ps, strict=True)]
                for vs, ps in zip(values, present, strict=True)
            ]
        return {
            "cases": [r.name for r in self.rows],
            "heads": self.heads,
            "metrics": metrics,
            "notable": [n.to_dict() for n in self.notable],
            "errors": [{"case": r.name, "error": r.error} for r in self.rows if r.error],
        }


def model_grid(rows: Sequence[GridRow], th: Thresholds) -> ModelGrid:
    """The grid of ``rows`` and its notable heads (:data:`~sdpa_cli.names.NOTABLE_HEADS`)."""
    measured = [r.heads for r in rows if r.heads is not None]
    heads = max((h.heads for h in measured), default=0)
    metrics = tuple(m for m in MODEL_METRICS if any(m in h.metrics for h in measured))
    notable = [n for r in rows if r.heads is not None for n in _notable(r.name, r.heads, th)]
    return ModelGrid(tuple(rows), heads, metrics, tuple(notable), th)


def _notable(name: str, heads: CaseHeads, th: Thresholds) -> list[Notable]:
    """One case's notable heads, head by head, in :data:`~sdpa_cli.names.NOTABLE_HEADS` order. A head
    is judged dead or saturated with ≥ 2 rows to judge, as compute's head rules do."""
    m = heads.metrics
    out = []
    for h in range(heads.heads):
        sink = float(m["sink_mass"][h])
        if sink > SINK_MASS:
            out.append(Notable(name, h, "sink", sink))
        if heads.rows[h] < 2:
            continue
        uniform, saturated = float(m["near_uniform"][h]), float(m["saturated"][h])
        if uniform >= th.head_fraction or heads.flatness[h] <= FLAT_MAX_WEIGHT:
            out.append(Notable(name, h, "dead", uniform))
        if saturated >= th.head_fraction:
            out.append(Notable(name, h, "saturated", saturated))
    return out
