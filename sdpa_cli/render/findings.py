"""Diagnosis → rich renderables: the findings panel, the findings at one stage,
per-head summaries, precision.

Never prints. Every severity reads as a word as well as a color, so a piped or
colorless panel says the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich import box
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnosis.findings import Diagnosis, Finding, HeadSummary
from sdpa_cli.engine import precision
from sdpa_cli.names import ALL_KINDS, KIND_UNITS, SEVERITIES
from sdpa_cli.render.common import MUTED, SEVERITY_STYLE, THEME, headroom_text, note_text
from sdpa_cli.text import format_index, plural, sig


@dataclass
class _Group:
    """Findings drawn under one heading, and how many there are in all."""

    kind: str
    severity: str
    dtype: str | None
    items: list[Finding]
    total: int = 0


def _groups(diagnosis: Diagnosis) -> list[_Group]:
    """Row and head findings grouped by kind, severity, format and stage; every other
    finding on its own (its message is the point). A kind with a single group counts
    its unlisted rows too."""
    keyed: dict[object, _Group] = {}
    for n, f in enumerate(diagnosis.findings):
        key = (f.kind, f.severity, f.dtype, f.stage) if f.kind in KIND_UNITS else n
        keyed.setdefault(key, _Group(f.kind, f.severity, f.dtype, [])).items.append(f)
    groups = list(keyed.values())
    for g in groups:
        sole = g.kind in KIND_UNITS and sum(h.kind == g.kind for h in groups) == 1
        g.total = diagnosis.counts.get(g.kind, len(g.items)) if sole else len(g.items)
    return groups


def severity_counts(diagnosis: Diagnosis) -> str:
    """``1 error · 2 warnings · 3 info``, counting unlisted rows too."""
    by: dict[str, int] = {}
    for g in _groups(diagnosis):
        by[g.severity] = by.get(g.severity, 0) + g.total
    parts = []
    for sev in reversed(SEVERITIES):
        n = by.get(sev, 0)
        if n:
            parts.append(f"{n} {sev}" + ("s" if n != 1 and sev != "info" else ""))
    return " · ".join(parts)


def _unlisted(diagnosis: Diagnosis) -> str | None:
    """Kinds counted but not listed at all (``--max-findings 0``), or None."""
    listed = {f.kind for f in diagnosis.findings}
    parts = [f"{n} {k.replace('_', ' ')}" for k, n in diagnosis.counts.items() if k not in listed]
    return f"counted, none listed (--max-findings 0): {', '.join(parts)}" if parts else None


NOTHING_FOUND = (
    "no saturated, uniform or fully masked rows, no non-finite values, no overflow or underflow"
)


def findings_panel(diagnosis: Diagnosis, nothing: str = NOTHING_FOUND) -> RenderableType:
    """Findings grouped by kind, format and stage, worst first, with counts and hints;
    ``nothing`` says what was looked for when nothing was found."""
    unlisted = _unlisted(diagnosis)
    if not diagnosis.findings:
        if unlisted:
            return Text.assemble(("findings  ", THEME["title"]), (unlisted, MUTED))
        return Text.assemble(
            ("findings  ", THEME["title"]),
            ("none: ", THEME["ok"]),
            (nothing, MUTED),
        )
    order = sorted(
        _groups(diagnosis),
        key=lambda g: (-SEVERITIES.index(g.severity), ALL_KINDS.index(g.kind)),
    )
    lines: list[RenderableType] = []
    for g in order:
        unit = KIND_UNITS.get(g.kind)
        label = g.kind.replace("_", " ") + (f" {g.dtype}" if g.dtype else "")
        counted = f" ({plural(g.total, unit)})" if unit else ""
        head = Text.assemble(
            (f" {g.severity:<8}", SEVERITY_STYLE[g.severity]),
            " ",
            (label, THEME["title"]),
            counted,
        )
        lines.append(head)
        first = g.items[0]
        lines.append(_indented(Text(first.message)))
        if len(g.items) > 1:
            more = ", ".join(format_index(f.index) for f in g.items[1:6])
            extra = g.total - 1
            tail = " …" if extra > 5 else ""
            lines.append(_indented(Text(f"and {extra} more: {more}{tail}", MUTED)))
        if first.hint:
            lines.append(_indented(Text(f"hint: {first.hint}", MUTED)))
    if unlisted:
        lines.append(Text(f" also {unlisted}", MUTED))
    title = f"findings: {severity_counts(diagnosis)}"
    if diagnosis.truncated:
        title += " (not all listed: --max-findings)"
    return Panel(Group(*lines), title=title, title_align="left", box=box.ROUNDED)


FINDINGS_PER_KIND = 3
"""Findings of one kind listed under a stage; the others are counted."""


def stage_findings(findings: Sequence[Finding], width: int) -> list[RenderableType]:
    """The findings at one stage: row and head findings a line per kind (the first
    message, the other rows counted), any other finding on its own; each with its hint."""
    by_kind: dict[object, list[Finding]] = {}
    for n, f in enumerate(findings):
        # Rows and heads of one kind share a line; any other finding is its own point.
        by_kind.setdefault((f.kind, f.severity) if f.kind in KIND_UNITS else n, []).append(f)
    lines: list[RenderableType] = []
    for group in by_kind.values():
        first = group[0]
        label = first.kind.replace("_", " ")
        line = note_text(f"{first.severity:<8} {label}  {first.message}", width, 9, first=0)
        line.stylize(SEVERITY_STYLE[first.severity], 0, len(first.severity))
        line.stylize(THEME["title"], 9, 9 + len(label))
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


def _indented(text: Text) -> Padding:
    """A message under its heading, wrapped lines kept indented."""
    return Padding(text, (0, 0, 0, 4))


def heads_table(
    heads: Sequence[HeadSummary], flagged: set[tuple[int, ...]], limit: int
) -> RenderableType:
    """Per-head summaries: flagged heads first, then in order, at most ``limit``."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("head", "rows", "entropy", "max weight", "one-hot", "uniform"):
        table.add_column(col, justify="left" if col == "head" else "right", no_wrap=True)
    ordered = sorted(heads, key=lambda h: (h.index not in flagged, h.index))
    for h in ordered[:limit]:
        style = SEVERITY_STYLE["warning"] if h.index in flagged else None
        table.add_row(
            Text(format_index(h.index), style or ""),
            str(h.rows),
            "—" if math.isnan(h.mean_normalized_entropy) else f"{h.mean_normalized_entropy:.3f}",
            "—" if math.isnan(h.mean_max_weight) else f"{h.mean_max_weight:.4f}",
            str(h.saturated),
            str(h.near_uniform),
        )
    if len(ordered) > limit:
        table.add_row(Text(f"… {len(ordered) - limit} more", MUTED), "", "", "", "", "")
    return Group(
        Text.assemble(
            ("heads", THEME["title"]),
            ("  means over rows with ≥ 2 visible keys; entropy as a fraction of log(keys)", MUTED),
        ),
        table,
    )


def precision_panel(diagnosis: Diagnosis) -> RenderableType | None:
    """The emulated run against float64, and each stage's headroom in bits."""
    parts: list[RenderableType] = []
    emu = diagnosis.emulation
    if emu is not None:
        u = precision.fmt(emu.dtype).unit_roundoff
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for col in ("stage", "max abs err", "at", "err / max", "in u", "problem"):
            table.add_column(
                col,
                justify="left" if col in ("stage", "at", "problem") else "right",
                no_wrap=col != "problem",
            )
        for s in emu.stages:
            where = s.max_abs_at
            problem = s.problem or ""
            errors = (sig(s.max_abs, 3), sig(s.normwise, 3), f"{s.normwise / u:.1f}")
            if s.new_nonfinite:
                # Values float64 holds finite came out inf or NaN: the error there is
                # infinite, whatever the finite elements' error (often 0) says.
                problem = f"{problem} ({s.new_nonfinite})"
                where, errors = s.new_nonfinite_at, ("inf", "inf", "inf")
            at = "—" if where is None else "[" + ",".join(map(str, where)) + "]"
            table.add_row(
                s.stage,
                errors[0],
                at,
                *errors[1:],
                Text(problem, SEVERITY_STYLE["error"] if s.problem else ""),
            )
        first = emu.first_problem
        verdict = (
            Text(f"first problem: {first.stage} {first.problem}", SEVERITY_STYLE["error"])
            if first
            else Text(
                f"every stage within {16} unit roundoffs of float64 (u = {sig(u, 3)})",
                THEME["good"],
            )
        )
        setup = (
            f"{emu.dtype} emulated against float64: accumulate {emu.accumulate}, "
            f"softmax in {emu.softmax_dtype}"
            + (", Q and K prescaled by √scale" if emu.prescale else "")
        )
        parts += [Text(setup), table, verdict, Text("")]
    if diagnosis.headroom:
        parts.append(headroom_table(diagnosis))
    if not parts:
        return None
    return Panel(Group(*parts), title="precision", title_align="left", box=box.ROUNDED)


def headroom_table(diagnosis: Diagnosis) -> RenderableType:
    """Bits between each stage's largest magnitude and each format's max (negative: overflow)."""
    stages = sorted(
        {s for per in diagnosis.headroom.values() for s in per},
        key=("raw", "scaled", "masked", "output").index,
    )
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("format")
    for s in stages:
        table.add_column(s, justify="right")
    for d, per in diagnosis.headroom.items():
        cells = []
        for s in stages:
            bits = per.get(s, math.nan)
            style = (
                SEVERITY_STYLE["error"]
                if bits < 0
                else SEVERITY_STYLE["warning"]
                if bits < 1
                else ""
            )
            cells.append(Text(headroom_text(bits), style))
        table.add_row(d, *cells)
    title = Text.assemble(
        ("headroom", THEME["title"]),
        ("  bits between each stage's largest value and the format's max", MUTED),
    )
    return Group(title, table)
