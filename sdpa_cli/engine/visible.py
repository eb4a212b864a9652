"""Which keys each query row of a block may attend to: every mask combined.

:func:`visibility` is the keys whose logits the mask value replaces (the causal mask,
a window, chunks, key padding, absent rows, a boolean mask, a mask-mod, documents, segments);
:func:`sentinel_keys` the keys a float mask's sentinels hide, which are added;
:func:`visible_keys` what the findings and tables count. Masks made of positions are
made in the namespace asked for (numpy, or on a torch device: :mod:`~sdpa_cli.engine.arrays`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import expressions, masks, positions
from sdpa_cli.engine.positions import full_keys
from sdpa_cli.engine.spec import AttentionSpec


def block_part(a: NDArray[Any], rows: slice, keys: slice) -> NDArray[Any]:
    """The block's rows and keys of a (L or 1, S or 1) mask/bias slice."""
    a = a if a.shape[0] == 1 else a[rows]
    return a if a.shape[1] == 1 else a[:, keys]


def visibility(
    spec: AttentionSpec,
    lead_index: tuple[int, ...],
    rows: slice,
    keys: slice | None = None,
    xp: Any = np,
) -> NDArray[np.bool_] | None:
    """Which keys each query row of the block may attend to: every mask combined, or
    None when no mask applies (every key is visible). These are the keys whose
    logits the mask value replaces; a float mask's sentinels, which are added, are
    :func:`sentinel_keys`. In ``xp``'s arrays: masks of positions made on a torch
    device, the others (files, mask-mods, documents, segments) moved there."""
    o = spec.options
    keys = keys if keys is not None else full_keys(spec)
    i0, i1 = rows.start, rows.stop
    n_rows, S, L = i1 - i0, spec.S, spec.L
    visible: NDArray[np.bool_] | None = None

    def both(m: NDArray[np.bool_]) -> NDArray[np.bool_]:
        return m if visible is None else visible & m

    def moved(m: NDArray[np.bool_]) -> NDArray[np.bool_]:
        return m if xp is np else xp.asarray(np.ascontiguousarray(m))

    offset = positions.diagonal_offset(spec, lead_index)
    docs = positions.documents(spec)
    if docs is not None:  # the causal mask, window and chunks within each document
        visible = moved(
            masks.packed(
                i0, i1, keys, docs, causal=o.causal, window=o.window, chunk=o.attention_chunk
            )
        )
    elif o.causal:
        visible = both(masks.causal(i0, i1, L, S, keys=keys, offset=offset, xp=xp))
    if docs is None and o.window is not None:
        visible = both(masks.window(i0, i1, L, S, *o.window, keys=keys, offset=offset, xp=xp))
    if docs is None and o.attention_chunk is not None:
        chunks = masks.chunk(i0, i1, o.attention_chunk, keys, offset=offset, xp=xp)
        visible = both(chunks)
    n_valid = positions.valid_keys(spec, lead_index)
    if n_valid is not None:
        visible = both(masks.key_padding(n_valid, n_rows, S, keys, xp))
    if o.query_lengths is not None:  # absent rows see no key
        present = xp.arange(i0, i1) < positions.valid_queries(spec, lead_index)
        visible = both(xp.broadcast_to(present[:, None], (n_rows, keys.stop - keys.start)))
    if spec.mask_is_bool:
        assert spec.mask is not None
        allowed = block_part(spec.mask[spec.operand_index("mask", lead_index)], rows, keys)
        visible = both(moved(~allowed if o.mask_true_means == "masked" else allowed))
    if o.mask_mod is not None:
        visible = both(moved(expressions.mask_mod(o.mask_mod, lead_index, rows, keys)))
    if (same := positions.same_segment(spec, lead_index, rows, keys)) is not None:
        visible = both(moved(same))
    if visible is not None:
        visible = xp.broadcast_to(visible, (n_rows, keys.stop - keys.start))
    return visible


def sentinel_keys(
    spec: AttentionSpec,
    lead_index: tuple[int, ...],
    rows: slice,
    keys: slice,
    visible: NDArray[np.bool_] | None,
) -> NDArray[np.bool_] | None:
    """The keys of the block that a float mask's sentinel (≤ −1e4) hides and
    ``visible`` (:func:`visibility`) leaves, or None when there are none."""
    if not (spec.sentinels and spec.sentinels.values):
        return None
    assert spec.mask is not None
    part = block_part(spec.mask[spec.operand_index("mask", lead_index)], rows, keys)
    shape = (rows.stop - rows.start, keys.stop - keys.start)
    hit = np.broadcast_to(masks.hides(part), shape)
    if visible is not None:
        hit = hit & visible
    return hit if hit.any() else None


def visible_keys(
    spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice, keys: slice | None = None
) -> NDArray[np.bool_] | None:
    """The keys each row of the block sees, as the findings and tables count them:
    :func:`visibility` less the keys a float mask's sentinel hides (None: all)."""
    keys = keys if keys is not None else full_keys(spec)
    visible = visibility(spec, lead_index, rows, keys)
    return seen_keys(visible, sentinel_keys(spec, lead_index, rows, keys, visible))


def seen_keys(
    visible: NDArray[np.bool_] | None, sentinel: NDArray[np.bool_] | None
) -> NDArray[np.bool_] | None:
    if sentinel is None:
        return visible
    return ~sentinel if visible is None else visible & ~sentinel
