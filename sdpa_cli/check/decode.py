"""``sdpa check --decode``: a causal prefill against the same tokens decoded step by step.

A prefill computes the L new queries at once; decoding computes them one at a time,
each against the cache as it grows. Step i takes query i alone, placed where a
decoder puts it, after the cache (position p = N + i, N = ``--query-offset`` of its
batch item, else S − L: the keys before the new tokens), over keys 0 .. p; causal,
the window and ALiBi then see it at p, as they see row i of a prefill aligned
bottom right. The outputs, stacked, must equal the prefill's: to rounding in
float64, within the format's default tolerance under ``--dtype`` (or ``--rtol`` and
``--atol``). A prefill whose diagonal sits elsewhere (``--causal-align upper-left``
with L ≠ S) is not what its decode gives, and the check says so.

An ``--expect-output`` given beside ``--decode`` (a decode run's steps, stacked along
L) is judged against the prefill reference by the usual checks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import DTYPE_TOLERANCES, Tolerance
from sdpa_cli.check.elements import close_check
from sdpa_cli.check.records import Check
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine.options import per_item
from sdpa_cli.engine.positions import item_offsets
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import trace
from sdpa_cli.engine.types import F64
from sdpa_cli.errors import SpecError

ROUNDING = Tolerance(1e-12, 1e-12, "float64 rounding")
"""Prefill and decode in float64 compute each row from the same terms (hidden keys add
exact zeros), so they agree to a few units of float64's rounding."""

FLAG = "--decode"
LABEL = "decode steps vs prefill"


def decode_checks(spec: AttentionSpec, settings: CheckSettings) -> list[Check]:
    """``decode.output.close``: the prefill's output against the decoded steps'.

    Raises:
        SpecError: a case that is not a causal prefill, or options a decode step
            cannot take (packed documents, segment ids, FlexAttention expressions,
            dropout).
    """
    _check_decodable(spec)
    prefill = _output(spec)
    steps = np.concatenate([_output(step_spec(spec, i)) for i in range(spec.L)], axis=-2)
    check = close_check(
        "decode.output", steps, prefill, _tolerance(spec, settings), LABEL, settings.equal_nan
    )
    o = spec.options
    upper_left = o.query_offset is None and o.causal_align == "upper-left"
    if check.status == "fail" and upper_left and spec.L != spec.S:
        hint = (
            "decoding places query i after the S − L cached keys (bottom right); this "
            "prefill's diagonal is upper-left: give --causal-align lower-right, or "
            "--query-offset with each item's cache length"
        )
        check = dataclasses.replace(check, hint=hint)
    return [check]


def _check_decodable(spec: AttentionSpec) -> None:
    o = spec.options
    if not o.causal:
        raise SpecError(FLAG, "compares a causal prefill with its decode steps; give --causal")
    refused = (
        ("--cu-seqlens", o.cu_seqlens is not None),
        ("--segment-ids", spec.segment_ids is not None),
        ("--mask-mod", o.mask_mod is not None),
        ("--score-mod", o.score_mod is not None),
        ("--dropout", o.dropout > 0),
    )
    for name, given in refused:
        if given:
            raise SpecError(FLAG, f"is not supported with {name}")


def _output(spec: AttentionSpec) -> F64:
    out = trace(spec, stages=("output",), gather_stats=False).output
    assert out is not None
    return out


def _per_item(spec: AttentionSpec, values: tuple[int, ...] | None, fill: int) -> tuple[int, ...]:
    """One value per batch item (every item the one value, or ``fill`` without any)."""
    items = spec.lead[-2] if len(spec.lead) >= 2 else 1
    return (fill,) * items if values is None else per_item(values, items)


def step_spec(spec: AttentionSpec, i: int) -> AttentionSpec:
    """Decode step ``i``: query i alone at position p_b = N_b + i of each batch item,
    over keys 0 .. max_b p_b (each item's beyond its p_b hidden by the causal mask)."""
    o = spec.options
    # decoding appends each token after the cache: the items' own lengths place it
    # (--query-offset, or lower-right, per item when the prefill's alignment is)
    per_item = o.query_offset is not None or o.causal_align == "lower-right-per-item"
    positions = [n + i for n in item_offsets(spec, None if per_item else "lower-right")]
    n = max(1, min(spec.S, max(positions) + 1))
    key_lengths = None
    if o.key_lengths is not None:
        key_lengths = tuple(min(k, n) for k in _per_item(spec, o.key_lengths, spec.S))
    query_lengths = None
    if o.query_lengths is not None:
        query_lengths = tuple(int(i < q) for q in _per_item(spec, o.query_lengths, spec.L))
    options = dataclasses.replace(
        o,
        causal_align="upper-left",
        query_offset=tuple(positions) if len(set(positions)) > 1 else (positions[0],),
        key_lengths=key_lengths,
        query_lengths=query_lengths,
    )
    return dataclasses.replace(
        spec,
        q=spec.q[..., i : i + 1, :],
        k=spec.k[..., :n, :],
        v=spec.v[..., :n, :],
        bias=_rows_keys(spec.bias, i, n),
        mask=_rows_keys(spec.mask, i, n),
        L=1,
        S=n,
        options=options,
    )


def _rows_keys(values: NDArray[Any] | None, i: int, n: int) -> NDArray[Any] | None:
    """Row ``i`` and keys ``:n`` of a bias or mask broadcastable to (..., L, S)."""
    if values is None:
        return None
    rows = slice(i, i + 1) if values.shape[-2] > 1 else slice(None)
    keys = slice(None, n) if values.shape[-1] > 1 else slice(None)
    return values[..., rows, keys]


def _tolerance(spec: AttentionSpec, settings: CheckSettings) -> Tolerance:
    if settings.rtol is not None and settings.atol is not None:
        return Tolerance(settings.rtol, settings.atol, "given")
    if not spec.options.emulated:
        return ROUNDING
    rtol, atol = DTYPE_TOLERANCES[spec.options.dtype]
    return Tolerance(rtol, atol, f"{spec.options.dtype} defaults")
