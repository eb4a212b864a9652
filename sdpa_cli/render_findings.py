"""Diagnosis → rich renderables: the findings panel, per-head summaries, precision.

Never prints. Every severity reads as a word as well as a color, so a piped or
colorless panel says the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich import box
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.style import Style
from rich.table import Table
from rich.text import Text

from sdpa_cli import precision
from sdpa_cli.diagnose import KINDS, SEVERITIES, Diagnosis, Finding, HeadSummary

SEVERITY_STYLE = {
    "error": Style(color="red", bold=True),
    "warning": Style(color="yellow", bold=True),
    "info": Style(color="cyan"),
}
MUTED = Style(dim=True)

UNITS = {
    "saturated": "row",
    "near_uniform": "row",
    "fully_masked": "row",
    "underflow": "row",
    "dead_head": "head",
    "collapsed_head": "head",
}


def _plural(n: int, unit: str) -> str:
    return f"{n} {unit}{'' if n == 1 else 's'}"


def _index(f: Finding) -> str:
    return "[" + ", ".join(str(i) for i in f.index or ()) + "]"


def _totals(diagnosis: Diagnosis) -> dict[tuple[str, str, str | None, str | None], list[Finding]]:
    """Row and head findings grouped by kind, severity, format and stage; every other
    finding on its own (its message is the point)."""
    groups: dict[tuple[str, str, str | None, str | None], list[Finding]] = {}
    for n, f in enumerate(diagnosis.findings):
        stage = f.stage if f.kind in UNITS else f"{f.stage}#{n}"
        groups.setdefault((f.kind, f.severity, f.dtype, stage), []).append(f)
    return groups


def _group_total(diagnosis: Diagnosis, groups: dict, key: tuple) -> int:  # type: ignore[type-arg]
    """Findings in a group, counting unlisted rows when the kind has only this group."""
    kind = key[0]
    if kind in UNITS and sum(1 for k in groups if k[0] == kind) == 1:
        return int(diagnosis.counts.get(kind, len(groups[key])))
    return len(groups[key])


def severity_counts(diagnosis: Diagnosis) -> str:
    """``1 error · 2 warnings · 3 info``, counting unlisted rows too."""
    groups = _totals(diagnosis)
    by: dict[str, int] = {}
    for key in groups:
        by[key[1]] = by.get(key[1], 0) + _group_total(diagnosis, groups, key)
    parts = []
    for sev in reversed(SEVERITIES):
        n = by.get(sev, 0)
        if n:
            parts.append(f"{n} {sev}" + ("s" if n != 1 and sev != "info" else ""))
    return " · ".join(parts)


def findings_panel(diagnosis: Diagnosis) -> RenderableType:
    """Findings grouped by kind, format and stage, worst first, with counts and hints."""
    if not diagnosis.findings and diagnosis.counts:
        counted = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in diagnosis.counts.items())
        return Text.assemble(
            ("findings  ", Style(bold=True)),
            (f"{counted}: counted, none listed (--max-findings 0)", MUTED),
        )
    if not diagnosis.findings:
        return Text.assemble(
            ("findings  ", Style(bold=True)),
            ("none: ", Style(color="green", bold=True)),
            (
                "no saturated, uniform or fully masked rows, no non-finite values, "
                "no overflow or underflow",
                MUTED,
            ),
        )
    groups = _totals(diagnosis)
    order = sorted(
        groups.items(),
        key=lambda kv: (-SEVERITIES.index(kv[0][1]), KINDS.index(kv[0][0])),
    )
    lines: list[RenderableType] = []
    for (kind, sev, dtype, stage), items in order:
        unit = UNITS.get(kind)
        listed = len(items)
        total = _group_total(diagnosis, groups, (kind, sev, dtype, stage))
        label = kind.replace("_", " ")
        if dtype:
            label += f" {dtype}"
        counted = f" ({_plural(total, unit)})" if unit else ""
        head = Text.assemble(
            (f" {sev:<8}", SEVERITY_STYLE[sev]), " ", (label, Style(bold=True)), counted
        )
        lines.append(head)
        first = items[0]
        lines.append(_indented(Text(first.message)))
        if listed > 1:
            more = ", ".join(_index(f) for f in items[1:6])
            extra = total - 1
            tail = " …" if extra > 5 else ""
            lines.append(_indented(Text(f"and {extra} more: {more}{tail}", MUTED)))
        if first.hint:
            lines.append(_indented(Text(f"hint: {first.hint}", MUTED)))
    listed_kinds = {f.kind for f in diagnosis.findings}
    unlisted = [
        f"{n} {k.replace('_', ' ')}" for k, n in diagnosis.counts.items() if k not in listed_kinds
    ]
    if unlisted:
        lines.append(
            Text(f" also counted, none listed (--max-findings 0): {', '.join(unlisted)}", MUTED)
        )
    title = f"findings: {severity_counts(diagnosis)}"
    if diagnosis.truncated:
        title += " (some rows not listed; see --max-findings)"
    return Panel(Group(*lines), title=title, title_align="left", box=box.ROUNDED)


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
            Text("[" + ", ".join(map(str, h.index)) + "]", style or ""),
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
            ("heads", Style(bold=True)),
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
            at = "—" if s.max_abs_at is None else "[" + ",".join(map(str, s.max_abs_at)) + "]"
            problem = s.problem or ""
            if s.new_nonfinite:
                problem = f"{problem} ({s.new_nonfinite})"
            table.add_row(
                s.stage,
                f"{s.max_abs:.3g}",
                at,
                f"{s.normwise:.3g}",
                f"{s.normwise / u:.1f}",
                Text(problem, SEVERITY_STYLE["error"] if s.problem else ""),
            )
        first = emu.first_problem
        verdict = (
            Text(f"first problem: {first.stage} {first.problem}", SEVERITY_STYLE["error"])
            if first
            else Text(
                f"every stage within {16} unit roundoffs of float64 (u = {u:.3g})",
                Style(color="green"),
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
            text = "—" if math.isnan(bits) else ("∞" if math.isinf(bits) else f"{bits:+.1f}")
            style = (
                SEVERITY_STYLE["error"]
                if bits < 0
                else SEVERITY_STYLE["warning"]
                if bits < 1
                else ""
            )
            cells.append(Text(text, style))
        table.add_row(d, *cells)
    title = Text.assemble(
        ("headroom", Style(bold=True)),
        ("  bits between each stage's largest value and the format's max", MUTED),
    )
    return Group(title, table)
