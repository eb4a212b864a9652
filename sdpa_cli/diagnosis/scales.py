"""The scale compared: one slice under no scaling, 1/√d_k and 1/d_k (the raw scores
[0, d_k, 2·d_k] example), judged by the findings' rules.

Pure numpy; ``explain --compare-scales`` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.rows import classify_rows
from sdpa_cli.engine.block import attend_block
from sdpa_cli.engine.driver import slice_blocks
from sdpa_cli.engine.records import Moments
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.text import sig

SCALE_RULES = (("none", "none (×1)"), ("sqrt-dk", "1/√d_k"), ("dk", "1/d_k"))


@dataclass(frozen=True)
class ScaleRun:
    """The slice under one scale: the shown rows' weights and every row's shape."""

    rule: str | float
    label: str
    factor: float
    weights: F64
    max_weight: F64
    normalized_entropy: F64
    logit_std: float
    rows: int
    saturated: int
    uniform: int
    verdict: str
    current: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "scale": self.rule,
            "label": self.label,
            "factor": self.factor,
            "current": self.current,
            "weights": self.weights.tolist(),
            "max_weight": self.max_weight.tolist(),
            "normalized_entropy": self.normalized_entropy.tolist(),
            "logit_std": self.logit_std,
            "rows": self.rows,
            "saturated": self.saturated,
            "near_uniform": self.uniform,
            "verdict": self.verdict,
        }


def _scale_run(
    spec: AttentionSpec,
    lead: Index,
    rows: range,
    th: Thresholds,
    rule: str | float,
    label: str,
    current: bool,
) -> ScaleRun:
    """The slice under one scale: every row's max weight and entropy over its visible
    keys, judged by the findings' rules (:func:`~sdpa_cli.diagnosis.rows.classify_rows`)."""
    run = spec if current else spec.with_scale(rule)
    # The row statistics and rules of the findings, gathered over this slice only.
    stats = Stats.empty(run)
    logits = Moments()
    for block in slice_blocks(run, lead):
        stats.observe(block, block)
        logits.add(block.logits_before("masked"), block.attended)
    shown = attend_block(run, lead, slice(rows.start, rows.stop)).weights
    classes = classify_rows(stats, th, lead)
    eligible, saturated, uniform = classes.eligible, classes.saturated, classes.uniform
    n, s, u = int(eligible.sum()), int(saturated.sum()), int(uniform.sum())
    if not n:
        verdict = "no row with two visible keys"
    elif s >= th.head_fraction * n:
        verdict = "saturated: one-hot rows"
    elif u >= th.head_fraction * n:
        verdict = "too flat: near-uniform rows"
    elif s or u:
        verdict = f"mixed: {s} one-hot, {u} near-uniform of {n} rows"
    else:
        verdict = "balanced: neither one-hot nor uniform"
    picked = slice(rows.start, rows.stop)
    return ScaleRun(
        rule=rule,
        label=label,
        factor=run.factor,
        weights=shown,
        max_weight=stats.max_weight[lead][picked],
        normalized_entropy=classes.normalized[picked],
        logit_std=logits.std,
        rows=n,
        saturated=s,
        uniform=u,
        verdict=verdict,
        current=current,
    )


def compare_scales(
    spec: AttentionSpec, lead: Index, rows: range, th: Thresholds
) -> tuple[tuple[ScaleRun, ...], str]:
    """No scaling, 1/√d_k and 1/d_k (and the run's own scale when it is another one),
    with a verdict on each and a conclusion."""
    runs: list[ScaleRun] = []
    o = spec.options
    matched = False
    for rule, name in SCALE_RULES:
        current = o.scale == rule
        matched |= current
        label = name if rule == "none" else f"{name} = {sig(spec.with_scale(rule).scale)}"
        runs.append(_scale_run(spec, lead, rows, th, rule, label, current))
    if not matched:
        runs.append(_scale_run(spec, lead, rows, th, o.scale, f"this run: {sig(spec.scale)}", True))
    balanced = [r.label.split(" =")[0] for r in runs if r.verdict.startswith("balanced")]
    default = runs[1]
    if not default.rows:
        return tuple(runs), "No row has two visible keys: there is nothing to compare."
    if balanced:
        conclusion = "Balanced under " + ", ".join(balanced)
    else:
        conclusion = "No scale gives balanced rows here"
    if not default.verdict.startswith("balanced"):
        conclusion += (
            f"; the standard 1/√d_k is {default.verdict.split(':')[0]} here (logit std "
            f"{sig(default.logit_std)})"
        )
    t = o.temperature
    if t != 1:
        # Every scale is divided by the temperature: say so, lest the scale take the blame.
        conclusion += f", every scale divided by the temperature {t:g}"
    return tuple(runs), conclusion + "."
