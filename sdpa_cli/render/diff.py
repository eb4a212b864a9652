"""``sdpa diff`` → rich renderables: the two runs, how their calls paired, a row per
pair (Q, K, V and the output of B against A, B's kernel, where it diverges), and the
conclusion. Never prints.
"""

from __future__ import annotations

import math

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sdpa_cli.check.diff import CallDiff, RunDiff
from sdpa_cli.engine import precision
from sdpa_cli.render.common import MUTED, THEME, note_text
from sdpa_cli.text import compact, shared_parts

HEADINGS = {"q": "Q", "k": "K", "v": "V", "output": "O"}
"""The table's columns: a bias's difference is named under "diverges" (the JSON has it)."""


def render_diff(diff: RunDiff, width: int) -> RenderableType:
    """The whole view: the runs, the rule, the table, the conclusion."""
    head = Text.assemble(("A  ", THEME["label"]), diff.a, "\n", ("B  ", THEME["label"]), diff.b)
    parts: list[RenderableType] = [head]
    pairing = diff.pairing
    style = THEME["note"] if pairing.only_a or pairing.only_b or pairing.by != "name" else MUTED
    parts.append(note_text(pairing.note(), width, indent=0, style=style))
    parts.append(note_text(rule_text(diff), width, indent=0, style=MUTED))
    names, shared = shared_parts([c.a for c in diff.calls], "call")
    if shared is not None:
        parts.append(Text(f"call: {shared}", MUTED))
    parts.append(_table(diff, names))
    first = diff.first
    style = THEME["ok"] if first is None and diff.exit_code == 0 else THEME["title"]
    parts.append(note_text(diff.conclusion(), width, indent=0, style=style))
    return Group(*parts)


def rule_text(diff: RunDiff) -> str:
    """What the numbers are, and when an input differs."""
    formats = sorted({c.format for c in diff.calls if c.error is None}, key=precision.FORMATS.index)
    units = ", ".join(f"{f}: u = {power_of_two(precision.fmt(f).unit_roundoff)}" for f in formats)
    return (
        "Q K V O: RMS(B − A) ÷ RMS(A), the largest over (batch, head) slices, in units u "
        f"of the narrower run's unit roundoff ({units or 'no call compared'}); an input "
        f"differs past {compact(diff.bound, 3)}u and {compact(diff.jump, 3)}× any earlier "
        "call's. kernel: B's output judged against its own inputs, as sdpa check judges it"
    )


def power_of_two(x: float) -> str:
    """``2^-8`` for a power of two, else the number."""
    exponent = math.log2(x) if x > 0 else math.nan
    if exponent.is_integer():
        return f"2^{int(exponent)}"
    return compact(x, 3)


def _table(diff: RunDiff, names: list[str]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=False)
    table.add_column("call", overflow="fold")
    for n in HEADINGS:
        table.add_column(HEADINGS[n], justify="right", no_wrap=True)
    table.add_column("kernel", no_wrap=True)
    table.add_column("diverges", overflow="fold")
    for name, call in zip(names, diff.calls, strict=True):
        table.add_row(name, *_cells(call), _kernel(call), _where(call))
    return table


def _cells(call: CallDiff) -> list[Text]:
    """Each difference in units, those past the limit marked."""
    differing = {n.lower() for n in call.differing()}
    cells = []
    for n in HEADINGS:
        found = call.differences.get(n)
        if found is None:
            cells.append(Text("—", MUTED))
            continue
        text = found.text().removesuffix("u")
        cells.append(Text(text, THEME["leak"] if n in differing else ""))
    return cells


def _kernel(call: CallDiff) -> Text:
    if call.kernel is None:
        return Text("—", MUTED)
    return Text("pass", THEME["good"]) if call.kernel.passed else Text("FAIL", THEME["unchecked"])


def _where(call: CallDiff) -> Text:
    if call.error is not None:
        return Text("error", THEME["unchecked"])
    if call.where == "upstream":
        what = " ".join(call.differing()) or (call.mismatch or "").partition(":")[0]
        return Text(f"upstream: {what.removeprefix('the ')}", THEME["note"])
    if call.where == "kernel":
        failed = call.failed_kernel()
        return Text("kernel" + (" (A)" if failed and failed.run == "a" else ""), THEME["note"])
    return Text("")
