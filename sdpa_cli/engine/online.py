"""The lean pass: query rows over blocks of keys with an online softmax, every
statistic read from what the softmax computes anyway.

For one (batch, head) slice and query rows i0..i1, key blocks of :data:`KEY_BLOCK`
keys are visited in order, as FlashAttention does. Per row it keeps the running max
m, the running sum ℓ = Σ exp(x − m) and the output accumulator, rescaled by
exp(m_old − m_new) when a later key block raises m; every row statistic of
:data:`~sdpa_cli.engine.row_stats.ROW_STATISTICS` is folded in key block by key block
by its own rules (a :class:`~sdpa_cli.engine.row_stats.Chunk` of e = exp(x − m) and
log e = x − m). At the end

    output     = acc / ℓ                         (normalised once, not every weight)
    LSE        = m + log ℓ
    max weight = 1 / ℓ                           (the top weight is exp(0) / ℓ)
    entropy    = log ℓ − Σ e·(x − m) / ℓ         (H = −Σ w log w, w = e / ℓ)

and the weights that would flush to zero in a narrow format are counted only for
rows whose smallest weight, exp(min x − m) / ℓ, is small enough to flush.

The scale is folded into Q (one (rows, E) product instead of a pass over the
scores), and two score-sized buffers per thread are reused from block to block.

This covers the common computation: native arithmetic (float64, or float32
throughout), scale, causal, window, key padding and boolean masks, finite K and V,
and a finite mask value (``--as jax|hf``, ``finfo-min``, ``-1e9``). A hidden key's
weight under a finite mask value is exp(mask value − m): 0 once below the
denormal floor (as the one-shot softmax makes it), which the pass checks row by row
(refusing the block otherwise); a row with no visible key is uniform over every
key, its output V's mean and its LSE the mask value + log S; and what a kernel that
*adds* the mask value would overflow in a narrow format is recorded from the hidden
scores of every key block, even those no row sees.
:func:`attend_online` returns None where it does not apply, and for a block whose
scores leave every checked format's range or are not finite: the caller then runs
the per-stage path (:func:`~sdpa_cli.engine.block.attend_block` and
:meth:`~sdpa_cli.engine.stats.Stats.measure`), which records where and how.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision, row_stats
from sdpa_cli.engine.arrays import (
    Backend,
    astype,
    namespace,
    namespace_of,
    numpy_dtype,
    scratch,
    to_host,
)
from sdpa_cli.engine.block import (
    DENORMAL_FLOOR,
    Operands,
    common_keys,
    native_dtype,
    visibility,
)
from sdpa_cli.engine.positions import valid_queries
from sdpa_cli.engine.records import Records
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError

KEY_BLOCK = 1024
"""Keys per block of the online softmax: with :data:`QUERY_BLOCK` rows, two buffers of
1 MiB (float32) or 2 MiB (float64), about what a core's L2 cache holds."""

QUERY_BLOCK = 256
"""Query rows per block of the lean pass, whatever the key length (the cost per score
stays flat: the matmuls keep their shape as S grows)."""


DEVICE_KEY_BLOCK = 8192
"""Keys per block on a torch device: a whole sequence up to this length (a device's
matmuls want large blocks; its memory, not a cache, bounds them)."""

DEVICE_SCORE_ARRAYS = 8
"""Score-sized arrays a device block holds at once, at most: the scores, their exp, the
visibility mask and torch's temporaries (a masked min, a comparison)."""

DEVICE_ROWS = 4096
"""Query rows per block on a device, at most."""


def key_block(spec: AttentionSpec, backend: Backend) -> int:
    """Keys per block of the lean pass: :data:`KEY_BLOCK` on a CPU (numpy's; twice it
    for torch's, whose every call costs more), :data:`DEVICE_KEY_BLOCK` (or the
    sequence, when shorter) on a device."""
    if backend.device == "cpu":
        return KEY_BLOCK if backend.name == "numpy" else 2 * KEY_BLOCK
    return max(1, min(spec.S, DEVICE_KEY_BLOCK))


def block_shape(spec: AttentionSpec, backend: Backend) -> tuple[int, int]:
    """(query rows, keys) per block of the lean pass: :data:`QUERY_BLOCK` ×
    :data:`KEY_BLOCK` on a CPU (numpy's or torch's: a core's cache); on a device,
    :data:`DEVICE_KEY_BLOCK` keys and as many rows as half its free memory holds,
    beside two slices of K and V.

    Raises:
        SpecError: not one row of the case fits in the device's free memory.
    """
    keys = key_block(spec, backend)
    if backend.device == "cpu":
        return QUERY_BLOCK if backend.name == "numpy" else 4 * QUERY_BLOCK, keys
    free = namespace(backend).free_bytes()
    size = (native_dtype(spec) or np.dtype(np.float64)).itemsize
    per_row = size * (keys * DEVICE_SCORE_ARRAYS + 4 * (spec.E + spec.Ev))
    fixed = 2 * 2 * size * spec.S * (spec.E + spec.Ev)  # K and V of two slices
    rows = (free // 2 - fixed) // per_row
    if rows < 1:
        need = (fixed + per_row) * 2
        raise SpecError(
            "--device",
            f"{backend.device} has {free >> 20} MiB free; a block of this case needs "
            f"{need >> 20} MiB (K and V of a slice, one query row's scores): use --device "
            "cpu, or free the device's memory",
        )
    return int(min(rows, DEVICE_ROWS)), keys


def applies(spec: AttentionSpec) -> bool:
    """Whether the lean pass computes this spec: native arithmetic, no stage between
    the scaled scores and the mask (softcap, bias, ALiBi, score-mod, a float mask), no sinks, no
    dropout, and a finite non-zero scale."""
    o = spec.options
    factor = spec.factor
    return (
        native_dtype(spec) is not None
        and o.softcap is None
        and spec.bias is None
        and spec.sinks is None
        and not o.alibi
        and o.score_mod is None
        and (spec.mask is None or spec.mask_is_bool)
        and o.dropout == 0
        and not o.prescale
        and math.isfinite(factor)
        and factor != 0
    )


def hidden_value(spec: AttentionSpec) -> float | None:
    """The value a hidden key's logit takes in the computation's arithmetic, when it
    is finite (None: −inf, the hidden key weighs nothing whatever the row)."""
    dt = native_dtype(spec)
    with np.errstate(over="ignore"):
        value = float(dt.type(spec.options.effective_mask_value)) if dt is not None else -math.inf
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Online:
    """What the lean pass gives for a block of query rows."""

    output: NDArray[Any]
    """(rows, Ev), in the computation's dtype (on the host, whatever computed it)."""
    lse: F64
    """(rows,), float64: −inf for a row with no visible key (the mask value + log S
    under a finite one)."""
    rows: row_stats.RowStats
    records: Records
    weights: NDArray[Any] | None = None
    """With ``keep_weights``: (rows, keys) the softmax's weights, hidden keys 0: this
    thread's scratch array, valid until its next pass."""
    pooled: NDArray[Any] | None = None
    """With ``pool``: (rows, ⌈S / pool⌉) each group of ``pool`` keys' largest logit as
    the softmax sees it (hidden keys the most negative number): the pattern a page
    draws, exp(it − LSE), is the group's largest weight."""


def attend_online(
    spec: AttentionSpec,
    lead: Index,
    rows: slice,
    keys: slice,
    inputs: Operands,
    records: Records,
    *,
    key_block: int = KEY_BLOCK,
    keep_weights: bool = False,
    pool: int = 0,
    xp: Any = np,
) -> Online | None:
    """The lean pass over query rows ``rows`` of the slice at ``lead``, keys ``keys``
    (the range :func:`~sdpa_cli.engine.block.key_range` leaves), or None where the
    per-stage path must compute the block (see the module's docstring).

    ``records`` is a block's empty records (:meth:`Records.empty`), filled here: its
    formats are those the statistics check for overflow and flushed weights. With
    ``keep_weights`` the keys are one block and the weights are kept (the backward
    pass reads them). With ``pool`` (numpy only), each group of ``pool`` keys' largest
    logit is kept (:attr:`Online.pooled`): one reduction over the scores the pass
    holds anyway. ``xp`` is the namespace that computes (numpy, or a torch
    device's: :mod:`~sdpa_cli.engine.arrays`); what comes back is on the host."""
    checked = tuple(dict.fromkeys(d for _, d in records.overflow))
    narrow = tuple(records.exp_overflow)
    if inputs.v_bad.any() or inputs.k_bad.any():
        return None
    dt = inputs.k.dtype
    ops = inputs.on(xp)  # K and V where they are computed (copied once a slice)
    n = rows.stop - rows.start
    k0, k1 = keys.start, keys.stop
    if keep_weights:
        key_block = max(k1 - k0, 1)
    q = xp.asarray(spec.q[spec.operand_index("q", lead)][rows], dtype=dt)
    factor = spec.factor
    qf = q * float(dt.type(factor))  # the factor in the dtype, a weak scalar for both
    ev = ops.v.shape[1]
    neg = float(np.finfo(dt).min)  # hidden keys: exp gives 0, and 0 · it is 0 (not NaN)
    floor = DENORMAL_FLOOR[dt]
    common = common_keys(spec, lead, rows)
    mask_value = hidden_value(spec)
    added = (
        {d: dt.type(spec.options.mask_value_in(d)) for d in narrow}
        if mask_value is not None
        else {}
    )

    m = xp.full(n, -np.inf, dtype=dt)  # running row max
    total = xp.zeros(n, dtype=dt)  # Σ exp(x − m)
    low = xp.full(n, np.inf, dtype=dt)  # smallest visible logit
    acc = xp.zeros((n, ev), dtype=dt)
    fold = row_stats.Fold(n, dt, xp)  # every row statistic, chunk by chunk
    nothing_hidden = xp.zeros(n, dtype=dt)  # hidden keys weigh 0 here (checked below)
    everyone = xp.arange(n)
    hi_all, lo_all = -math.inf, math.inf
    exp_limit = min(precision.fmt(d).exp_limit for d in narrow)
    pooled = np.full((n, -(-spec.S // pool)), neg, dtype=dt) if pool and xp is np else None

    with xp.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        for c0 in range(k0, k1, key_block):
            c1 = min(c0 + key_block, k1)
            width = c1 - c0
            x = scratch("x", dt, n * width, xp).reshape(n, width)
            xp.matmul(qf, ops.k[c0:c1].T, out=x)
            # A key block every row sees (below a causal diagonal) needs no mask.
            inside = common.start <= c0 and c1 <= common.stop
            vis = None if inside else visibility(spec, lead, rows, slice(c0, c1), xp)
            if vis is None:
                seen = xp.full(n, width, dtype=np.int64)
                chunk_lo = x[everyone, xp.argmin(x, axis=1)]  # argmin: faster than min
            else:
                if added:
                    _mask_add_overflow(records, x, vis, added, (*lead, rows.start, c0))
                seen = vis.sum(axis=1)
                if not seen.any() and not keep_weights:  # no row sees them: they add nothing
                    continue
                chunk_lo = xp.min(x, axis=1, where=vis, initial=np.inf)
                xp.copyto(x, neg, where=~vis)
            if pooled is not None:
                pool_columns(pooled, x, c0, pool)
            at = xp.argmax(x, axis=1)
            chunk_max = x[everyone, at]
            if vis is not None:
                chunk_max = astype(xp.where(seen > 0, chunk_max, -np.inf), dt)
            hi = float(xp.max(chunk_max, initial=-math.inf))
            lo = float(xp.min(chunk_lo, initial=math.inf))
            if math.isnan(hi) or math.isnan(lo) or hi == math.inf or lo == -math.inf:
                return None  # not finite: the per-stage path says where
            hi_all, lo_all = max(hi_all, hi), min(lo_all, lo)
            if hi > exp_limit:  # exp with no max subtracted would overflow: where
                _exp_overflow(records, x, (*lead, rows.start, c0), narrow)
            xp.minimum(low, chunk_lo, out=low)

            new_m = xp.maximum(m, chunk_max)
            shift = astype(xp.where(new_m == -np.inf, 0, new_m), dt)
            alpha = xp.exp(m - shift)  # m = −inf (nothing seen yet): 0
            fold.rescale(row_stats.Rescale(alpha, m - shift, total))
            total *= alpha
            acc *= alpha[:, None]
            m = new_m

            xp.subtract(x, shift[:, None], out=x)
            top_log = chunk_max - shift  # the top key's x − m, as x holds it now
            if float(xp.min(chunk_lo - shift, initial=math.inf)) < floor:
                xp.copyto(x, neg, where=x < floor)  # subnormal exp: see DENORMAL_FLOOR
                top_log[top_log < floor] = neg
            e = scratch("e", dt, n * width, xp).reshape(n, width)
            xp.exp(x, out=e)
            total += e.sum(axis=1)
            # x now holds log e = x − m (hidden keys: the most negative number)
            fold.add(
                row_stats.Chunk(
                    e,
                    x,
                    seen,
                    at,
                    chunk_max,
                    c0,
                    nothing_hidden,
                    e_top=xp.exp(top_log),  # e[everyone, at], without a gather
                    rows=everyone,
                )
            )
            acc += e @ ops.v[c0:c1]

        seen_any = total > 0
        # a hidden key weighs exp(mask value − m): 0 only below the denormal floor
        nearest = float(xp.min(m, where=seen_any, initial=math.inf))
        if mask_value is not None and nearest - mask_value < -floor + 1:
            return None
        safe = astype(xp.where(seen_any, total, 1), dt)
        output = acc / safe[:, None]
        log_total = xp.log(astype(safe, np.float64))
        lse = xp.where(seen_any, astype(m, np.float64) + log_total, -math.inf)
        uniform = None
        if mask_value is not None and k1 > k0:
            uniform = xp.asarray(uniform_rows(spec, lead, rows, to_host(seen_any)))
            if uniform.any():
                if keep_weights:
                    return None  # their weights are not e / ℓ: the per-stage path keeps them
                output[uniform] = xp.mean(ops.v[k0:k1], axis=0, dtype=dt)
                lse[uniform] = mask_value + math.log(k1 - k0)
        finite_m = astype(xp.where(xp.isfinite(m), m, 0), dt)
        final = row_stats.Final(
            total,
            log_total,
            uniform,
            # inf for a row that saw nothing (low = inf): it has no weight to lose
            lambda: xp.exp(low - finite_m) / safe,
        )
        out_hi = float(xp.max(xp.abs(output), initial=0.0))
        weights = None
        if keep_weights:  # one key block: e holds every key's exp(x − m)
            weights = xp.divide(e, safe[:, None], out=e) if k1 > k0 else xp.zeros((n, 0), dt)
    if not math.isfinite(out_hi):
        return None

    # Every stage inside every checked format (else the per-stage path says where).
    smallest_max = min(precision.fmt(d).max for d in checked)
    raw_max = max(abs(hi_all), abs(lo_all)) / abs(factor) if hi_all >= lo_all else 0.0
    scaled_max = max(abs(hi_all), abs(lo_all)) if hi_all >= lo_all else 0.0
    if max(raw_max, scaled_max, out_hi) > smallest_max:
        return None
    settle = _settle(spec, lead, rows, keys, qf, ops, finite_m, final, narrow, key_block)
    stats = row_stats.collect(fold, settle, final)
    if xp is not np:  # the results to the host: a block's rows, never a whole tensor
        output, lse = to_host(output), to_host(lse)
        stats = row_stats.RowStats({c: to_host(x) for c, x in stats.items()}, stats.formats)
        weights = None if weights is None else to_host(weights)
    counted = int(stats.n_visible.sum())
    for stage, extreme, count in (
        ("raw", raw_max, counted),
        ("scaled", scaled_max, counted),
        ("masked", scaled_max, counted),
        ("output", out_hi, output.size),
    ):
        records.absmax[stage].count += count
        records.absmax[stage].extreme = extreme
    return Online(output.astype(dt, copy=False), lse, stats, records, weights, pooled)


POOL_RUN = 16
"""Keys folded at once by :func:`pool_columns`: contiguous runs this long, then across."""


def pool_columns(into: NDArray[Any], x: NDArray[Any], c0: int, pool: int) -> None:
    """Fold ``x``'s columns (keys ``c0`` onwards) into ``into``'s groups of ``pool``
    keys by their largest value, in place: group g holds keys g·pool to (g+1)·pool − 1."""
    n, width = x.shape
    if not width:
        return
    g0, g1 = c0 // pool, (c0 + width - 1) // pool + 1
    view = into[:, g0:g1]
    if c0 % pool or width % pool:  # a ragged chunk: reduceat (slower) at its edges
        starts = np.maximum(np.arange(g0, g1) * pool - c0, 0)
        np.maximum(view, np.maximum.reduceat(x, starts, axis=1), out=view)
        return
    # Groups of whole runs: their maxima run by run of POOL_RUN contiguous keys, then
    # across a run's keys (numpy's reduceat, or max over a short last axis, is 4-5×
    # one exp over the block; this is about one).
    groups = x.reshape(n, g1 - g0, pool)
    # measured on 256 × 1024 blocks: runs of 16 but for float64 in groups under 64 keys
    run = min(pool, POOL_RUN if x.itemsize < 8 or pool >= 64 else POOL_RUN // 2)
    folded = groups[..., :run]
    if pool > run:
        folded = folded.copy()
        for j in range(run, pool, run):
            np.maximum(folded, groups[..., j : j + run], out=folded)
    for j in range(run):
        np.maximum(view, folded[..., j], out=view)


def _exp_overflow(records: Records, x: NDArray[Any], base: Index, narrow: tuple[str, ...]) -> None:
    """Logits whose exp would overflow a narrow format with no max subtracted (the
    naive softmax). A row block's key blocks are not in C order: a later key block's
    first hit may come first."""
    x = to_host(x)  # rare (a logit past log(max)); the records are the host's
    for d in narrow:
        hits = x > precision.fmt(d).exp_limit
        records.exp_overflow[d].add(hits, base, x, in_order=False)


def uniform_rows(
    spec: AttentionSpec, lead: Index, rows: slice, seen: NDArray[np.bool_]
) -> NDArray[np.bool_]:
    """Under a finite mask value, the rows that see no key (``seen`` False) and are
    present: every logit of theirs is the mask value, so they spread evenly over every
    key. Absent rows (past ``--query-lengths``) stay zeros."""
    return ~seen & (np.arange(rows.start, rows.stop) < valid_queries(spec, lead))


def weighed_keys(
    spec: AttentionSpec, lead: Index, rows: slice, keys: slice
) -> NDArray[np.bool_] | None:
    """The keys each row of the lean pass's block weighs (None: every one): its
    visible keys, and every key for a row that sees none under a finite mask value
    (it is uniform), unless the row is absent (``--query-lengths``: zeros)."""
    vis = visibility(spec, lead, rows, keys)
    if vis is None or hidden_value(spec) is None:
        return vis
    spread = uniform_rows(spec, lead, rows, np.asarray(vis.any(axis=1)))
    if not spread.any():
        return vis
    vis = vis.copy()
    vis[spread] = True
    return vis


def _mask_add_overflow(
    records: Records,
    x: NDArray[Any],
    visible: NDArray[np.bool_],
    added: dict[str, Any],
    base: Index,
) -> None:
    """Hidden scores a kernel that *adds* the mask value (in each narrow format's
    own value, as HF's finfo.min is) would take beyond that format. Not in C order:
    see :func:`_exp_overflow`."""
    x, visible = to_host(x), to_host(visible)  # the records are the host's
    hidden = ~visible
    for d, value in added.items():
        total = x + value
        hits = hidden & precision.fmt(d).overflows(total)
        records.mask_add_overflow[d].add(hits, base, total, in_order=False)


def _settle(
    spec: AttentionSpec,
    lead: Index,
    rows: slice,
    keys: slice,
    qf: NDArray[Any],
    inputs: Operands,
    m: NDArray[Any],
    final: row_stats.Final,
    narrow: tuple[str, ...],
    key_block: int,
) -> row_stats.Settle:
    """The settled statistics (what would flush to zero in each narrow format): the
    keys read again, block by block, for the rows their prefilter picks (those whose
    smallest weight exp(min x − m) / ℓ could flush), w = exp(x − m) / ℓ (``m``: the
    running max, 0 for a row that saw no key)."""
    floor = DENORMAL_FLOOR[numpy_dtype(m)]
    xp = namespace_of(m)
    with xp.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        settle = row_stats.Settle(final, narrow)
        again = settle.rows
        if not len(again):
            return settle
        for c0 in range(keys.start, keys.stop, key_block):
            c1 = min(c0 + key_block, keys.stop)
            x = qf[again] @ inputs.k[c0:c1].T
            x -= m[again, None]
            vis = visibility(spec, lead, rows, slice(c0, c1), xp)
            w = xp.where(x < floor, 0, xp.exp(x)) / final.safe[again, None]
            settle.add(row_stats.Settled(w, None if vis is None else vis[again]))
    return settle
