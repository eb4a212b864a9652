"""The benchmark's output: plain tables, the figures against their targets, Markdown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Figure:
    """One figure of the issue next to its target: a row of the final table."""

    name: str
    measured: str  # as printed, e.g. "1.23×" or "352 of 336 MiB"
    target: str  # as printed, e.g. "≤ 1.5×"
    value: float | None = None
    limit: float | None = None
    met: bool | None = None  # None: not measured (skipped, an error), or no target
    note: str = ""  # why not measured, or what the figure is

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def figure(
    name: str, value: float | None, limit: float | None, unit: str, spec: str, note: str = ""
) -> Figure:
    """A figure `value` ≤ `limit` (`unit` "×" or " s"); no limit: reported, no target."""
    measured = "-" if value is None else f"{value:{spec}}{unit}"
    target = "-" if limit is None else f"≤ {limit:g}{unit}"
    met = None if value is None or limit is None else value <= limit
    return Figure(name, measured, target, value, limit, met, note)


def verdict(f: Figure) -> str:
    if f.target == "-":
        return "info" if f.value is not None else "n/a"
    return "n/a" if f.met is None else "met" if f.met else "MISSED"


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1, indent: str = "  "
) -> str:
    """Columns two spaces apart; the first `left` columns left-aligned, the rest right."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return (indent + "  ".join(parts)).rstrip()

    rule = indent + "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def markdown(figures: Sequence[Figure]) -> str:
    """figure | measured | target | verdict, for the README's performance section."""
    rows = ["| figure | measured | target | verdict |", "|---|---|---|---|"]
    for f in figures:
        v = verdict(f)
        if v == "MISSED":
            v = "**missed**"
        elif v == "n/a" and f.note:
            v = f"n/a: {f.note}"
        rows.append(f"| {f.name} | {f.measured} | {f.target} | {v} |")
    return "\n".join(rows)


def summary(figures: Sequence[Figure]) -> str:
    targets = [f for f in figures if f.target != "-"]
    met = sum(f.met is True for f in targets)
    missed = sum(f.met is False for f in targets)
    unmeasured = sum(f.met is None for f in targets)
    text = f"targets met: {met} of {len(targets)} ({missed} missed"
    return text + (f", {unmeasured} not measured)" if unmeasured else ")")
