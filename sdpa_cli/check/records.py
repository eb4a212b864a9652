"""The records of ``sdpa check``: an export (:class:`Expected`), one check's verdict
(:class:`Check`) and its text in full (:func:`failure_lines`), everything
concluded about one case (:class:`CheckReport`), and a named case's report or the
reason it has none (:class:`CaseResult`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from numpy.typing import NDArray

from sdpa_cli.check.compare import Judgement, Mismatch, Tolerance, mismatch_lines
from sdpa_cli.check.structure import slice_line
from sdpa_cli.diagnosis.findings import Diagnosis
from sdpa_cli.diagnosis.model import CaseHeads
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.text import format_index, plural


@dataclass(frozen=True)
class Expected:
    """One exported tensor: what it is (``output``, ``weights``, ``lse``), its values
    and the file it came from."""

    name: str
    values: NDArray[Any]
    label: str


@dataclass(frozen=True)
class Check:
    """One check: its name, status, a one-line figure, and the numbers behind it.

    ``index`` is the full index of the worst element (in the layout of the file
    checked), or None when nothing is wrong or the check is not about one element.
    """

    name: str
    status: str
    summary: str
    index: Index | None = None
    file: str | None = None
    tolerance: Tolerance | None = None
    mismatch: Mismatch | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    hint: str | None = None
    """What probably went wrong, when sdpa could tell (a failed comparison)."""

    @property
    def passed(self) -> bool:
        return self.status != "fail"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "passed": self.passed,
            "status": self.status,
            "summary": self.summary,
            "index": None if self.index is None else list(self.index),
        }
        if self.file is not None:
            out["file"] = self.file
        if self.tolerance is not None:
            out["tolerance"] = self.tolerance.to_dict()
        if self.mismatch is not None:
            out["mismatch"] = self.mismatch.to_dict()
        if self.hint is not None:
            out["hint"] = self.hint
        out.update(self.details)
        return out


def failure_lines(check: Check) -> list[str]:
    """A failed check in full, one fact per line (shared by the table, JUnit and
    assertions): the mismatch report, the findings (``• message``, ``  hint: ...``),
    or the figure and index; then the hint."""
    lines: list[str] = []
    findings = check.details.get("findings")
    if check.mismatch is not None:
        lines += mismatch_lines(check.mismatch, check.tolerance, check.details.get("diagnosis"))
        by_slice = slice_line(check.details.get("error_stats", {}).get("by_slice", ()))
        if by_slice is not None:
            lines.append(by_slice)
    elif findings:
        count = check.details.get("count", len(findings))
        lines.append(f"{plural(count, 'finding')}{', the first' if count > len(findings) else ''}:")
        for f in findings:
            lines.append(f"• {f['message']}")
            if f.get("hint"):
                lines.append(f"  hint: {f['hint']}")
    else:
        lines.append(check.summary)
        if check.index is not None:
            lines.append(f"index: {format_index(check.index)}")
    if check.hint:
        lines.append(f"hint: {check.hint}")
    return lines


@dataclass(frozen=True)
class Evidence:
    """What a page draws of a case's failed checks (``check --html``): each export and
    the reference's and the plain computation's values of it, in the computation's
    layout ``(*lead, L, Ev)`` (weights ``(*lead, L, S)``, the LSE ``(*lead, L)``), the
    kernel-relative rule's terms, and the computation a hint found the export matches
    (where the hint names options or a kernel's slip: its mask can be drawn)."""

    spec: AttentionSpec
    exports: Mapping[str, F64]
    reference: Mapping[str, F64]
    plain: Mapping[str, F64 | None]
    """NaN where the rule did not need it; None where it was not computed at all."""
    judgement: Judgement | None = None
    """The kernel-relative rule the verdict used (the format it judged the export in,
    its factor and floor), None under a fixed tolerance."""
    matched: Mapping[str, AttentionSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckReport:
    """Everything ``check`` concluded about one case."""

    checks: tuple[Check, ...]
    diagnosis: Diagnosis
    export_dtype: str
    reference: str
    gate: tuple[str, ...]
    fail_on_severity: str | None
    backend: str = "numpy"
    """The library that computed the reference's lean pass (``numpy``, ``torch``)."""
    device: str = "cpu"
    """Where it computed it (``cpu``, ``cuda:0``)."""
    evidence: Evidence | None = field(default=None, compare=False, repr=False)
    """Kept when asked for (:attr:`~sdpa_cli.check.settings.Overrides.evidence`)."""
    heads: CaseHeads | None = field(default=None, compare=False, repr=False)
    """The case's row of a model's grid, from the same pass, when asked for
    (``check --manifest --html``)."""

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)


@dataclass(frozen=True)
class CaseResult:
    """A case's report, or the one-line reason it could not be checked."""

    name: str
    report: CheckReport | None = None
    error: str | None = None
    internal: bool = False

    @property
    def passed(self) -> bool:
        return self.report is not None and self.report.passed
