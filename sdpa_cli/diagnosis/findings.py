"""Findings as data: what the diagnose steps conclude, never exceptions.

Every finding has a ``kind`` (exactly one of :data:`KINDS`, or of :data:`GRADIENT_KINDS`
for ``sdpa grad``), a ``severity`` (one of :data:`SEVERITIES`), a message and, where
they apply, a hint, the ``index`` of the row (``[*lead, i]``) or head (``[*lead]``),
the ``stage``, the ``dtype`` and a ``count``. Row findings are listed up to
``max_findings`` per kind and always counted in full (:attr:`Diagnosis.counts`).
The rules that make them are :mod:`sdpa_cli.diagnosis.rules` (the step and the inputs),
:mod:`sdpa_cli.diagnosis.formats` (low precision), :mod:`sdpa_cli.diagnosis.rows` (rows
and heads) and :mod:`sdpa_cli.diagnosis.grad` (gradients).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sdpa_cli.engine.types import Index
from sdpa_cli.names import SEVERITIES
from sdpa_cli.text import finite_or_none

CONTRACT_STAGE = {"capped": "scaled", "biased": "masked", "dropped": "weights"}
"""Engine steps reported under the contract's stage names."""


@dataclass(frozen=True)
class Thresholds:
    """When a row or head is flagged. Set by options or a config file (README)."""

    saturation: float = 0.99
    uniform: float = 0.98
    head_fraction: float = 0.9
    max_findings: int = 50
    vanishing: float = 1e-3
    """``sdpa grad``: a row whose softmax passes back at most this fraction of its
    incoming gradient (1 − Σ w², the Jacobian's norm bound) has a vanishing gradient."""


THRESHOLD_NAMES = tuple(Thresholds.__dataclass_fields__)


@dataclass(frozen=True)
class Finding:
    """One thing worth knowing about the computation."""

    kind: str
    severity: str
    message: str
    hint: str | None = None
    index: Index | None = None
    stage: str | None = None
    dtype: str | None = None
    count: int | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract: ``kind``, ``severity``, ``message``, then what applies.

        ``stage`` is one of the contract's six: soft-capping counts as ``scaled``,
        the bias as ``masked`` (the logits with bias and mask), dropout as
        ``weights``; ``details.step`` keeps the exact step when it differs.
        """
        out: dict[str, Any] = {"kind": self.kind, "severity": self.severity}
        out["message"] = self.message
        if self.hint is not None:
            out["hint"] = self.hint
        if self.index is not None:
            out["index"] = list(self.index)
        details = dict(self.details)
        if self.stage is not None:
            out["stage"] = CONTRACT_STAGE.get(self.stage, self.stage)
            if out["stage"] != self.stage:
                details["step"] = self.stage
        for name in ("dtype", "count"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if details:
            out["details"] = details
        return out


@dataclass(frozen=True)
class HeadSummary:
    """One (batch, head) slice: how its rows with ≥ 2 visible keys behave."""

    index: Index
    rows: int
    mean_entropy: float
    mean_normalized_entropy: float
    mean_max_weight: float
    saturated: int
    near_uniform: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": list(self.index),
            "rows": self.rows,
            "mean_entropy": finite_or_none(self.mean_entropy),
            "mean_normalized_entropy": finite_or_none(self.mean_normalized_entropy),
            "mean_max_weight": finite_or_none(self.mean_max_weight),
            "saturated": self.saturated,
            "near_uniform": self.near_uniform,
        }


@dataclass(frozen=True)
class StageAccuracy:
    """One stage of an emulated run against float64."""

    stage: str
    max_abs: float
    max_abs_at: Index | None
    normwise: float
    max_row_rel: float
    max_row_rel_at: Index | None
    new_nonfinite: int
    new_nonfinite_at: Index | None
    problem: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "max_abs_error": finite_or_none(self.max_abs),
            "max_abs_error_at": index_list(self.max_abs_at),
            "normwise_error": finite_or_none(self.normwise),
            "max_row_relative_error": finite_or_none(self.max_row_rel),
            "max_row_relative_error_at": index_list(self.max_row_rel_at),
            "new_nonfinite": self.new_nonfinite,
            "new_nonfinite_at": index_list(self.new_nonfinite_at),
            "problem": self.problem,
        }


@dataclass(frozen=True)
class Emulation:
    """How far an emulated low-precision run strays from float64, stage by stage."""

    dtype: str
    accumulate: str
    softmax_dtype: str
    logits_dtype: str
    prescale: bool
    stages: tuple[StageAccuracy, ...]

    @property
    def first_problem(self) -> StageAccuracy | None:
        """The first stage that overflowed or lost precision, if any."""
        return next((s for s in self.stages if s.problem), None)

    def stage(self, name: str) -> StageAccuracy | None:
        return next((s for s in self.stages if s.stage == name), None)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_problem
        return {
            "dtype": self.dtype,
            "accumulate": self.accumulate,
            "softmax_dtype": self.softmax_dtype,
            "logits_dtype": self.logits_dtype,
            "prescale": self.prescale,
            "first_problem": None
            if first is None
            else {"stage": first.stage, "problem": first.problem},
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass(frozen=True)
class Diagnosis:
    """Everything the diagnose step concluded."""

    findings: tuple[Finding, ...]
    counts: Mapping[str, int]
    heads: tuple[HeadSummary, ...]
    headroom: Mapping[str, Mapping[str, float]]
    emulation: Emulation | None
    thresholds: Thresholds

    @property
    def truncated(self) -> bool:
        """Whether some row findings were counted but not listed."""
        listed: dict[str, int] = {}
        for f in self.findings:
            listed[f.kind] = listed.get(f.kind, 0) + 1
        return any(n > listed.get(k, 0) for k, n in self.counts.items())

    def total(self, hits: Iterable[Finding]) -> int:
        """How many findings ``hits`` (some of :attr:`findings`) stand for: a kind whose
        every listed finding is among them counts its unlisted rows too."""
        chosen: dict[str, int] = {}
        listed: dict[str, int] = {}
        for f in hits:
            chosen[f.kind] = chosen.get(f.kind, 0) + 1
        for f in self.findings:
            listed[f.kind] = listed.get(f.kind, 0) + 1
        return sum(
            max(self.counts.get(k, n), n) if n == listed.get(k) else n for k, n in chosen.items()
        )

    def worst(self) -> str | None:
        """The highest severity found, or None when nothing was."""
        found = {f.severity for f in self.findings}
        return next((s for s in reversed(SEVERITIES) if s in found), None)


def index_list(at: Index | None) -> list[int] | None:
    """An index as JSON writes it: a list, or None."""
    return None if at is None else list(at)


class Tally:
    """Findings gathered kind by kind: each counted, listed in ``kinds`` order; a row
    kind lists at most ``limit`` rows and counts them all."""

    def __init__(self, kinds: Sequence[str]) -> None:
        self._found: dict[str, list[Finding]] = {k: [] for k in kinds}
        self._counts: dict[str, int] = {k: 0 for k in kinds}

    def add(self, findings: Iterable[Finding]) -> None:
        for f in findings:
            self._counts[f.kind] += 1
            self._found[f.kind].append(f)

    def rows(self, kind: str, rows: Sequence[Finding], limit: int) -> None:
        self._counts[kind] += len(rows)
        self._found[kind].extend(rows[:limit])

    @property
    def findings(self) -> tuple[Finding, ...]:
        return tuple(f for found in self._found.values() for f in found)

    @property
    def counts(self) -> dict[str, int]:
        """The kinds found, with how many of each (listed or not)."""
        return {k: n for k, n in self._counts.items() if n}
