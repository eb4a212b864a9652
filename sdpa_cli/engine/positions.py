"""Where each batch item's queries and keys sit: the diagonal offset of a causal mask
and window, ALiBi's, the valid queries and keys, the keys a block may skip, and
dropout's keep-mask, drawn by element position.

Query i of batch item b sits at position offset_b + i, and key j at position j:

    no --query-offset:  offset_b = 0 (upper-left) or S − L (lower-right), every item,
                        or S_b − L_b (lower-right-per-item), the item's own lengths
    --query-offset N_b: offset_b = N_b, the cache length before the new tokens

ALiBi measures from the bottom-right diagonal (S − L) unless ``--query-offset`` says
where the queries are. ``--key-lengths`` leaves item b its first keys;
``--query-lengths`` its first queries: the rows after them are *absent* (hidden from
every key, zero weights and output, whatever the mask value; not judged).
``--cu-seqlens`` packs documents along L (and S): a query sees its own document's
keys only, the causal mask, window and chunks placed within the document
(``--key-lengths`` and ``--query-offset`` then count per document: chunked prefill's
sequences, each with its own cache). ``--segment-ids``
(JAX's segment ids) lets a query see only the keys of its own id, beside every other mask.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import masks
from sdpa_cli.engine.options import Options, per_item
from sdpa_cli.engine.spec import AttentionSpec


def _item(values: tuple[int, ...], lead_index: tuple[int, ...]) -> int:
    """The value of this slice's batch item (one value: every item's)."""
    return values[lead_index[-2] if len(values) > 1 else 0]


def diagonal_offset(spec: AttentionSpec, lead_index: tuple[int, ...]) -> int:
    """The causal mask's, the window's and the chunks' offset for this slice:
    j ≤ i + offset. ``lower-right-per-item`` counts the item's own lengths, its
    ``--key-lengths`` less its ``--query-lengths`` (negative when it has more queries
    than keys, as FlashAttention's ``seqlen_k − seqlen_q``)."""
    o = spec.options
    if o.query_offset is not None:
        return _item(o.query_offset, lead_index)
    if o.causal_align == "lower-right-per-item":
        keys = valid_keys(spec, lead_index)
        return (spec.S if keys is None else keys) - valid_queries(spec, lead_index)
    return masks.align_offset(o.causal_align, spec.L, spec.S)


def item_offsets(spec: AttentionSpec, align: str | None = None) -> tuple[int, ...]:
    """Each batch item's diagonal offset (one, without a batch axis; each packed
    document's, with ``--cu-seqlens``); under the alignment ``align`` in place of the
    spec's and its query offsets, when given."""
    if align is not None:
        placed = dataclasses.replace(spec.options, causal_align=align, query_offset=None)
        spec = dataclasses.replace(spec, options=placed)
    if (docs := documents(spec)) is not None:
        return docs.offsets
    items = spec.lead[-2] if len(spec.lead) >= 2 else 1
    return tuple(diagonal_offset(spec, (b, 0)) for b in range(items))


def alibi_offset(spec: AttentionSpec, lead_index: tuple[int, ...]) -> int:
    """ALiBi's distance |i + offset − j|: S − L, or the item's own (``--query-offset``,
    ``lower-right-per-item``)."""
    o = spec.options
    if o.query_offset is None and o.causal_align != "lower-right-per-item":
        return spec.S - spec.L
    return diagonal_offset(spec, lead_index)


def valid_queries(spec: AttentionSpec, lead_index: tuple[int, ...]) -> int:
    """How many of this slice's query rows are present (``--query-lengths``; all: L)."""
    o = spec.options
    return spec.L if o.query_lengths is None else _item(o.query_lengths, lead_index)


def valid_keys(spec: AttentionSpec, lead_index: tuple[int, ...]) -> int | None:
    """How many of this slice's keys are valid (``--key-lengths``; None: all, and for
    packed documents, whose key lengths are each document's, :func:`documents`)."""
    o = spec.options
    if o.key_lengths is None or o.cu_seqlens is not None:
        return None
    return _item(o.key_lengths, lead_index)


def documents(spec: AttentionSpec) -> masks.Documents | None:
    """Packed documents (``--cu-seqlens``, ``--cu-seqlens-k``, the keys' the queries'
    by default), each with its used keys (``--key-lengths`` per document: FlashAttention's
    ``seqused_k``; all by default) and the position of its first query: its
    ``--query-offset``, or the alignment's for its own lengths (lower-right: its used
    keys less its queries, as FlashAttention's varlen kernels), or None."""
    return _documents(spec.options)


@functools.lru_cache(maxsize=16)
def _documents(o: Options) -> masks.Documents | None:
    """:func:`documents`, made once per options: every block asks for them."""
    if o.cu_seqlens is None:
        return None
    cu_q = o.cu_seqlens
    cu_k = cu_q if o.cu_seqlens_k is None else o.cu_seqlens_k
    queries = [b - a for a, b in itertools.pairwise(cu_q)]
    used = tuple(b - a for a, b in itertools.pairwise(cu_k))
    if o.key_lengths is not None:
        used = per_item(o.key_lengths, len(used))
    if o.query_offset is not None:
        offsets = per_item(o.query_offset, len(used))
    elif o.causal_align == "upper-left":
        offsets = (0,) * len(used)
    else:
        offsets = tuple(u - n for u, n in zip(used, queries, strict=True))
    return masks.Documents(cu_q, cu_k, used, offsets)


def same_segment(
    spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice, keys: slice
) -> NDArray[np.bool_] | None:
    """The keys of each row's own segment (``--segment-ids``), ``(rows, keys)``, or
    None without segment ids: ``q_ids[i] == kv_ids[j]`` as JAX's segment mask."""
    if spec.segment_ids is None:
        return None
    ids_q, ids_kv = spec.segment_ids
    b = lead_index[-2] if ids_q.shape[0] > 1 else 0
    same: NDArray[np.bool_] = ids_q[b, rows][:, None] == ids_kv[b, keys][None, :]
    return same


def absent_rows(spec: AttentionSpec) -> NDArray[np.bool_]:
    """Rows past ``--query-lengths``, shape (..., L) as the per-row statistics."""
    shape = (*spec.lead, spec.L)
    o = spec.options
    if o.query_lengths is None:
        return np.zeros(shape, dtype=np.bool_)
    n = np.asarray(o.query_lengths, dtype=np.int64)
    # One per batch item: along the batch axis, (B, H, L)'s first; one: every item.
    n = n.reshape(-1, 1, 1) if len(o.query_lengths) > 1 else n.reshape(())
    return np.broadcast_to(np.arange(spec.L) >= n, shape)


def full_keys(spec: AttentionSpec) -> slice:
    return slice(0, spec.S)


def key_range(spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice) -> slice:
    """The keys a block must compute: all of them, less those a causal mask, a window
    or key padding hides from every row of the block, when hidden keys weigh nothing
    (the mask value is −inf; a finite one still spreads a fully masked row over them).
    A block whose rows are all absent (``--query-lengths``) computes no key."""
    if not math.isinf(spec.options.effective_mask_value):
        return full_keys(spec)
    present = min(rows.stop, valid_queries(spec, lead_index))
    if present <= rows.start:
        return slice(0, 0)
    return _seen_by_any(spec, lead_index, rows.start, present)


def common_keys(spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice) -> slice:
    """The keys every row of the block sees: no mask hides them from any row (empty
    under a boolean mask, --mask-mod or --segment-ids, which may hide any key, and for
    a block with an absent row).
    A row's keys under a causal mask, a window and padding are a range whose ends
    never go back as the row goes down, so the keys of all rows are those the last
    row starts at and the first row ends at."""
    if spec.mask_is_bool or spec.options.mask_mod is not None or rows.stop <= rows.start:
        return slice(0, 0)
    if spec.segment_ids is not None:  # segment ids may hide any key, as a boolean mask
        return slice(0, 0)
    if rows.stop > valid_queries(spec, lead_index):
        return slice(0, 0)
    docs = documents(spec)
    if docs is not None:  # rows of two documents share no key
        ends = masks.document_of(docs.cu_q, np.array([rows.start, rows.stop - 1]))
        if ends[0] != ends[1]:
            return slice(0, 0)
    first = _seen_by_any(spec, lead_index, rows.start, rows.start + 1)
    last = _seen_by_any(spec, lead_index, rows.stop - 1, rows.stop)
    return slice(last.start, max(last.start, first.stop))


def _seen_by_any(spec: AttentionSpec, lead_index: tuple[int, ...], i0: int, i1: int) -> slice:
    """The keys a causal mask, a window, chunks, padding and packed documents leave
    to any of rows i0..i1."""
    o = spec.options
    docs = documents(spec)
    if docs is not None:
        return masks.packed_key_range(
            i0, i1, docs, causal=o.causal, window=o.window, chunk=o.attention_chunk
        )
    return masks.key_range(
        i0,
        i1,
        spec.L,
        spec.S,
        causal=o.causal,
        window=o.window,
        n_valid=valid_keys(spec, lead_index),
        offset=diagonal_offset(spec, lead_index),
        chunk=o.attention_chunk,
    )


def dropout_keep(
    spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice, keys: slice
) -> NDArray[np.bool_]:
    """The dropout keep-mask of a block, drawn by element position, or the block of
    ``--dropout-mask`` when one is given.

    Philox is counter-based: the counter of row r of slice n starts at
    (n·L + r) · ⌈S/4⌉, so a row's draws do not depend on how rows are blocked.
    """
    o = spec.options
    if spec.dropout_mask is not None:  # replayed from a file (--dropout-mask)
        part = spec.dropout_mask[spec.operand_index("dropout_mask", lead_index)]
        part = part if part.shape[0] == 1 else part[rows]
        part = part if part.shape[1] == 1 else part[:, keys]
        return np.broadcast_to(part, (rows.stop - rows.start, keys.stop - keys.start))
    words = -(-spec.S // 4)  # Philox4x64 gives 4 words per counter step
    flat = int(np.ravel_multi_index(lead_index, spec.lead)) if spec.lead else 0
    first_row = flat * spec.L + rows.start
    gen = np.random.Philox(key=o.seed, counter=first_row * words)
    n_rows = rows.stop - rows.start
    draws = gen.random_raw(n_rows * words * 4).reshape(n_rows, words * 4)[:, keys]
    uniform = (draws >> np.uint64(11)).astype(np.float64) * 2.0**-53  # 53-bit uniform in [0, 1)
    return uniform >= o.dropout  # type: ignore[no-any-return]
