"""One (batch, head) slice explained stage by stage: values, what changed, what went wrong.

Pure numpy: :func:`explain` returns an :class:`~sdpa_cli.diagnosis.explained.Explanation`
that the renderer draws and the report writes as JSON. Values come from the engine
(:func:`~sdpa_cli.engine.block.attend_block`) for the rows shown; the notes
(:mod:`sdpa_cli.diagnosis.notes`) come from one pass over every row of the slice, block
by block, so they describe the whole slice however few rows are shown; the findings
come from the diagnosis of the whole input, each put at the stage where it arose.

Stage names are the engine's, except ``dropped``, which is ``dropout`` here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sdpa_cli.diagnosis.explained import Explanation, RowStats, StageExplained
from sdpa_cli.diagnosis.findings import Diagnosis, Finding, Thresholds
from sdpa_cli.diagnosis.notes import gather_slice, slice_variance, stage_notes
from sdpa_cli.diagnosis.rows import RowClasses, classify_rows, row_flags
from sdpa_cli.diagnosis.rules import nonfinite_values
from sdpa_cli.diagnosis.scales import ScaleRun, compare_scales
from sdpa_cli.diagnosis.scorecard import scorecard
from sdpa_cli.engine.block import Block, applicable_stages, attend_block
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats, working_formats
from sdpa_cli.engine.types import Index
from sdpa_cli.names import STAGES
from sdpa_cli.text import format_index, plural

NAMES = {"dropped": "dropout"}
"""Engine stage → its name in ``explain`` (the rest keep theirs)."""


def explain_name(stage: str) -> str:
    return NAMES.get(stage, stage)


def explained_stages(spec: AttentionSpec) -> tuple[str, ...]:
    """The engine's stages that apply, without ``masked`` when nothing masks."""
    o = spec.options
    masks = o.hides_by_position or spec.mask is not None or o.mask_mod is not None
    return tuple(s for s in applicable_stages(spec) if s != "masked" or masks)


# --- findings in their place -------------------------------------------------------------------


def in_slice(f: Finding, spec: AttentionSpec, lead: Index) -> bool:
    """Whether finding ``f`` concerns the slice at ``lead``.

    A non-finite input is indexed in its own file's layout: it concerns the slice
    when the slice reads a non-finite value of that tensor (a GQA head reads its kv
    head). Other findings are indexed in the scores' layout, or not at all.
    """
    tensor = f.details.get("tensor") if f.stage == "input" else None
    if f.kind == "nonfinite" and isinstance(tensor, str):
        arr = getattr(spec, tensor)
        part = np.asarray(arr[spec.operand_index(tensor, lead)], dtype=np.float64)
        return bool(nonfinite_values(tensor, part).any())
    return f.index is None or tuple(f.index[: len(lead)]) == lead


def _placed(
    diagnosis: Diagnosis, spec: AttentionSpec, lead: Index, stages: Sequence[str]
) -> tuple[dict[str, list[Finding]], list[Finding], list[Finding]]:
    """Findings of this slice by stage, its other findings (inputs), and the rest.

    A finding at a stage not shown (``masked`` with nothing masked) goes to the
    last shown stage before it.
    """
    by_stage: dict[str, list[Finding]] = {s: [] for s in stages}
    inputs: list[Finding] = []
    elsewhere: list[Finding] = []
    for f in diagnosis.findings:
        if not in_slice(f, spec, lead):
            elsewhere.append(f)
        elif f.stage in STAGES:
            earlier = [s for s in STAGES[: STAGES.index(f.stage) + 1] if s in by_stage]
            (by_stage[earlier[-1]] if earlier else inputs).append(f)
        else:
            inputs.append(f)
    return by_stage, inputs, elsewhere


# --- the whole explanation -----------------------------------------------------------------------


def explain(
    spec: AttentionSpec,
    stats: Stats,
    diagnosis: Diagnosis,
    lead: Index,
    rows: range,
    *,
    query: int | None = None,
    scales: bool = False,
    key_limit: int = 16,
) -> Explanation:
    """Explain the slice at ``lead`` (a position of ``spec.lead``), showing ``rows``.

    Args:
        spec: the validated computation.
        stats, diagnosis: the whole input's statistics and findings (``trace`` and
            ``diagnose``); the slice's rows are read from them.
        lead: the (…, batch, head) position explained.
        rows: the query rows whose values are kept (a contiguous range).
        query: also build the scorecard of this query row.
        scales: also compare no scaling, 1/√d_k and 1/d_k.
        key_limit: keys listed in a scorecard of more keys (the heaviest).
    """
    th = diagnosis.thresholds
    engine = explained_stages(spec)
    gathered = gather_slice(spec, lead, engine)
    variance = slice_variance(spec, lead, gathered)
    classes = classify_rows(stats, th, lead)
    notes = stage_notes(spec, gathered, stats, th, classes, lead, variance)
    by_stage, inputs, elsewhere = _placed(diagnosis, spec, lead, engine)
    block = attend_block(spec, lead, slice(rows.start, rows.stop))
    stages = tuple(
        StageExplained(
            name=explain_name(s),
            step=s,
            values=getattr(block, s),
            note=notes[s],
            summary=gathered.moments[s].to_dict(),
            findings=tuple(by_stage[s]),
        )
        for s in engine
    )
    card = scorecard(spec, lead, query, key_limit) if query is not None else None
    runs: tuple[ScaleRun, ...] = ()
    verdict = None
    if scales:
        runs, verdict = compare_scales(spec, lead, rows, th)
    return Explanation(
        spec=spec,
        lead=lead,
        rows=rows,
        visible=block.attended,
        stages=stages,
        row_stats=_row_stats(spec, stats, th, classes, lead, rows, block),
        variance=variance,
        input_findings=tuple(inputs),
        elsewhere=tuple(elsewhere),
        diagnosis=diagnosis,
        scorecard=card,
        scales=runs,
        scales_verdict=verdict,
    )


def _row_stats(
    spec: AttentionSpec,
    stats: Stats,
    th: Thresholds,
    classes: RowClasses,
    lead: Index,
    rows: range,
    block: Block,
) -> RowStats:
    """The shown rows' statistics: visible keys and weight sums from their ``block``,
    entropy, max weight and flags from the whole input's statistics."""
    picked: tuple[int | slice, ...] = (*lead, slice(rows.start, rows.stop))
    return RowStats(
        rows=rows,
        visible=block.attended.sum(axis=1).astype(np.int64),
        sums=block.weights.sum(axis=1),
        entropy=stats.entropy[picked].copy(),
        normalized_entropy=np.asarray(classes.normalized)[rows.start : rows.stop].copy(),
        max_weight=stats.max_weight[picked].copy(),
        argmax=stats.argmax[picked].astype(np.int64),
        flags={
            i: f for i, f in row_flags(stats, th, lead, working_formats(spec)).items() if i in rows
        },
    )


def slice_at(spec: AttentionSpec, batch: int = 0, head: int = 0) -> Index:
    """The lead position of (batch, head); any axis before the batch at 0."""
    lead = [0] * len(spec.lead)
    if lead:
        lead[-1] = head
    if len(lead) >= 2:
        lead[-2] = batch
    return tuple(lead)


def elsewhere_summary(found: Sequence[Finding], lead: Index) -> str | None:
    """``3 findings in other slices: saturated at [0, 2, 5], …`` or None."""
    if not found:
        return None
    places = []
    for f in found:
        at = f.index[: len(lead)] if f.index is not None else None
        label = f"{f.kind.replace('_', ' ')} in {format_index(at)}"
        if label not in places:
            places.append(label)
    more = " …" if len(places) > 4 else ""
    return f"{plural(len(found), 'finding')} in other slices: {', '.join(places[:4])}{more}"
