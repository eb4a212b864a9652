"""Checks of the options and extra tensors that :func:`~sdpa_cli.engine.spec.build_spec`
makes once the leading axes are known: per-item lists, the query offset, the sinks,
the segment ids, the dropout keep mask."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.options import Options, per_item
from sdpa_cli.errors import SpecError
from sdpa_cli.text import shown


def check_per_item(
    flag: str,
    values: tuple[int, ...],
    lead: tuple[int, ...],
    scores_shape: tuple[int, ...],
    most: tuple[str, int] | None,
) -> None:
    """One value, or one per batch item; none above ``most`` (what, how many)."""
    B = lead[-2] if len(lead) >= 2 else None
    n_given = len(values)
    if n_given != 1 and n_given != B:
        axis = (
            f"the batch axis has {B} items"
            if B is not None
            else (f"the inputs have no batch axis (scores {scores_shape} read as (H, L, S))")
        )
        what = "offset" if flag == "--query-offset" else "length"
        raise SpecError(
            flag, f"{n_given} {what}s given but {axis}; give one {what} or one per item"
        )
    too_long = [n for n in values if most is not None and n > most[1]]
    if most is not None and too_long:
        name = f"{most[0]}, {'S' if most[0] == 'keys' else 'L'} = {most[1]}"
        raise SpecError(flag, f"{shown(too_long[0])} exceeds the number of {name}")


def check_query_offset(opts: Options) -> None:
    """An offset places queries for causal, window, chunks, ALiBi: alone or with an
    alignment, a slip."""
    if opts.query_offset is not None and not (opts.placed or opts.alibi):
        raise SpecError(
            "--query-offset",
            "places the queries for --causal, --window, --attention-chunk or --alibi; none given",
        )
    if opts.query_offset is not None and opts.causal_align != "upper-left":
        offset = "S − L for every item" if opts.causal_align == "lower-right" else "S_b − L_b"
        raise SpecError(
            "--query-offset",
            f"replaces --causal-align {opts.causal_align} (the offset {offset}); give one",
        )


def check_sinks(sinks: NDArray[Any], H: int, label: str) -> None:
    """gpt-oss sinks: one logit per query head, ``(H,)``, or one for all, ``(1,)``."""
    if sinks.ndim != 1 or sinks.shape[0] not in (1, H):
        raise SpecError(label, f"shape {tuple(sinks.shape)}, expected (H,) = ({H},) or (1,)")


def check_documents(opts: Options, lead: tuple[int, ...], L: int, S: int) -> None:
    """Packed documents (``--cu-seqlens``, ``--cu-seqlens-k``): one sequence of packed
    tokens (no batch, or a batch of 1), the last value L (S), as many documents along
    both axes, and no per-item option beside them."""
    cu_q, cu_k = opts.cu_seqlens, opts.cu_seqlens_k
    if cu_q is None:
        if cu_k is not None:
            raise SpecError("--cu-seqlens-k", "needs --cu-seqlens (the queries' documents)")
        return
    for flag, cu in (("--cu-seqlens", cu_q), ("--cu-seqlens-k", cu_k)):
        if cu is not None:
            _check_cumulative(flag, cu)
    if math.prod(lead[:-1]) > 1:
        raise SpecError(
            "--cu-seqlens",
            f"packs documents along one sequence, but the leading axes are {lead} (..., B, H); "
            "give a batch of 1",
        )
    if cu_q[-1] != L:
        raise SpecError("--cu-seqlens", f"ends at {cu_q[-1]}, but the queries number L = {L}")
    if cu_k is None and L != S:
        raise SpecError(
            "--cu-seqlens",
            f"serves the keys too without --cu-seqlens-k, but L = {L} and S = {S} differ",
        )
    if cu_k is not None and cu_k[-1] != S:
        raise SpecError("--cu-seqlens-k", f"ends at {cu_k[-1]}, but the keys number S = {S}")
    if cu_k is not None and len(cu_k) != len(cu_q):
        raise SpecError(
            "--cu-seqlens-k",
            f"{len(cu_k) - 1} documents, but --cu-seqlens has {len(cu_q) - 1}",
        )
    if opts.query_lengths is not None:
        raise SpecError(
            "--query-lengths", "is per batch item; packed documents (--cu-seqlens) have none"
        )
    sizes = [b - a for a, b in itertools.pairwise(cu_k if cu_k is not None else cu_q)]
    for flag, values in (
        ("--key-lengths", opts.key_lengths),
        ("--query-offset", opts.query_offset),
    ):
        if values is None:
            continue
        if len(values) not in (1, len(sizes)):
            raise SpecError(
                flag,
                f"{len(values)} values given but --cu-seqlens packs {len(sizes)} documents; "
                "give one or one per document",
            )
        if flag == "--key-lengths":
            for d, (n, size) in enumerate(zip(per_item(values, len(sizes)), sizes, strict=True)):
                if n > size:
                    raise SpecError(flag, f"{n} exceeds document {d}'s {size} keys")
    per_document = opts.key_lengths is not None or opts.query_offset is not None
    if opts.alibi and ((cu_k is not None and cu_k != cu_q) or per_document):
        raise SpecError(
            "--alibi",
            "with --cu-seqlens-k other than --cu-seqlens, or per-document --key-lengths "
            "or --query-offset, is not supported",
        )


def _check_cumulative(flag: str, cu: tuple[int, ...]) -> None:
    """Cumulative lengths: from 0, never decreasing (an empty document is allowed)."""
    if cu[0] != 0:
        raise SpecError(flag, f"must start at 0, got {shown(cu[0])}")
    if len(cu) < 2:
        raise SpecError(flag, "expected at least two values, 0 and the total length")
    for a, b in itertools.pairwise(cu):
        if b < a:
            raise SpecError(flag, f"must not decrease, got {shown(b)} after {shown(a)}")


def check_score_mod(opts: Options, has_bias: bool) -> None:
    """``--score-mod`` replaces every modification of the scaled scores, as
    flex_attention's score_mod does: a softcap, a bias or ALiBi go into the expression."""
    if opts.score_mod is None:
        return
    for flag, given in (("--softcap", opts.softcap is not None), ("--alibi", opts.alibi)):
        if given:
            raise SpecError(flag, "with --score-mod: write it into the expression instead")
    if has_bias:
        raise SpecError("--bias", "with --score-mod: write it into the expression instead")


def check_segment_ids(
    ids_q: NDArray[Any] | None,
    ids_kv: NDArray[Any] | None,
    lead: tuple[int, ...],
    L: int,
    S: int,
    names: Mapping[str, str],
) -> tuple[NDArray[np.int64], NDArray[np.int64]] | None:
    """Segment (document) ids, as JAX's and the TPU kernels take them: one integer per
    query ``(L,)`` or ``(B, L)`` and per key ``(S,)`` or ``(B, S)`` (the queries' ids
    serve the keys when L = S). Returned as ``(1 or B, L)`` and ``(1 or B, S)``."""
    labels = [names.get(n, f"--{n.replace('_', '-')}") for n in ("segment_ids", "segment_ids_kv")]
    if ids_q is None:
        if ids_kv is not None:
            raise SpecError(labels[1], "needs --segment-ids (the queries' segments)")
        return None
    B = lead[-2] if len(lead) >= 2 else None
    out: list[NDArray[np.int64]] = []
    for label, ids, n, axis in (
        (labels[0], ids_q, L, "L"),
        (labels[1], ids_q if ids_kv is None else ids_kv, S, "S"),
    ):
        if ids.dtype.kind not in "iu":
            raise SpecError(label, f"holds {ids.dtype} values; segment ids are integers")
        want = f"({axis},) = ({n},)" + (f" or (B, {axis}) = ({B}, {n})" if B else "")
        if ids.ndim not in (1, 2) or ids.shape[-1] != n or (ids.ndim == 2 and ids.shape[0] != B):
            if ids_kv is None and L != S:
                raise SpecError(
                    label, f"serves the keys too without --segment-ids-kv, but L = {L}, S = {S}"
                )
            raise SpecError(label, f"shape {tuple(ids.shape)}, expected {want}")
        out.append(np.asarray(ids, dtype=np.int64).reshape(-1, n))
    return out[0], out[1]


def check_dropout_mask(
    keep: NDArray[Any] | None, opts: Options, label: str
) -> NDArray[np.bool_] | None:
    """A replayed dropout keep mask (``--dropout-mask``): only beside ``--dropout``,
    booleans or 0/1 (True, 1: kept). Returned boolean."""
    if keep is None:
        return None
    if opts.dropout == 0:
        raise SpecError(label, "replays dropout's keep mask; give --dropout P beside it")
    if keep.dtype == np.bool_:
        return keep
    if keep.dtype.kind not in "iuf" or not np.isin(keep, (0, 1)).all():
        raise SpecError(label, "holds values other than 0 and 1; a keep mask is boolean or 0/1")
    kept: NDArray[np.bool_] = keep != 0
    return kept
