"""What pages draw of a check: a case's failed comparisons (``check --html``, the
report's :class:`~sdpa_cli.check.records.Evidence`, every export in the computation's
layout), and a manifest's case as a row of a model's grid (``check --manifest
--html``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from sdpa_cli.check.compare import Judgement
from sdpa_cli.check.exports import Fitted
from sdpa_cli.check.records import Evidence
from sdpa_cli.check.relative import error_ratio
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
        judgement,
    )


def grid_row(
    gather: HeadGather, stats: Stats, kept: Evidence | None, thresholds: Thresholds | None
) -> CaseHeads:
    """The case's row of a model's grid, from the check's own pass: its statistics, its
    patterns and, with an exported output (``kept``), its error per head against the
    reference and its largest error ÷ the allowance the verdict used, per head."""
    spec = gather.spec
    error = over = None
    if kept is not None and "output" in kept.exports:
        a = np.asarray(kept.exports["output"], dtype=np.float64)
        r = np.asarray(kept.reference["output"], dtype=np.float64)
        error = error_by_head(spec, a, r)
        if (judgement := kept.judgement) is not None:
            plain = kept.plain.get("output")
            shape = (-1, spec.L, a.shape[-1])
            p = None if plain is None else np.asarray(plain, dtype=np.float64).reshape(shape)
            ratio = error_ratio(a.reshape(shape), r.reshape(shape), p, judgement, rows=True)
            # NaN: a side not finite, which other checks report (not this ratio)
            by_slice = np.where(np.isnan(ratio), 0.0, ratio).max(axis=(1, 2), initial=0.0)
            over = np.max(by_slice.reshape(-1, spec.H), axis=0)
    heads = gather.heads(stats, thresholds or Thresholds(), error)
    return dataclasses.replace(heads, over_allowance=over)
