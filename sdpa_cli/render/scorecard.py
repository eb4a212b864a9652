"""A query's scorecard as rich renderables: its dot products, scaled scores, weights
and contributions, with bars that repeat the numbers.

Never prints. Every color repeats what the text says, so a piped trace reads the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from rich.console import RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnosis.explained import Explanation
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
    titled,
)
from sdpa_cli.text import decimals, plural, sig

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
