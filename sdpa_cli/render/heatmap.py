"""Heatmap tables: one stage of a slice (:func:`stage_table`) and a gradient matrix
(:func:`matrix_table`), as many columns as the width allows, what was cut said below.

Every cell shows its value as text; the heat color only repeats it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.render.common import SEVERITY_STYLE, THEME, View, cell_style
from sdpa_cli.text import decimals


def fit_columns(widths: Sequence[int], used: int, total: int, width: int) -> int:
    """How many of the columns ``widths`` (in order) fit in ``width`` cells after the
    ``used`` ones. Each costs its text, a space of padding either side and the box's
    divider (+3); while more of the ``total`` columns follow, room stays for a ``…``
    column (+4). The first column is always shown."""
    fitted = 0
    for n, w in enumerate(widths):
        more_follow = n + 1 < total
        if used + w + 3 + (4 if more_follow else 0) > width and fitted:
            break
        used += w + 3
        fitted += 1
    return fitted


# --- a stage of a slice -----------------------------------------------------------------------


@dataclass(frozen=True)
class _StageCells:
    """One stage's values over the shown query rows, as cell texts and styles.

    ``data`` is ``(rows, S)`` (``(rows, Ev)`` for the output), ``visible`` ``(rows, S)``.
    """

    stage: str
    data: NDArray[np.float64]
    visible: NDArray[np.bool_]
    precision: int

    @property
    def is_output(self) -> bool:
        return self.stage == "output"

    @property
    def is_weights(self) -> bool:
        return self.stage in ("weights", "dropped")

    @property
    def shows_masked(self) -> bool:
        """Stages from the mask on write ``masked`` in a hidden key's cell."""
        return self.stage in ("masked", "weights", "dropped")

    def leaks(self, r: int, j: int) -> bool:
        """A hidden key that still gets weight: a finite mask value on a fully masked row."""
        return self.is_weights and float(self.data[r, j]) != 0.0

    def text(self, r: int, j: int) -> str:
        if (
            not self.is_output
            and self.shows_masked
            and not self.visible[r, j]
            and not self.leaks(r, j)
        ):
            return "masked"
        return decimals(float(self.data[r, j]), self.precision)

    def cell(self, r: int, j: int, heat: float) -> Text:
        """The cell's text, colored by its value over ±``heat`` (hidden keys: grey)."""
        if not self.is_output and not self.visible[r, j]:
            style = (
                "leak" if self.leaks(r, j) else "masked" if self.shows_masked else "hidden_value"
            )
            return Text(self.text(r, j), THEME[style])
        x = float(self.data[r, j])
        return Text(self.text(r, j), cell_style(x, heat, weights=self.is_weights))

    def heat(self, n_rows: int, cols: range) -> float:
        """The largest finite magnitude among the shown cells (visible keys only): the
        diverging palette's scale."""
        block = np.ix_(list(range(n_rows)), list(cols))
        shown = self.data[block] if n_rows and len(cols) else np.zeros((0, 0))
        heat_mask = np.isfinite(shown)
        if not self.is_output and shown.size:
            heat_mask &= self.visible[block]
        return float(np.abs(shown[heat_mask]).max()) if heat_mask.any() else 0.0


def _side_width(
    sums: Sequence[str], extra: Sequence[tuple[str, Sequence[str]]], flags: Sequence[str]
) -> int:
    """Cells the columns after the keys take: Σ, the ``extra`` ones, the flag."""
    used = (max(len(s) for s in sums) + 3) if sums else 0
    used += sum(max([len(h)] + [len(t) for t in texts]) + 3 for h, texts in extra)
    return used + ((max(len(f) for f in flags) + 3) if flags else 0)


def _fit_stage_columns(
    cells: _StageCells, view: View, n_rows: int, n_cols: int, prefix: str, used: int
) -> tuple[range, dict[int, int]]:
    """The key (or output) columns that fit the width, from ``--keys`` (at most
    ``--max-rows``), and the width of each candidate, from its exact cell texts."""
    chosen = range(n_cols) if cells.is_output else view.key_columns(n_cols)
    candidates = chosen[: view.max_rows]
    widths = {
        j: max([len(f"{prefix}{j}")] + [len(cells.text(r, j)) for r in range(n_rows)])
        for j in candidates
    }
    fitted = fit_columns([widths[j] for j in candidates], used, n_cols, view.width)
    return candidates[:fitted], widths


def _stage_captions(
    spec: AttentionSpec, cells: _StageCells, rows: range, cols: range, cut: bool, n_cols: int
) -> list[Text]:
    """In words, below the table: what was cut, and rows whose hidden keys still get weight."""
    captions = []
    if cut:
        what = "columns" if cells.is_output else "keys"
        span = f"{cols[0]}–{cols[-1]}" if len(cols) else "none"
        captions.append(
            Text(
                f"rows {rows.start}–{rows.stop - 1} of {spec.L}, {what} {span} of {n_cols} shown",
                THEME["muted"],
            )
        )
    leaking = [
        i
        for r, i in enumerate(rows)
        if cells.is_weights and not cells.visible[r].any() and cells.data[r].any()
    ]
    if leaking:
        # A float mask's finite sentinel is added, so it leaves the row's weight where the
        # logits put it; a finite mask value replaces the logits: uniform weights.
        sentinels = spec.sentinels
        how = f"the finite mask value {spec.options.mask_value_label} spreads their weight uniformly over hidden keys"
        if sentinels is not None and sentinels.finite:
            how = f"the {spec.mask_kind} mask's finite sentinel {sentinels.label()} leaves their weight on the keys it hides"
        captions.append(
            Text(
                f"rows {', '.join(f'q{i}' for i in leaking[:6])}{' …' if len(leaking) > 6 else ''} have no visible key, "
                f"yet {how} (a −inf mask gives zeros)",
                THEME["note"],
            )
        )
    return captions


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
    cells = _StageCells(stage, data, visible, view.precision)
    n_cols = spec.Ev if cells.is_output else spec.S
    prefix = "d" if cells.is_output else "k"
    n_rows = len(rows)
    sums = (
        [decimals(float(data[r].sum()), view.precision) for r in range(n_rows)]
        if cells.is_weights
        else []
    )
    shown_flags = [flags[i][0] for i in rows if i in flags] if cells.is_weights else []
    label_width = len(f"q{spec.L - 1}")
    used = max(label_width, 1) + _side_width(sums, extra, shown_flags)
    cols, widths = _fit_stage_columns(cells, view, n_rows, n_cols, prefix, used)
    cut_cols = len(cols) < n_cols

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    table.add_column("", style=THEME["label"], no_wrap=True, min_width=label_width)
    for j in cols:
        table.add_column(f"{prefix}{j}", justify="right", no_wrap=True, min_width=widths[j])
    if cut_cols:
        table.add_column("…", justify="center", no_wrap=True)
    if cells.is_weights:
        table.add_column("Σ", justify="right", style=THEME["muted"], no_wrap=True)
    for header_text, _ in extra:
        table.add_column(header_text, justify="right", no_wrap=True)
    if shown_flags:
        table.add_column("flag", no_wrap=True)

    heat = cells.heat(n_rows, cols)
    for r, i in enumerate(rows):
        row = [cells.cell(r, j, heat) for j in cols]
        if cut_cols:
            row.append(Text("…", THEME["muted"]))
        if cells.is_weights:
            row.append(Text(sums[r]))
        row.extend(Text(texts[r]) for _, texts in extra)
        flag = flags.get(i)
        if shown_flags:
            row.append(Text(flag[0], SEVERITY_STYLE[flag[1]]) if flag else Text(""))
        label_style = SEVERITY_STYLE[flag[1]] if flag else THEME["label"]
        table.add_row(Text(f"q{i}", label_style), *row)
    if cut_rows:
        table.add_row(*[Text("…", THEME["muted"]) for _ in table.columns])
    captions = _stage_captions(spec, cells, rows, cols, cut_rows or cut_cols, n_cols)
    if captions:
        return Group(table, *captions)
    return table


# --- a gradient matrix ------------------------------------------------------------------------


def matrix_table(
    values: NDArray[np.float64],
    rows: range,
    cols: range,
    row_prefix: str,
    col_prefix: str,
    view: View,
    extra: Sequence[tuple[str, Sequence[Text]]] = (),
    *,
    row_offset: int = 0,
) -> RenderableType:
    """Rows ``rows`` and columns ``cols`` of ``values`` as a heat table (diverging
    around 0), as many columns as fit ``view.width``; ``extra`` adds (header, one cell
    per row) columns. Rows are labelled from ``row_offset`` (values holding rows 5..
    label them q5..)."""
    shown_rows = rows[: view.max_rows]
    candidates = cols[: view.max_rows]
    texts = {
        j: [decimals(float(values[i, j]), view.precision) for i in shown_rows] for j in candidates
    }
    label_width = max([len(f"{row_prefix}{i + row_offset}") for i in shown_rows] or [1])
    used = label_width + sum(
        max([len(h)] + [len(c.plain) for c in cells]) + 3 for h, cells in extra
    )
    widths = [max([len(f"{col_prefix}{j}")] + [len(t) for t in texts[j]]) for j in candidates]
    fitted = list(candidates[: fit_columns(widths, used, len(cols), view.width)])
    cut_cols = len(fitted) < len(cols)

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    table.add_column("", style=THEME["label"], no_wrap=True)
    for j in fitted:
        table.add_column(f"{col_prefix}{j}", justify="right", no_wrap=True)
    if cut_cols:
        table.add_column("…", justify="center", no_wrap=True)
    for h, _ in extra:
        table.add_column(h, justify="right", no_wrap=True)
    block = values[np.ix_(list(shown_rows), fitted)] if fitted and len(shown_rows) else None
    finite = block[np.isfinite(block)] if block is not None else np.zeros(0)
    heat = float(np.abs(finite).max()) if finite.size else 0.0
    for r, i in enumerate(shown_rows):
        cells = [Text(texts[j][r], cell_style(float(values[i, j]), heat)) for j in fitted]
        if cut_cols:
            cells.append(Text("…", THEME["muted"]))
        cells.extend(col[r] for _, col in extra)
        table.add_row(Text(f"{row_prefix}{i + row_offset}"), *cells)
    if len(shown_rows) < len(rows):
        table.add_row(*[Text("…", THEME["muted"]) for _ in table.columns])
    cut = []
    if len(shown_rows) < len(rows):
        first, last = shown_rows.start + row_offset, shown_rows.stop - 1 + row_offset
        cut.append(f"rows {first}–{last} of {values.shape[0] + row_offset}")
    if cut_cols:
        span = f"{fitted[0]}–{fitted[-1]}" if fitted else "none"
        cut.append(f"columns {span} of {values.shape[1]}")
    if cut:
        return Group(table, Text(", ".join(cut) + " shown", THEME["muted"]))
    return table
