"""Shard reports: what ``sdpa check --manifest M --shard I/N`` adds to its JSON report
(:func:`shard_document`), and ``sdpa report merge``: the reports of a run's shards read
back, checked and merged into the report the unsharded run writes.

A shard's report is the manifest's report of its cases, with ``shard`` after
``manifest``::

    "shard": {"index": 2, "count": 4, "manifest_cases": 10, "positions": [2, 6, 10],
              "fingerprint": "sha256:…"}

``positions`` are the 1-based positions of its ``cases`` in the manifest (round robin,
:class:`~sdpa_cli.api.manifest.Shard`); ``fingerprint`` identifies the run (the
manifest's cases and the command line's settings,
:func:`~sdpa_cli.api.manifest.fingerprint`).

Merging refuses (:class:`~sdpa_cli.errors.InputError`, exit 2), naming the file: a
file that is not the JSON report of a shard, or of another ``schema_version``; shards of another manifest, another run
(fingerprint), another N or another sdpa version; a shard given twice; a shard missing.
A merged report missing a shard would pass over that shard's failures, so no partial
merge is written. The merged document is the unsharded run's: the same keys in the same
order, the cases in manifest order, ``passed`` and ``exit_code`` of them all.

The table, the JUnit XML and the GitHub annotations of a merged run are those of the
unsharded run too (a shard's report is a file from elsewhere, so every string read back
into them is :func:`~sdpa_cli.text.printable`, and a case's name and error are cut short
as a message's file name and problem are): each case is read back into a
:class:`~sdpa_cli.check.records.CaseResult` holding what they read (the checks, with
their tolerances and mismatch reports, or the case's error). The findings are not read
back (each rebuilt report's diagnosis is empty): the merged JSON is assembled from the
shards' own JSON, never written again from the rebuilt results.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdpa_cli.api.check import CheckRun
from sdpa_cli.api.manifest import SHARD_KEY, Shard, manifest_names
from sdpa_cli.check.compare import Mismatch, Tolerance
from sdpa_cli.check.records import CaseResult, Check, CheckReport
from sdpa_cli.diagnosis.findings import Diagnosis, Thresholds
from sdpa_cli.engine.types import Index
from sdpa_cli.errors import ExitCode, InputError, shortened
from sdpa_cli.files.structured import parse_text
from sdpa_cli.names import STATUSES
from sdpa_cli.report import check_exit_code, document_head
from sdpa_cli.schemas import SCHEMA_VERSION
from sdpa_cli.text import NON_FINITE_JSON, one_line, printable, shown

"""Non-finite numbers as sdpa's JSON writes them."""
NOT_READ = Diagnosis(
    findings=(), counts={}, heads=(), headroom={}, emulation=None, thresholds=Thresholds()
)
"""The diagnosis of a report read back: its findings stay in the JSON."""
INTERNAL_PREFIX = "internal error: "
MAX_ERROR = 500
"""A case's error read back is cut to this many characters (sdpa's own are shorter)."""
# fmt: off
CHECK_KEYS = (
    "name", "passed", "status", "summary", "index", "file", "tolerance", "mismatch", "hint",
)
# fmt: on
"""The keys of :meth:`Check.to_dict` that are not ``details``."""


@dataclass(frozen=True)
class ShardReport:
    """A shard's JSON report, read back and checked."""

    label: str
    document: dict[str, Any]
    shard: Shard
    total: int
    fingerprint: str
    results: list[CaseResult]

    @property
    def positions(self) -> list[int]:
        return self.shard.positions(self.total)


# --- reading ----------------------------------------------------------------------------


def _line(text: str) -> str:
    """A string read back as the table, stderr and JUnit may show it: printable, on one
    line of at most :data:`MAX_ERROR` characters."""
    return one_line(printable(text), MAX_ERROR)


def _optional(text: str | None) -> str | None:
    """:func:`_line` of a string that may be null."""
    return None if text is None else _line(text)


def _get(data: dict[str, Any], key: str, kind: str, label: str, where: str = "") -> Any:
    """``data[key]``, held to ``kind``: str, int (not a bool), bool, list, dict,
    number (or a non-finite number's string), or any of them ``|None``."""
    at = f"{where}.{key}" if where else key
    if key not in data:
        raise InputError(label, f"{at} is missing; not a report of sdpa check")
    value = data[key]
    optional = kind.endswith("|None")
    base = kind.removesuffix("|None")
    if value is None and optional:
        return None
    if base == "number":
        fits = isinstance(value, str) and value in NON_FINITE_JSON
        fits |= isinstance(value, (int, float)) and not isinstance(value, bool)
    elif base == "int":
        fits = isinstance(value, int) and not isinstance(value, bool)
    else:
        fits = isinstance(value, {"str": str, "bool": bool, "list": list, "dict": dict}[base])
    if not fits:
        raise InputError(
            label, f"{at}: expected {kind.replace('|None', ' or null')}, got {shown(value)}"
        )
    if base == "number":
        return NON_FINITE_JSON[value] if isinstance(value, str) else float(value)
    return value


def _index(data: dict[str, Any], key: str, label: str, where: str) -> Index | None:
    value = _get(data, key, "list|None", label, where)
    if value is None:
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise InputError(label, f"{where}.{key}: expected a list of integers, got {shown(value)}")
    return tuple(value)


def _mismatch(data: dict[str, Any], label: str, where: str) -> Mismatch:
    counts = {k: _get(data, k, "int", label, where) for k in ("total", "mismatched")}
    counts |= {k: _get(data, k, "int", label, where) for k in ("nan_mismatches", "inf_mismatches")}
    return Mismatch(
        **counts,
        max_abs=_get(data, "max_abs", "number", label, where),
        max_abs_at=_index(data, "max_abs_at", label, where),
        max_rel=_get(data, "max_rel", "number", label, where),
        max_rel_at=_index(data, "max_rel_at", label, where),
        worst_at=_index(data, "worst_at", label, where),
        worst_actual=_get(data, "worst_actual", "number|None", label, where),
        worst_reference=_get(data, "worst_reference", "number|None", label, where),
        passing_atol=_get(data, "passing_atol", "number|None", label, where),
        passing_rtol=_get(data, "passing_rtol", "number|None", label, where),
        passing_factor=_get(data, "passing_factor", "number|None", label, where)
        if "passing_factor" in data
        else None,
        worst_allowed=_get(data, "worst_allowed", "number|None", label, where)
        if "worst_allowed" in data
        else None,
    )


def _findings(data: dict[str, Any], label: str, where: str) -> None:
    """A findings check's ``findings`` (each with a ``message``) and ``count``, as a
    failure's text reads them."""
    findings = data.get("findings")
    if findings is None:
        return
    if not isinstance(findings, list) or not all(
        isinstance(f, dict) and isinstance(f.get("message"), str) for f in findings
    ):
        raise InputError(label, f"{where}.findings: expected a list of findings with messages")
    if "count" in data:
        _get(data, "count", "int", label, where)


def _details(data: dict[str, Any]) -> dict[str, Any]:
    """A check's extra keys; its findings' messages and hints (which a failure's text
    shows) made printable."""
    details = {k: v for k, v in data.items() if k not in CHECK_KEYS}
    if details.get("findings"):
        details["findings"] = [
            {**f, "message": _line(f["message"])}
            | (
                {"hint": _line(f["hint"] if isinstance(f["hint"], str) else shown(f["hint"]))}
                if f.get("hint")
                else {}
            )
            for f in details["findings"]
        ]
    return details


def _check(data: Any, label: str, where: str) -> Check:
    """A check as :meth:`Check.to_dict` wrote it; its extra keys back into ``details``."""
    if not isinstance(data, dict):
        raise InputError(label, f"{where}: expected a check (a JSON object), got {shown(data)}")
    status = _get(data, "status", "str", label, where)
    if status not in STATUSES:
        raise InputError(label, f"{where}.status: expected pass, warn or fail, got {shown(status)}")
    tolerance = mismatch = None
    if data.get("tolerance") is not None:
        tol = _get(data, "tolerance", "dict", label, where)
        at = f"{where}.tolerance"
        tolerance = Tolerance(
            rtol=_get(tol, "rtol", "number", label, at),
            atol=_get(tol, "atol", "number", label, at),
            source=_line(_get(tol, "source", "str", label, at)),
            factor=_get(tol, "factor", "number", label, at) if "factor" in tol else None,
        )
    if data.get("mismatch") is not None:
        mismatch = _mismatch(
            _get(data, "mismatch", "dict", label, where), label, f"{where}.mismatch"
        )
    _findings(data, label, where)
    passed = _get(data, "passed", "bool", label, where)
    if passed != (status != "fail"):
        raise InputError(
            label, f"{where}: says passed {str(passed).lower()}, but its status is {status}"
        )
    return Check(
        name=_line(_get(data, "name", "str", label, where)),
        status=status,
        summary=_line(_get(data, "summary", "str", label, where)),
        index=_index(data, "index", label, where),
        file=_optional(_get(data, "file", "str|None", label, where)) if "file" in data else None,
        tolerance=tolerance,
        mismatch=mismatch,
        details=_details(data),
        hint=_optional(_get(data, "hint", "str|None", label, where)) if "hint" in data else None,
    )


def _case(data: Any, label: str, where: str, internal_possible: bool) -> CaseResult:
    """A case as :func:`~sdpa_cli.report.check_document` wrote it."""
    if not isinstance(data, dict):
        raise InputError(label, f"{where}: expected a case (a JSON object), got {shown(data)}")
    # The name heads the case's lines, as a file name heads a message's.
    name = shortened(printable(_get(data, "name", "str", label, where)))
    error = _get(data, "error", "str|None", label, where)
    passed = _get(data, "passed", "bool", label, where)
    checks = _get(data, "checks", "list", label, where)
    if error is not None:
        if passed:
            raise InputError(label, f"{where}: says passed true, but it could not be checked")
        internal = internal_possible and error.startswith(INTERNAL_PREFIX)
        return CaseResult(name, error=_line(error), internal=internal)
    report = CheckReport(
        checks=tuple(_check(c, label, f"{where}.checks[{i}]") for i, c in enumerate(checks)),
        diagnosis=NOT_READ,
        export_dtype=_line(_get(data, "export_dtype", "str", label, where)),
        reference=_line(_get(data, "reference", "str", label, where)),
        gate=tuple(_line(str(k)) for k in _get(data, "fail_on", "list", label, where)),
        fail_on_severity=_optional(_get(data, "fail_on_severity", "str|None", label, where)),
    )
    if passed != report.passed:
        verdict = "every check passed" if report.passed else "a check failed"
        raise InputError(label, f"{where}: says passed {str(passed).lower()}, but {verdict}")
    return CaseResult(name, report)


def read_shard_report(path: str) -> ShardReport:
    """A shard's JSON report (read with the size limit of every JSON input), checked.

    Raises:
        InputError: naming the file: not JSON, not the report of a shard, a shard
            block that does not fit its cases.
    """
    label = printable(path)
    doc = parse_text(Path(path), "json", label)
    if not isinstance(doc, dict) or ("cases" not in doc and "checks" not in doc):
        raise InputError(label, "is not a JSON report of sdpa check")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise InputError(
            label,
            f"is a report of schema_version {shown(version)}, not {SCHEMA_VERSION}; "
            "run the shards with this sdpa",
        )
    if doc.get("manifest") is None:
        raise InputError(label, "is the report of one case, not of a shard of a manifest")
    if SHARD_KEY not in doc:
        raise InputError(
            label,
            "is the report of a whole manifest, not of a shard (sdpa check --manifest M "
            "--shard I/N writes those)",
        )
    for key, kind in (("sdpa_version", "str"), ("manifest", "str"), ("passed", "bool")):
        _get(doc, key, kind, label)
    code = _get(doc, "exit_code", "int", label)
    if code not in (0, 1, 2, 3):
        raise InputError(label, f"exit_code: expected 0, 1, 2 or 3, got {code}")
    block = _get(doc, SHARD_KEY, "dict", label)
    index, count = (_get(block, k, "int", label, SHARD_KEY) for k in ("index", "count"))
    total = _get(block, "manifest_cases", "int", label, SHARD_KEY)
    fingerprint = _get(block, "fingerprint", "str", label, SHARD_KEY)
    if not 1 <= index <= count or total < 0:
        raise InputError(label, f"shard: not a shard: {index}/{count} of {total} cases")
    shard = Shard(index, count)
    if _get(block, "positions", "list", label, SHARD_KEY) != shard.positions(total):
        raise InputError(label, f"shard.positions: not those of shard {shard} of {total} cases")
    cases = _get(doc, "cases", "list", label)
    if len(cases) != len(shard.positions(total)):
        raise InputError(
            label,
            f"holds {len(cases)} cases; shard {shard} of {total} cases has {len(shard.positions(total))}",
        )
    results = [_case(c, label, f"cases[{i}]", code == 3) for i, c in enumerate(cases)]
    if doc["passed"] != all(r.passed for r in results) or code != check_exit_code(results):
        raise InputError(
            label,
            f"says passed {str(doc['passed']).lower()} and exit code {code}, but its cases "
            f"give exit code {int(check_exit_code(results))}",
        )
    return ShardReport(label, doc, shard, total, fingerprint, results)


# --- merging ----------------------------------------------------------------------------


def _same_run(first: ShardReport, other: ShardReport) -> None:
    """Refuse ``other`` unless it is a shard of ``first``'s run."""
    a, b = first.document, other.document
    differences = [
        (
            a["manifest"] != b["manifest"],
            f"manifest {shown(b['manifest'])}, not {shown(a['manifest'])}",
        ),
        (
            first.shard.count != other.shard.count,
            f"{other.shard.count} shards, not {first.shard.count}",
        ),
        (first.total != other.total, f"{other.total} cases, not {first.total}"),
        (first.fingerprint != other.fingerprint, "another manifest's cases, or other settings"),
        (
            a["sdpa_version"] != b["sdpa_version"],
            f"sdpa {b['sdpa_version']}, not {a['sdpa_version']}",
        ),
    ]
    for differs, what in differences:
        if differs:
            raise InputError(other.label, f"is a shard of another run than {first.label}: {what}")


def _as_the_manifest(reports: list[ShardReport], manifest: str) -> None:
    """Refuse a shard whose cases are not the manifest's at its positions (renamed,
    another manifest's), or a run of another number of cases."""
    try:
        names = manifest_names(manifest)
    except InputError as exc:
        raise InputError(
            exc.where,
            f"{exc.problem}; the shards are verified against the manifest they ran: give "
            "--manifest FILE where it is",
        ) from None
    for r in reports:
        if r.total != len(names):
            raise InputError(
                r.label,
                f"is a shard of {r.total} cases, but {printable(manifest)} lists {len(names)}",
            )
        for i, (position, result) in enumerate(zip(r.positions, r.results, strict=True)):
            if result.name != shortened(names[position - 1]):
                raise InputError(
                    r.label,
                    f"cases[{i}] is named {result.name!r}, but case {position} of "
                    f"{printable(manifest)} is {shortened(names[position - 1])!r}",
                )


def merge_shard_reports(reports: list[ShardReport]) -> tuple[dict[str, Any], list[CaseResult]]:
    """Every shard of one run → the unsharded run's JSON document and its cases, in
    manifest order.

    Raises:
        InputError: no report; shards of different runs; a shard twice or missing.
    """
    if not reports:
        raise InputError("", "give the JSON reports of every shard of a run")
    first = reports[0]
    seen: dict[int, str] = {}
    for r in reports:
        _same_run(first, r)
        if r.shard.index in seen:
            raise InputError(
                r.label,
                f"is shard {r.shard} again (as {seen[r.shard.index]}); give each shard once",
            )
        seen[r.shard.index] = r.label
    missing = [f"{i}/{first.shard.count}" for i in range(1, first.shard.count + 1) if i not in seen]
    if missing:
        raise InputError(
            printable(first.document["manifest"]),
            f"{'shard' if len(missing) == 1 else 'shards'} {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing; merge the reports of every shard",
        )
    # (position in the manifest, the case's JSON, its result), every case once.
    placed = sorted(
        (
            (pos, case, result)
            for r in reports
            for pos, case, result in zip(r.positions, r.document["cases"], r.results, strict=True)
        ),
        key=lambda t: t[0],
    )
    cases = [case for _, case, _ in placed]
    results = [result for _, _, result in placed]
    code = check_exit_code(results)
    document = {
        **document_head(),
        "sdpa_version": first.document["sdpa_version"],
        "manifest": first.document["manifest"],
        "passed": code == ExitCode.OK,
        "exit_code": int(code),
        "cases": cases,
    }
    return document, results


def merge_reports(paths: list[str] | tuple[str, ...], manifest: str | None = None) -> CheckRun:
    """``sdpa report merge``: the JSON reports of every shard of a run, read, each
    checked against itself and against the manifest its run read (``manifest``, or
    the path the reports name), and merged into the unsharded run (its document
    assembled from the shards' own JSON).

    Raises:
        InputError: naming the file: one that is not a shard's report or contradicts
            itself, shards of different runs, a shard twice or missing, a shard whose
            cases are not the manifest's.
    """
    reports = [read_shard_report(path) for path in paths]
    document, results = merge_shard_reports(reports)  # one run's shards, each once
    _as_the_manifest(reports, manifest or str(document["manifest"]))
    manifest = document["manifest"]
    title = None if manifest is None else printable(str(manifest))
    return CheckRun(results, manifest=title, merged=document)
