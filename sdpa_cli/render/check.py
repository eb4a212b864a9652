"""Check reports → rich renderables: one row per check, the mismatch report of each
failure, a verdict. Never prints. Every status reads as a word (PASS, WARN, FAIL) as
well as a color, so a piped or colorless report says the same.
"""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from sdpa_cli.check.records import CaseResult, Check, CheckReport, failure_lines
from sdpa_cli.render.common import MUTED, SEVERITY_STYLE, THEME
from sdpa_cli.text import plural

STATUS_STYLE = {
    "pass": THEME["ok"],
    "warn": SEVERITY_STYLE["warning"],
    "fail": SEVERITY_STYLE["error"],
    "error": THEME["unchecked"],
}
"""A check's or a case's status word → its style; ``error``: it could not be checked."""


def _status(word: str) -> Text:
    return Text(word.upper(), style=STATUS_STYLE[word])


def checks_table(checks: tuple[Check, ...]) -> Table:
    """One row per check: its name, PASS/WARN/FAIL and its figure."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=False)
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("figure", overflow="fold")
    for c in checks:
        table.add_row(c.name, _status(c.status), c.summary)
    return table


WORST_VERSUS_GREATEST = "(worst: furthest past its own tolerance; not always the greatest |Δ|)"
"""Said under ``worst element``, which the greatest absolute difference above it may not be."""


def failure_panel(check: Check) -> Panel:
    """A failed check in full (:func:`~sdpa_cli.check.records.failure_lines`); a listed
    finding and its hint hang from their bullet when they wrap."""
    body: list[RenderableType] = []
    bullets: Table | None = None
    lines = failure_lines(check)
    # the explanation of "worst" follows what the worst element was allowed, if told
    told = any(line.startswith("at the worst element:") for line in lines)
    for line in lines:
        if line.startswith(("• ", "  ")):
            if bullets is None:
                bullets = Table.grid(padding=(0, 1))
                bullets.add_column(no_wrap=True)
                bullets.add_column()
                body.append(bullets)
            if line.startswith("• "):
                bullets.add_row("•", line[2:])
            else:
                bullets.add_row("", Text(line.strip(), style=MUTED))
        else:
            bullets = None
            body.append(Text(line))
            if line.startswith("at the worst element:") or (
                line.startswith("worst element:") and not told
            ):
                body.append(Text(WORST_VERSUS_GREATEST, style=MUTED))
    title = Text(check.name, style=STATUS_STYLE["fail"])
    if check.file:
        title.append(f" · {check.file}", style="default")
    return Panel(Group(*body), title=title, title_align="left", box=box.ROUNDED)


def _verdict(failed: int, total: int, unit: str, warned: int = 0, errors: int = 0) -> Text:
    if errors:
        word, style = "ERROR", STATUS_STYLE["error"]
        rest = f" {plural(errors, unit)} could not be checked"
        if failed:
            rest += f"; {failed} of {total} failed"
    elif failed:
        word, style = "FAIL", STATUS_STYLE["fail"]
        rest = f" {failed} of {plural(total, unit)} failed"
    else:
        word, style = "PASS", STATUS_STYLE["pass"]
        rest = f" {plural(total, unit)} passed"
        if warned:
            rest += f" ({plural(warned, 'warning')})"
    return Text.assemble((word, style), (":", style), rest)


def render_report(report: CheckReport, title: str | None = None) -> RenderableType:
    """One case: header, the checks table, a panel per failure, the verdict."""
    head = Text()
    if title:
        head.append(f"{title}\n", style=THEME["title"])
    computed = "" if report.backend == "numpy" else f" on {report.backend} ({report.device})"
    head.append(f"export {report.export_dtype} · reference {report.reference}{computed}")
    gate = ", ".join(report.gate) or "none"
    if report.fail_on_severity:
        gate += f"; any {report.fail_on_severity} or worse"
    head.append(f" · fail on findings: {gate}", style=MUTED)
    parts: list[RenderableType] = [head, checks_table(report.checks)]
    parts += [failure_panel(c) for c in report.failed]
    warned = sum(c.status == "warn" for c in report.checks)
    parts.append(_verdict(len(report.failed), len(report.checks), "check", warned))
    return Group(*parts)


def render_cases(results: list[CaseResult], manifest: str) -> RenderableType:
    """A manifest: one row per case, then each failing case's failures, the verdict."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=manifest, title_justify="left")
    table.add_column("case", overflow="fold")
    table.add_column("result", no_wrap=True)
    table.add_column("checks", justify="right", no_wrap=True)
    table.add_column("first failure", overflow="fold")
    details: list[RenderableType] = []
    for r in results:
        if r.report is None:
            table.add_row(r.name, _status("error"), "-", r.error or "")
            continue
        failed = r.report.failed
        status = (
            "fail"
            if failed
            else "warn"
            if any(c.status == "warn" for c in r.report.checks)
            else "pass"
        )
        passed = len(r.report.checks) - len(failed)
        first = f"{failed[0].name}: {failed[0].summary}" if failed else _why_warned(r.report)
        table.add_row(r.name, _status(status), f"{passed}/{len(r.report.checks)}", first)
        for c in failed:
            panel = failure_panel(c)
            panel.title = Text.assemble((f"{r.name} › ", THEME["title"]), panel.title or "")
            details.append(panel)
    errors = sum(r.report is None for r in results)
    failed_cases = sum(r.report is not None and not r.passed for r in results)
    warned = sum(
        r.report is not None and r.passed and any(c.status == "warn" for c in r.report.checks)
        for r in results
    )
    verdict = _verdict(failed_cases, len(results), "case", warned, errors)
    return Group(table, *details, verdict)


def _why_warned(report: CheckReport) -> str:
    """A passing case's first warning in a few words, for the cases' table:
    ``findings: head [0, 2] is dead (3 findings not gating: dead_head, saturated)``."""
    warned = next((c for c in report.checks if c.status == "warn"), None)
    if warned is None:
        return ""
    d = warned.details
    if "first" not in d:
        return f"{warned.name}: {warned.summary}"
    return (
        f"{warned.name}: {d['first']} ({plural(d['count'], 'finding')} not gating: "
        f"{', '.join(d['kinds'])})"
    )


def render_results(
    results: list[CaseResult], manifest: str | None, title: str | None
) -> RenderableType:
    """What ``sdpa check`` shows a person: the one case's checks, or the manifest's
    cases (titled ``title``, or the manifest)."""
    if manifest is not None:
        return render_cases(results, title or manifest)
    assert results[0].report is not None
    return render_report(results[0].report, title)
