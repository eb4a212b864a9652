"""A backward kernel's exported gradients judged as the output is: ``--dout`` (the
upstream gradient dO the kernel was given) with ``--expect-dq``, ``--expect-dk``,
``--expect-dv``, ``--expect-dbias``, ``--expect-dsinks``.

Each gradient is compared with the float64 backward pass of ``Σ O ⊙ dO``
(:func:`~sdpa_cli.engine.grad.backward`, from the inputs as the kernel saw them) by the
kernel-relative rule (:mod:`~sdpa_cli.check.relative`) against the plain backward
computation in the export's format (:mod:`~sdpa_cli.engine.grad_plain`), as
FlashAttention's tests judge ``dq``, ``dk``, ``dv``; a float64 export, or a given
``--rtol``/``--atol``, by a fixed tolerance. A dV has a check that needs no reference
(without dropout): its column sums over the keys equal dO's over the rows whose
weights sum to 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import DTYPE_TOLERANCES, Tolerance
from sdpa_cli.check.elements import close_check, finite_check
from sdpa_cli.check.exports import as_naive, as_seen_by_kernel, strip_ones
from sdpa_cli.check.grad_hints import with_gradient_hints
from sdpa_cli.check.records import Check, Expected
from sdpa_cli.check.relative import Judgement, factor_for, relative_check
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine import precision
from sdpa_cli.engine.block import visibility
from sdpa_cli.engine.grad import OPERAND, backward, make_dout
from sdpa_cli.engine.grad_plain import plain_backward
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64
from sdpa_cli.errors import SpecError
from sdpa_cli.text import format_index, sig

GRADIENT_FACTORS = {"float16": 3.0, "bfloat16": 3.0, "float32": 8.0}
"""How much worse than the plain backward computation a gradient may be, by format
(others: the output's factor). PyTorch's fused and math 16-bit backward needed up to
1.8× the plain computation's largest error per slice (1,920 checks: float16 and
bfloat16, full, causal and grouped-query, 5 to 48 rows), where the output's kernels
need at most 1: 3 keeps the output's margin over what was measured. In float32 a
kernel's gradients and the plain computation's are the same kind of rounding, and
dS = P ⊙ (dA − Σ P dA) cancels: up to 3.4× (840 checks; 7.6× before the floor of the
terms' magnitudes), and 8 is over twice that."""


GRADIENT_FLOOR_ULPS = 4.0
"""The floor of a gradient's allowance, in ulp of the sum of its terms' magnitudes
(:class:`~sdpa_cli.engine.grad_plain.PlainGradients`), where the output's is 2 ulp of
its row's scale: a kernel stores P, dS and dO in 16 bits as the plain computation
does, but rounds them otherwise, and in a slice of a few rows the plain computation's
largest error is a poor guess of that. At 2 ulp, PyTorch's fused bfloat16 backward
failed 1 of 480 small grouped-query slices (16 rows, 2.3× its allowance); at 4, none
of 960 across float16 and bfloat16."""


def gradient_checks(
    spec: AttentionSpec,
    expected: Sequence[Expected],
    dout: NDArray[Any] | None,
    settings: CheckSettings,
    export: str,
    *,
    dout_label: str = "--dout",
    jobs: int = 1,
) -> list[Check]:
    """The checks of exported gradients (``expected``: of
    :data:`~sdpa_cli.names.GRADIENTS`) of ``Σ O ⊙ dout``; ``export`` the format
    the kernel computed in.

    Raises:
        SpecError: a gradient without ``dout``, or one whose shape is not its
            input's, naming the file.
    """
    if not expected:
        return []
    if dout is None:
        raise SpecError(
            expected[0].label,
            f"is a gradient ({expected[0].name}): give --dout FILE, the gradient of the output "
            "the backward kernel was given",
        )
    seen = as_seen_by_kernel(spec, export)
    d = make_dout(seen, dout, spec.options.seed, dout_label)
    wide = seen.in_float64()
    reference = backward(wide, d, jobs=jobs)
    narrow = export != "float64" and settings.rtol is None and settings.tolerance == "kernel"
    plain = plain_backward(as_naive(seen, export), d) if narrow else None
    factor = settings.fudge if settings.fudge is not None else GRADIENT_FACTORS.get(export)
    judgement = Judgement(
        export,
        factor=factor or factor_for(export, None),
        floor_ulps=GRADIENT_FLOOR_ULPS,
        floor_of="the sum of its terms' magnitudes",
    )
    checks: list[Check] = []
    exports: dict[str, F64] = {}
    refs: dict[str, F64] = {}
    for e in expected:
        got = exports[e.name] = _fitted(spec, e)
        ref = refs[e.name] = np.asarray(reference.loaded(e.name))
        checks.append(finite_check(e.name, got, e.label))
        if plain is not None:
            mine = spec.as_loaded(OPERAND[e.name], plain.values[e.name])
            terms = spec.as_loaded(OPERAND[e.name], plain.terms[e.name])
            per_head = e.name == "dsinks"  # one number per head: no rows
            checks.append(
                relative_check(
                    e.name,
                    got,
                    ref,
                    mine,
                    judgement,
                    e.label,
                    settings.equal_nan,
                    rows=not per_head,
                    slices=1 if per_head else 2,
                    terms=terms,
                )
            )
        else:
            tol = _fixed(settings, export)
            checks.append(close_check(e.name, got, ref, tol, e.label, settings.equal_nan))
        if e.name == "dv":
            d_seen = np.where(_weighing_rows(seen)[..., None], np.asarray(d, np.float64), 0.0)
            checks += _dv_sums(spec, got, d_seen, e.label, export)
    return with_gradient_hints(checks, wide, d, exports, refs, export)


def _weighing_rows(spec: AttentionSpec) -> NDArray[np.bool_]:
    """``(*lead, L)``: the rows whose weights sum to 1. Every row where hidden logits
    take a finite value (a row that sees no key then weighs them all alike, as Hugging
    Face's finfo.min mask gives its padding rows); under −inf, the rows with a key
    the mask does not replace (the others weigh nothing)."""
    rows = np.ones((*spec.lead, spec.L), dtype=np.bool_)
    if np.isfinite(spec.options.effective_mask_value):
        return rows
    for lead in np.ndindex(*spec.lead):
        for r0 in range(0, spec.L, ROW_BLOCK):
            block = slice(r0, min(r0 + ROW_BLOCK, spec.L))
            visible = visibility(spec, lead, block)
            if visible is not None:
                rows[(*lead, block)] = np.asarray(visible).any(axis=-1)
    return rows


ROW_BLOCK = 256
"""Query rows whose visibility is read at a time (by every key)."""


def _fitted(spec: AttentionSpec, e: Expected) -> F64:
    """A gradient export in its input's shape as loaded (leading 1s may differ), in
    its own dtype (the checks read it as float64 a block at a time)."""
    operand = OPERAND[e.name]
    if operand not in spec.shapes:
        raise SpecError(e.label, f"is the gradient of the {operand}, and the computation has none")
    want = tuple(spec.shapes[operand])
    got = tuple(e.values.shape)
    if got != want and strip_ones(got) != strip_ones(want):
        raise SpecError(e.label, f"has shape {got}; {e.name} is shaped as its input, {want}")
    return np.asarray(e.values).reshape(want)  # read as float64 a block at a time


def _fixed(settings: CheckSettings, export: str) -> Tolerance:
    """A given ``--rtol``/``--atol``, or the export format's defaults."""
    if settings.rtol is not None and settings.atol is not None:
        return Tolerance(settings.rtol, settings.atol, "given")
    rtol, atol = DTYPE_TOLERANCES[export]
    return Tolerance(rtol, atol, f"{export} defaults")


def _dv_sums(spec: AttentionSpec, dv: F64, dout: F64, label: str, export: str) -> list[Check]:
    """``dv.sums``: Σ over keys of dV equals Σ over rows of dO (``dout``: zero in the
    rows whose weights do not sum to 1), per slice and feature; where nothing drops
    and nothing else takes weight (sinks). Within the format's rounding of the sums:
    4 ε of the format times Σ |dO|."""
    o = spec.options
    if o.dropout > 0 or spec.sinks is not None or o.query_lengths is not None:
        return []
    if o.heads is not None or o.layout != "bhsd":
        return []
    dv4 = np.asarray(dv, np.float64).reshape(spec.v.shape)
    group = spec.group
    # dO summed over rows, then over the query heads that share a K/V head
    d_rows = dout.sum(axis=-2)  # (*lead, Ev)
    d_abs = np.abs(dout).sum(axis=-2)
    if group > 1:
        shape = (*d_rows.shape[:-2], d_rows.shape[-2] // group, group, d_rows.shape[-1])
        d_rows, d_abs = d_rows.reshape(shape).sum(axis=-2), d_abs.reshape(shape).sum(axis=-2)
    v_keys = dv4.sum(axis=-2)
    if v_keys.shape != d_rows.shape:  # a broadcast K/V: its sums gather several slices
        return []
    allowed = 4.0 * precision.fmt(export).eps * d_abs + 4.0 * precision.fmt(export).tiny
    off = np.abs(v_keys - d_rows)
    bad = off > allowed
    if not bad.any():
        return [Check("dv.sums", "pass", "Σ over keys of dV equals Σ over rows of dO", file=label)]
    at = tuple(
        int(i)
        for i in np.unravel_index(int(np.argmax(off / np.maximum(allowed, 1e-300))), off.shape)
    )
    return [
        Check(
            "dv.sums",
            "fail",
            f"Σ over keys of dV is not Σ over rows of dO in {int(bad.sum()):,} of {bad.size:,} "
            f"(slice, feature) pairs; at {format_index(at)}: {sig(float(v_keys[at]), 6)} against "
            f"{sig(float(d_rows[at]), 6)}, where each row's weights sum to 1: dV is not Pᵀ·dO "
            "for weights P (dv.close's hint names the slip where one matches)",
            index=at,
            file=label,
        )
    ]
