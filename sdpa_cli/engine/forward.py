"""One block of query rows of the forward pass, as every command reads it: the
output, the LSE and the statistics' records, from the lean pass
(:mod:`sdpa_cli.engine.online`) where it applies, else from the per-stage blocks.

:func:`forward` is what a visitor of the block driver calls when it wants the
forward pass's results and not its stages; :func:`query_block` is the row block to
sweep with (the lean pass keeps its matmuls' shape whatever the key length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import online, precision
from sdpa_cli.engine.arrays import NUMPY, Backend, current
from sdpa_cli.engine.block import Block, block_lse, native_dtype
from sdpa_cli.engine.driver import Place, block_rows
from sdpa_cli.engine.records import Moments, Records
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.types import F64


@dataclass(frozen=True)
class Forward:
    """The forward pass over one place's query rows."""

    output: NDArray[Any]
    """(rows, Ev) in the computation's dtype."""
    lse: F64 | None
    """(rows,) in float64, when asked for."""
    records: Records | None
    """The statistics' records (the rows' own were written into the stats)."""
    blocks: tuple[Block, ...]
    """The per-stage blocks, where the lean pass did not apply (else empty)."""
    pattern: F64 | None = None
    """With ``pool``: (rows, ⌈S / pool⌉) float64, each group of ``pool`` keys' largest
    weight (:func:`pattern_of`)."""


def first_moments(place: Place, stats: Stats | None) -> Moments | None:
    """The slice's score moments, with its first block (None for the others, or
    without statistics): computed in the visitor, on the sweep's threads."""
    if stats is None or place.rows.start != 0:
        return None
    return stats.slice_moments(place.lead, xp=place.inputs.xp)


def lean_backend(spec: AttentionSpec) -> Backend:
    """What a sweep of :func:`forward` over ``spec`` computes with: the context's
    backend (:func:`~sdpa_cli.engine.arrays.current`) where the lean pass applies and
    the device computes in its dtype; numpy, on the sweep's threads, for the per-stage
    path, and for float64 on a device without it (the same numbers, not float32's)."""
    backend = current()
    if not online.applies(spec):
        return NUMPY
    if not backend.float64 and native_dtype(spec) == np.dtype(np.float64):
        return NUMPY
    return backend


def query_block(spec: AttentionSpec) -> int | None:
    """Query rows per block for a sweep that calls :func:`forward` (None: the
    driver's default, for the per-stage path), on :func:`lean_backend`'s library."""
    return online.block_shape(spec, lean_backend(spec))[0] if online.applies(spec) else None


def forward(
    place: Place,
    spec: AttentionSpec,
    stats: Stats | None,
    *,
    lse: bool = False,
    pool: int = 0,
) -> Forward:
    """The forward pass of ``spec`` over ``place``'s rows, measured into ``stats``.

    ``spec`` is the computation run (a check's reference, or the spec as given);
    ``stats`` (None: not gathered) judges it; it must not be emulated in a format
    narrower than float32 when ``stats`` are gathered (the per-stage path reads an
    emulated block against its float64 twin: :meth:`Place.twin`). With ``pool``,
    the rows' weights pooled by groups of ``pool`` keys come too (the lean pass on
    numpy only: a sweep asking for them runs on numpy)."""
    found = None
    # An emulated run's statistics read every stage against its float64 twin.
    if online.applies(spec) and not (stats is not None and stats.spec.options.emulated):
        inputs = place.inputs.get(spec, place.lead)
        records = (
            Records.empty(stats.spec, stats.checked, stats.narrow)
            if stats is not None
            else Records.empty(spec, precision.CHECKED, ("float16",))
        )
        backend = place.inputs.backend
        found = online.attend_online(
            spec,
            place.lead,
            place.rows,
            place.keys,
            inputs,
            records,
            key_block=online.key_block(spec, backend),
            pool=pool,
            xp=place.inputs.xp,
        )
    if found is not None:
        pattern = None if found.pooled is None else pattern_of(found.pooled, found.lse)
        if stats is not None:
            stats.write_rows(place.at, found.rows)
        kept = None if stats is None else found.records
        return Forward(found.output, found.lse if lse else None, kept, (), pattern)
    done = _per_stage(place, spec, stats, lse)
    if not pool:
        return done
    pattern = blocks_pattern(done.blocks, spec.S, pool)
    return Forward(done.output, done.lse, done.records, done.blocks, pattern)


def blocks_pattern(blocks: Sequence[Block], S: int, pool: int) -> F64:
    """Per-stage blocks' rows (in order) pooled over groups of ``pool`` of the ``S``
    keys by their largest weight: :attr:`Forward.pattern` where the lean pass did not
    apply."""
    pooled = np.zeros((sum(len(b.weights) for b in blocks), -(-S // pool)))
    at = 0
    for block in blocks:
        w = np.where(np.isfinite(block.weights), block.weights, 0.0)
        online.pool_columns(pooled[at : at + len(w)], w, block.keys.start or 0, pool)
        at += len(w)
    return pooled


def pattern_of(pooled: NDArray[Any], lse: F64) -> F64:
    """Each group's largest weight from its largest logit: exp(logit − LSE) (exp is
    increasing, so the largest logit gives the largest weight); 0 for a row that sees
    no key."""
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        w = np.exp(np.minimum(pooled.astype(np.float64) - lse[:, None], 0.0))
    return np.where(np.isfinite(lse)[:, None] & np.isfinite(w), w, 0.0)


def _per_stage(place: Place, spec: AttentionSpec, stats: Stats | None, lse: bool) -> Forward:
    """The per-stage path, a few rows at a time (its blocks hold every stage)."""
    step = block_rows(spec)
    blocks = []
    records: Records | None = None
    for i0 in range(place.rows.start, place.rows.stop, step):
        part = place.part(spec, slice(i0, min(i0 + step, place.rows.stop)))
        block = part.attend(spec)
        if stats is not None:
            found = stats.measure(block, part.twin(spec, block))
            if records is None:
                records = found
            else:
                records.merge(found)
        blocks.append(block)
    output = np.concatenate([b.output for b in blocks]) if blocks else np.empty((0, spec.Ev))
    lses = np.concatenate([block_lse(b) for b in blocks]) if lse and blocks else None
    return Forward(output, lses, records, tuple(blocks))
