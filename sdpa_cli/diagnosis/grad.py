"""Gradients → gradient-health findings (data, never exceptions), per-head norms and
the gradients' range in low-precision formats.

Findings follow the contract of :mod:`sdpa_cli.diagnosis.findings` (kind, severity, message,
hint, index, stage, dtype, count); their kinds are :data:`GRADIENT_KINDS` and their
stage is the gradient (``dq``, ``dk``, ``dv``, ``dbias``) or ``weights`` for a row.
Rows are indexed ``[*lead, i]`` as the forward findings are, query heads ``[*lead]``,
key/value heads by K's own leading axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnosis.causes import saturation_hint
from sdpa_cli.diagnosis.findings import Diagnosis, Finding, Tally, Thresholds
from sdpa_cli.diagnosis.grad_summary import (
    GradRange,
    GradSummary,
    add_summed,
    summarise,
)
from sdpa_cli.engine import precision
from sdpa_cli.engine.driver import Progress
from sdpa_cli.engine.grad import Gradients, backward
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.types import Index
from sdpa_cli.names import GRADIENT_KINDS
from sdpa_cli.text import finite_or_none, format_index, plural, sig

WEAK_HEAD = 1e-3
"""A query head whose ‖dQ‖ is below this fraction of the median head's learns little."""

FLUSH_WARNING = 1e-3
"""Fraction of a gradient's nonzero values flushing to zero above which it warns."""

LABEL = {"dq": "dQ", "dk": "dK", "dv": "dV", "dbias": "d(bias)", "dsinks": "d(sinks)"}


@dataclass(frozen=True)
class QueryHeadGrad:
    """One query head's (one lead position's) gradient."""

    index: Index
    dq_norm: float
    rows: int
    vanishing: int
    mean_gain: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": list(self.index),
            "dq_norm": finite_or_none(self.dq_norm),
            "rows": self.rows,
            "vanishing_rows": self.vanishing,
            "mean_gain": finite_or_none(self.mean_gain),
        }


@dataclass(frozen=True)
class KVHeadGrad:
    """One key/value head's gradients, and its keys that receive none."""

    index: Index
    dk_norm: float
    dv_norm: float
    keys: int
    hidden: int
    starved: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": list(self.index),
            "dk_norm": finite_or_none(self.dk_norm),
            "dv_norm": finite_or_none(self.dv_norm),
            "keys": self.keys,
            "keys_hidden": self.hidden,
            "keys_starved": self.starved,
        }


@dataclass(frozen=True)
class GradDiagnosis:
    """Everything the gradient-health step concluded."""

    findings: tuple[Finding, ...]
    counts: Mapping[str, int]
    query_heads: tuple[QueryHeadGrad, ...]
    kv_heads: tuple[KVHeadGrad, ...]
    norms: Mapping[str, float]
    ranges: tuple[GradRange, ...]
    vanishing: float
    """The threshold rows were judged against (``Thresholds.vanishing``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "norms": {k: finite_or_none(v) for k, v in self.norms.items()},
            "query_heads": [h.to_dict() for h in self.query_heads],
            "kv_heads": [h.to_dict() for h in self.kv_heads],
            "ranges": [r.to_dict() for r in self.ranges],
        }


def diagnose_grad(
    grads: Gradients,
    thresholds: Thresholds | None = None,
    dtype: str = "float64",
    summary: GradSummary | None = None,
) -> GradDiagnosis:
    """Read the gradients and their records; ``dtype`` is the training format the
    gradients are judged against (``--dtype``; float64 judges float16 at info level).

    ``summary`` is what the backward pass gathered slice by slice (needed when it kept
    some slices only); without one, the whole gradients are read here."""
    th = thresholds or Thresholds()
    summary = summary or summarise(grads, dtype)
    tally = Tally(GRADIENT_KINDS)
    tally.add(_nonfinite(summary))
    ranges = tuple(summary.ranges())
    tally.add(_range_findings(ranges, dtype))
    tally.rows("vanishing_gradient", list(_vanishing(grads, th)), th.max_findings)
    query_heads = _query_heads(grads, summary, th)
    tally.add(_weak_heads(query_heads, th))
    kv_heads, kv_findings = _kv_heads(grads, summary)
    tally.add(kv_findings)
    return GradDiagnosis(
        findings=tally.findings,
        counts=tally.counts,
        query_heads=query_heads,
        kv_heads=kv_heads,
        norms={n: summary.norm(n) for n in grads.present()},
        ranges=ranges,
        vanishing=th.vanishing,
    )


def _nonfinite(summary: GradSummary) -> Iterator[Finding]:
    for t in summary.in_order():
        if not t.nonfinite:
            continue
        n, nans = t.nonfinite, t.nans
        yield Finding(
            "gradient_nonfinite",
            "error",
            f"{LABEL[t.name]} has {plural(n, 'non-finite value')} ({nans} NaN, {n - nans} inf), "
            f"first at {format_index(t.first_bad)}",
            hint="a NaN or inf in Q, K, V, the bias or dO reaches every gradient it "
            "touches: see the forward findings for where it enters",
            index=t.first_bad,
            stage=t.name,
            count=n,
        )


def _range_findings(ranges: tuple[GradRange, ...], dtype: str) -> Iterator[Finding]:
    for r in ranges:
        f = precision.fmt(r.dtype)
        working = r.dtype == dtype
        if r.overflow:
            yield Finding(
                "gradient_range",
                "error" if working else ("warning" if r.dtype == "float16" else "info"),
                f"{LABEL[r.name]}: {plural(r.overflow, 'value')} overflow {r.dtype} "
                f"(max {sig(f.max, 6)}; the largest is {sig(r.max_abs)})",
                hint="unscale the loss, or keep gradients in float32 or bfloat16",
                stage=r.name,
                dtype=r.dtype,
                count=r.overflow,
                details={"max_abs": r.max_abs},
            )
        if working and r.nonzero and (r.flush or r.subnormal):
            share = r.flush / r.nonzero
            yield Finding(
                "gradient_range",
                "warning" if share >= FLUSH_WARNING else "info",
                f"{LABEL[r.name]}: {r.flush} of {r.nonzero} nonzero values ({share:.2%}) "
                f"flush to zero in {r.dtype} and {r.subnormal} are subnormal, losing bits",
                hint="scale the loss up (loss scaling) so small gradients stay normal, or "
                "keep them in float32 or bfloat16",
                stage=r.name,
                dtype=r.dtype,
                count=r.flush,
                details={"subnormal": r.subnormal, "nonzero": r.nonzero},
            )


def _one_minus(x: float, rest: float) -> str:
    """A weight near 1 as ``1 − 2.1e-06`` (four decimals would say 1.0000); ``rest``
    is the weight on the other keys, 1 − x without rounding."""
    return f"{x:.4f}" if rest >= 1e-3 else f"1 − {sig(rest, 2)}"


def _vanishing(grads: Gradients, th: Thresholds) -> Iterator[Finding]:
    spec = grads.spec
    flagged = grads.vanishing(th.vanishing)
    hint = saturation_hint(spec)
    for at in np.argwhere(flagged):
        idx = tuple(int(i) for i in at)
        gain, mw = float(grads.gain[idx]), float(grads.max_weight[idx])
        ds, da = float(grads.ds_norm[idx]), float(grads.da_norm[idx])
        key, n = int(grads.argmax[idx]), int(grads.n_visible[idx])
        rest = float(grads.rest[idx])
        if rest == 0:
            what = (
                f"passes back nothing: all its weight is on key {key} of {n} visible (the "
                f"others underflow to 0); ‖dA‖ = {sig(da, 3)}"
            )
        else:
            what = (
                f"passes back at most {sig(gain, 2)} of its gradient: max weight "
                f"{_one_minus(mw, rest)} on key {key} of {n} visible; ‖dS‖ = {sig(ds, 3)} "
                f"against ‖dA‖ = {sig(da, 3)}"
            )
        yield Finding(
            "vanishing_gradient",
            "warning",
            f"row {format_index(idx)} {what}",
            hint=hint,
            index=idx,
            stage="weights",
            details={
                "jacobian_bound": gain,
                "ds_norm": ds,
                "da_norm": da,
                "max_weight": mw,
                "key": int(grads.argmax[idx]),
                "visible": int(grads.n_visible[idx]),
            },
        )


def _query_heads(
    grads: Gradients, summary: GradSummary, th: Thresholds
) -> tuple[QueryHeadGrad, ...]:
    spec = grads.spec
    flagged = grads.vanishing(th.vanishing)
    heads = []
    for lead in np.ndindex(*spec.lead):
        li = tuple(int(i) for i in lead)
        eligible = grads.n_visible[li] >= 2
        gains = grads.gain[li][eligible]
        vanishing = int(np.count_nonzero(flagged[li]))
        heads.append(
            QueryHeadGrad(
                li,
                summary.slice_norm("dq", spec.operand_index("q", li)),
                int(eligible.sum()),
                vanishing,
                float(gains.mean()) if gains.size else math.nan,
            )
        )
    return tuple(heads)


def _weak_heads(heads: tuple[QueryHeadGrad, ...], th: Thresholds) -> Iterator[Finding]:
    norms = np.array([h.dq_norm for h in heads])
    median = float(np.median(norms)) if len(heads) >= 2 else math.nan
    for h in heads:
        if not h.index:
            continue  # no head axis: the rows' findings say it all
        if h.rows and h.vanishing >= th.head_fraction * h.rows:
            yield Finding(
                "weak_head_gradient",
                "warning",
                f"head {format_index(h.index)}: {h.vanishing} of {plural(h.rows, 'row')} "
                f"pass back less than {th.vanishing:g} of their gradient (‖dQ‖ = "
                f"{sig(h.dq_norm, 3)})",
                hint="the head's softmax is saturated: it barely learns until its logits shrink",
                index=h.index,
                stage="dq",
                details={"dq_norm": h.dq_norm, "vanishing_rows": h.vanishing, "rows": h.rows},
            )
        elif median > 0 and h.dq_norm < WEAK_HEAD * median:
            yield Finding(
                "weak_head_gradient",
                "warning",
                f"head {format_index(h.index)} gets {sig(h.dq_norm / median, 2)} of the median "
                f"head's query gradient (‖dQ‖ = {sig(h.dq_norm, 3)} against {sig(median, 3)})",
                hint="its rows are saturated or fully masked, or its dO is near zero",
                index=h.index,
                stage="dq",
                details={"dq_norm": h.dq_norm, "median_dq_norm": median},
            )


def _keys_text(keys: NDArray[Any], limit: int = 6) -> str:
    """``key 6`` or ``keys 3, 4, 7 …``."""
    shown = ", ".join(str(int(j)) for j in keys[:limit])
    return ("key " if keys.size == 1 else "keys ") + shown + (" …" if keys.size > limit else "")


def _kv_heads(
    grads: Gradients, summary: GradSummary
) -> tuple[tuple[KVHeadGrad, ...], list[Finding]]:
    """Each key/value head's norms; its keys hidden from every query reading it, and
    those visible to some query but weighted 0 by every one (both get no gradient)."""
    spec = grads.spec
    k_lead = spec.k.shape[:-2]
    weight = np.zeros((*k_lead, spec.S))
    seen = np.zeros((*k_lead, spec.S), np.bool_)
    v_of: dict[Index, Index] = {}  # K's head → the V head read beside it
    for lead in np.ndindex(*spec.lead):
        li = tuple(int(i) for i in lead)
        ki = spec.operand_index("k", li)
        v_of.setdefault(ki, spec.operand_index("v", li))
        np.fmax(weight[ki], grads.key_weight[li], out=weight[ki])
        seen[ki] |= grads.key_seen[li]
    heads, findings = [], []
    for lead in np.ndindex(*k_lead):
        ki = tuple(int(i) for i in lead)
        hidden = np.flatnonzero(~seen[ki])
        starved = np.flatnonzero(seen[ki] & (weight[ki] == 0))
        vi = v_of.get(ki, ki)
        heads.append(
            KVHeadGrad(
                ki,
                summary.slice_norm("dk", ki),
                summary.slice_norm("dv", vi),
                spec.S,
                int(hidden.size),
                int(starved.size),
            )
        )
        where = f"K/V head {format_index(ki)}" if ki else "K/V"
        if starved.size:
            findings.append(
                Finding(
                    "no_gradient_keys",
                    "warning",
                    f"{where}: {starved.size} of {spec.S} keys get no gradient though some "
                    f"query may see them: every weight on them is 0 ({_keys_text(starved)})",
                    hint="saturated rows put all their weight elsewhere; the keys' weights "
                    "underflowed to 0",
                    index=ki,
                    stage="dk",
                    count=int(starved.size),
                    details={"keys": [int(j) for j in starved[:50]]},
                )
            )
        if hidden.size:
            findings.append(
                Finding(
                    "no_gradient_keys",
                    "info",
                    f"{where}: {hidden.size} of {spec.S} keys "
                    f"{'is' if hidden.size == 1 else 'are'} hidden from every query and get "
                    f"no gradient ({_keys_text(hidden)})",
                    hint="expected for padding; otherwise check the mask",
                    index=ki,
                    stage="dk",
                    count=int(hidden.size),
                    details={"keys": [int(j) for j in hidden[:50]]},
                )
            )
    return tuple(heads), findings


def combined(forward: Diagnosis, health: GradDiagnosis) -> Diagnosis:
    """The forward findings and the gradient findings as one diagnosis (one panel)."""
    return dataclasses.replace(
        forward,
        findings=forward.findings + health.findings,
        counts={**forward.counts, **health.counts},
    )


def backward_health(
    spec: AttentionSpec,
    dout: NDArray[np.float64],
    thresholds: Thresholds,
    *,
    jobs: int = 1,
    stats: Stats | None = None,
    progress: Progress | None = None,
    keep: Collection[Index] | None = None,
) -> tuple[Gradients, GradDiagnosis]:
    """The backward pass of ``Σ O ⊙ dO`` in float64 and its health: the gradients and
    their diagnosis, their range judged against ``spec``'s ``--dtype``.

    ``dout`` is dO in the engine's layout (:func:`~sdpa_cli.engine.inputs.load_dout`);
    ``stats`` gathers the forward statistics in the same pass (``Stats.empty`` of the
    float64 spec), ``progress`` is told the scores done; ``keep`` names the query
    slices whose dQ, dK and dV to keep (None: all). Every slice is judged as the pass
    finishes it, kept or not.
    """
    wide = spec.in_float64()  # the backward pass is float64; --dtype judges the range
    summary = GradSummary(wide, spec.options.dtype)
    grads = backward(
        wide, dout, jobs=jobs, progress=progress, stats=stats, keep=keep, on_slice=summary.add
    )
    add_summed(summary, grads)
    return grads, diagnose_grad(grads, thresholds, spec.options.dtype, summary)
