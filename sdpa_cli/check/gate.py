"""Which findings fail the run: the kinds gated (``--fail-on``, by default non-finite
values and overflow in the run's own formats when nothing is exported), a severity
(``--fail-on-severity``), and a warning of the serious findings neither gates."""

from __future__ import annotations

from collections.abc import Iterator

from sdpa_cli.check.records import Check
from sdpa_cli.check.settings import DEFAULT_GATE, CheckSettings
from sdpa_cli.diagnosis.findings import Diagnosis, Finding
from sdpa_cli.names import KINDS, SEVERITIES
from sdpa_cli.text import plural


def gated_kinds(settings: CheckSettings, has_expectations: bool) -> tuple[tuple[str, ...], bool]:
    """The gated kinds, and whether overflow counts only in the run's own formats."""
    if settings.fail_on is not None:
        return settings.fail_on, False
    if has_expectations:
        return (), False
    return DEFAULT_GATE, True


def finding_checks(
    diagnosis: Diagnosis,
    gate: tuple[str, ...],
    own_formats_only: bool,
    working: tuple[str, ...],
    severity: str | None,
) -> Iterator[Check]:
    """A check per gated kind, one for ``--fail-on-severity`` when given, and one
    warning of the serious findings neither gates."""
    used: set[int] = set()
    for kind in gate:
        filtered = own_formats_only and kind == "overflow"
        hits = [
            f
            for f in diagnosis.findings
            if f.kind == kind and not (filtered and f.dtype not in working)
        ]
        used.update(id(f) for f in hits)
        yield _kind_check(diagnosis, kind, hits, filtered, working)
    if severity is not None:
        rank = SEVERITIES.index(severity)
        hits = [f for f in diagnosis.findings if SEVERITIES.index(f.severity) >= rank]
        used.update(id(f) for f in hits)
        yield _severity_check(diagnosis, hits, severity)
    yield _rest_check(diagnosis, [f for f in diagnosis.findings if id(f) not in used])


def _counted(total: int, listed: int, what: str) -> str:
    """``367 info findings (50 listed)``: the total, and how many are listed when fewer."""
    return plural(total, what) + (f" ({listed} listed)" if listed < total else "")


def _kind_check(
    diagnosis: Diagnosis,
    kind: str,
    hits: list[Finding],
    filtered: bool,
    working: tuple[str, ...],
) -> Check:
    """``findings.<kind>``: fails on any of ``hits`` (overflow only in the run's own
    formats when ``filtered``)."""
    if not hits:
        scope = ""
        if filtered:
            scope = f" in {', '.join(working) or 'float64'}, the run's own format"
            if diagnosis.counts.get(kind):
                scope += " (other formats: see findings)"
        return Check(f"findings.{kind}", "pass", f"no {kind} findings{scope}")
    # Row findings are listed up to --max-findings but all counted.
    count = len(hits) if filtered else diagnosis.total(hits)
    return Check(
        f"findings.{kind}",
        "fail",
        f"{_counted(count, len(hits), kind + ' finding')}; first: {hits[0].message}",
        index=hits[0].index,
        details={"findings": [f.to_dict() for f in hits[:5]], "count": count},
    )


def _severity_check(diagnosis: Diagnosis, hits: list[Finding], severity: str) -> Check:
    """``findings.severity``: fails on any finding at ``severity`` or worse."""
    if not hits:
        return Check("findings.severity", "pass", f"no finding at {severity} or worse")
    count = diagnosis.total(hits)
    return Check(
        "findings.severity",
        "fail",
        f"{_counted(count, len(hits), 'finding')} at {severity} or worse; "
        f"first: {hits[0].kind}: {hits[0].message}",
        index=hits[0].index,
        details={"findings": [f.to_dict() for f in hits[:5]], "count": count},
    )


def _rest_check(diagnosis: Diagnosis, rest: list[Finding]) -> Check:
    """``findings``: a warning of the findings no gate used, unless all are info."""
    serious = [f for f in rest if f.severity != "info"]
    if serious:
        kinds = sorted({f.kind for f in serious}, key=KINDS.index)
        count = diagnosis.total(serious)
        return Check(
            "findings",
            "warn",
            f"{_counted(count, len(serious), 'finding')} not gating ({', '.join(kinds)}); "
            f"first: {serious[0].message}",
            index=serious[0].index,
            # A message says what, then the numbers after a colon: the what, for a table
            # of cases ("head [0, 2] is dead", "row [1, 0, 0] has no visible key").
            details={"count": count, "kinds": kinds, "first": serious[0].message.split(": ")[0]},
        )
    note = ""
    if rest:
        total = diagnosis.total(rest)
        listed = f", {len(rest)} listed" if len(rest) < total else ""
        note = f" ({plural(total, 'info finding')}{listed})"
    return Check("findings", "pass", f"nothing worth a warning{note}")
