"""The stages of one (batch, head) slice as pictures: scores, masked scores, weights
and output over a window of it (default the whole slice), pooled to a size a page
can hold.

One sweep of the block driver over the slice (every key, the per-stage path), each
block's stages pooled as it is computed: nothing the size of the slice's scores is
kept, so a slice of 8,192 × 8,192 is drawn in the memory of a block. A cell holds
the value of largest magnitude among its positions (its sign kept): a sink's
column, a diagonal one key wide and a lone spike keep their height where a mean
would fade them; a hidden score (−∞) is no value, so a cell is blank only where
every position is hidden.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.driver import Place, sweep
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index

PICTURE_SIDE = 512
"""A picture's most cells along an axis: a window longer than this is pooled (by a
power of two)."""

BLOCK_SCORES = 1 << 19
"""Scores a block of the pictures' pass holds per stage (4 MiB in float64): its rows see
every key, so that at S = 8,192 a block is 64 rows, not 256 (the pass took 420 MiB)."""

STAGES = ("scores", "masked", "weights", "output")
"""What a slice's pictures show, in order (``scores`` after the scale)."""


@dataclass(frozen=True)
class SlicePictures:
    """One slice's stages over a window, pooled ``pool`` × ``pool`` positions a cell
    (the output: ``pool`` rows a cell, every feature)."""

    lead: Index
    rows: range
    keys: range
    pool: int
    stages: dict[str, F64]
    """``scores``, ``masked``, ``weights``: (⌈rows / pool⌉, ⌈keys / pool⌉); ``output``:
    (⌈rows / pool⌉, Ev). NaN: no value (every position hidden)."""


def pooling(rows: int, keys: int, side: int = PICTURE_SIDE) -> int:
    """The positions a cell pools along each axis, a power of two, for a window of
    ``rows`` × ``keys`` to fit ``side`` cells a side."""
    pool = 1
    while max(rows, keys) > side * pool:
        pool *= 2
    return pool


def slice_pictures(
    spec: AttentionSpec,
    lead: Index,
    rows: range | None = None,
    keys: range | None = None,
    *,
    jobs: int = 1,
) -> SlicePictures:
    """The pictures of the slice ``lead`` over ``rows`` × ``keys`` (default all)."""
    rows = rows if rows is not None else range(spec.L)
    keys = keys if keys is not None else range(spec.S)
    pool = pooling(len(rows), len(keys))
    n_r, n_k = -(-len(rows) // pool), -(-len(keys) // pool)
    out = {s: np.full((n_r, n_k), math.nan) for s in STAGES[:3]}
    out["output"] = np.full((n_r, spec.Ev), math.nan)
    # rows a block: every key of them, all stages, within BLOCK_SCORES scores a stage
    step = max(pool, min(256, BLOCK_SCORES // max(spec.S, 1)) // pool * pool)
    k0, k1 = keys.start, keys.stop
    lock = threading.Lock()  # a row group may span two blocks (a window not aligned)

    def visit(place: Place) -> None:
        r0, r1 = max(place.rows.start, rows.start), min(place.rows.stop, rows.stop)
        if r0 >= r1:
            return
        at = Place(place.lead, slice(r0, r1), slice(0, spec.S), place.inputs)
        block = at.attend(spec)
        g = slice((r0 - rows.start) // pool, -(-(r1 - rows.start) // pool))
        stages = {
            "scores": block.scaled,
            "masked": np.where(np.isneginf(block.masked), np.nan, block.masked),
            "weights": block.weights,
        }
        # the block's rows from the window's group boundary below r0 (NaN-padded)
        g0 = r0 - (r0 - rows.start) % pool
        pad = ((r0 - g0, 0), (0, 0))
        pooled = {
            name: largest(
                np.pad(np.asarray(v, np.float64)[:, k0:k1], pad, constant_values=np.nan), pool, pool
            )
            for name, v in stages.items()
        }
        pooled["output"] = largest(
            np.pad(np.asarray(block.output, np.float64), pad, constant_values=np.nan), pool, 1
        )
        with lock:
            for name, cells in pooled.items():
                _merge(out[name][g], cells)

    for _ in sweep(spec, visit, jobs=jobs, rows=step, leads=[lead], keys="all"):
        pass
    return SlicePictures(lead, rows, keys, pool, out)


def _merge(into: F64, new: F64) -> None:
    """Keep, cell by cell, the value of larger magnitude (a value over NaN)."""
    take = ~np.isnan(new) & (np.isnan(into) | (np.abs(new) > np.abs(into)))
    into[take] = new[take]


def pooled_to(a: F64, rows: int, cols: int) -> tuple[F64, int, int]:
    """``a`` (2-D) pooled to at most ``rows`` × ``cols`` cells (:func:`largest`), and the
    pooling factors used along each axis."""
    fr = max(1, math.ceil(a.shape[0] / max(rows, 1)))
    fc = max(1, math.ceil(a.shape[1] / max(cols, 1)))
    return largest(np.asarray(a, dtype=np.float64), fr, fc), fr, fc


def largest(a: F64, fr: int, fc: int) -> F64:
    """``a`` pooled ``fr`` × ``fc``: each cell its value of largest magnitude, its sign
    kept (of non-negative values, the largest: a pattern's, a ratio's); NaN where all
    are NaN. The largest, not the mean: a sink's column, a diagonal one key wide and a
    lone spike keep their height, where a mean over 16 × 16 would fade them to 1/16."""
    if fr == fc == 1:
        return a
    pr, pc = -a.shape[0] % fr, -a.shape[1] % fc
    padded = np.pad(a, ((0, pr), (0, pc)), constant_values=np.nan)
    tiled = padded.reshape(padded.shape[0] // fr, fr, padded.shape[1] // fc, fc)
    blocks = tiled.transpose(0, 2, 1, 3).reshape(tiled.shape[0], tiled.shape[2], -1)
    size = np.where(np.isnan(blocks), -1.0, np.abs(blocks))
    pick = np.argmax(size, axis=-1)
    chosen: NDArray[np.float64] = np.take_along_axis(blocks, pick[..., None], axis=-1)[..., 0]
    return chosen
