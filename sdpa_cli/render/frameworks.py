"""``sdpa compute --frameworks``: each framework's conventions and answer side by side,
a small table per kind of disagreement, and a one-line verdict."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import groupby

import numpy as np
from rich import box
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnosis.frameworks import Comparison, Disagreement
from sdpa_cli.engine.conventions import CONVENTIONS
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import Index
from sdpa_cli.render.common import THEME, note_text, rule, slice_label
from sdpa_cli.render.header import header
from sdpa_cli.text import compact, plural, run_text, runs, sig

SHOWN_SLICES = 6
"""(batch, head) slices whose rows a disagreement lists; the rest are counted."""
SHOWN_OUTPUT_ROWS = 6
"""Differing rows whose outputs the table shows side by side (the JSON holds more)."""
SHOWN_RUNS = 8
"""Runs of consecutive rows listed per slice; the rows of the rest are counted."""
PLAIN_SOFTMAX = (
    "a plain softmax (exp over sum, as PyTorch before 2.5 and hand-written attention) "
    "gives such a row NaN: 0/0"
)


def render_frameworks(spec: AttentionSpec, comparison: Comparison, width: int) -> RenderableType:
    """The header, the conventions and answers, one table per disagreement, the verdict."""
    parts: list[RenderableType] = [header(spec, "sdpa compute --frameworks")]
    parts += [Text(""), rule("Frameworks", width)]
    typed = spec.options.window_as_typed
    if typed is not None:
        left, right = typed
        counting = [c.name for c in CONVENTIONS.values() if c.window_counts_query]
        parts.append(
            Text(
                f"--window {left},{right} as typed, read in each framework's terms "
                f"({', '.join(counting)}'s counts the query):"
            )
        )
    parts.append(_answers(comparison))
    if any(a.align == PER_ITEM for a in comparison.answers):
        parts.append(Text(f"{PER_ITEM_SHORT}: {PER_ITEM}, j ≤ i + S_b − L_b", THEME["muted"]))
    if not comparison.agree:
        parts += [Text(""), *_outputs(spec, comparison, width)]
    for d in comparison.disagreements:
        parts += [Text(""), _disagreement(spec, d, comparison.n_rows, width)]
    parts += [Text(""), verdict_text(comparison)]
    return Group(*parts)


PER_ITEM = "lower-right-per-item"
PER_ITEM_SHORT = "per item"
"""How the table names each item's own diagonal, said in full under it."""


def verdict_text(comparison: Comparison) -> Text:
    return Text(comparison.verdict, THEME["ok"] if comparison.agree else THEME["note"])


def _answers(comparison: Comparison) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("as", no_wrap=True)
    table.add_column("causal", no_wrap=True)
    table.add_column("window", no_wrap=True)
    table.add_column("empty row", no_wrap=True)
    first = comparison.answers[0].convention.name
    table.add_column(f"rows ≠ {first}", justify="right", no_wrap=True)
    table.add_column("max |Δ|", justify="right", no_wrap=True)
    for i, a in enumerate(comparison.answers):
        c = a.convention
        if i == 0:
            rows, most = Text("—", THEME["muted"]), Text("—", THEME["muted"])
        elif not a.rows:
            rows, most = Text("0", THEME["good"]), Text("0", THEME["good"])
        else:
            rows, most = Text(str(a.rows)), Text(sig(a.max_diff))
        window = c.window_label if a.window is None else f"{a.window[0]} left, {a.window[1]} right"
        align = PER_ITEM_SHORT if a.align == PER_ITEM else a.align
        table.add_row(c.name, align, window, c.empty_row, rows, most)
    return table


def _outputs(spec: AttentionSpec, comparison: Comparison, width: int) -> list[RenderableType]:
    """The rows the frameworks differ on, each framework's output side by side: the
    first :data:`SHOWN_OUTPUT_ROWS`, as many of a row's values as fit the width."""
    shown = comparison.side_by_side(SHOWN_OUTPUT_ROWS)
    # frameworks that answer these rows alike share a column: the distinct answers
    columns: list[list[str]] = []
    for a in comparison.answers:
        name = a.convention.name
        same = next(
            (
                c
                for c in columns
                if all(np.array_equal(out[c[0]], out[name], equal_nan=True) for _, out in shown)
            ),
            None,
        )
        if same is None:
            columns.append([name])
        else:
            same.append(name)
    names = [c[0] for c in columns]
    labels = [_row_label(spec, row) for row, _ in shown]
    label_width = max([3, *(len(x) for x in labels)])
    room = (width - label_width) // len(names) - 3  # each column: its text and a gap
    ev = len(next(iter(shown[0][1].values()))) if shown else 0
    count = max(1, min(ev, (room + 1) // 8))  # about 7 characters a value and a space
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("row", style=THEME["label"], no_wrap=True)
    for column in columns:
        table.add_column(", ".join(column), no_wrap=True, justify="right")
    for label, (_, out) in zip(labels, shown, strict=True):
        cells = []
        for name in names:
            values = " ".join(compact(float(x), 3) for x in out[name][:count])
            cells.append(values + (" …" if ev > count else ""))
        table.add_row(label, *cells)
    n = len(comparison.differing())
    title = Text.assemble(
        ("Each framework's output", THEME["title"]),
        f" for the rows they differ on ({_first(len(shown), n)}",
        f"{', the first ' + str(count) + ' of ' + str(ev) + ' values' if ev > count else ''})",
    )
    parts: list[RenderableType] = [title, Padding(table, (0, 0, 0, 2))]
    if n > len(shown) or ev > count:
        parts.append(note_text("--format json holds every value", width, indent=2))
    return parts


def _first(shown: int, total: int) -> str:
    return plural(total, "row") if shown == total else f"the first {shown} of {total} rows"


def _row_label(spec: AttentionSpec, row: Index) -> str:
    """``b0 h1 q3``: a row's batch item, head and query."""
    lead = row[:-1]
    axes = (
        ("b", "h")[-len(lead) :] if 0 < len(lead) <= 2 else tuple(f"d{i}" for i in range(len(lead)))
    )
    return " ".join([*(f"{a}{i}" for a, i in zip(axes, lead, strict=True)), f"q{row[-1]}"])


def _disagreement(spec: AttentionSpec, d: Disagreement, n_rows: int, width: int) -> Group:
    title = Text.assemble(
        (d.title[:1].upper() + d.title[1:], THEME["title"]),
        f": {len(d.rows)} of {plural(n_rows, 'row')} differ, max |Δ| {sig(d.max_diff)}",
    )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_header=False, show_edge=False)
    table.add_column(style=THEME["label"], no_wrap=True)
    table.add_column(overflow="fold")
    for what, names in d.groups:
        table.add_row(what, ", ".join(names))
    notes = [note_text("query rows: " + rows_label(spec, d.rows), width, indent=2)]
    if d.kind == "empty":
        notes.append(note_text(PLAIN_SOFTMAX, width, indent=2, style=THEME["muted"]))
    return Group(title, Padding(table, (0, 0, 0, 2)), *notes)


def rows_label(spec: AttentionSpec, rows: Sequence[Index]) -> str:
    """``batch 0 · head 1: 0–2, 5; batch 1 · head 0: 3`` (a few slices, the rest counted)."""
    slices = [(lead, [r[-1] for r in group]) for lead, group in groupby(rows, key=lambda r: r[:-1])]
    parts = []
    for lead, queries in slices[:SHOWN_SLICES]:
        label = slice_label(spec, tuple(lead))
        parts.append(f"{label}: {_ranges(queries)}" if label else _ranges(queries))
    if len(slices) > SHOWN_SLICES:
        parts.append(f"and {plural(len(slices) - SHOWN_SLICES, 'more slice')}")
    return "; ".join(parts)


def _ranges(values: Iterable[int]) -> str:
    """``0–2, 5``: consecutive runs joined."""
    found = runs(values)
    shown = [run_text(first, last) for first, last in found[:SHOWN_RUNS]]
    if len(found) > SHOWN_RUNS:
        rest = sum(last - first + 1 for first, last in found[SHOWN_RUNS:])
        shown.append(f"and {plural(rest, 'more row')}")
    return ", ".join(shown)
