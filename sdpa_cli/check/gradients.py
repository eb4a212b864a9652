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

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import DTYPE_TOLERANCES, Judgement, Tolerance, factor_for
from sdpa_cli.check.elements import close_check, finite_check
from sdpa_cli.check.error_stats import by_slice, pairs
from sdpa_cli.check.exports import (
    as_naive,
    as_seen_by_kernel,
    engine_layout,
    layout_hint,
    loaded_index,
    strip_ones,
)
from sdpa_cli.check.grad_hints import with_gradient_hints
from sdpa_cli.check.records import Check, Expected
from sdpa_cli.check.relative import RelativeRule, needs_plain
from sdpa_cli.check.residual import Residual
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine import precision
from sdpa_cli.engine.block import visibility
from sdpa_cli.engine.grad import OPERAND, backward, make_dout
from sdpa_cli.engine.grad_plain import plain_slices
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError
from sdpa_cli.files.limits import release_freed_blocks
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
(:class:`~sdpa_cli.engine.grad_plain.PlainSlice`), where the output's is 2 ulp of
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

    Two backward passes, each handing its slices over as it finishes them, so that
    nothing gradient-sized is kept in float64: the reference's, each slice kept as its
    difference from the export (:class:`~sdpa_cli.check.residual.Residual`), then the
    plain computation's, for the slices that cannot pass without it, each slice
    judged as it comes (:class:`~sdpa_cli.check.relative.RelativeRule`). Compared in
    the engine's layout, (batch, head) slices whatever the file's; indices reported
    in the file's.

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
    loaded = {e.name: _fitted(spec, e) for e in expected}
    got = {n: engine_layout(spec, OPERAND[n], x) for n, x in loaded.items()}
    reference = _reference(wide, d, got, jobs)
    release_freed_blocks()  # the pass's blocks, before the slices are judged
    narrow = export != "float64" and settings.rtol is None and settings.tolerance == "kernel"
    checks: dict[str, Check] = {}
    if narrow:
        labels = {e.name: e.label for e in expected}
        checks = _relative_checks(seen, export, d, got, reference, settings, labels)
    out: list[Check] = []
    for e in expected:
        out.append(finite_check(e.name, loaded[e.name], e.label))
        close = checks.get(e.name) or close_check(
            e.name,
            got[e.name],
            reference[e.name],
            _fixed(settings, export),
            e.label,
            settings.equal_nan,
        )
        out.append(_in_file_layout(spec, OPERAND[e.name], close))
        if e.name == "dv":
            out += _dv_sums(seen, loaded[e.name], d, e.label, export)
    return with_gradient_hints(out, wide, d, got, reference, export)


def _reference(
    wide: AttentionSpec, dout: NDArray[Any], got: Mapping[str, NDArray[Any]], jobs: int
) -> dict[str, Residual]:
    """The float64 backward pass of ``wide``, each gradient in ``got`` held as its
    difference from the export (engine layout), slice by slice as the pass finishes."""
    held = {n: Residual(x, _slices(n)) for n, x in got.items()}

    def keep(name: str, at: Index, values: F64) -> None:
        if name in held:
            lead = got[name].shape[:-2]
            held[name].put(int(np.ravel_multi_index(at, lead)) if lead else 0, 1, values)

    grads = backward(wide, dout, jobs=jobs, keep=(), on_slice=keep)
    for name, whole in (("dbias", grads.dbias), ("dsinks", grads.dsinks)):
        if name in held and whole is not None:
            held[name].put(0, held[name].n, whole)
    return held


def _slices(name: str) -> int:
    """The trailing axes of one slice of a gradient: d(sinks) has one number a head."""
    return 1 if name == "dsinks" else 2


def _relative_checks(
    seen: AttentionSpec,
    export: str,
    dout: NDArray[Any],
    got: Mapping[str, NDArray[Any]],
    reference: Mapping[str, Residual],
    settings: CheckSettings,
    labels: Mapping[str, str],
) -> dict[str, Check]:
    """Each gradient of ``got`` (engine layout) against ``reference`` by the
    kernel-relative rule, fed the plain backward computation a slice at a time where
    a slice cannot pass without it."""
    factor = settings.fudge if settings.fudge is not None else GRADIENT_FACTORS.get(export)
    judgement = Judgement(
        export,
        factor=factor or factor_for(export, None),
        floor_ulps=GRADIENT_FLOOR_ULPS,
        floor_of="the sum of its terms' magnitudes",
    )
    rules: dict[str, RelativeRule] = {}
    for name, values in got.items():
        slices = _slices(name)  # d(sinks), one number a head, has no rows
        rules[name] = RelativeRule(name, values.shape, judgement, rows=slices > 1, slices=slices)
    views = {
        n: (by_slice(got[n], r.slices), by_slice(reference[n], r.slices)) for n, r in rules.items()
    }
    needed = {
        n: _slices_needing_plain(got[n], reference[n], judgement, rule) for n, rule in rules.items()
    }
    added: dict[str, set[int]] = {n: set() for n in rules}
    leads = _leads_needing_plain(seen, needed)
    if leads:
        for part in plain_slices(as_naive(seen, export), dout, leads=leads):
            if part.name not in rules:
                continue
            rule = rules[part.name]
            if part.at:  # one slice
                k = int(np.ravel_multi_index(part.at, rule.lead))
                at = slice(k, k + 1)
            else:  # d(bias) or d(sinks), whole
                at = slice(0, math.prod(rule.lead))
            a = np.asarray(views[part.name][0][at], np.float64)
            r = views[part.name][1][at]
            plain = np.asarray(by_slice(part.values, rule.slices), np.float64)
            terms = np.asarray(by_slice(part.terms, rule.slices), np.float64)
            rule.add(at, a, r, np.isfinite(a) & np.isfinite(r), plain, terms)
            added[part.name].update(range(at.start, at.stop))
    for name, rule in rules.items():  # the slices that pass without it
        for k in range(math.prod(rule.lead)):
            if k not in added[name]:
                a = np.asarray(views[name][0][k : k + 1], np.float64)
                r = views[name][1][k : k + 1]
                rule.add(slice(k, k + 1), a, r, np.isfinite(a) & np.isfinite(r), None)
    out = {}
    for name, rule in rules.items():
        out[name] = rule.check(
            got[name],
            reference[name],
            labels[name],
            settings.equal_nan,
            lambda pair=views[name]: pairs(*pair),  # type: ignore[misc]
        )
    return out


def _slices_needing_plain(
    got: NDArray[Any], reference: Residual, judgement: Judgement, rule: RelativeRule
) -> set[Index]:
    """The slices of a gradient (indices of its leading axes) that cannot pass without
    the plain computation (:func:`~sdpa_cli.check.relative.needs_plain`, at the row's
    scale: the floor of the terms' magnitudes, which only widens an allowance, is left
    out)."""
    need = needs_plain(got, reference, judgement, rows=rule.rows, slices=rule.slices)
    per_slice = need.reshape(max(math.prod(rule.lead), 1), -1).any(axis=1)
    if not rule.lead:
        return {()} if per_slice.any() else set()
    return {
        tuple(int(i) for i in np.unravel_index(k, rule.lead)) for k in np.flatnonzero(per_slice)
    }


def _leads_needing_plain(spec: AttentionSpec, needed: Mapping[str, set[Index]]) -> list[Index]:
    """The query slices the plain backward pass must run over for the ``needed``
    slices of each gradient: every query slice that reads a K/V head whose dK or dV,
    or one of whose query heads' dQ, is needed (dK and dV sum over all of them);
    every one for d(bias) and d(sinks), which sum over the heads, or a Q shared by
    several."""
    leads = [tuple(int(i) for i in lead) for lead in np.ndindex(*spec.lead)]
    if not any(needed.values()):
        return []
    broadcast_q = math.prod(spec.q.shape[:-2]) < math.prod(spec.lead)
    if needed.get("dbias") or needed.get("dsinks") or broadcast_q:
        return leads

    def unit(lead: Index) -> Index:
        return (*spec.operand_index("k", lead), -1, *spec.operand_index("v", lead))

    units = {
        unit(lead)
        for lead in leads
        if spec.operand_index("q", lead) in needed.get("dq", set())
        or spec.operand_index("k", lead) in needed.get("dk", set())
        or spec.operand_index("v", lead) in needed.get("dv", set())
    }
    return [lead for lead in leads if unit(lead) in units]


def _in_file_layout(spec: AttentionSpec, operand: str, check: Check) -> Check:
    """A check made in the engine's layout with its indices in the file's."""

    def moved(at: Index | None) -> Index | None:
        return None if at is None else loaded_index(spec, operand, at)

    m = check.mismatch
    if m is not None:
        m = dataclasses.replace(
            m,
            worst_at=moved(m.worst_at),
            max_abs_at=moved(m.max_abs_at),
            max_rel_at=moved(m.max_rel_at),
        )
    index = check.index
    if index is not None and len(index) == len(getattr(spec, operand).shape):
        index = moved(index)
    return dataclasses.replace(check, index=index, mismatch=m)


def _weighing_rows(spec: AttentionSpec) -> NDArray[np.bool_]:
    """``(*lead, L)``: the rows whose weights sum to 1. Every row where hidden logits
    take a finite value (a row that sees no key then weighs them all alike, as Hugging
    Face's finfo.min mask gives its padding rows); under −inf, the rows with a key
    the mask does not replace (the others weigh nothing)."""
    rows = np.full((*spec.lead, spec.L), spec.S > 0)  # no key at all: nothing weighs
    if np.isfinite(spec.options.effective_mask_value) or not spec.S:
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
        raise SpecError(
            e.label,
            f"has shape {got}; {e.name} is shaped as its input, {want}"
            f"{layout_hint(spec, e.name, got)}",
        )
    return np.asarray(e.values).reshape(want)  # read as float64 a block at a time


def _fixed(settings: CheckSettings, export: str) -> Tolerance:
    """A given ``--rtol``/``--atol``, or the export format's defaults."""
    if settings.rtol is not None and settings.atol is not None:
        return Tolerance(settings.rtol, settings.atol, "given")
    rtol, atol = DTYPE_TOLERANCES[export]
    return Tolerance(rtol, atol, f"{export} defaults")


def _dv_sums(
    spec: AttentionSpec, dv: NDArray[Any], dout: NDArray[Any], label: str, export: str
) -> list[Check]:
    """``dv.sums``: Σ over keys of dV equals Σ over rows of dO (over the rows whose
    weights sum to 1), per slice and feature; where nothing drops and nothing else
    takes weight (sinks). Within the format's rounding of the sums: 4 ε of the format
    times Σ |dO|. ``dv`` as loaded, ``dout`` in the engine's layout; read a slice at a
    time."""
    o = spec.options
    if o.dropout > 0 or spec.sinks is not None or o.query_lengths is not None:
        return []
    if o.heads is not None or o.layout != "bhsd":
        return []
    weighing = _weighing_rows(spec)
    d_rows, d_abs = np.zeros((*spec.lead, spec.Ev)), np.zeros((*spec.lead, spec.Ev))
    for lead in np.ndindex(*spec.lead):
        rows = np.asarray(dout[lead], np.float64)[weighing[lead]]
        d_rows[lead], d_abs[lead] = rows.sum(axis=0), np.abs(rows).sum(axis=0)
    # then over the query heads that share a K/V head
    group = spec.group
    if group > 1:
        shape = (*d_rows.shape[:-2], d_rows.shape[-2] // group, group, d_rows.shape[-1])
        d_rows, d_abs = d_rows.reshape(shape).sum(axis=-2), d_abs.reshape(shape).sum(axis=-2)
    v_keys = np.asarray(dv).reshape(spec.v.shape).sum(axis=-2, dtype=np.float64)
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
