"""Trace → rich renderables: heatmap tables, a header, a summary. Never prints.

One theme below. Colors only say what the numbers already say: every cell shows its
value as text, so a piped or colorless table reads the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.style import Style
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnose.rules import Diagnosis, row_flags
from sdpa_cli.engine.block import Block, Trace, applicable_stages
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Moments, working_formats
from sdpa_cli.render.findings import SEVERITY_STYLE, findings_panel, heads_table, precision_panel
from sdpa_cli.text import decimals, shape

THEME = {
    "title": Style(bold=True),
    "label": Style(color="cyan"),
    "muted": Style(dim=True),
    "masked": Style(color="grey50", italic=True),
    "hidden_value": Style(color="grey50", dim=True),
    "note": Style(color="yellow"),
    "leak": Style(color="yellow", bold=True, underline=True),
}
NEGATIVE = (59, 110, 190)  # blue
POSITIVE = (200, 70, 60)  # red
WEIGHT = (230, 150, 30)  # amber
BACKGROUND = (30, 30, 30)

STAGE_TITLES = {
    "raw": ("raw scores", "Q·Kᵀ"),
    "scaled": ("scaled scores", "raw · scale / temperature"),
    "capped": ("soft-capped", "C · tanh(scaled / C)"),
    "biased": ("biased", "+ bias / ALiBi"),
    "masked": ("masked logits", "hidden keys set to the mask value"),
    "weights": ("weights", "softmax over keys"),
    "dropped": ("after dropout", "kept weights / (1 − p)"),
    "output": ("output", "weights · V"),
}


@dataclass(frozen=True)
class View:
    """What to show: which stages and which part of a large tensor."""

    stages: tuple[str, ...]
    batch: int | None = None
    head: int | None = None
    rows: slice | None = None
    keys: slice | None = None
    max_rows: int = 16
    max_slices: int = 1
    precision: int = 4
    width: int = 80
    explicit_stages: bool = False


def _blend(rgb: tuple[int, int, int], t: float) -> Style:
    """A cell style: ``rgb`` at strength t ∈ [0, 1] over the background."""
    t = min(max(t, 0.0), 1.0)
    r, g, b = (round(c0 + (c1 - c0) * t) for c0, c1 in zip(BACKGROUND, rgb, strict=True))
    fg = "black" if (0.299 * r + 0.587 * g + 0.114 * b) > 140 else "white"
    return Style(color=fg, bgcolor=f"rgb({r},{g},{b})")


def cell_style(x: float, stage: str, scale: float) -> Style:
    """Heat color: weights on 0 → 1, other stages diverging around 0 over ±scale."""
    if not math.isfinite(x):
        return Style(color="magenta", bold=True)
    if stage in ("weights", "dropped"):
        return _blend(WEIGHT, x)
    if scale <= 0:
        return Style()
    return _blend(POSITIVE if x >= 0 else NEGATIVE, abs(x) / scale)


def slice_positions(spec: AttentionSpec, view: View) -> list[tuple[int, ...]]:
    """The (…, batch, head) positions to show, filtered by ``--batch`` and ``--head``."""
    picked = []
    for idx in np.ndindex(*spec.lead):
        if view.head is not None and spec.lead and idx[-1] != view.head:
            continue
        if view.batch is not None and len(spec.lead) >= 2 and idx[-2] != view.batch:
            continue
        picked.append(tuple(int(i) for i in idx))
    return picked


def slice_label(spec: AttentionSpec, idx: tuple[int, ...]) -> str:
    """``batch 1 · head 3 (kv head 1)`` for a lead position."""
    if not idx:
        return ""
    parts = [f"axis {a} = {i}" for a, i in enumerate(idx[:-2])]
    if len(idx) >= 2:
        parts.append(f"batch {idx[-2]}")
    head = f"head {idx[-1]}"
    if spec.group > 1:
        head += f" (kv head {idx[-1] // spec.group})"
    parts.append(head)
    return " · ".join(parts)


def header(spec: AttentionSpec, title: str = "sdpa compute") -> RenderableType:
    """Shapes, the scale and every option that changed the computation."""
    o = spec.options
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style=THEME["label"], no_wrap=True)
    grid.add_column(overflow="fold")
    names = spec.names
    for n in ("q", "k", "v", "bias", "mask"):
        if n not in spec.shapes or (n in ("bias", "mask")):
            continue
        source = names.get(n, "")
        origin = f"  {source}" if source and ": " not in source and source != n.upper() else ""
        grid.add_row(n.upper(), Text(f"{shape(spec.shapes[n])}{origin}"))
    queries = "query" if spec.L == 1 else "queries"
    keys = "key" if spec.S == 1 else "keys"
    dims = f"L = {spec.L} {queries}, S = {spec.S} {keys}, E = {spec.E}, Ev = {spec.Ev}"
    if o.heads is not None:
        dims += f", split into {o.heads} heads"
    if spec.group > 1:
        dims += f", grouped-query: {spec.H} query heads share {spec.H // spec.group} kv heads"
    grid.add_row("dims", Text(dims))
    grid.add_row(
        "scores", Text(f"{shape(spec.weights_shape)}   output {shape(spec.merged_output_shape)}")
    )
    scale = spec.scale_label
    if o.temperature != 1:
        scale += f", temperature {o.temperature:g} (effective {spec.scale / o.temperature:.6g})"
    grid.add_row("scale", Text(scale))
    if o.softcap is not None:
        grid.add_row("softcap", Text(f"{o.softcap:g} · tanh(scaled / {o.softcap:g})"))
    if spec.bias is not None:
        grid.add_row("bias", Text(f"{names.get('bias', 'bias')} {shape(spec.shapes['bias'])}"))
    if o.alibi:
        shown = spec.alibi_slopes[:8]
        slopes = ", ".join(f"{s:.4g}" for s in shown) + (", …" if spec.H > 8 else "")
        grid.add_row("ALiBi", Text(f"−slope_h · |i + S − L − j|, slopes {slopes}"))
    for label, text in mask_lines(spec):
        grid.add_row(label, Text(text))
    if o.dropout:
        grid.add_row(
            "dropout", Text(f"p = {o.dropout:g}, seed {o.seed}: kept weights ÷ {1 - o.dropout:g}")
        )
    if o.emulated:
        stored = (
            "every stage stored in " + o.dtype
            if o.logits_dtype == o.dtype
            else f"logits stored in {o.logits_dtype}, weights and output in {o.dtype}"
        )
        how = f"emulated: inputs and {stored}, matmuls accumulated in {o.accumulate}, softmax in {o.softmax_dtype}"
        grid.add_row("dtype", Text(how))
    if o.prescale:
        grid.add_row("prescale", Text("Q and K each × √scale before the matmul: raw = scaled"))
    return Panel(grid, title=title, title_align="left", box=box.ROUNDED, expand=False)


def mask_lines(spec: AttentionSpec) -> list[tuple[str, str]]:
    """One line per mask, plus the alignment and mask value when they matter."""
    o = spec.options
    lines: list[tuple[str, str]] = []
    aligned = o.causal or o.window is not None
    if o.causal:
        rule = "j ≤ i" if o.causal_align == "upper-left" else "j ≤ i + S − L"
        lines.append(("causal", f"{o.causal_align} ({rule})"))
    if o.window is not None:
        left, right = o.window
        lines.append(("window", f"{left} left, {right} right (−{left} ≤ j − i − offset ≤ {right})"))
    if aligned and spec.L != spec.S:
        off = spec.S - spec.L if o.causal_align == "lower-right" else 0
        lines.append(("alignment", f"L ≠ S: {o.causal_align}, diagonal offset {off}"))
    if o.key_lengths is not None:
        per = "per batch item" if len(o.key_lengths) > 1 else "every item"
        lengths = ", ".join(str(n) for n in o.key_lengths)
        lines.append(("key lengths", f"first {lengths} keys valid ({per}; the rest is padding)"))
    if spec.mask is not None:
        kind = "boolean, True = " + ("masked" if o.mask_true_means == "masked" else "may attend")
        if not spec.mask_is_bool:
            kind = "float, added to the logits"
        lines.append(
            ("mask", f"{spec.names.get('mask', 'mask')} {shape(spec.shapes['mask'])}, {kind}")
        )
    if lines:
        lines.append(("mask value", o.mask_value_label))
    return lines


def _window(n: int, chosen: slice | None, cap: int) -> tuple[range, bool]:
    """Indices to show along an axis of length n, and whether some were cut."""
    r = range(n)[chosen] if chosen is not None else range(n)
    return (r[:cap], len(r) > cap)


def rule(text: str, width: int) -> Text:
    """``── text ─────``: a heading across the width."""
    return Text(f"── {text} " + "─" * max(0, width - len(text) - 4), THEME["title"])


def titled(title: str, formula: str) -> Text:
    """``weights  softmax over keys``: a bold name, then a muted formula."""
    return Text.assemble((title, THEME["title"]), "  ", (formula, THEME["muted"]))


def stage_title(stage: str) -> Text:
    """A stage's name and formula."""
    return titled(*STAGE_TITLES[stage])


def stage_table(
    spec: AttentionSpec,
    stage: str,
    data: NDArray[np.float64],
    visible: NDArray[np.bool_],
    view: View,
    rows: range,
    cut_rows: bool,
    flags: dict[int, tuple[str, str]] | None = None,
    extra: Sequence[tuple[str, Sequence[str]]] = (),
) -> RenderableType:
    """One stage of the query rows ``rows`` of a slice as a heatmap table, as many
    columns as the width allows.

    ``data`` holds just those rows (``(len(rows), S)``, or ``(len(rows), Ev)`` for
    the output) and ``visible`` their keys. Flagged rows (``flags``: row → (label,
    severity)) have their label colored by severity; the weights table names the flag
    in a last column. ``extra`` adds (header, one text per row) columns after the
    row sums. Below the table, in words: what was cut, and hidden keys that still
    receive weight.
    """
    flags = flags or {}
    is_output = stage == "output"
    is_weights = stage in ("weights", "dropped")
    shows_masked = stage in ("masked", "weights", "dropped")
    n_cols = spec.Ev if is_output else spec.S
    prefix = "d" if is_output else "k"

    def leaks(r: int, j: int) -> bool:
        """A hidden key that still gets weight: a finite mask value on a fully masked row."""
        return is_weights and float(data[r, j]) != 0.0

    def text_of(r: int, j: int) -> str:
        if not is_output and shows_masked and not visible[r, j] and not leaks(r, j):
            return "masked"
        return decimals(float(data[r, j]), view.precision)

    # Fit columns to the width from the exact cell texts. Each column after the row
    # label costs its text, a space of padding either side and the box's divider.
    positions = range(len(rows))
    every = range(n_cols)
    candidates = (every[view.keys] if view.keys is not None and not is_output else every)[
        : view.max_rows
    ]
    widths = {
        j: max([len(f"{prefix}{j}")] + [len(text_of(r, j)) for r in positions]) for j in candidates
    }
    sums = [decimals(float(data[r].sum()), view.precision) for r in positions] if is_weights else []
    shown_flags = [flags[i][0] for i in rows if i in flags] if is_weights else []
    used = max(len(f"q{spec.L - 1}"), 1)
    used += (max(len(s) for s in sums) + 3) if sums else 0
    used += sum(max([len(h)] + [len(t) for t in texts]) + 3 for h, texts in extra)
    used += (max(len(f) for f in shown_flags) + 3) if shown_flags else 0
    fitted = 0
    for n, j in enumerate(candidates):
        more_follow = n + 1 < n_cols
        if used + widths[j] + 3 + (4 if more_follow else 0) > view.width and fitted:
            break
        used += widths[j] + 3
        fitted += 1
    cols = candidates[:fitted]
    cut_cols = fitted < n_cols

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    table.add_column("", style=THEME["label"], no_wrap=True, min_width=len(f"q{spec.L - 1}"))
    for j in cols:
        table.add_column(f"{prefix}{j}", justify="right", no_wrap=True, min_width=widths[j])
    if cut_cols:
        table.add_column("…", justify="center", no_wrap=True)
    if is_weights:
        table.add_column("Σ", justify="right", style=THEME["muted"], no_wrap=True)
    for header_text, _ in extra:
        table.add_column(header_text, justify="right", no_wrap=True)
    if shown_flags:
        table.add_column("flag", no_wrap=True)

    block = np.ix_(list(positions), list(cols))
    shown = data[block] if len(rows) and len(cols) else np.zeros((0, 0))
    heat_mask = np.isfinite(shown)
    if not is_output and shown.size:
        heat_mask &= visible[block]
    heat = float(np.abs(shown[heat_mask]).max()) if heat_mask.any() else 0.0
    for r, i in enumerate(rows):
        cells: list[Text] = []
        for j in cols:
            x = float(data[r, j])
            if not is_output and not visible[r, j]:
                style = "leak" if leaks(r, j) else "masked" if shows_masked else "hidden_value"
                cells.append(Text(text_of(r, j), THEME[style]))
            else:
                cells.append(Text(text_of(r, j), cell_style(x, stage, heat)))
        if cut_cols:
            cells.append(Text("…", THEME["muted"]))
        if is_weights:
            cells.append(Text(sums[r]))
        for _, texts in extra:
            cells.append(Text(texts[r]))
        flag = flags.get(i)
        if shown_flags:
            cells.append(Text(flag[0], SEVERITY_STYLE[flag[1]]) if flag else Text(""))
        label_style = SEVERITY_STYLE[flag[1]] if flag else THEME["label"]
        table.add_row(Text(f"q{i}", label_style), *cells)
    if cut_rows:
        table.add_row(*[Text("…", THEME["muted"]) for _ in table.columns])
    captions = []
    if cut_rows or cut_cols:
        what = "columns" if is_output else "keys"
        span = f"{cols[0]}–{cols[-1]}" if len(cols) else "none"
        captions.append(
            Text(
                f"rows {rows.start}–{rows.stop - 1} of {spec.L}, {what} {span} of {n_cols} shown",
                THEME["muted"],
            )
        )
    leaking = [
        i for r, i in enumerate(rows) if is_weights and not visible[r].any() and data[r].any()
    ]
    if leaking:
        captions.append(
            Text(
                f"rows {', '.join(f'q{i}' for i in leaking[:6])}{' …' if len(leaking) > 6 else ''} have no visible key, "
                f"yet the finite mask value {spec.options.mask_value_label} spreads their weight "
                "uniformly over hidden keys (a −inf mask gives zeros)",
                THEME["note"],
            )
        )
    if captions:
        return Group(table, *captions)
    return table


def summary(summaries: Mapping[str, Moments], stages: Sequence[str]) -> Table:
    """Range of each stage over the whole tensor (finite, visible values)."""
    table = Table(title="whole tensor", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    for col in ("stage", "min", "max", "mean", "non-finite"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage in stages:
        m = summaries.get(stage)
        if m is None:
            continue
        row = [f"{m.lo:.4g}", f"{m.hi:.4g}", f"{m.mean:.4g}"] if m.count else ["—", "—", "—"]
        table.add_row(stage, *row, str(m.nonfinite))
    return table


def layout(spec: AttentionSpec, view: View) -> tuple[list[tuple[int, ...]], range, bool]:
    """What a ``compute`` table shows: the slices (at most ``--max-slices``), the query
    rows, and whether rows were cut."""
    rows, cut_rows = _window(spec.L, view.rows, view.max_rows)
    return slice_positions(spec, view)[: view.max_slices], rows, cut_rows


def more_slices(n_positions: int, view: View) -> list[RenderableType]:
    """A note on the slices ``--max-slices`` left out (none when none were)."""
    hidden = n_positions - view.max_slices
    if hidden <= 0:
        return []
    return [
        Text(
            f"… {hidden} more {'slice' if hidden == 1 else 'slices'} not shown; "
            "pick one with --batch/--head or raise --max-slices",
            THEME["note"],
        ),
        Text(""),
    ]


def render_compute(
    trace: Trace,
    view: View,
    shown: Mapping[tuple[int, ...], Block],
    diagnosis: Diagnosis | None = None,
) -> RenderableType:
    """The whole ``compute`` view: header, each chosen slice stage by stage (``shown``:
    the blocks of :func:`layout`'s rows), then the per-head summaries, the precision
    report and the findings (when diagnosed). ``trace`` gives the statistics and the
    whole-tensor ranges (its ``summaries``)."""
    spec = trace.spec
    working = working_formats(spec)
    parts: list[RenderableType] = [header(spec)]
    n_positions = len(slice_positions(spec, view))
    _, rows, cut_rows = layout(spec, view)
    stages = [s for s in view.stages if s in applicable_stages(spec)]
    nothing_hidden = bool((trace.stats.n_visible == spec.S).all())
    if not view.explicit_stages and nothing_hidden and spec.mask is None:
        stages = [s for s in stages if s != "masked"]  # nothing was masked: it repeats the logits
    if n_positions > view.max_slices or cut_rows or view.max_rows < spec.S:
        parts.append(summary(trace.summaries, stages))
    for idx, block in shown.items():
        label = slice_label(spec, idx)
        if label:
            parts.append(rule(label, view.width))
        flags = row_flags(trace.stats, diagnosis.thresholds, idx, working) if diagnosis else {}
        for stage in stages:
            parts.append(stage_title(stage))
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
