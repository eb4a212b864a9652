"""Explanation → rich renderables: the stage walk, the scorecard, the scale comparison.

Never prints. Every color repeats what the text says, so a piped trace reads the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnosis.explain import elsewhere_summary
from sdpa_cli.diagnosis.explained import Explanation
from sdpa_cli.diagnosis.scales import ScaleRun
from sdpa_cli.diagnosis.scorecard import KeyScore, Scorecard
from sdpa_cli.render.common import (
    MUTED,
    NEGATIVE,
    POSITIVE,
    SEVERITY_STYLE,
    THEME,
    WEIGHT,
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
    """A bar of ``width`` cells from an axis at 0: left for negatives (to half a
    cell), right for positives (to an eighth)."""
    neg = max(-lo, 0.0)
    pos = max(hi, 0.0)
    total = neg + pos
    if total <= 0 or not math.isfinite(x):
        return Text(" " * width)
    left = round(width * neg / total)
    right = width - left
    if x < 0:
        halves = round(-x / neg * left * 2) if left else 0
        full, half = divmod(halves, 2)
        drawn = ("▐" if half else "") + "█" * full
        if not drawn and left:
            drawn = "▕"  # a sliver: nonzero, but too small to draw
        return Text.assemble(
            " " * (left - len(drawn)), (drawn, Style(color=f"rgb{NEGATIVE}")), " " * right
        )
    drawn = bar(x, pos, right)
    return Text.assemble(
        " " * left, (drawn, Style(color=f"rgb{POSITIVE}")), " " * (right - len(drawn))
    )


def _vector(values: Sequence[float | str], precision: int | None, limit: int = 4) -> str:
    """``[1.0000, 2.0000, …]``: the first ``limit`` values, in ``precision`` decimals
    (or as given, for strings)."""
    shown = [
        x if isinstance(x, str) else decimals(float(x), precision or 0) for x in values[:limit]
    ]
    return "[" + ", ".join(shown) + (", …" if len(values) > limit else "") + "]"


def render_scorecard(card: Scorecard, ex: Explanation, view: View) -> list[RenderableType]:
    """The scorecard for one query: dot products, scaled scores, weights, contributions."""
    spec = ex.spec
    p = view.precision
    where = slice_label(spec, ex.lead)
    title = f"scorecard · q{card.query}" + (f" · {where}" if where else "")
    parts: list[RenderableType] = [rule(title, view.width)]
    parts.append(
        note_text(
            f"q{card.query} = {_vector(card.q.tolist(), p, 8)}; {plural(spec.S, 'key')}, d_k = "
            f"{spec.E}, scale {spec.scale_label}",
            view.width,
            2,
            first=0,
        )
    )
    keys = [card.keys[j] for j in card.shown]
    parts.extend(_dot_products(card, keys, view.width))
    parts.append(_score_table(card, keys, view))
    if len(keys) < spec.S:
        parts.append(
            note_text(_listed_note(card, len(keys), p), view.width, 2, first=0, style=MUTED)
        )
    parts.append(_softmax_note(card, ex, view))
    parts.append(Text(""))
    parts.append(titled("contributions", "weight · v_j, summed: the output row"))
    parts.extend(_contributions(card, ex, keys, view))
    flag = ex.row_stats.flags.get(card.query)
    if flag:
        parts.append(Text(f"row q{card.query} is flagged: {flag[0]}", SEVERITY_STYLE[flag[1]]))
    return parts


def _factor(x: float) -> str:
    """A factor of a product: a negative one in parentheses, first or second alike,
    ``(-0.49)·(-0.46)``, so every term reads as written and ``+`` joins them all
    (−0 and −inf too: the sign decides, as written)."""
    text = sig(x)
    return f"({text})" if text.startswith("-") else text


def _listed_note(card: Scorecard, listed: int, precision: int) -> str:
    """Which keys a scorecard of more keys than it lists shows, and what the others
    weigh: ``… only 6 of the 40 keys are visible: all listed, heaviest first; the 34
    masked keys hold weight 0.0000 together``."""
    S, seen = len(card.keys), card.n_visible
    masked, rest = S - seen, S - listed
    weight = f"hold weight {decimals(card.rest_weight, precision)} together"
    if not seen:
        return f"… no key is visible: the heaviest {listed} of the {S} listed; the other {rest} {weight}"
    if seen <= listed:
        shown = "is visible, listed" if seen == 1 else "are visible: all listed, heaviest first"
        return f"… only {seen} of the {S} keys {shown}; the {plural(masked, 'masked key')} {weight}"
    if masked:
        return (
            f"… the heaviest {listed} of the {seen} visible keys listed, heaviest first; the "
            f"other {plural(rest, 'key')} ({masked} of them masked) {weight}"
        )
    return (
        f"… the heaviest {listed} of the {S} keys listed, heaviest first; the other {rest} {weight}"
    )


def _dot_products(card: Scorecard, keys: Sequence[KeyScore], width: int) -> list[RenderableType]:
    """``q0·k1 = 1·2 + (-0.5)·(-1) = 2.5`` per listed key, when the terms are few
    enough to list."""
    if not keys or keys[0].terms is None:
        return []
    lines: list[RenderableType] = []
    for k in keys:
        assert k.terms is not None
        terms = " + ".join(f"{_factor(a)}·{_factor(b)}" for a, b in k.terms)
        line = f"q{card.query}·k{k.key} = {terms} = {sig(k.raw)}"
        lines.append(note_text(line, width, 4, first=2))
    return lines


def _score_table(card: Scorecard, keys: Sequence[KeyScore], view: View) -> Table:
    """Per listed key: raw, scaled (and logit, when they differ), e^(x−m), weight, and
    bars of the raw score (diverging around 0) and of the weight."""
    p = view.precision
    logit_differs = any(k.logit != k.scaled for k in card.keys)
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, show_header=True)
    table.add_column("key", style=THEME["label"], no_wrap=True)
    columns = ["raw", "scaled"] + (["logit"] if logit_differs else []) + ["e^(x−m)", "weight"]
    for c in columns:
        table.add_column(c, justify="right", no_wrap=True)
    fixed = 5 + sum(max(len(c), p + 4) + 1 for c in columns)
    bar_width = max(6, min(14, (view.width - fixed - 4) // 2))
    table.add_column("raw score".ljust(bar_width), no_wrap=True, min_width=bar_width)
    table.add_column("weight", no_wrap=True, min_width=bar_width)
    raws = [k.raw for k in card.keys if math.isfinite(k.raw)]
    lo, hi = (min(raws), max(raws)) if raws else (0.0, 0.0)
    top_weight = max((k.weight for k in card.keys), default=0.0)
    for k in keys:
        cells = [decimals(k.raw, p), decimals(k.scaled, p)]
        if logit_differs:
            cells.append(decimals(k.logit, p) if k.visible else "masked")
        cells.append(decimals(k.exp, p) if k.visible or k.exp else "—")
        cells.append(decimals(k.weight, p) if k.visible or k.weight else "masked")
        style = THEME["masked"] if not k.visible else Style()
        weight_bar = Text(bar(k.weight, top_weight, bar_width), Style(color=f"rgb{WEIGHT}"))
        table.add_row(
            Text(f"k{k.key}"),
            *[Text(c, style) for c in cells],
            diverging_bar(k.raw, lo, hi, bar_width),
            weight_bar,
        )
    return table


def _softmax_note(card: Scorecard, ex: Explanation, view: View) -> Text:
    """``m = max logit; Z = Σ e^(x − m); weight = e^(x − m) / Z`` on the query's numbers."""
    p = view.precision
    if not math.isfinite(card.logit_max):
        return Text("no visible key: every weight is zero, and so is the output", MUTED)
    m = decimals(card.logit_max, p)
    plain = card.sum_exp
    raw_sum = f" (Σ e^x = {sig(plain, 6)})" if math.isfinite(plain) and plain > 0 else ""
    dropout = ex.spec.options.dropout
    return note_text(
        f"m = max logit = {m}; Z = Σ e^(x − m) = {decimals(card.z, p)}{raw_sum}; "
        "weight = e^(x − m) / Z"
        + (f", then dropout (p = {sig(dropout, 6)}) on it" if card.dropout else ""),
        view.width,
        2,
        first=0,
        style=MUTED,
    )


def _contributions(
    card: Scorecard, ex: Explanation, keys: Sequence[KeyScore], view: View
) -> list[RenderableType]:
    """``k0  0.881645 · [10, 0]  = [8.8165, 0.0000]`` per key, then the output row.

    The weight gets two more digits than the tables, so the products can be checked
    by hand. When the lines would pass the width, v_j is named instead of written
    out, then fewer columns are shown (the rest as …).
    """
    spec = ex.spec
    p = view.precision
    v = np.asarray(spec.v[spec.operand_index("v", ex.lead)], dtype=np.float64)
    labels = [f"k{k.key}" for k in keys] + (["rest"] if len(keys) < spec.S else [])
    weights = [decimals(k.weight, p + 2) for k in keys]
    if len(keys) < spec.S:
        weights.append(decimals(card.rest_weight, p + 2))
    label_w = max([len(f"q{card.query}"), *map(len, labels)])
    weight_w = max([0, *map(len, weights)])

    def layout(dims: int, named: bool) -> list[tuple[str, str, str, str]]:
        rows = []
        for n, k in enumerate(keys):
            vj = f"v{k.key}" if named else _vector([sig(float(x)) for x in v[k.key]], None, dims)
            rows.append(
                (labels[n], weights[n], f"· {vj}", "= " + _vector(k.contribution.tolist(), p, dims))
            )
        if len(keys) < spec.S:
            rows.append(
                ("rest", weights[-1], "", "= " + _vector(card.rest_contribution.tolist(), p, dims))
            )
        rows.append((f"q{card.query}", "", "output", "= " + _vector(card.output.tolist(), p, dims)))
        return rows

    def width(rows: list[tuple[str, str, str, str]]) -> int:
        vw = max(len(r[2]) for r in rows)
        return max(label_w + 2 + weight_w + 1 + vw + 2 + len(r[3]) for r in rows)

    rows = layout(spec.Ev, False)
    if width(rows) > view.width:
        rows = layout(spec.Ev, True)
    dims = spec.Ev
    while width(rows) > view.width and dims > 1:
        dims -= 1
        rows = layout(dims, True)
    vw = max(len(r[2]) for r in rows)
    out: list[RenderableType] = []
    for n, (label, weight, vj, result) in enumerate(rows):
        last = n == len(rows) - 1
        line = Text.assemble(
            (label.ljust(label_w), THEME["title"] if last else THEME["label"]),
            "  ",
            weight.rjust(weight_w),
            " ",
            (vj.ljust(vw), THEME["title"] if last else Style()),
            "  ",
            (result, THEME["title"] if last else Style()),
        )
        out.append(line)
    return out


# --- the scale comparison ---------------------------------------------------------------------


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
