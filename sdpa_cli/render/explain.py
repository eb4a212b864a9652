"""Explanation → rich renderables: the stage walk, the scorecard (:mod:`~sdpa_cli.render.
scorecard`), the scale comparison.

Never prints. Every color repeats what the text says, so a piped trace reads the same.
"""

from __future__ import annotations

import math

import numpy as np
from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnosis.explain import elsewhere_summary
from sdpa_cli.diagnosis.explained import Explanation
from sdpa_cli.diagnosis.scales import ScaleRun
from sdpa_cli.render.common import (
    MUTED,
    SEVERITY_STYLE,
    THEME,
    View,
    note_text,
    rule,
    slice_label,
    stage_title,
    titled,
)
from sdpa_cli.render.explain_grad import render_backward
from sdpa_cli.render.findings import NOTHING_FOUND, severity_counts, stage_findings
from sdpa_cli.render.header import header
from sdpa_cli.render.heatmap import stage_table
from sdpa_cli.render.scorecard import render_scorecard
from sdpa_cli.text import decimals, plural, sig

UNDIMMED = Style(dim=False)
"""Added to a style inside a muted line: that part reads at full strength."""


def _mask_picture(ex: Explanation, view: View, n_rows: int) -> RenderableType | None:
    """The mask over the shown rows: ■ a visible key, · a hidden one. When the keys
    do not fit, each character stands for a run of keys (□: some of them visible),
    unless --keys picks a window."""
    visible = ex.visible[:n_rows]
    if visible.all() or not visible.size:
        return None
    S = ex.spec.S
    label = max(len(f"q{ex.spec.L - 1}"), 2)
    room = max(view.width - label - 1, 8)
    window = view.key_columns(S)
    per = 1 if len(window) <= room or view.keys is not None else math.ceil(S / room)
    if per == 1:
        window = window[:room]
        cells = visible[:, window.start : window.stop]
        legend = "■ visible  · hidden"
        span = f"keys {window.start}–{window.stop - 1} of {S}" if len(window) < S else ""
    else:
        n = math.ceil(S / per)
        padded = np.zeros((visible.shape[0], n * per), dtype=np.int64)
        padded[:, :S] = visible
        counts = padded.reshape(visible.shape[0], n, per).sum(axis=2)
        sizes = np.minimum(per, S - np.arange(n) * per)
        cells = np.where(counts == sizes, 2, np.where(counts > 0, 1, 0))
        legend = "■ visible  □ partly  · hidden"
        span = f"{per} keys per character"
    lines: list[RenderableType] = [
        Text.assemble(
            ("mask", THEME["title"]),
            (f"  {legend}", MUTED),
            (f"  ({span})" if span else "", MUTED),
        )
    ]
    glyph = "·□■" if per > 1 else "·■"
    for r, i in enumerate(ex.rows[:n_rows]):
        row = "".join(glyph[int(v)] for v in cells[r])
        lines.append(Text.assemble((f"q{i}".ljust(label), THEME["label"]), " ", row))
    return Group(*lines)


def _weights_extra(ex: Explanation, view: View, n: int) -> list[tuple[str, list[str]]]:
    """The weights table's H/Hmax and max columns for the first ``n`` shown rows."""
    rs = ex.row_stats

    def num(x: float, digits: int) -> str:
        return "—" if not math.isfinite(x) else f"{x:.{digits}f}"

    ent = [
        num(float(e), 3) if int(keys) >= 2 else "—"
        for e, keys in zip(rs.normalized_entropy[:n], rs.visible[:n], strict=True)
    ]
    top = [
        num(float(m), view.precision) if int(keys) else "—"
        for m, keys in zip(rs.max_weight[:n], rs.visible[:n], strict=True)
    ]
    return [("H/Hmax", ent), ("max", top)]


def render_walk(ex: Explanation, view: View) -> list[RenderableType]:
    """Every stage: its title and formula, what it did, its table, its findings."""
    spec = ex.spec
    # --rows may ask for more rows than a table shows: the JSON has them all.
    rows = ex.rows[: view.max_rows]
    cut_rows = len(rows) < len(ex.rows)
    n = len(rows)
    flags = dict(ex.row_stats.flags)
    parts: list[RenderableType] = []
    for stage in ex.stages:
        parts.append(
            stage_title(stage.step, spec.options.score_mod, dropout=spec.options.dropout > 0)
        )
        parts.append(note_text(stage.note, view.width))
        extra = _weights_extra(ex, view, n) if stage.step == "weights" else []
        parts.append(
            stage_table(
                spec,
                stage.step,
                stage.values[:n],
                ex.visible[:n],
                view,
                rows,
                cut_rows,
                flags if stage.step in ("weights", "dropped") else None,
                extra,
            )
        )
        if stage.step == "weights" and spec.S:
            parts.append(
                Text("H/Hmax: entropy ÷ log(visible keys); max: the largest weight", MUTED)
            )
        if stage.step == "masked":
            picture = _mask_picture(ex, view, n)
            if picture is not None:
                parts.append(picture)
        if stage.findings:
            parts.extend(stage_findings(stage.findings, view.width))
        parts.append(Text(""))
    return parts


# --- the scale comparison -----------------------------------------------------------------


def render_scales(ex: Explanation, view: View) -> list[RenderableType]:
    """Raw scores [0, d_k, 2·d_k] on the data: the weights under each scale, side by side."""
    spec = ex.spec
    runs = ex.scales
    p = view.precision
    where = slice_label(spec, ex.lead)
    parts: list[RenderableType] = [
        rule("scales compared" + (f" · {where}" if where else ""), view.width)
    ]
    if ex.variance is not None and math.isfinite(ex.variance.predicted_raw_std):
        v = ex.variance
        parts.append(
            note_text(
                f"Raw scores: std {sig(v.raw_std)} over the slice; independent components "
                f"would give √d_k·σ_q·σ_k = √{v.E}·{sig(v.sigma_q)}·{sig(v.sigma_k)} = "
                f"{sig(v.predicted_raw_std)}.",
                view.width,
                0,
            )
        )
    summary = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False)
    summary.add_column("", style=THEME["label"], no_wrap=True)
    for run in runs:
        summary.add_column(run.label + (" ◂" if run.current else ""), justify="right")
    summary.add_row("logit std", *[sig(r.logit_std) for r in runs])
    for r_pos, i in enumerate(ex.rows[: view.max_rows]):
        summary.add_row(
            f"q{i} max · H",
            *[
                f"{decimals(float(r.max_weight[r_pos]), p)} · {float(r.normalized_entropy[r_pos]):.2f}"
                for r in runs
            ],
        )
    summary.add_row("one-hot rows", *[f"{r.saturated} of {r.rows}" for r in runs])
    summary.add_row("uniform rows", *[f"{r.uniform} of {r.rows}" for r in runs])
    summary.add_row(
        "verdict",
        *[Text(r.verdict.split(":")[0], _verdict_style(r)) for r in runs],
    )
    parts.append(summary)
    parts.append(Text("max = largest weight; H = entropy ÷ log(visible keys); ◂ this run", MUTED))
    parts.append(Text(""))
    for run in runs:
        parts.append(titled("weights", run.label))
        parts.append(stage_table(spec, "weights", run.weights, ex.visible, view, ex.rows, False))
    if ex.scales_verdict:
        parts.append(note_text(ex.scales_verdict, view.width, 0, style=THEME["title"]))
    return parts


def _verdict_style(run: ScaleRun) -> Style:
    if run.verdict.startswith("balanced"):
        return THEME["ok"]
    if run.verdict.startswith(("saturated", "too flat")):
        return SEVERITY_STYLE["warning"]
    return Style()


# --- the whole view ---------------------------------------------------------------------------


def render_explain(ex: Explanation, view: View, *, walk: bool = True) -> RenderableType:
    """Header, the slice, the walk (or the scorecard and the scale comparison), a summary."""
    spec = ex.spec
    parts: list[RenderableType] = [header(spec, "sdpa explain")]
    if walk:
        where = slice_label(spec, ex.lead)
        rows = ex.rows
        span = f"q{rows.start}" if len(rows) == 1 else f"q{rows.start}–q{rows.stop - 1}"
        shown = f"rows {span} of {spec.L}" if len(rows) < spec.L else plural(spec.L, "row")
        parts.append(rule(" · ".join(x for x in (where, shown) if x), view.width))
    if ex.input_findings:
        parts.append(titled("inputs", "found before any stage"))
        parts.extend(stage_findings(ex.input_findings, view.width))
        parts.append(Text(""))
    if walk:
        parts.extend(render_walk(ex, view))
    if ex.backward is not None:
        parts.extend(render_backward(ex, view))
    if ex.scorecard is not None:
        parts.extend(render_scorecard(ex.scorecard, ex, view))
        parts.append(Text(""))
    if ex.scales:
        parts.extend(render_scales(ex, view))
        parts.append(Text(""))
    if not walk:
        here = [f for s in ex.stages for f in s.findings]
        if here:
            parts.append(titled("findings", "in this slice"))
            parts.extend(stage_findings(here, view.width))
            parts.append(Text(""))
    parts.extend(_closing(ex, walk, view.width))
    return Group(*parts)


def _closing(ex: Explanation, walk: bool, width: int) -> list[RenderableType]:
    """One line on the findings: how many in all, how many here, where the others are."""
    if not ex.diagnosis.findings:
        line = note_text(
            "findings  none: " + NOTHING_FOUND,
            width,
            2,
            first=0,
            style=MUTED,
        )
        line.stylize(THEME["title"] + UNDIMMED, 0, 8)  # the rest of the line stays muted
        line.stylize(THEME["ok"] + UNDIMMED, 10, 15)
        return [line]
    here = sum(len(s.findings) for s in ex.stages) + len(ex.input_findings)
    line = note_text(
        f"findings  {severity_counts(ex.diagnosis)} in the whole input; "
        + (
            "none in this slice"
            if not here
            else f"{plural(here, 'finding')} in this slice"
            + ((", shown at its stage" if here == 1 else ", shown at their stage") if walk else "")
        ),
        width,
        2,
        first=0,
    )
    line.stylize(THEME["title"], 0, 8)
    lines: list[RenderableType] = [line]
    other = elsewhere_summary(ex.elsewhere, ex.lead)
    if other:
        lines.append(note_text(f"{other} (sdpa compute lists them all)", width, 2, style=MUTED))
    return lines
