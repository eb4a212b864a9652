"""The one theme and the view every renderer shares: styles and heat colors, what a
table shows (:class:`View`, the slices and rows), headings and wrapped notes.

Colors only say what the text already says: every cell shows its value as text, so a
piped or colorless view reads the same.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from rich.console import RenderableType
from rich.style import Style
from rich.text import Text

from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.names import FORMULAS, STAGE_TITLES
from sdpa_cli.text import headroom_bits

THEME = {
    "title": Style(bold=True),
    "ok": Style(color="green", bold=True),
    "good": Style(color="green"),
    "unchecked": Style(color="red", bold=True, reverse=True),
    "label": Style(color="cyan"),
    "muted": Style(dim=True),
    "masked": Style(color="grey50", italic=True),
    "hidden_value": Style(color="grey50", dim=True),
    "note": Style(color="yellow"),
    "leak": Style(color="yellow", bold=True, underline=True),
    "nonfinite": Style(color="magenta", bold=True),
    "description": Style(italic=True),
}
MUTED = THEME["muted"]
SEVERITY_STYLE = {
    "error": Style(color="red", bold=True),
    "warning": Style(color="yellow", bold=True),
    "info": Style(color="cyan"),
}
NEGATIVE = (59, 110, 190)  # blue
POSITIVE = (200, 70, 60)  # red
WEIGHT = (230, 150, 30)  # amber
BACKGROUND = (30, 30, 30)


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

    def key_columns(self, n: int) -> range:
        """The keys ``--keys`` picks out of ``n`` (every one by default); a table shows
        those of them that fit."""
        return _picked(n, self.keys)

    def query_rows(self, n: int) -> range:
        """The query rows ``--rows`` picks out of ``n`` (every one by default); a table
        shows the first ``max_rows`` of them and says how many there were."""
        return _picked(n, self.rows)


# --- heat colors ------------------------------------------------------------------------------


def _blend(rgb: tuple[int, int, int], t: float) -> Style:
    """A cell style: ``rgb`` at strength t ∈ [0, 1] over the background."""
    t = min(max(t, 0.0), 1.0)
    r, g, b = (round(c0 + (c1 - c0) * t) for c0, c1 in zip(BACKGROUND, rgb, strict=True))
    fg = "black" if (0.299 * r + 0.587 * g + 0.114 * b) > 140 else "white"
    return Style(color=fg, bgcolor=f"rgb({r},{g},{b})")


def cell_style(x: float, scale: float, *, weights: bool = False) -> Style:
    """Heat color of a cell: with ``weights``, amber on 0 → 1 (``scale`` unused);
    otherwise diverging around 0, blue to red over ±scale. Non-finite values stand out."""
    if not math.isfinite(x):
        return THEME["nonfinite"]
    if weights:
        return _blend(WEIGHT, x)
    if scale <= 0:
        return Style()
    return _blend(POSITIVE if x >= 0 else NEGATIVE, abs(x) / scale)


# --- which slices and rows --------------------------------------------------------------------


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


def _picked(n: int, chosen: slice | None) -> range:
    """The indices along an axis of length n that ``--rows`` or ``--keys`` picks."""
    return range(n)[chosen] if chosen is not None else range(n)


def _window(n: int, chosen: slice | None, cap: int) -> tuple[range, bool]:
    """Indices to show along an axis of length n, and whether some were cut."""
    r = _picked(n, chosen)
    return (r[:cap], len(r) > cap)


class Layout(NamedTuple):
    """What a table view shows of a computation."""

    positions: list[tuple[int, ...]]
    """The slices shown: those ``--batch`` and ``--head`` pick, at most ``--max-slices``."""
    rows: range
    """The query rows shown (``--rows``, at most ``--max-rows``)."""
    cut_rows: bool
    """Whether ``--max-rows`` cut some of the rows picked."""
    picked: int
    """How many slices ``--batch`` and ``--head`` pick (:func:`more_slices` notes the rest)."""


def layout(spec: AttentionSpec, view: View) -> Layout:
    """What a ``compute`` or ``grad`` table shows: the slices, the query rows, whether
    rows were cut, and how many slices there were to show."""
    rows, cut_rows = _window(spec.L, view.rows, view.max_rows)
    picked = slice_positions(spec, view)
    return Layout(picked[: view.max_slices], rows, cut_rows, len(picked))


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


# --- headings and notes -----------------------------------------------------------------------


def case_description(description: str | None) -> list[RenderableType]:
    """A case file's description, in italics, above a command's view (none without one)."""
    return [Text(description.strip(), THEME["description"])] if description else []


def rule(text: str, width: int) -> Text:
    """``── text ─────``: a heading across the width."""
    return Text(f"── {text} " + "─" * max(0, width - len(text) - 4), THEME["title"])


def titled(title: str, formula: str) -> Text:
    """``weights  softmax over keys``: a bold name, then a muted formula."""
    return Text.assemble((title, THEME["title"]), "  ", (formula, THEME["muted"]))


def stage_title(stage: str, score_mod: str | None = None, *, dropout: bool = False) -> Text:
    """A stage's name and formula (``--score-mod`` fills the biased stage; under
    ``--dropout`` the output reads the dropped weights)."""
    if stage == "biased" and score_mod is not None:
        return titled("biased", "score_mod(scaled), --score-mod")
    return titled(*stage_heading(stage, dropout=dropout))


def stage_heading(stage: str, *, dropout: bool = False) -> tuple[str, str]:
    """A forward stage's title and formula; under ``--dropout`` the output is
    ``dropped · V``, the weights dropout kept."""
    if stage == "output" and dropout:
        return STAGE_TITLES[stage], "dropped · V"
    return STAGE_TITLES[stage], FORMULAS[stage]


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


def headroom_text(bits: float) -> str:
    """Bits of headroom to a tenth (:func:`~sdpa_cli.text.headroom_bits`); an overflow
    too small to show there keeps its sign and one digit (``-0.05``, never ``-0.0``),
    and a zero reads ``+0.0``."""
    if bits < 0 and round(bits, 1) == 0:
        return f"{bits:+.1g}"
    return headroom_bits(bits + 0.0)  # + 0.0: a negative zero becomes 0.0
