"""``sdpa explain --backward``: the backward stages of one slice, each with a note.

The stages and their formulas are :mod:`sdpa_cli.names`'. Values of the
row-shaped stages are the shown rows'; ``d_key`` and ``d_value`` are the whole kv
head's. Notes read the whole slice's records (every row), as the forward notes do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from sdpa_cli.diagnosis.explained import Backward, StageExplained
from sdpa_cli.diagnosis.findings import Finding
from sdpa_cli.diagnosis.grad import GradDiagnosis
from sdpa_cli.engine.grad import Gradients
from sdpa_cli.engine.grad_block import backward_block
from sdpa_cli.engine.records import Moments
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.names import BACKWARD_STAGES, GRADIENT_STAGE
from sdpa_cli.text import plural, prose, sig


def _span(values: F64) -> str:
    m = Moments()
    m.add(values)
    return f"{prose(m.lo, 3)} … {prose(m.hi, 3)}" if m.count else "no finite values"


def explain_backward(
    grads: Gradients, health: GradDiagnosis, lead: Index, rows: range, dout_label: str
) -> Backward:
    """The backward stages of the slice at ``lead`` for the shown ``rows``."""
    spec = grads.spec
    r = slice(rows.start, rows.stop)
    block = backward_block(spec, lead, r, grads.dout[lead][r], keep_steps=True)
    assert block.steps is not None
    steps = block.steps
    values: dict[str, F64] = {
        "d_output": grads.dout[lead][r],
        "d_weights": steps["d_weights"],
        "d_scores": steps["d_scores"],
        "d_query": block.dq,
        "d_key": grads.at("dk", lead),
        "d_value": grads.at("dv", lead),
    }
    if spec.options.softcap is not None:
        values["d_scaled"] = steps["d_scaled"]
    if grads.dbias is not None:
        values["d_bias"] = steps["d_scores"]
    notes = _notes(grads, health, lead, values, steps, dout_label)
    placed, elsewhere = _placed(health, spec, lead, values)
    stages = tuple(
        StageExplained(
            name=s,
            step=s,
            values=values[s],
            note=notes[s],
            summary=_summary(values[s]),
            findings=tuple(placed[s]),
        )
        for s in BACKWARD_STAGES
        if s in values
    )
    return Backward(dout_label, stages, tuple(elsewhere), health)


def _placed(
    health: GradDiagnosis, spec: AttentionSpec, lead: Index, values: Mapping[str, F64]
) -> tuple[dict[str, list[Finding]], list[Finding]]:
    """The gradient findings of this slice by stage, and the rest: a row's and a
    query head's where they are this slice's, a kv head's where it is this slice's
    kv head, whole-tensor findings wherever the tensor is shown."""
    kv = spec.operand_index("k", lead)
    placed: dict[str, list[Finding]] = {s: [] for s in values}
    elsewhere: list[Finding] = []
    for f in health.findings:
        stage = "d_scores" if f.kind == "vanishing_gradient" else GRADIENT_STAGE.get(f.stage or "")
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
    return placed, elsewhere


# --- the notes ---------------------------------------------------------------------------


def _notes(
    grads: Gradients,
    health: GradDiagnosis,
    lead: Index,
    values: Mapping[str, F64],
    steps: Mapping[str, F64],
    dout_label: str,
) -> dict[str, str]:
    """Backward stage → its note, for every stage in ``values``."""
    spec = grads.spec
    notes = {
        "d_output": (
            f"dO, the loss's gradient at the output ({dout_label}). The loss is ℓ = Σ O ⊙ dO, "
            "so every stage below is ∂ℓ/∂(that stage); a real model's dO comes from the "
            "layers above."
        ),
        "d_weights": _d_weights_note(spec, values["d_weights"]),
        "d_scores": _d_scores_note(grads, health, lead, steps["d_scores"]),
    }
    if "d_scaled" in values:
        notes["d_scaled"] = _d_scaled_note(spec, steps["scaled"])
    notes["d_query"] = _d_query_note(spec, health, lead)
    notes["d_key"] = _d_key_note(spec, health, lead)
    notes["d_value"] = _d_value_note(spec, lead)
    if "d_bias" in values:
        notes["d_bias"] = (
            "d(bias) = dS: the bias is added to the logits, so it gets their gradient "
            "(summed over any axis it broadcasts along)."
        )
    return notes


def _d_weights_note(spec: AttentionSpec, d_weights: F64) -> str:
    o = spec.options
    dropped = ""
    if o.dropout > 0:
        dropped = (
            f" Dropout passes it back as it passed the weights forward: the kept weights' dA "
            f"× 1/(1 − {o.dropout:g}), the dropped ones' 0."
        )
    return (
        f"dA = dO · Vᵀ: how ℓ moves with each weight, the dot product of dO with each key's "
        f"value row; here {_span(d_weights)}.{dropped}"
    )


def _d_scores_note(grads: Gradients, health: GradDiagnosis, lead: Index, d_scores: F64) -> str:
    """The softmax's Jacobian: how much of dA each row passes back, over the slice."""
    gain = grads.gain[lead]
    eligible = grads.n_visible[lead] >= 2
    row_gain = gain[eligible]
    if not row_gain.size:
        return (
            "dS = A ⊙ (dA − Σ A ⊙ dA): no row of this slice sees two keys, so the softmax "
            "passes nothing back (a single visible key always gets weight 1)."
        )
    vanishing = next((h.vanishing for h in health.query_heads if h.index == lead), 0)
    low = int(np.argmin(np.where(eligible, gain, np.inf)))
    sums = np.abs(d_scores.sum(axis=1))
    worst_sum = float(sums[np.isfinite(sums)].max()) if np.isfinite(sums).any() else math.nan
    return (
        "dS = A ⊙ (dA − Σ A ⊙ dA): the softmax's Jacobian, diag(A) − A Aᵀ, applied "
        "to dA. It passes back at most 1 − Σ w² of dA per row: 0 for a one-hot row, "
        f"1 − 1/n for a uniform one. In this slice it ranges {prose(float(row_gain.min()), 3)} "
        f"(q{low}) … {prose(float(row_gain.max()), 3)}; {vanishing} of "
        f"{plural(int(eligible.sum()), 'row')} that see two keys or more pass back less than "
        f"{health.vanishing:g}: their gradient vanishes. Each row of dS sums to 0 "
        f"(shown rows: |Σ| ≤ {prose(worst_sum, 3)}), and hidden keys get none."
    )


def _d_scaled_note(spec: AttentionSpec, scaled: F64) -> str:
    cap = spec.options.softcap
    assert cap is not None
    t = np.tanh(scaled / cap)
    slope = 1.0 - t * t
    return (
        f"softcap's chain rule: dS × (1 − tanh²(scaled / {cap:g})), a factor "
        f"{_span(slope)} on the shown rows; logits near ±{cap:g} pass back little."
    )


def _d_query_note(spec: AttentionSpec, health: GradDiagnosis, lead: Index) -> str:
    o = spec.options
    factor = spec.factor
    sqrt_dk = (
        " The 1/√d_k that keeps the logits O(1) also keeps dQ and dK from growing with √d_k."
        if o.scale == "sqrt-dk"
        else ""
    )
    head_norm = next((h.dq_norm for h in health.query_heads if h.index == lead), math.nan)
    return (
        f"The scores' factor, {spec.scale_label}"
        + (f", ÷ temperature {o.temperature:g}" if o.temperature != 1 else "")
        + f", multiplies their gradient too: dQ = dS · K · {sig(factor)}.{sqrt_dk} ‖dQ‖ of "
        f"this head: {prose(head_norm, 3)}."
    )


def _group(spec: AttentionSpec, lead: Index) -> str:
    """``, summed over the 4 query heads that share kv head 1`` under GQA, else empty."""
    kv = spec.operand_index("k", lead)
    if spec.group > 1:
        return f", summed over the {spec.group} query heads that share kv head {kv[-1]}"
    return ""


def _d_key_note(spec: AttentionSpec, health: GradDiagnosis, lead: Index) -> str:
    """dK gathers every row's dS; the kv head's keys that get none."""
    kv = spec.operand_index("k", lead)
    factor = spec.factor
    kv_head = next((h for h in health.kv_heads if h.index == kv), None)
    none_get = ""
    if kv_head is not None and (kv_head.hidden or kv_head.starved):
        none_get = (
            f" {kv_head.hidden + kv_head.starved} of its {spec.S} keys get no gradient "
            f"({kv_head.hidden} hidden from every query, {kv_head.starved} weighted 0 by all)."
        )
    return (
        f"dK = dSᵀ · Q · {sig(factor)}: each key's gradient gathers every query row's dS "
        f"(all {spec.L}, not only those shown){_group(spec, lead)}.{none_get}"
    )


def _d_value_note(spec: AttentionSpec, lead: Index) -> str:
    return (
        "dV = Aᵀ · dO"
        + (" (the weights after dropout)" if spec.options.dropout > 0 else "")
        + f": each key's value gets the sum of the rows' dO, each times its weight on the "
        f"key{_group(spec, lead)}; a key no row weighs gets none."
    )


def _summary(values: F64) -> Mapping[str, Any]:
    m = Moments()
    m.add(values)
    return m.to_dict()
