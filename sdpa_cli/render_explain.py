"""Explanation → rich renderables: the stage walk, the scorecard, the scale comparison.

Never prints. Every color repeats what the text says, so a piped trace reads the same.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import numpy as np
from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnose import Finding, format_index, plural
from sdpa_cli.explain import Explanation, ScaleRun, Scorecard, elsewhere_summary
from sdpa_cli.render import (
    NEGATIVE,
    POSITIVE,
    THEME,
    WEIGHT,
    View,
    fmt,
    header,
    slice_label,
    stage_table,
    stage_title,
)
from sdpa_cli.render_findings import SEVERITY_STYLE, severity_counts

MUTED = Style(dim=True)
FINDINGS_PER_KIND = 3
"""Findings of one kind listed under a stage; the others are counted."""


def _rule(text: str, width: int) -> Text:
    return Text(f"── {text} " + "─" * max(0, width - len(text) - 4), THEME["title"])


def note_text(
    note: str, width: int, indent: int = 2, *, first: int | None = None, style: Style | None = None
) -> Text:
    """Text wrapped to the width, indented (the first line by ``first``, default the
    same), with no trailing spaces, so a piped trace has none either."""
    lines = textwrap.wrap(
        note,
        max(width, 30),
        initial_indent=" " * (indent if first is None else first),
        subsequent_indent=" " * indent,
        break_on_hyphens=False,
        break_long_words=False,
    )
    return Text("\n".join(lines), style=style or "")


def stage_findings(findings: Sequence[Finding], width: int) -> list[RenderableType]:
    """The findings at one stage: a line per kind (worst first), the first message, a hint."""
    by_kind: dict[str, list[Finding]] = {}
    for f in findings:
        by_kind.setdefault(f.kind, []).append(f)
    lines: list[RenderableType] = []
    for kind, group in by_kind.items():
        first = group[0]
        label = kind.replace("_", " ")
        line = note_text(f"{first.severity:<8} {label}  {first.message}", width, 9, first=0)
        line.stylize(SEVERITY_STYLE[first.severity], 0, len(first.severity))
        line.stylize(Style(bold=True), 9, 9 + len(label))
        lines.append(line)
        others = group[1:]
        if others:
            listed = ", ".join(format_index(f.index) for f in others[:FINDINGS_PER_KIND])
            tail = " …" if len(others) > FINDINGS_PER_KIND else ""
            lines.append(
                note_text(f"and {len(others)} more: {listed}{tail}", width, 9, style=MUTED)
            )
        if first.hint:
            lines.append(note_text(f"hint: {first.hint}", width, 9, style=MUTED))
    return lines


def _mask_picture(ex: Explanation, view: View) -> RenderableType | None:
    """The mask over the shown rows: ■ a visible key, · a hidden one. When the keys
    do not fit, each character stands for a run of keys (□: some of them visible),
    unless --keys picks a window."""
    visible = ex.visible
    if visible.all() or not visible.size:
        return None
    S = ex.spec.S
    label = max(len(f"q{ex.spec.L - 1}"), 2)
    room = max(view.width - label - 1, 8)
    window = range(S)[view.keys] if view.keys is not None else range(S)
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
            ("mask", Style(bold=True)),
            (f"  {legend}", MUTED),
            (f"  ({span})" if span else "", MUTED),
        )
    ]
    glyph = "·□■" if per > 1 else "·■"
    for r, i in enumerate(ex.rows):
        row = "".join(glyph[int(v)] for v in cells[r])
        lines.append(Text.assemble((f"q{i}".ljust(label), THEME["label"]), " ", row))
    return Group(*lines)


def _weights_extra(ex: Explanation, view: View) -> list[tuple[str, list[str]]]:
    rs = ex.row_stats

    def num(x: float, digits: int) -> str:
        return "—" if not math.isfinite(x) else f"{x:.{digits}f}"

    ent = [
        num(float(e), 3) if int(n) >= 2 else "—"
        for e, n in zip(rs.normalized_entropy, rs.visible, strict=True)
    ]
    top = [
        num(float(m), view.precision) if int(n) else "—"
        for m, n in zip(rs.max_weight, rs.visible, strict=True)
    ]
    return [("H/Hmax", ent), ("max", top)]


def render_walk(ex: Explanation, view: View) -> list[RenderableType]:
    """Every stage: its title and formula, what it did, its table, its findings."""
    spec = ex.spec
    rows = ex.rows
    cut_rows = False
    flags = dict(ex.row_stats.flags)
    parts: list[RenderableType] = []
    for stage in ex.stages:
        parts.append(stage_title(stage.step))
        parts.append(note_text(stage.note, view.width))
        visible = ex.visible
        extra = _weights_extra(ex, view) if stage.step == "weights" else []
        parts.append(
            stage_table(
                spec,
                stage.step,
                stage.values,
                visible,
                view,
                rows,
                cut_rows,
                flags if stage.step in ("weights", "dropped") else None,
                extra,
            )
        )
        if stage.step == "masked":
            picture = _mask_picture(ex, view)
            if picture is not None:
                parts.append(picture)
        if stage.findings:
            parts.extend(stage_findings(stage.findings, view.width))
        parts.append(Text(""))
    return parts


# --- the scorecard ----------------------------------------------------------------------------

BARS = " ▏▎▍▌▋▊▉█"


def bar(x: float, top: float, width: int) -> str:
    """A left-aligned bar of ``width`` cells for x ∈ [0, top], to an eighth of a cell."""
    if top <= 0 or not math.isfinite(x) or x <= 0:
        return ""
    eighths = round(min(x / top, 1.0) * width * 8)
    if eighths == 0:
        return BARS[1]  # a sliver: nonzero, but too small to draw
    full, part = divmod(eighths, 8)
    return "█" * full + (BARS[part] if part else "")


def diverging_bar(x: float, lo: float, hi: float, width: int) -> Text:
    """A bar from an axis at 0: left for negatives, right for positives."""
    neg = max(-lo, 0.0)
    pos = max(hi, 0.0)
    total = neg + pos
    if total <= 0 or not math.isfinite(x):
        return Text(" " * width)
    left = round(width * neg / total)
    right = width - left
    if x < 0:
        n = max(1, round(-x / neg * left)) if left else 0
        return Text.assemble(
            " " * (left - n), ("█" * n, Style(color=f"rgb{NEGATIVE}")), " " * right
        )
    drawn = bar(x, pos, right)
    return Text.assemble(
        " " * left, (drawn, Style(color=f"rgb{POSITIVE}")), " " * (right - len(drawn))
    )


def _short(x: float) -> str:
    """A vector component in at most 4 significant digits: ``10``, ``-0.5``, ``1.5e-05``."""
    return f"{x:.4g}"


def _vector(values: Sequence[float], precision: int, limit: int = 4) -> str:
    shown = [fmt(float(x), precision) for x in values[:limit]]
    return "[" + ", ".join(shown) + (", …" if len(values) > limit else "") + "]"


def render_scorecard(card: Scorecard, ex: Explanation, view: View) -> list[RenderableType]:
    """Seed 003's scorecard for one query: dot products, scaled scores, weights, contributions."""
    spec = ex.spec
    p = view.precision
    where = slice_label(spec, ex.lead)
    title = f"scorecard · q{card.query}" + (f" · {where}" if where else "")
    parts: list[RenderableType] = [_rule(title, view.width)]
    parts.append(
        Text(
            f"q{card.query} = {_vector(card.q.tolist(), p, 8)}; {plural(spec.S, 'key')}, d_k = "
            f"{spec.E}, scale {spec.scale_label}"
        )
    )
    keys = [card.keys[j] for j in card.shown]
    if keys and keys[0].terms is not None:
        for k in keys:
            assert k.terms is not None
            terms = " + ".join(
                f"{_short(a)}·{_short(b) if b >= 0 else f'({_short(b)})'}" for a, b in k.terms
            )
            line = f"  q{card.query}·k{k.key} = {terms} = {_short(k.raw)}"
            parts.append(Text(line.replace("-", "−")))
    logit_differs = any(k.logit != k.scaled for k in card.keys)
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, show_header=True)
    table.add_column("key", style=THEME["label"], no_wrap=True)
    columns = ["raw", "scaled"] + (["logit"] if logit_differs else []) + ["e^(x−m)", "weight"]
    for c in columns:
        table.add_column(c, justify="right", no_wrap=True)
    fixed = 5 + sum(max(len(c), p + 4) + 1 for c in columns)
    bar_width = max(6, min(14, (view.width - fixed - 4) // 2))
    table.add_column("raw score".ljust(bar_width), no_wrap=True, min_width=bar_width)
    table.add_column("weight".ljust(bar_width), no_wrap=True, min_width=bar_width)
    raws = [k.raw for k in card.keys if math.isfinite(k.raw)]
    lo, hi = (min(raws), max(raws)) if raws else (0.0, 0.0)
    top_weight = max((k.weight for k in card.keys), default=0.0)
    for k in keys:
        cells = [fmt(k.raw, p), fmt(k.scaled, p)]
        if logit_differs:
            cells.append(fmt(k.logit, p) if k.visible else "masked")
        cells.append(fmt(k.exp, p) if k.visible else "—")
        cells.append(fmt(k.weight, p) if k.visible or k.weight else "masked")
        style = THEME["masked"] if not k.visible else Style()
        weight_bar = Text(bar(k.weight, top_weight, bar_width), Style(color=f"rgb{WEIGHT}"))
        table.add_row(
            f"k{k.key}",
            *[Text(c, style) for c in cells],
            diverging_bar(k.raw, lo, hi, bar_width),
            weight_bar,
        )
    parts.append(table)
    rest = spec.S - len(keys)
    if rest:
        parts.append(
            Text(
                f"… {plural(rest, 'other key')} (the heaviest {len(keys)} listed) hold weight "
                f"{fmt(card.rest_weight, p)} together",
                MUTED,
            )
        )
    if math.isfinite(card.logit_max):
        m = fmt(card.logit_max, p)
        plain = card.sum_exp
        raw_sum = f" (Σ e^x = {plain:.6g})" if math.isfinite(plain) and plain > 0 else ""
        parts.append(
            note_text(
                f"m = max logit = {m}; Z = Σ e^(x − m) = {fmt(card.z, p)}{raw_sum}; "
                "weight = e^(x − m) / Z"
                + (f", then dropout (p = {spec.options.dropout:g}) on it" if card.dropout else ""),
                view.width,
                0,
                style=MUTED,
            )
        )
    else:
        parts.append(Text("no visible key: every weight is zero, and so is the output", MUTED))
    parts.append(Text(""))
    parts.append(stage_title_text("contributions", "weight · v_j, summed: the output row"))
    contrib = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, show_header=False)
    contrib.add_column(style=THEME["label"], no_wrap=True)
    contrib.add_column(justify="right", no_wrap=True)
    contrib.add_column(no_wrap=True)
    contrib.add_column(no_wrap=True)
    v = spec.v[spec.operand_index("v", ex.lead)]
    for k in keys:
        contrib.add_row(
            f"k{k.key}",
            fmt(k.weight, p),
            "· "
            + "["
            + ", ".join(_short(float(x)) for x in np.asarray(v[k.key])[:4])
            + (", …]" if spec.Ev > 4 else "]"),
            "= " + _vector(k.contribution.tolist(), p),
        )
    if rest:
        contrib.add_row(
            "rest", fmt(card.rest_weight, p), "", "= " + _vector(card.rest_contribution.tolist(), p)
        )
    contrib.add_row(
        Text(f"q{card.query}", Style(bold=True)),
        "",
        Text("output", Style(bold=True)),
        Text("= " + _vector(card.output.tolist(), p), Style(bold=True)),
    )
    parts.append(contrib)
    flag = ex.row_stats.flags.get(card.query)
    if flag:
        parts.append(Text(f"row q{card.query} is flagged: {flag[0]}", SEVERITY_STYLE[flag[1]]))
    return parts


def stage_title_text(title: str, formula: str) -> Text:
    return Text.assemble((title, THEME["title"]), "  ", (formula, THEME["muted"]))


# --- the scale comparison ---------------------------------------------------------------------


def render_scales(ex: Explanation, view: View) -> list[RenderableType]:
    """Seed 002's example 3 on the data: the weights under each scale, side by side."""
    spec = ex.spec
    runs = ex.scales
    p = view.precision
    where = slice_label(spec, ex.lead)
    parts: list[RenderableType] = [
        _rule("scales compared" + (f" · {where}" if where else ""), view.width)
    ]
    if ex.variance is not None and math.isfinite(ex.variance.predicted_raw_std):
        v = ex.variance
        parts.append(
            note_text(
                f"Raw scores: std {v.raw_std:.4g} over the slice; independent components "
                f"would give √d_k·σ_q·σ_k = √{v.E}·{v.sigma_q:.4g}·{v.sigma_k:.4g} = "
                f"{v.predicted_raw_std:.4g}.",
                view.width,
                0,
            )
        )
    summary = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False)
    summary.add_column("", style=THEME["label"], no_wrap=True)
    for run in runs:
        summary.add_column(run.label + (" ◂" if run.current else ""), justify="right")
    summary.add_row("logit std", *[f"{r.logit_std:.4g}" for r in runs])
    for r_pos, i in enumerate(ex.rows[: view.max_rows]):
        summary.add_row(
            f"q{i} max · H",
            *[
                f"{fmt(float(r.max_weight[r_pos]), p)} · {float(r.normalized_entropy[r_pos]):.2f}"
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
        parts.append(stage_title_text("weights", run.label))
        parts.append(stage_table(spec, "weights", run.weights, ex.visible, view, ex.rows, False))
    if ex.scales_verdict:
        parts.append(note_text(ex.scales_verdict, view.width, 0, style=Style(bold=True)))
    return parts


def _verdict_style(run: ScaleRun) -> Style:
    if run.verdict.startswith("balanced"):
        return Style(color="green", bold=True)
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
        parts.append(_rule(" · ".join(x for x in (where, shown) if x), view.width))
    if ex.input_findings:
        parts.append(stage_title_text("inputs", "found before any stage"))
        parts.extend(stage_findings(ex.input_findings, view.width))
        parts.append(Text(""))
    if walk:
        parts.extend(render_walk(ex, view))
    if ex.scorecard is not None:
        parts.extend(render_scorecard(ex.scorecard, ex, view))
        parts.append(Text(""))
    if ex.scales:
        parts.extend(render_scales(ex, view))
        parts.append(Text(""))
    if not walk:
        here = [f for s in ex.stages for f in s.findings]
        if here:
            parts.append(stage_title_text("findings", "in this slice"))
            parts.extend(stage_findings(here, view.width))
            parts.append(Text(""))
    parts.extend(_closing(ex, walk, view.width))
    return Group(*parts)


def _closing(ex: Explanation, walk: bool, width: int) -> list[RenderableType]:
    """One line on the findings: how many in all, how many here, where the others are."""
    if not ex.diagnosis.findings:
        line = note_text(
            "findings  none: no saturated, uniform or fully masked rows, no non-finite "
            "values, no overflow or underflow",
            width,
            2,
            first=0,
            style=MUTED,
        )
        line.stylize(Style(bold=True, dim=False), 0, 8)
        line.stylize(Style(color="green", bold=True, dim=False), 10, 15)
        return [line]
    here = sum(len(s.findings) for s in ex.stages) + len(ex.input_findings)
    line = note_text(
        f"findings  {severity_counts(ex.diagnosis)} in the whole input; "
        + (
            "none in this slice"
            if not here
            else f"{plural(here, 'finding')} in this slice"
            + (", shown at their stage" if walk else "")
        ),
        width,
        2,
        first=0,
    )
    line.stylize(Style(bold=True), 0, 8)
    lines: list[RenderableType] = [line]
    other = elsewhere_summary(ex.elsewhere, ex.lead)
    if other:
        lines.append(note_text(f"{other} (sdpa compute lists them all)", width, 2, style=MUTED))
    return lines
