"""``sdpa report model`` → rich renderables: a heatmap table per metric, a row per case
and a column per query head, then the notable heads, case by case.

Never prints. The heads that do not fit the width go on in a further table below
(the same rows, the next heads), so every value is shown; long case names lose
what all of them share (``model.layers.‹row›.self_attn``), then their start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from rich import box
from rich.color import Color
from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnosis.model import ModelGrid
from sdpa_cli.names import NOTABLE_HEADS
from sdpa_cli.render.common import MUTED, THEME, note_text, rule
from sdpa_cli.render.grid_words import kind_titles, metric_description, row_labels
from sdpa_cli.render.pages.images import palette
from sdpa_cli.text import compact, plural

PRECISION = 2
"""Decimals of a cell: the metrics are shares and means in [0, 1]."""

SHARES = ("saturated", "near_uniform", "fully_masked")
"""Metrics that count rows: any that is not 0 is at least one row."""


def cell_text(x: float, metric: str) -> str:
    """A cell, three characters for a share or a mean in [0, 1] so that 16 heads fit
    80 columns: ``.84``, ``1``, ``0``, ``<.01`` for a share that is not 0 but would
    read so (one fully masked row in many; a mean that small is rounding, ``0``); the
    error in two significant digits (``.29``, ``1.6e-4``); ``—`` for no value (a
    head with no row to judge)."""
    if math.isnan(x):
        return "—"
    if metric == "error":
        if x != 0 and abs(x) < 0.01:
            mantissa, _, exponent = f"{x:.1e}".partition("e")
            return f"{mantissa}e{int(exponent)}"
        return _no_leading_zero(compact(x, 2))
    if metric in SHARES and 0 < x < 0.005:
        return "<.01"
    return _no_leading_zero(f"{x:.{PRECISION}f}")


def _no_leading_zero(text: str) -> str:
    """``0.84`` → ``.84``; ``1.00`` → ``1``; ``0.00`` → ``0``."""
    if float(text) in (0.0, 1.0):
        return str(int(float(text)))
    return text.removeprefix("0")


RAMP = palette("sequential")
"""The cells' shading, the page's map: viridis, dark (0) to light (the largest)."""


def shade(x: float, top: float) -> Style:
    """A cell's background on the full ramp (0 → ``top``), its text dark or light to read."""
    t = min(max(x / top, 0.0), 1.0) if top > 0 else 0.0
    r, g, b = (int(c) for c in RAMP[round(t * 255)])
    ink = "black" if t > 0.55 else "white"
    return Style(color=ink, bgcolor=Color.from_rgb(r, g, b))


def _cells(grid: ModelGrid, metric: str) -> tuple[list[list[str]], list[list[Text]], float]:
    """Each case's cell per head, as text and as shaded text (blank where the case has
    no such head, ``—`` where the head has no row to judge), and the ramp's top."""
    values, present = grid.values(metric), grid.present(metric)
    finite = values[present & np.isfinite(values)]
    top = 1.0 if metric != "error" else (float(np.abs(finite).max()) if finite.size else 0.0)
    texts: list[list[str]] = []
    styled: list[list[Text]] = []
    for vs, ps in zip(values, present, strict=True):
        row_texts, row_cells = [], []
        for x, p in zip(vs.tolist(), ps.tolist(), strict=True):
            text = cell_text(x, metric) if p else ""
            if not p:
                cell = Text("")
            elif math.isnan(x):
                cell = Text(text, MUTED)
            elif not math.isfinite(x):
                cell = Text(text, THEME["nonfinite"])
            else:
                cell = Text(text, shade(x, top))
            row_texts.append(text)
            row_cells.append(cell)
        texts.append(row_texts)
        styled.append(row_cells)
    return texts, styled, top


def grid_tables(grid: ModelGrid, metric: str, width: int) -> list[RenderableType]:
    """One metric as one heatmap table: a row per case, a column per head; past the
    heads one line holds (16 at 80 columns), each case goes on over more lines (the
    next heads, ``↳16``), never into a second table; a legend of the ramp below."""
    labels, header, _ = row_labels(grid, width)
    texts, styled, top = _cells(grid, metric)
    cell = max([len(f"h{j}") for j in range(grid.heads)] + [len(t) for r in texts for t in r])
    label_width = max([len(header), *(len(x) for x in labels), len(f"↳{grid.heads}")])
    fit = max(1, (width - label_width) // (cell + 1))
    per_line = grid.heads if grid.heads <= fit else 1 << (fit.bit_length() - 1)  # 16, 8, …
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False, show_edge=False)
    table.add_column(header, style=THEME["label"], no_wrap=True, min_width=label_width)
    for j in range(per_line):
        table.add_column(f"h{j}", justify="right", no_wrap=True, min_width=cell)
    for label, cells in zip(labels, styled, strict=True):
        for start in range(0, max(grid.heads, 1), per_line):
            part = cells[start : start + per_line]
            part += [Text("")] * (per_line - len(part))
            table.add_row(Text(label if not start else f"↳{start}"), *part)
    parts: list[RenderableType] = [table]
    if per_line < grid.heads:
        parts.append(
            note_text(f"↳N: the case's heads from hN on, {per_line} a line", width, style=MUTED)
        )
    parts.append(_legend(top if metric == "error" else 1.0, metric))
    return parts


def _legend(top: float, metric: str) -> Text:
    """The ramp in eight steps, its ends named: ``0 ▁▂▃▄▅▆▇█ 1``, each step in its
    colour and its height (without color, in a pipe, the heights still read low to
    high)."""
    legend = Text("  0 ", MUTED)
    for i, glyph in enumerate("▁▂▃▄▅▆▇█"):
        r, g, b = (int(c) for c in RAMP[round(i * 255 / 7)])
        legend.append(glyph, Style(color=Color.from_rgb(r, g, b)))
    end = cell_text(top, metric) if metric == "error" else "1"
    legend.append(f" {end}", MUTED)
    return legend


def _notable_lines(grid: ModelGrid, width: int, max_listed: int) -> list[RenderableType]:
    """The notable heads, kind by kind, a line per case (named in full):
    ``model.layers.3.self_attn: h3 0.97, h5 0.88``."""
    titles = kind_titles(grid.thresholds)
    parts: list[RenderableType] = []
    for kind in NOTABLE_HEADS:
        found = [n for n in grid.notable if n.kind == kind]
        if not found:
            continue
        parts.append(note_text(f"{titles[kind]}: {plural(len(found), 'head')}", width))
        by_case: dict[str, list[str]] = {}
        for n in found[:max_listed]:
            by_case.setdefault(n.case, []).append(f"h{n.head} {cell_text(n.value, kind)}")
        for case, heads in by_case.items():
            line = f"{case}: {', '.join(heads)}"
            parts.append(note_text(line, width, indent=6, first=4))
        if len(found) > max_listed:
            more = len(found) - max_listed
            parts.append(
                note_text(f"… and {more} more (--format json lists every one)", width, indent=4)
            )
    if not parts:
        parts.append(Text("  no attention sink, no dead head, no saturated head", THEME["good"]))
    return parts


def render_model(
    grid: ModelGrid,
    metrics: Sequence[str],
    title: str,
    width: int,
    max_listed: int = 50,
) -> RenderableType:
    """The whole view: a title, each metric's tables (``metrics``, in order), the
    notable heads (at most ``max_listed`` of each kind), the cases not read."""
    n_read = sum(r.heads is not None for r in grid.rows)
    head = Text(f"{title}\n", THEME["title"])
    head.append(
        f"{plural(len(grid.rows), 'case')} × {plural(grid.heads, 'query head')} · "
        "each head's rows pooled over the batch",
        MUTED,
    )
    _, _, label_note = row_labels(grid, width)
    if label_note:
        head.append(f"\n{label_note}", MUTED)
    parts: list[RenderableType] = [head]
    for metric in metrics:
        parts += [Text(""), rule(metric, width)]
        parts.append(note_text(metric_description(metric, grid.thresholds), width, style=MUTED))
        parts.append(Text(""))
        parts += grid_tables(grid, metric, width) if n_read else []
        missing = [
            r.name for r in grid.rows if r.heads is not None and metric not in r.heads.metrics
        ]
        if missing:
            parts.append(note_text(f"no expect-output: {', '.join(missing)}", width, style=MUTED))
    parts += [Text(""), rule("notable heads", width), *_notable_lines(grid, width, max_listed)]
    unread = [r.name for r in grid.rows if r.heads is None]
    if unread:
        parts.append(Text(""))
        parts.append(
            note_text(
                f"not read ({plural(len(unread), 'case')}; the errors above say why): "
                + ", ".join(unread),
                width,
                indent=0,
                style=THEME["note"],
            )
        )
    return Group(*parts)
