"""FlashAttention's reference rules, written step by step in numpy float64 from its
tests (``hopper/test_util.py`` and ``tests/test_flash_attn.py``: ``construct_local_mask``,
``construct_chunk_mask``, ``attention_ref``). Nothing here comes from ``sdpa_cli``.

Tensors are FlashAttention's: Q ``(b, t, h, d)``, K ``(b, s, h_k, d)``, V ``(b, s, h_k, dv)``,
padding masks ``(b, t)`` and ``(b, s)`` (True: present). Each item's diagonal sits at
``row + sk − sq``, ``sk`` and ``sq`` its own key and query lengths (the padding masks'
sums), so an item with more queries than keys has a negative offset. ``window_size``
``(-1, -1)`` is none; ``causal`` makes its right side 0. ``attention_chunk`` C > 0
keeps the keys of the query's own chunk, ``col_limit_left = p − p mod C`` with
``p = row + sk − sq``. ``qv`` adds ``qv · vᵀ`` to the scores and the scale becomes
1/√(d + dv). Descale factors ``(b, h_k)`` multiply Q (repeated over each group's
heads), K and V before anything else. ``p_format`` rounds the weights to a narrower
format before they meet V (FlashAttention-3's FP8 kernels store P in e4m3), the
row sums staying those of the unrounded weights, as the tests' ``intermediate_dtype``.
A row with no key left gives zeros, as the kernels do.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]


def _lengths(mask: NDArray[np.bool_] | None, full: int) -> NDArray[np.int64]:
    if mask is None:
        return np.asarray(full, dtype=np.int64).reshape(1, 1, 1, 1)
    return np.asarray(mask.sum(-1), dtype=np.int64).reshape(-1, 1, 1, 1)


def construct_local_mask(
    seqlen_q: int,
    seqlen_k: int,
    window_size: tuple[int, int],
    query_padding_mask: NDArray[np.bool_] | None = None,
    key_padding_mask: NDArray[np.bool_] | None = None,
) -> NDArray[np.bool_]:
    """True where masked out: FlashAttention's ``construct_local_mask``."""
    row_idx = np.arange(seqlen_q, dtype=np.int64).reshape(-1, 1)
    col_idx = np.arange(seqlen_k, dtype=np.int64)
    sk = _lengths(key_padding_mask, seqlen_k)
    sq = _lengths(query_padding_mask, seqlen_q)
    if window_size[0] < 0:
        return np.asarray(col_idx > row_idx + sk - sq + window_size[1])
    right = window_size[1] if window_size[1] >= 0 else seqlen_k
    return np.asarray(
        (col_idx > np.minimum(row_idx + sk - sq + right, sk))
        | (col_idx < row_idx + sk - sq - window_size[0])
    )


def construct_chunk_mask(
    seqlen_q: int,
    seqlen_k: int,
    attention_chunk: int,
    query_padding_mask: NDArray[np.bool_] | None = None,
    key_padding_mask: NDArray[np.bool_] | None = None,
) -> NDArray[np.bool_]:
    """True where masked out: FlashAttention's ``construct_chunk_mask`` (the remainder
    subtracted, so a negative position's chunk is the one below)."""
    row_idx = np.arange(seqlen_q, dtype=np.int64).reshape(-1, 1)
    col_idx = np.arange(seqlen_k, dtype=np.int64)
    sk = _lengths(key_padding_mask, seqlen_k)
    sq = _lengths(query_padding_mask, seqlen_q)
    left = row_idx + sk - sq - (row_idx + sk - sq) % attention_chunk
    return np.asarray((col_idx < left) | (col_idx >= left + attention_chunk))


def attention_ref(
    q: NDArray[Any],
    k: NDArray[Any],
    v: NDArray[Any],
    query_padding_mask: NDArray[np.bool_] | None = None,
    key_padding_mask: NDArray[np.bool_] | None = None,
    *,
    causal: bool = False,
    qv: NDArray[Any] | None = None,
    q_descale: NDArray[Any] | None = None,
    k_descale: NDArray[Any] | None = None,
    v_descale: NDArray[Any] | None = None,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    p_format: Any = None,
) -> F64:
    """FlashAttention's ``attention_ref`` in float64: the output ``(b, t, h, dv)``."""
    if causal:
        window_size = (window_size[0], 0)
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    qv = None if qv is None else np.asarray(qv, dtype=np.float64)
    g = q.shape[2] // k.shape[2]
    if q_descale is not None:
        scale_q = np.repeat(np.asarray(q_descale, np.float64), g, axis=1)[:, None, :, None]
        q = q * scale_q
        qv = None if qv is None else qv * scale_q
    if k_descale is not None:
        k = k * np.asarray(k_descale, np.float64)[:, None, :, None]
    if v_descale is not None:
        v = v * np.asarray(v_descale, np.float64)[:, None, :, None]
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    k = np.repeat(k, g, axis=2)
    v = np.repeat(v, g, axis=2)
    d, dv = q.shape[-1], v.shape[-1]
    softmax_scale = 1.0 / math.sqrt(d if qv is None else d + dv)
    scores = np.einsum("bthd,bshd->bhts", q * softmax_scale, k)
    if qv is not None:
        scores = scores + np.einsum("bthd,bshd->bhts", qv * softmax_scale, v)
    hidden = np.zeros(scores.shape, dtype=np.bool_)
    if key_padding_mask is not None:
        hidden |= ~key_padding_mask[:, None, None, :]
    local = None
    if window_size[0] >= 0 or window_size[1] >= 0:
        local = construct_local_mask(
            seqlen_q, seqlen_k, window_size, query_padding_mask, key_padding_mask
        )
    if attention_chunk > 0:
        chunk = construct_chunk_mask(
            seqlen_q, seqlen_k, attention_chunk, query_padding_mask, key_padding_mask
        )
        local = chunk if local is None else local | chunk
    if local is not None:
        hidden = hidden | local
    scores = np.where(hidden, -np.inf, scores)
    top = scores.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(scores - top)
    total = e.sum(axis=-1, keepdims=True)
    seen = total > 0
    p = e if p_format is None else e.astype(p_format).astype(np.float64)
    attention = np.where(seen, p / np.where(seen, total, 1.0), 0.0)
    if query_padding_mask is not None:
        attention = np.where(query_padding_mask[:, None, :, None], attention, 0.0)
    output = np.einsum("bhts,bshd->bthd", attention, v)
    if query_padding_mask is not None:
        output = np.where(query_padding_mask[:, :, None, None], output, 0.0)
    return np.asarray(output, dtype=np.float64)


def padding(lengths: tuple[int, ...], size: int) -> NDArray[np.bool_]:
    """A prefix padding mask ``(b, size)``: item b's first ``lengths[b]`` present."""
    return np.asarray(np.arange(size)[None, :] < np.asarray(lengths)[:, None], dtype=np.bool_)
