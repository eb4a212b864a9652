"""Trace → rich renderables: ``sdpa compute``'s view (every stage of each chosen
slice, the whole-tensor ranges, per-head summaries, precision, findings). Never prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnosis.findings import Diagnosis
from sdpa_cli.diagnosis.rows import row_flags
from sdpa_cli.engine.block import Block, applicable_stages
from sdpa_cli.engine.records import Moments
from sdpa_cli.engine.stats import working_formats
from sdpa_cli.engine.trace import Trace
from sdpa_cli.render.common import (
    MUTED,
    Layout,
    View,
    layout,
    more_slices,
    rule,
    slice_label,
    stage_title,
)
from sdpa_cli.render.findings import findings_panel, heads_table, precision_panel
from sdpa_cli.render.header import header
from sdpa_cli.render.heatmap import stage_table
from sdpa_cli.text import sig


def summary(
    summaries: Mapping[str, Moments], stages: Sequence[str], hidden: int = 0
) -> RenderableType:
    """Range of each stage over the whole tensor (finite, visible values). ``hidden``:
    the score entries a mask hides, left out of every score stage's figures and
    counted in a column of their own, so the masked stage's −inf is not read as
    non-finite."""
    table = Table(title="whole tensor", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    columns = ("stage", "min", "max", "mean", "non-finite") + (("hidden",) if hidden else ())
    for col in columns:
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage in stages:
        m = summaries.get(stage)
        if m is None:
            continue
        row = [sig(m.lo), sig(m.hi), sig(m.mean)] if m.count else ["—", "—", "—"]
        row.append(str(m.nonfinite))
        if hidden:
            row.append("—" if stage == "output" else str(hidden))
        table.add_row(stage, *row)
    if not hidden:
        return table
    note = "hidden: scores a mask hides (set to the mask value), not counted in min, max, mean or non-finite"
    return Group(table, Text(note, MUTED))


def render_compute(
    trace: Trace,
    view: View,
    shown: Mapping[tuple[int, ...], Block],
    diagnosis: Diagnosis | None = None,
    *,
    laid_out: Layout | None = None,
) -> RenderableType:
    """The whole ``compute`` view: header, each chosen slice stage by stage (``shown``:
    the blocks of :func:`layout`'s rows), then the per-head summaries, the precision
    report and the findings (when diagnosed). ``trace`` gives the statistics and the
    whole-tensor ranges (its ``summaries``); ``laid_out`` is the view's :func:`layout`
    when the caller has it already."""
    spec = trace.spec
    working = working_formats(spec)
    parts: list[RenderableType] = [header(spec)]
    _, rows, cut_rows, n_positions = laid_out if laid_out is not None else layout(spec, view)
    stages = [s for s in view.stages if s in applicable_stages(spec)]
    nothing_hidden = bool((trace.stats.n_visible == spec.S).all())
    if not view.explicit_stages and nothing_hidden and spec.mask is None:
        stages = [s for s in stages if s != "masked"]  # nothing was masked: it repeats the logits
    if n_positions > view.max_slices or cut_rows or view.max_rows < spec.S:
        parts.append(summary(trace.summaries, stages, trace.hidden))
    for idx, block in shown.items():
        label = slice_label(spec, idx)
        if label:
            parts.append(rule(label, view.width))
        flags = row_flags(trace.stats, diagnosis.thresholds, idx, working) if diagnosis else {}
        for stage in stages:
            parts.append(
                stage_title(stage, spec.options.score_mod, dropout=spec.options.dropout > 0)
            )
            parts.append(
                stage_table(
                    spec, stage, getattr(block, stage), block.visible, view, rows, cut_rows, flags
                )
            )
            parts.append(Text(""))
    parts.extend(more_slices(n_positions, view))
    if diagnosis is not None:
        parts.extend(diagnosis_parts(diagnosis, view, working))
    return Group(*parts)


def diagnosis_parts(
    diagnosis: Diagnosis, view: View, working: tuple[str, ...]
) -> list[RenderableType]:
    """Per-head summaries (several slices), precision (when it matters), findings.

    ``working``: the formats the run uses (the inputs' and ``--dtype``'s)."""
    parts: list[RenderableType] = []
    if len(diagnosis.heads) > 1:
        flagged = {
            f.index
            for f in diagnosis.findings
            if f.kind in ("dead_head", "collapsed_head") and f.index is not None
        }
        parts.append(heads_table(diagnosis.heads, flagged, view.max_rows))
        parts.append(Text(""))
    low_precision = (
        diagnosis.emulation is not None
        or any(f.kind == "overflow" and f.severity != "info" for f in diagnosis.findings)
        or any(d != "float32" for d in working)
    )
    if low_precision:
        panel = precision_panel(diagnosis)
        if panel is not None:
            parts.append(panel)
    parts.append(findings_panel(diagnosis))
    return parts
