"""What pages draw of a check: a case's failed comparisons (``check --html``, the
report's :class:`~sdpa_cli.check.records.Evidence`, every export in the computation's
layout), and a manifest's case as a row of a model's grid (``check --manifest
--html``)."""

from __future__ import annotations

from collections.abc import Mapping

from sdpa_cli.check.exports import Fitted
from sdpa_cli.check.records import Evidence
from sdpa_cli.check.relative import Judgement
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.model import CaseHeads, HeadGather, error_by_head
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.trace import split_heads_of_output
from sdpa_cli.engine.types import F64


def kept_for_pages(
    spec: AttentionSpec,
    fitted: Mapping[str, Fitted],
    reference: Mapping[str, F64],
    plain: Mapping[str, F64 | None] | None,
    judgement: Judgement | None,
) -> Evidence:
    """Each export, its reference and its plain computation (a merged output's heads
    split again), and the rule's terms (none under a fixed tolerance)."""

    def engine(name: str, values: F64, merged: bool) -> F64:
        return split_heads_of_output(spec, values) if name == "output" and merged else values

    plains: dict[str, F64 | None] = {}
    for n, f in fitted.items():
        values = (plain or {}).get(n)
        plains[n] = None if values is None else engine(n, values, f.merged)
    return Evidence(
        spec,
        {n: engine(n, f.values, f.merged) for n, f in fitted.items()},
        {n: engine(n, reference[n], f.merged) for n, f in fitted.items()},
        plains,
        None if judgement is None else judgement.factor,
        0.0 if judgement is None else judgement.floor_ulps,
    )


def grid_row(
    gather: HeadGather,
    stats: Stats,
    output: Fitted | None,
    reference: Mapping[str, F64],
    thresholds: Thresholds | None,
) -> CaseHeads:
    """The case's row of a model's grid, from the check's own pass: its statistics, its
    patterns, and the exported output's error per head against the reference."""
    spec = gather.spec
    error = None
    if output is not None and "output" in reference:
        values = split_heads_of_output(spec, output.values) if output.merged else output.values
        error = error_by_head(spec, values, reference["output"])
    return gather.heads(stats, thresholds or Thresholds(), error)
