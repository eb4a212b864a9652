"""A paged KV cache gathered into contiguous K and V, once, at the entry.

vLLM, FlashInfer (its NHD layout) and FlashAttention's ``flash_attn_with_kvcache`` keep
K as pages ``(P, page_size, G, E)`` and V as ``(P, page_size, G, Ev)``, and give each
batch item a row of a block table ``(B, max_pages)`` of physical page indices. Key j
of item b is ``pages[table[b, j // page_size], j % page_size]``. Item b reads its first
``key_lengths[b]`` keys (FlashAttention's ``cache_seqlens``; without ``--key-lengths``,
its whole table): the table's entries past its last used page are padding, never read.

:func:`gather_pages` checks the table against the pages and the lengths before
anything is allocated, gathers every used page whole (the slots past an item's length
too, as a kernel reads them, hidden by ``--key-lengths``; zeros past its last page), and
returns K and V in Q's layout (``--layout``) with a :class:`Paging` record that names
the page of a key (:meth:`Paging.where`) and the pages the table shares amiss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.options import Options
from sdpa_cli.errors import SpecError
from sdpa_cli.files.opening import check_fits

KEPT_SHARED = 8
"""Pages shared amiss kept as examples (all are counted)."""


@dataclass(frozen=True)
class Shared:
    """A physical page that several items read, not as a shared prefix.

    Attributes:
        page: the physical page.
        uses: who reads it: (item, page of its table, slots it reads), by item.
    """

    page: int
    uses: tuple[tuple[int, int, int], ...]

    @property
    def problem(self) -> str:
        """``positions`` (read as different pages of the items' tables) or ``partial``
        (at one position, but with different numbers of slots: one item's tail is
        another's keys, and its next token overwrites them)."""
        return "positions" if len({u[1] for u in self.uses}) > 1 else "partial"


@dataclass(frozen=True)
class Paging:
    """Where the keys of a paged cache came from.

    Attributes:
        page_size: keys per page.
        num_pages: the physical pages of K and V.
        table: the block table ``(B, max_pages)`` as given (padding included).
        lengths: the keys each item reads (its row of the table's used part).
        label: where the table came from, for messages.
        shared: the first :data:`KEPT_SHARED` pages shared amiss (:class:`Shared`).
        shared_count: how many pages are shared amiss.
        prefix_pages: pages shared as a common prefix (one position in every item that
            reads it, the same slots): vLLM's prefix caching, legitimate.
    """

    page_size: int
    num_pages: int
    table: NDArray[np.int64]
    lengths: tuple[int, ...]
    label: str
    shared: tuple[Shared, ...] = ()
    shared_count: int = 0
    prefix_pages: int = 0

    def locate(self, item: int, key: int) -> tuple[int, int | None, int]:
        """Key ``key`` of item ``item`` → (page of its table, physical page, slot); the
        physical page is None past the item's last used page (padding, zeros)."""
        row = item if self.table.shape[0] > 1 else 0
        logical, slot = divmod(key, self.page_size)
        used = -(-self.lengths[row] // self.page_size)
        return logical, int(self.table[row, logical]) if logical < used else None, slot

    def where(self, item: int, key: int) -> str:
        """``item 1 key 517: page 3 of its table (physical page 42, slot 5)``."""
        logical, physical, slot = self.locate(item, key)
        if physical is None:
            return f"item {item} key {key}: page {logical} of its table, past its length"
        return (
            f"item {item} key {key}: page {logical} of its table "
            f"(physical page {physical}, slot {slot})"
        )


def gather_pages(
    k: NDArray[Any],
    v: NDArray[Any],
    table: NDArray[Any],
    options: Options,
    names: Mapping[str, str],
    q_shape: tuple[int, ...],
) -> tuple[NDArray[Any], NDArray[Any], Paging]:
    """K and V pages and a block table → contiguous K ``(B, S, G, E)`` and V
    ``(B, S, G, Ev)`` (``(B, G, S, ·)`` unless ``--layout bshd``) and their record.

    S is the longest item's length under ``--key-lengths``, else the whole table,
    ``max_pages · page_size``: what the table merely declares is never allocated.

    Raises:
        SpecError: naming the table (or K, V): a table not 2-D or not integer, pages of
            another shape than K's, a length past the table, a page index out of range
            or read twice by one item, or more memory than the machine has.
    """
    label = names.get("block_table", "--block-table")
    k_label, v_label = names.get("k", "K"), names.get("v", "V")
    if options.heads is not None:
        raise SpecError(label, "pages are (num_pages, page_size, G, E); give --layout, not --heads")
    if k.ndim != 4:
        raise SpecError(
            k_label,
            f"paged K should be (num_pages, page_size, G, E): but got K {tuple(k.shape)}",
        )
    if v.ndim != 4 or v.shape[:3] != k.shape[:3]:
        raise SpecError(
            v_label,
            f"paged V should be (num_pages, page_size, G, Ev) with K's (num_pages, page_size, "
            f"G) = {tuple(k.shape[:3])}: but got V {tuple(v.shape)}",
        )
    if table.ndim != 2:
        raise SpecError(
            label, f"the block table should be (B, max_pages), 2-D: but got {tuple(table.shape)}"
        )
    if table.dtype.kind not in "iu":
        raise SpecError(
            label, f"the block table holds {table.dtype}; expected integer page indices"
        )
    P, page_size, G = (int(n) for n in k.shape[:3])
    B, max_pages = (int(n) for n in table.shape)
    if page_size == 0:
        raise SpecError(k_label, f"pages of no key: K {tuple(k.shape)}")
    if len(q_shape) >= 4 and q_shape[-4] not in (1, B) and B != 1:
        raise SpecError(
            label, f"the block table has {B} items but Q has {q_shape[-4]} (Q {q_shape})"
        )
    lengths = _lengths(options, B, max_pages * page_size, page_size, label)
    items, logical, physical = _used(table, lengths, page_size)
    _check_entries(items, logical, physical, P, table, label, options.key_lengths is None)
    S = int(lengths.max(initial=0)) if options.key_lengths is not None else max_pages * page_size
    E, Ev = int(k.shape[-1]), int(v.shape[-1])
    need = B * S * G * (E * k.dtype.itemsize + Ev * v.dtype.itemsize)
    check_fits(need, label, "for K and V gathered from the pages")
    keys, values = (np.zeros((B, S, G, a.shape[-1]), dtype=a.dtype) for a in (k, v))
    for b in range(B):
        used = -(-int(lengths[b]) // page_size)
        pages = table[b, :used]
        n = min(used * page_size, S)
        keys[b, :n] = k[pages].reshape(used * page_size, G, E)[:n]
        values[b, :n] = v[pages].reshape(used * page_size, G, Ev)[:n]
    shared, count, prefix = _sharing(items, logical, physical, lengths, page_size)
    paging = Paging(
        page_size=page_size,
        num_pages=P,
        table=table.astype(np.int64),
        lengths=tuple(int(n) for n in lengths),
        label=label,
        shared=shared,
        shared_count=count,
        prefix_pages=prefix,
    )
    if options.layout != "bshd":  # Q is (B, H, L, E): K and V come as (B, G, S, ·)
        keys, values = np.swapaxes(keys, 1, 2), np.swapaxes(values, 1, 2)
    return keys, values, paging


def _lengths(options: Options, B: int, most: int, page_size: int, label: str) -> NDArray[np.int64]:
    """The keys each item reads: ``--key-lengths`` (one, or one per item), else all of
    its table; none past the table."""
    given = options.key_lengths
    if given is None:
        return np.full(B, most, dtype=np.int64)
    if len(given) not in (1, B):
        raise SpecError(
            "--key-lengths",
            f"{len(given)} lengths given but the block table ({label}) has {B} items; "
            "give one length or one per item",
        )
    lengths = np.broadcast_to(np.asarray(given, dtype=np.int64), (B,))
    for b, n in enumerate(lengths.tolist()):
        if n > most:
            raise SpecError(
                label,
                f"item {b} reads {n} keys (--key-lengths) but its table holds "
                f"{most // page_size} pages of {page_size} = {most} keys",
            )
    return lengths


def _used(
    table: NDArray[Any], lengths: NDArray[np.int64], page_size: int
) -> tuple[NDArray[np.intp], NDArray[np.intp], NDArray[Any]]:
    """The table's used entries, item by item: (item, page of its table, the entry)."""
    used = -(-lengths // page_size)
    items, logical = np.nonzero(np.arange(table.shape[1])[None, :] < used[:, None])
    return items, logical, table[items, logical]


def _check_entries(
    items: NDArray[np.intp],
    logical: NDArray[np.intp],
    physical: NDArray[Any],
    P: int,
    table: NDArray[Any],
    label: str,
    whole: bool = False,
) -> None:
    """Every used entry is a page of K, and no item reads a page twice (``whole``: no
    key lengths were given, so every entry is used)."""
    bad = np.flatnonzero((physical < 0) | (physical >= P))
    if bad.size:
        b, p = int(items[bad[0]]), int(logical[bad[0]])
        padding = table[b, p] < 0 and whole
        hint = "; padding past an item's pages? give --key-lengths (cache_seqlens)"
        raise SpecError(
            label,
            f"item {b}'s page {p} (entry [{b}, {p}]) is {table[b, p]}, not a page of K "
            f"(0 to {P - 1}){hint if padding else ''}",
        )
    order = np.lexsort((logical, physical, items))
    i, pp, lp = items[order], physical[order], logical[order]
    twice = np.flatnonzero((i[1:] == i[:-1]) & (pp[1:] == pp[:-1]))
    if twice.size:
        t = int(twice[0])
        raise SpecError(
            label,
            f"item {int(i[t])} reads physical page {int(pp[t])} twice, as pages "
            f"{int(lp[t])} and {int(lp[t + 1])} of its table",
        )


def _sharing(
    items: NDArray[np.intp],
    logical: NDArray[np.intp],
    physical: NDArray[Any],
    lengths: NDArray[np.int64],
    page_size: int,
) -> tuple[tuple[Shared, ...], int, int]:
    """The pages several items read: those shared amiss (the first kept, all counted),
    and how many are a common prefix (one position, the same slots)."""
    if not items.size:
        return (), 0, 0
    slots = np.minimum(page_size, lengths[items] - logical * page_size)
    order = np.lexsort((items, physical))
    i, lp, pp, sl = items[order], logical[order], physical[order], slots[order]
    starts = np.flatnonzero(np.r_[True, pp[1:] != pp[:-1]])
    many = np.diff(np.r_[starts, pp.size]) > 1
    same = (np.minimum.reduceat(lp, starts) == np.maximum.reduceat(lp, starts)) & (
        np.minimum.reduceat(sl, starts) == np.maximum.reduceat(sl, starts)
    )
    amiss = np.flatnonzero(many & ~same)
    ends = np.r_[starts[1:], pp.size]
    kept = tuple(
        Shared(
            int(pp[starts[g]]),
            tuple((int(i[n]), int(lp[n]), int(sl[n])) for n in range(starts[g], ends[g])),
        )
        for g in amiss[:KEPT_SHARED]
    )
    return kept, int(amiss.size), int(np.count_nonzero(many & same))
