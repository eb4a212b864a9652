"""``sdpa explain --backward``: the backward stages of one slice, each with a note.

Stages, in the order the gradient flows (``d_scaled`` only with a softcap,
``d_bias`` only with a bias):

    d_output  dO                              (rows, Ev)
    d_weights dA = dO · Vᵀ                    (rows, S)
    d_scores  dS = A ⊙ (dA − Σ A ⊙ dA)        (rows, S)
    d_scaled  dS ⊙ (1 − tanh²(scaled / C))    (rows, S)
    d_query   dQ = dS · K · scale             (rows, E)
    d_key     dK = dSᵀ · Q · scale            (S, E)   the whole kv head, every row
    d_value   dV = Aᵀ · dO                    (S, Ev)  the whole kv head, every row
    d_bias    d(bias) = dS                    (rows, S)

Values of the row-shaped stages are the shown rows'; notes read the whole slice's
records (every row), as the forward notes do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnose.explain import StageExplained
from sdpa_cli.diagnose.grad import GradDiagnosis
from sdpa_cli.diagnose.rules import Finding
from sdpa_cli.engine.grad import Gradients, backward_block
from sdpa_cli.engine.stats import Index, Moments
from sdpa_cli.text import plural, prose

F64 = NDArray[np.float64]

FORMULAS = {
    "d_output": "dO",
    "d_weights": "dA = dO · Vᵀ",
    "d_scores": "dS = A ⊙ (dA − Σ A ⊙ dA)",
    "d_scaled": "dS ⊙ (1 − tanh²(scaled / C))",
    "d_query": "dQ = dS · K · scale",
    "d_key": "dK = dSᵀ · Q · scale",
    "d_value": "dV = Aᵀ · dO",
    "d_bias": "d(bias) = dS",
}
"""Every backward stage and its formula."""

FINDING_STAGE = {"dq": "d_query", "dk": "d_key", "dv": "d_value", "dbias": "d_bias"}


@dataclass(frozen=True)
class Backward:
    """The backward stages of the slice, the gradient findings placed at them, and
    the whole input's gradient health."""

    dout_label: str
    stages: tuple[StageExplained, ...]
    elsewhere: tuple[Finding, ...]
    health: GradDiagnosis

    def to_dict(self) -> dict[str, Any]:
        return {"dout": self.dout_label, **self.health.to_dict()}


def _span(values: F64) -> str:
    m = Moments()
    m.add(values)
    return f"{prose(m.lo, 3)} … {prose(m.hi, 3)}" if m.count else "no finite values"


def explain_backward(
    grads: Gradients, health: GradDiagnosis, lead: Index, rows: range, dout_label: str
) -> Backward:
    """The backward stages of the slice at ``lead`` for the shown ``rows``."""
    spec = grads.spec
    o = spec.options
    r = slice(rows.start, rows.stop)
    block = backward_block(spec, lead, r, grads.dout[lead][r], keep_steps=True)
    assert block.steps is not None
    steps = block.steps
    kv = spec.operand_index("k", lead)
    factor = spec.scale / o.temperature
    gain = grads.gain[lead]
    eligible = grads.n_visible[lead] >= 2
    vanishing = next((h.vanishing for h in health.query_heads if h.index == lead), 0)

    values: dict[str, F64] = {
        "d_output": grads.dout[lead][r],
        "d_weights": steps["d_weights"],
        "d_scores": steps["d_scores"],
        "d_query": block.dq,
        "d_key": grads.dk[kv],
        "d_value": grads.dv[spec.operand_index("v", lead)],
    }
    if o.softcap is not None:
        values["d_scaled"] = steps["d_scaled"]
    if grads.dbias is not None:
        values["d_bias"] = steps["d_scores"]

    notes: dict[str, str] = {}
    notes["d_output"] = (
        f"dO, the loss's gradient at the output ({dout_label}). The loss is ℓ = Σ O ⊙ dO, "
        "so every stage below is ∂ℓ/∂(that stage); a real model's dO comes from the layers above."
    )
    dropped = ""
    if o.dropout > 0:
        dropped = (
            f" Dropout passes it back as it passed the weights forward: the kept weights' dA "
            f"× 1/(1 − {o.dropout:g}), the dropped ones' 0."
        )
    notes["d_weights"] = (
        f"dA = dO · Vᵀ: how ℓ moves with each weight, the dot product of dO with each key's "
        f"value row; here {_span(values['d_weights'])}.{dropped}"
    )
    row_gain = gain[eligible]
    if row_gain.size:
        low = int(np.argmin(np.where(eligible, gain, np.inf)))
        sums = np.abs(steps["d_scores"].sum(axis=1))
        worst_sum = float(sums[np.isfinite(sums)].max()) if np.isfinite(sums).any() else math.nan
        notes["d_scores"] = (
            "dS = A ⊙ (dA − Σ A ⊙ dA): the softmax's Jacobian, diag(A) − A Aᵀ, applied "
            "to dA. It passes back at most 1 − Σ w² of dA per row: 0 for a one-hot row, "
            f"1 − 1/n for a uniform one. In this slice it ranges {prose(float(row_gain.min()), 3)} "
            f"(q{low}) … {prose(float(row_gain.max()), 3)}; {vanishing} of "
            f"{plural(int(eligible.sum()), 'row')} that see two keys or more pass back less than "
            f"{health.vanishing:g}: their gradient vanishes. Each row of dS sums to 0 "
            f"(shown rows: |Σ| ≤ {prose(worst_sum, 3)}), and hidden keys get none."
        )
    else:
        notes["d_scores"] = (
            "dS = A ⊙ (dA − Σ A ⊙ dA): no row of this slice sees two keys, so the softmax "
            "passes nothing back (a single visible key always gets weight 1)."
        )
    if "d_scaled" in values:
        assert o.softcap is not None
        t = np.tanh(steps["scaled"] / o.softcap)
        slope = 1.0 - t * t
        notes["d_scaled"] = (
            f"softcap's chain rule: dS × (1 − tanh²(scaled / {o.softcap:g})), a factor "
            f"{_span(slope)} on the shown rows; logits near ±{o.softcap:g} pass back little."
        )
    sqrt_dk = (
        " The 1/√d_k that keeps the logits O(1) also keeps dQ and dK from growing with √d_k."
        if o.scale == "sqrt-dk"
        else ""
    )
    notes["d_query"] = (
        f"The scores' factor, {spec.scale_label}"
        + (f", ÷ temperature {o.temperature:g}" if o.temperature != 1 else "")
        + f", multiplies their gradient too: dQ = dS · K · {factor:.4g}.{sqrt_dk} ‖dQ‖ of "
        f"this head: {prose(_head_norm(health, lead), 3)}."
    )
    group = (
        f", summed over the {spec.group} query heads that share kv head {kv[-1]}"
        if spec.group > 1
        else ""
    )
    kv_head = next((h for h in health.kv_heads if h.index == kv), None)
    none_get = ""
    if kv_head is not None and (kv_head.hidden or kv_head.starved):
        none_get = (
            f" {kv_head.hidden + kv_head.starved} of its {spec.S} keys get no gradient "
            f"({kv_head.hidden} hidden from every query, {kv_head.starved} weighted 0 by all)."
        )
    notes["d_key"] = (
        f"dK = dSᵀ · Q · {factor:.4g}: each key's gradient gathers every query row's dS "
        f"(all {spec.L}, not only those shown){group}.{none_get}"
    )
    notes["d_value"] = (
        "dV = Aᵀ · dO"
        + (" (the weights after dropout)" if o.dropout > 0 else "")
        + f": each key's value gets the sum of the rows' dO, each times its weight on the "
        f"key{group}; a key no row weighs gets none."
    )
    if "d_bias" in values:
        notes["d_bias"] = (
            "d(bias) = dS: the bias is added to the logits, so it gets their gradient "
            "(summed over any axis it broadcasts along)."
        )

    placed: dict[str, list[Finding]] = {s: [] for s in values}
    elsewhere: list[Finding] = []
    for f in health.findings:
        stage = "d_scores" if f.kind == "vanishing_gradient" else FINDING_STAGE.get(f.stage or "")
        if f.kind == "weak_head_gradient":
            mine = f.index == lead
        elif f.kind == "no_gradient_keys":
            mine = f.index == kv
        elif f.kind == "vanishing_gradient":
            mine = f.index is not None and tuple(f.index[: len(lead)]) == lead
        else:
            mine = True  # whole-tensor findings: shown wherever the tensor is
        if mine and stage in placed:
            placed[stage].append(f)
        else:
            elsewhere.append(f)
    order = [s for s in FORMULAS if s in values]
    stages = tuple(
        StageExplained(
            name=s,
            step=s,
            values=values[s],
            note=notes[s],
            summary=_summary(values[s]),
            findings=tuple(placed[s]),
        )
        for s in order
    )
    return Backward(dout_label, stages, tuple(elsewhere), health)


def _head_norm(health: GradDiagnosis, lead: Index) -> float:
    return next((h.dq_norm for h in health.query_heads if h.index == lead), math.nan)


def _summary(values: F64) -> Mapping[str, Any]:
    m = Moments()
    m.add(values)
    return m.to_dict()
