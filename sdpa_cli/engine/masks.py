"""Small pure mask and bias builders, one block of query rows at a time.

Every builder takes the absolute query rows ``i0 .. i1`` of the block, so a block
anywhere in a long sequence gets exactly the values the whole matrix would hold.
Masks are boolean "may attend" arrays of shape (rows, S); True means visible.

Alignment of a causal mask or window when L ≠ S (the query rows are a suffix of the
keys for ``lower-right``) is an offset added to the query index::

    upper-left  (PyTorch ``is_causal``):            offset = 0
    lower-right (``causal_lower_right``):            offset = S − L
    lower-right-per-item (FlashAttention, ONNX's nonpad_kv_seqlen): offset = S_b − L_b
    --query-offset N (a KV-cache step, per batch item; may be negative):  offset = N

Chunked attention (``--attention-chunk C``) places chunks by the same positions: the
query at position p = i + offset sees the keys p − p mod C ≤ j < p − p mod C + C.

Each builder takes the offset itself (``offset``) in place of an alignment's name.

A float mask hides keys with a sentinel, added to the logits: −inf, or a large
negative number as models build their masks (Hugging Face's ``finfo(dtype).min``,
−1e4 or −1e9 in older code). :data:`HIDES` decides which values the findings read as
hiding; :func:`sentinels` lists those a mask holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision

HIDES = -1e4
"""A float mask's value at or below this (−inf included) hides its key for the
findings and the tables: the smallest sentinel in common use (BERT's −10000.0), and far
below any additive bias a model means (ALiBi, relative positions). Only what the
findings call hidden changes: the mask is still added as given, and a sentinel too weak
for the logits it faces is a finding of its own."""

_LISTED = 4
"""Distinct sentinels a mask's summary keeps (the rest are counted)."""

_CHUNK = 1 << 20
"""Mask values compared at a time when a mask is scanned for its sentinels."""


def hides(values: NDArray[Any]) -> NDArray[np.bool_]:
    """Where a float mask's values hide their key (≤ :data:`HIDES`; NaN does not)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(values, dtype=np.float64) <= HIDES


@dataclass(frozen=True)
class Sentinels:
    """The distinct values of a float mask that hide keys (≤ :data:`HIDES`).

    Attributes:
        values: the most negative first, at most a few.
        more: whether the mask holds other such values beyond those.
    """

    values: tuple[float, ...]
    more: bool = False

    @property
    def finite(self) -> tuple[float, ...]:
        return tuple(x for x in self.values if math.isfinite(x))

    def label(self) -> str:
        """``-3.40282e+38 (finfo(float32).min)``, ``-inf and -1e+09``, ..."""
        names = [sentinel_label(x) for x in self.values]
        text = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        return text + (" (and more)" if self.more else "")


def sentinels(mask: NDArray[Any]) -> Sentinels:
    """The sentinels a float mask holds, read :data:`_CHUNK` values at a time (a
    memory-mapped mask is not converted whole). A mask holds one or two in practice:
    a chunk whose hidden values are all equal costs two reductions, not a sort."""
    flat = np.ravel(mask, order="K")
    found: set[float] = set()
    more = False
    for start in range(0, flat.size, _CHUNK):
        part = np.asarray(flat[start : start + _CHUNK], dtype=np.float64)
        hidden = part[hides(part)]
        if not hidden.size:
            continue
        lo, hi = float(hidden.min()), float(hidden.max())
        found.update((lo,) if lo == hi else np.unique(hidden).tolist())
        if len(found) > _LISTED:  # keep the most negative few; say there are more
            found, more = set(sorted(found)[:_LISTED]), True
    return Sentinels(tuple(sorted(found)), more)


def sentinel_label(x: float) -> str:
    """A sentinel as a number, named when models build it so: ``-65504
    (finfo(float16).min)``, ``-2.382e+38 (-0.7·finfo(float32).max, JAX's)``."""
    if x == -math.inf:
        return "-inf"
    text = f"{x:.6g}"
    for name in precision.FORMATS:
        top = precision.fmt(name).max
        if x == -top:
            return f"{text} (finfo({name}).min)"
        if name in ("float32", "float16", "bfloat16") and math.isclose(x, -0.7 * top, rel_tol=1e-6):
            return f"{text} (-0.7·finfo({name}).max, JAX's)"
    return text


def align_offset(align: str, L: int, S: int) -> int:
    """The diagonal offset of an alignment: 0 for upper-left, S − L for lower-right."""
    return S - L if align == "lower-right" else 0


def _rel(
    i0: int, i1: int, S: int, offset: int, keys: slice | None = None, xp: Any = np
) -> NDArray[np.int64]:
    """j − i − offset for rows i0..i1 and keys ``keys`` (default 0..S), shape (rows, keys)."""
    j0, j1 = (0, S) if keys is None else (keys.start, keys.stop)
    i = xp.arange(i0, i1, dtype=np.int64)[:, None]
    j = xp.arange(j0, j1, dtype=np.int64)[None, :]
    d: NDArray[np.int64] = j - i - offset
    return d


def causal(
    i0: int,
    i1: int,
    L: int,
    S: int,
    align: str = "upper-left",
    keys: slice | None = None,
    *,
    offset: int | None = None,
    xp: Any = np,
) -> NDArray[np.bool_]:
    """Key j is visible to query i when j ≤ i + offset (the alignment's, or ``offset``);
    in ``xp``'s arrays (numpy, or a torch device's: made where they are used)."""
    j0, j1 = (0, S) if keys is None else (keys.start, keys.stop)
    offset = align_offset(align, L, S) if offset is None else offset
    last = xp.arange(i0, i1, dtype=np.int64) + offset
    visible: NDArray[np.bool_] = xp.arange(j0, j1, dtype=np.int64)[None, :] <= last[:, None]
    return visible


def window(
    i0: int,
    i1: int,
    L: int,
    S: int,
    left: int,
    right: int,
    align: str = "upper-left",
    keys: slice | None = None,
    *,
    offset: int | None = None,
    xp: Any = np,
) -> NDArray[np.bool_]:
    """Key j is visible to query i when −left ≤ j − i − offset ≤ right."""
    offset = align_offset(align, L, S) if offset is None else offset
    d = _rel(i0, i1, S, offset, keys, xp)
    return (d >= -left) & (d <= right)


def chunk(
    i0: int,
    i1: int,
    size: int,
    keys: slice,
    *,
    offset: int = 0,
    xp: Any = np,
) -> NDArray[np.bool_]:
    """Chunked attention: the query at position p = i + offset sees the keys of its
    own chunk of ``size`` positions, p − p mod C ≤ j < p − p mod C + C (the floor
    remainder, so a negative position's chunk is the one below it, as FlashAttention's
    reference subtracts the remainder)."""
    p = xp.arange(i0, i1, dtype=np.int64)[:, None] + offset
    j = xp.arange(keys.start, keys.stop, dtype=np.int64)[None, :]
    visible: NDArray[np.bool_] = in_chunk(p, j, size)
    return visible


def in_chunk(p: Any, j: Any, size: int) -> Any:
    """Whether key position ``j`` is in the chunk of query position ``p`` (arrays
    that broadcast, or integers)."""
    start = chunk_start(p, size)
    return (j >= start) & (j < start + size)


def chunk_start(position: Any, size: int) -> Any:
    """The first position of the chunk that ``position`` sits in (an integer or an array)."""
    return position - position % size


def key_padding(
    n_valid: int, rows: int, S: int, keys: slice | None = None, xp: Any = np
) -> NDArray[np.bool_]:
    """Only the first ``n_valid`` keys are visible (the rest are padding)."""
    j0, j1 = (0, S) if keys is None else (keys.start, keys.stop)
    visible: NDArray[np.bool_] = xp.broadcast_to(xp.arange(j0, j1) < n_valid, (rows, j1 - j0))
    return visible


def key_range(
    i0: int,
    i1: int,
    L: int,
    S: int,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    align: str = "upper-left",
    n_valid: int | None = None,
    offset: int | None = None,
    chunk: int | None = None,
) -> slice:
    """The keys that any of the query rows i0..i1 may see under a causal mask, a
    window, chunks and key padding: every key outside it is hidden from every one of
    them."""
    offset = align_offset(align, L, S) if offset is None else offset
    j0, j1 = 0, S
    if causal:
        j1 = min(j1, i1 - 1 + offset + 1)
    if window is not None:
        left, right = window
        j0 = max(j0, i0 + offset - left)
        j1 = min(j1, i1 - 1 + offset + right + 1)
    if chunk is not None:
        j0 = max(j0, chunk_start(i0 + offset, chunk))
        j1 = min(j1, chunk_start(i1 - 1 + offset, chunk) + chunk)
    if n_valid is not None:
        j1 = min(j1, n_valid)
    j0 = min(max(j0, 0), S)
    return slice(j0, max(j0, min(j1, S)))


def document_of(cu: tuple[int, ...], at: NDArray[np.int64]) -> NDArray[np.int64]:
    """The document each position of ``at`` sits in, under cumulative lengths ``cu``
    (an empty document holds no position)."""
    found = np.searchsorted(np.asarray(cu, dtype=np.int64), at, side="right") - 1
    return found.astype(np.int64)


@dataclass(frozen=True)
class Documents:
    """Packed documents (FlashAttention's varlen): document d holds the queries
    ``cu_q[d] .. cu_q[d+1]`` and the keys ``cu_k[d] .. cu_k[d+1]``, of which its first
    ``used[d]`` are attended (``seqused_k``; the rest hidden), and its query i sits at
    local position i − cu_q[d] + ``offsets[d]`` (its key j at j − cu_k[d])."""

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    used: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.cu_q) - 1

    def queries(self, d: int) -> int:
        return self.cu_q[d + 1] - self.cu_q[d]


def packed(
    i0: int,
    i1: int,
    keys: slice,
    docs: Documents,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    chunk: int | None = None,
) -> NDArray[np.bool_]:
    """Packed documents: query i of document d sees key j only when j is one of
    document d's used keys, and a causal mask, window or chunks apply within the
    document, query i at local position i − cu_q[d] + offset_d and key j at
    j − cu_k[d]. Shape (rows, keys)."""
    i = np.arange(i0, i1, dtype=np.int64)
    j = np.arange(keys.start, keys.stop, dtype=np.int64)
    cq, ck = np.asarray(docs.cu_q, dtype=np.int64), np.asarray(docs.cu_k, dtype=np.int64)
    used, offsets = np.asarray(docs.used, np.int64), np.asarray(docs.offsets, np.int64)
    dq, dk = document_of(docs.cu_q, i), document_of(docs.cu_k, j)
    local_j = j[None, :] - ck[dq][:, None]
    visible = (dq[:, None] == dk[None, :]) & (local_j < used[dq][:, None])
    p = (i - cq[dq] + offsets[dq])[:, None]
    d = local_j - p
    if causal:
        visible &= d <= 0
    if window is not None:
        visible &= (d >= -window[0]) & (d <= window[1])
    if chunk is not None:
        visible &= in_chunk(p, local_j, chunk)
    return np.asarray(visible, dtype=np.bool_)


def packed_key_range(
    i0: int,
    i1: int,
    docs: Documents,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    chunk: int | None = None,
) -> slice:
    """The keys any of the query rows i0..i1 may see among packed documents: the span
    of each of their documents' keys that a causal mask, window, chunks and its used
    length leave (the keys of other documents between them stay inside, hidden by
    :func:`packed`)."""
    if i1 <= i0:
        return slice(0, 0)
    cu_q, cu_k = docs.cu_q, docs.cu_k
    ends = document_of(cu_q, np.array([i0, i1 - 1], dtype=np.int64))
    lo, hi = cu_k[-1], 0
    for d in range(int(ends[0]), int(ends[1]) + 1):
        r0, r1 = max(i0, cu_q[d]), min(i1, cu_q[d + 1])
        L_d, S_d = cu_q[d + 1] - cu_q[d], cu_k[d + 1] - cu_k[d]
        local = key_range(
            r0 - cu_q[d],
            r1 - cu_q[d],
            L_d,
            S_d,
            causal=causal,
            window=window,
            n_valid=docs.used[d],
            offset=docs.offsets[d],
            chunk=chunk,
        )
        if r1 > r0 and local.stop > local.start:
            lo, hi = min(lo, cu_k[d] + local.start), max(hi, cu_k[d] + local.stop)
    return slice(lo, hi) if hi > lo else slice(0, 0)


def alibi_slopes(H: int) -> NDArray[np.float64]:
    """ALiBi head slopes, as in the paper (Press et al., 2022) and its reference code.

    For H a power of two: 2^(−8(h+1)/H), h = 0 .. H−1. Otherwise the slopes of the
    closest lower power of two n, followed by every other slope of 2n (the paper's rule).
    """

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    if H <= 0:
        return np.zeros(0)
    n = 2 ** math.floor(math.log2(H))
    slopes = power_of_two(n)
    if n != H:
        slopes += power_of_two(2 * n)[0::2][: H - n]
    return np.array(slopes, dtype=np.float64)


def alibi(
    i0: int,
    i1: int,
    L: int,
    S: int,
    slope: float,
    keys: slice | None = None,
    *,
    offset: int | None = None,
) -> NDArray[np.float64]:
    """FlashAttention's ALiBi bias: −slope · |i + offset − j|, shape (rows, keys).

    The distance is measured from the bottom-right-aligned diagonal (offset S − L),
    so the most recent key of every query has bias 0 whatever L and S are; under
    ``--query-offset`` from query i's own position, N + i.
    """
    offset = S - L if offset is None else offset
    return -slope * np.abs(_rel(i0, i1, S, offset, keys)).astype(np.float64)
