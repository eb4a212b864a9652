"""Machine-readable payloads: a trace as JSON, YAML and .npz; what ``inspect`` read as JSON;
check reports as JSON, JUnit XML and GitHub Actions annotations; the exit status of ``check``.

JSON has no infinities or NaN, so non-finite numbers are written as the strings
``"Infinity"``, ``"-Infinity"`` and ``"NaN"`` (the convention of Protocol Buffers'
JSON mapping); YAML writes them natively (``.inf``, ``-.inf``, ``.nan``).

Every document starts with :func:`document_head`: ``schema_version`` then
``sdpa_version``; its shape is :mod:`sdpa_cli.schemas`' schema of its kind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml
from numpy.typing import NDArray

from sdpa_cli._version import __version__
from sdpa_cli.check.records import CaseResult, Check, CheckReport, failure_lines
from sdpa_cli.diagnosis.findings import Diagnosis
from sdpa_cli.diagnosis.inspect import FileReport, TensorStats, Unreadable
from sdpa_cli.engine.arrays import NUMPY, Backend
from sdpa_cli.engine.block import applicable_stages
from sdpa_cli.engine.forward import lean_backend
from sdpa_cli.engine.trace import Trace
from sdpa_cli.errors import ExitCode
from sdpa_cli.schemas import SCHEMA_VERSION
from sdpa_cli.text import json_number, printable

if TYPE_CHECKING:
    from sdpa_cli.diagnosis.explained import Explanation
    from sdpa_cli.diagnosis.grad import GradDiagnosis
    from sdpa_cli.engine.grad import Gradients
    from sdpa_cli.engine.numeric import NumericCheck
    from sdpa_cli.engine.spec import AttentionSpec


def _nested(a: NDArray[Any], for_json: bool) -> Any:
    lists = a.tolist()
    if not for_json or a.dtype == np.bool_ or bool(np.isfinite(a).all()):
        return lists

    def fix(node: Any) -> Any:
        return [fix(n) for n in node] if isinstance(node, list) else json_number(node)

    return fix(lists)


def document_head() -> dict[str, Any]:
    """The first keys of every JSON/YAML document: its shape's version, then sdpa's."""
    return {"schema_version": SCHEMA_VERSION, "sdpa_version": __version__}


def _typed_value(value: Any, for_json: bool) -> Any:
    """An option as typed, as JSON and YAML hold it (tuples as lists, JSON's infinity)."""
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and for_json:
        return json_number(value)
    return value


def setup_payload(
    spec: AttentionSpec, *, for_json: bool, computed: Backend | None = None
) -> dict[str, Any]:
    """Versions, shapes, scale, options and what computed them (default: what computes
    the findings' lean pass, ``lean_backend``): the head of every trace document."""
    computed = computed or lean_backend(spec)
    o = spec.options
    shapes: dict[str, list[int]] = {n: list(s) for n, s in spec.shapes.items()}
    shapes["weights"] = list(spec.weights_shape)
    shapes["output"] = list(spec.merged_output_shape)
    return {
        **document_head(),
        "shapes": shapes,
        "scale": spec.scale,
        "scale_rule": o.scale if isinstance(o.scale, str) else "given",
        "temperature": o.temperature,
        "options": {
            "framework": o.framework,
            "softcap": o.softcap,
            "alibi": o.alibi,
            "causal": o.causal,
            "causal_align": o.causal_align,
            "window": list(o.window) if o.window else None,
            "mask_mod": o.mask_mod,
            "score_mod": o.score_mod,
            "key_lengths": list(o.key_lengths) if o.key_lengths else None,
            "query_offset": list(o.query_offset) if o.query_offset else None,
            "attention_chunk": o.attention_chunk,
            "query_lengths": list(o.query_lengths) if o.query_lengths else None,
            "cu_seqlens": list(o.cu_seqlens) if o.cu_seqlens else None,
            "cu_seqlens_k": list(o.cu_seqlens_k) if o.cu_seqlens_k else None,
            "sinks": None if spec.sinks is None else [float(x) for x in spec.sinks],
            "descale": None if spec.descale is None else spec.descale.payload(),
            "mask_true_means": o.mask_true_means,
            "mask_value": json_number(o.mask_value) if for_json else o.mask_value,
            "dropout": o.dropout,
            "seed": o.seed,
            "heads": o.heads,
            "kv_heads": o.kv_heads,
            "layout": o.layout,
            "group": spec.group,
            "dtype": o.dtype,
            "accumulate": o.accumulate,
            "softmax_dtype": o.softmax_dtype,
            "logits_dtype": o.logits_dtype,
            "prescale": o.prescale,
        },
        "options_typed": {name: _typed_value(v, for_json) for name, v in o.typed.items()},
        "backend": computed.name,
        "device": computed.device,
    }


def payload(
    trace: Trace, stages: tuple[str, ...], diagnosis: Diagnosis | None = None, *, for_json: bool
) -> dict[str, Any]:
    """The ``--format json|yaml`` object: shapes, scale, options, stages, findings.

    Built whole, from a trace that kept its stages; ``sdpa compute`` writes the same
    text stage by stage with :func:`sdpa_cli.stream.write_document`."""
    spec = trace.spec
    data = setup_payload(spec, for_json=for_json)
    data["stages"] = [s for s in applicable_stages(spec) if s in stages]
    for name in data["stages"]:
        arr = trace.merged_output if name == "output" else trace.stage(name)
        if arr is not None:
            data[name] = _nested(arr, for_json)
    # Beside score-shaped stages only: which of their cells the masks hid.
    if trace.visible is not None and not trace.visible.all():
        data["visible"] = trace.visible.tolist()
    data.update(diagnosis_payload(diagnosis, for_json=for_json) if diagnosis else {"findings": []})
    return data


def explain_payload(ex: Explanation, *, for_json: bool) -> dict[str, Any]:
    """``sdpa explain --format json|yaml``: the slice, its stages with values, notes and
    findings, then the scorecard and the scale comparison when asked for."""
    spec = ex.spec
    data = setup_payload(spec, for_json=for_json)
    lead = list(ex.lead)
    data["slice"] = {
        "index": lead,
        "batch": lead[-2] if len(lead) >= 2 else None,
        "head": lead[-1] if lead else None,
        "rows": [ex.rows.start, ex.rows.stop],
        "queries": spec.L,
        "keys": spec.S,
    }
    stages = []
    for st in ex.stages:
        entry: dict[str, Any] = {
            "name": st.name,
            "values": _nested(st.values, for_json),
            "note": st.note,
            "summary": _clean(dict(st.summary), for_json),
            "findings": _clean([f.to_dict() for f in st.findings], for_json),
        }
        if st.step == "masked":
            entry["visible"] = ex.visible.tolist()
        if st.step == "weights":
            entry["rows"] = _clean(ex.row_stats.to_list(), for_json)
        stages.append(entry)
    data["stages"] = stages
    data["variance"] = _clean(ex.variance.to_dict(), for_json) if ex.variance else None
    data["input_findings"] = _clean([f.to_dict() for f in ex.input_findings], for_json)
    if ex.scorecard is not None:
        data["scorecard"] = _clean(ex.scorecard.to_dict(), for_json)
    if ex.scales:
        data["scales"] = {
            "runs": _clean([r.to_dict() for r in ex.scales], for_json),
            "verdict": ex.scales_verdict,
        }
    if ex.backward is not None:
        data["backward"] = {
            **_clean(ex.backward.to_dict(), for_json),
            "stages": [
                {
                    "name": st.name,
                    "values": _nested(st.values, for_json),
                    "note": st.note,
                    "summary": _clean(dict(st.summary), for_json),
                    "findings": _clean([f.to_dict() for f in st.findings], for_json),
                }
                for st in ex.backward.stages
            ],
            "elsewhere": _clean([f.to_dict() for f in ex.backward.elsewhere], for_json),
        }
    data.update(diagnosis_payload(ex.diagnosis, for_json=for_json))
    return data


def _clean(value: Any, for_json: bool) -> Any:
    """Non-finite floats as JSON strings (or kept for YAML), recursively."""
    if isinstance(value, float):
        return json_number(value) if for_json else value
    if isinstance(value, dict):
        return {k: _clean(v, for_json) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v, for_json) for v in value]
    if isinstance(value, np.generic):
        return _clean(value.item(), for_json)
    return value


def diagnosis_payload(diagnosis: Diagnosis, *, for_json: bool) -> dict[str, Any]:
    """``findings`` (the contract), their full counts, per-head summaries, precision."""
    out: dict[str, Any] = {
        "findings": [f.to_dict() for f in diagnosis.findings],
        "finding_counts": dict(diagnosis.counts),
        "findings_truncated": diagnosis.truncated,
        "thresholds": dataclasses.asdict(diagnosis.thresholds),
        "heads": [h.to_dict() for h in diagnosis.heads],
        "headroom_bits": {d: dict(per) for d, per in diagnosis.headroom.items()},
        "emulation": diagnosis.emulation.to_dict() if diagnosis.emulation else None,
    }
    return _clean(out, for_json)  # type: ignore[no-any-return]


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(data, allow_nan=False)


def to_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


# --- sdpa grad --------------------------------------------------------------------------


def grad_payload(
    grads: Gradients,
    health: GradDiagnosis,
    diagnosis: Diagnosis,
    *,
    dout: dict[str, Any],
    numeric: list[NumericCheck] | None,
    tolerance: float,
    dtype: str,
    for_json: bool,
) -> dict[str, Any]:
    """``sdpa grad --format json|yaml``: the setup, dO's source, the gradients, norms,
    ranges, the numeric check, findings. ``gradients`` is None here: its arrays
    (:func:`grad_arrays`) are written a piece at a time, in its place, by
    :func:`~sdpa_cli.stream.write_with_arrays`. ``options.dtype`` is the format the
    gradients were judged against (``--dtype``); the backward pass itself is float64."""
    data = setup_payload(grads.spec, for_json=for_json, computed=NUMPY)  # the backward: numpy
    data["options"]["dtype"] = dtype
    data["dout"] = dout
    data["gradients"] = None
    data.update(_clean(health.to_dict(), for_json))
    data["numeric_check"] = (
        None
        if numeric is None
        else {
            "tolerance": tolerance,
            "passed": all(c.passed(tolerance) for c in numeric),
            "tensors": _clean([dataclasses.asdict(c) for c in numeric], for_json),
        }
    )
    data.update(diagnosis_payload(diagnosis, for_json=for_json))
    return data


def grad_arrays(grads: Gradients) -> dict[str, NDArray[np.float64]]:
    """Every gradient, in its operand's shape as loaded (heads merged back): what the
    document's ``gradients`` and ``--save`` hold."""
    return {n: np.asarray(grads.loaded(n)) for n in grads.present()}


# --- sdpa inspect -----------------------------------------------------------------------


def inspect_payload(results: Sequence[FileReport | Unreadable]) -> dict[str, Any]:
    """``sdpa inspect``'s JSON: ``{"schema_version", "sdpa_version", "files": [{"path",
    "tensors": [...]}]}``.

    A statistic with no value (an empty tensor, one with no finite value) is ``null``;
    infinite headroom (a tensor of zeros) is the string ``"Infinity"``, as everywhere
    in sdpa's JSON. A file that could not be read has ``"error"`` and no tensors; a
    refused member has ``"error"`` and no statistics.

    Args:
        results: what :func:`~sdpa_cli.diagnosis.inspect.inspect_files` returns.
    """
    files = [
        {"path": r.path, "tensors": [], "error": str(r.error)}
        if isinstance(r, Unreadable)
        else {
            "path": r.path,
            "format": r.format,
            "case": r.case,
            "tensors": [_tensor_payload(t) for t in r.tensors],
            "error": None,
        }
        for r in results
    ]
    return {**document_head(), "files": files}


def _tensor_payload(t: TensorStats) -> dict[str, Any]:
    """One tensor of ``inspect``'s JSON: its statistics, or its error when refused."""
    if t.problem is not None:
        return {"name": t.name, "error": t.error}
    return {
        "name": t.name,
        "shape": list(t.shape),
        "dtype": t.dtype,
        "size": t.size,
        "finite": t.finite,
        "min": _nan_to_none(t.min),
        "max": _nan_to_none(t.max),
        "mean": _nan_to_none(t.mean),
        "std": _nan_to_none(t.std),
        "nan": t.nan,
        "posinf": t.posinf,
        "neginf": t.neginf,
        "max_abs": _nan_to_none(t.absmax),
        "min_abs_nonzero": _nan_to_none(t.absmin),
        "headroom": {
            h.format: {
                "max": h.max,
                "bits": None if math.isnan(h.bits) else json_number(h.bits),
                "overflow": h.overflow,
                "flush": h.flush,
                "subnormal": h.subnormal,
                "subnormal_notable": h.subnormal_notable,
            }
            for h in t.headroom
        },
        "source": t.source,
        "error": None,
    }


def _nan_to_none(x: float) -> float | str | None:
    """A statistic with no value (NaN) as ``null``; an infinite one (the mean of huge
    finite values can overflow) as ``"Infinity"``, as everywhere in sdpa's JSON."""
    return None if math.isnan(x) else json_number(x)


# --- sdpa check -------------------------------------------------------------------------


def check_payload(report: CheckReport, *, name: str) -> dict[str, Any]:
    """One case as JSON: ``name``, ``passed``, the settings, ``checks`` (each with
    ``index``), ``findings``, ``error`` (null: the case was checked)."""
    data: dict[str, Any] = {
        "name": name,
        "passed": report.passed,
        "export_dtype": report.export_dtype,
        "reference": report.reference,
        "backend": report.backend,
        "device": report.device,
        "fail_on": list(report.gate),
        "fail_on_severity": report.fail_on_severity,
        "checks": [c.to_dict() for c in report.checks],
    }
    diag = diagnosis_payload(report.diagnosis, for_json=True)
    data["findings"] = diag["findings"]
    data["finding_counts"] = diag["finding_counts"]
    data["error"] = None
    return _clean(data, True)  # type: ignore[no-any-return]


def _unchecked_payload(result: CaseResult) -> dict[str, Any]:
    """A case that could not be checked: its ``error``, no checks, no findings."""
    return {
        "name": result.name,
        "passed": False,
        "export_dtype": None,
        "reference": None,
        "backend": None,
        "device": None,
        "fail_on": [],
        "fail_on_severity": None,
        "checks": [],
        "findings": [],
        "finding_counts": {},
        "error": result.error,
    }


def check_document(results: list[CaseResult], *, manifest: str | None) -> dict[str, Any]:
    """The ``--format json`` object and ``--report``, one shape for every run:
    ``manifest`` (null for the one case of the command line), ``passed``,
    ``exit_code``, then ``cases`` (one entry for a single case, named as its table
    and JUnit suite are)."""
    code = check_exit_code(results)
    cases = [
        _unchecked_payload(r) if r.report is None else check_payload(r.report, name=r.name)
        for r in results
    ]
    return {
        **document_head(),
        "manifest": manifest,
        "passed": code == ExitCode.OK,
        "exit_code": int(code),
        "cases": cases,
    }


def check_exit_code(results: list[CaseResult]) -> ExitCode:
    """2 when a case could not be checked (3 for a bug), else 1 when a check failed, else 0."""
    if any(r.internal for r in results):
        return ExitCode.INTERNAL
    if any(r.report is None for r in results):
        return ExitCode.BAD_INPUT
    if not all(r.passed for r in results):
        return ExitCode.CHECK_FAILED
    return ExitCode.OK


def _failure_text(check: Check) -> str:
    """The text of a JUnit ``<failure>``: the figure, the full report, the file."""
    lines = [check.summary, *failure_lines(check)]
    if check.file:
        lines.append(f"file: {check.file}")
    return "\n".join(lines)


def xml_text(text: str) -> str:
    """``text`` as XML 1.0 can hold it: what it forbids (control characters but tab and
    line breaks, lone surrogates) escaped as :func:`~sdpa_cli.text.printable` does."""
    forbidden = r"[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]"
    return re.sub(forbidden, lambda m: printable(m.group()), text)


def junit_xml(results: list[CaseResult], *, suite: str = "sdpa check") -> bytes:
    """JUnit XML: a testsuite per case, a testcase per check, ``<failure>`` on failure.

    A case that could not be checked is one testcase with an ``<error>``; a warning is
    a passing testcase whose ``<system-out>`` says why; all of it :func:`xml_text`."""
    import xml.etree.ElementTree as ET  # imported here: only --junit needs it

    root = ET.Element("testsuites", name=suite)
    totals = {"tests": 0, "failures": 0, "errors": 0}
    for r in results:
        ts = ET.SubElement(root, "testsuite", name=r.name)
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if r.report is None:
            tc = ET.SubElement(ts, "testcase", classname=f"sdpa.check.{r.name}", name="load")
            ET.SubElement(tc, "error", message=r.error or "", type="error").text = r.error
            counts["tests"] += 1
            counts["errors"] += 1
        else:
            for c in r.report.checks:
                attrs = {"classname": f"sdpa.check.{r.name}", "name": c.name}
                if c.file:
                    attrs["file"] = c.file
                tc = ET.SubElement(ts, "testcase", attrs)
                counts["tests"] += 1
                if c.status == "fail":
                    counts["failures"] += 1
                    failure = ET.SubElement(tc, "failure", message=c.summary, type=c.name)
                    failure.text = _failure_text(c)
                elif c.status == "warn":
                    ET.SubElement(tc, "system-out").text = f"WARN: {c.summary}"
        for key, value in counts.items():
            ts.set(key, str(value))
        for key in totals:
            totals[key] += counts[key]
    for key, value in totals.items():
        root.set(key, str(value))
    ET.indent(root)
    text = xml_text(ET.tostring(root, encoding="unicode"))  # ET writes \x1b as it is
    return f"<?xml version='1.0' encoding='utf-8'?>\n{text}\n".encode()


def _escape(text: str, *, prop: bool = False) -> str:
    """GitHub's workflow-command escaping (properties also ``:`` and ``,``), then printable's."""
    text = printable(text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A"))
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def github_annotations(results: list[CaseResult], *, manifest: str | None) -> list[str]:
    """``::error``/``::warning`` lines for GitHub Actions: one per failed or warning check."""
    lines = []
    for r in results:
        prefix = f"{r.name}: " if manifest is not None else ""
        if r.report is None:
            props = f"file={_escape(manifest, prop=True)}," if manifest else ""
            lines.append(f"::error {props}title=sdpa check::{_escape(prefix + (r.error or ''))}")
            continue
        for c in r.report.checks:
            if c.status == "pass":
                continue
            level = "error" if c.status == "fail" else "warning"
            props = f"file={_escape(c.file, prop=True)}," if c.file else ""
            title = _escape(f"sdpa check {c.name}", prop=True)
            lines.append(f"::{level} {props}title={title}::{_escape(prefix + c.summary)}")
    return lines
