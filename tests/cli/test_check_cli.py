"""Tests of ``sdpa check``: exit codes per kind of check, every report format, tolerances,
bad usage, manifests (in parallel), the config file, and one end-to-end run.

Like ``test_cli.py``, most tests drive ``sdpa_cli.cli.cli`` through click's ``CliRunner``
(``exit_code`` is what a user sees, ``stderr`` is apart from ``stdout``); the inputs are
small arrays written with ``np.save`` into a fresh working directory, and the exports
are computed here from the formula, independently of the package.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import Result
from clirunner import ANSI, CLEAN_ENV, assert_one_error_line, invoke, only_case, strict_json
from numpy.typing import NDArray

from sdpa_cli import __version__
from sdpa_cli.errors import ExitCode
from sdpa_cli.names import KINDS, SEVERITIES

F64 = NDArray[np.float64]

GITHUB = {"GITHUB_ACTIONS": "true"}


def check(*args: str, env: Mapping[str, str | None] | None = None) -> Result:
    """``sdpa check ARGS``."""
    return invoke("check", *args, env=env)


def check_json(*args: str, code: int, env: Mapping[str, str | None] | None = None) -> Any:
    """``sdpa check ARGS --format json``: the exit code, then the validated document
    (of a manifest), or its one case (of the case on the command line)."""
    result = check(*args, "--format", "json", env=env)
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.output
    doc = strict_json(result.stdout)
    if doc["manifest"] is not None:
        validate_manifest_document(doc)
    else:
        validate_document(doc)
    assert doc["exit_code"] == code
    return doc if doc["manifest"] is not None else only_case(doc)


def by_name(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The checks of a case, by name (each name appears once)."""
    names = [c["name"] for c in doc["checks"]]
    assert len(names) == len(set(names)), names
    return {c["name"]: c for c in doc["checks"]}


# --- the documented JSON shape ----------------------------------------------------------------

NUMBER_STRINGS = ("NaN", "Infinity", "-Infinity")
MISMATCH_KEYS = {
    "total",
    "mismatched",
    "nan_mismatches",
    "inf_mismatches",
    "max_abs",
    "max_abs_at",
    "max_rel",
    "max_rel_at",
    "worst_at",
    "worst_actual",
    "worst_reference",
    "passing_atol",
    "passing_rtol",
    "passing_factor",
    "worst_allowed",
    "fraction",
}
CASE_KEYS = {
    "passed",
    "export_dtype",
    "reference",
    "fail_on",
    "fail_on_severity",
    "checks",
    "findings",
    "finding_counts",
}


def is_number(x: Any, *, optional: bool = False) -> bool:
    """A JSON number (never a bool), or one of the strings standing for non-finite ones."""
    if x is None:
        return optional
    if isinstance(x, bool):
        return False
    return isinstance(x, (int, float)) or x in NUMBER_STRINGS


def is_index(x: Any) -> bool:
    return x is None or (isinstance(x, list) and all(type(i) is int and i >= 0 for i in x))


def validate_check(c: Any) -> None:
    """One entry of ``checks``: name, passed, status, summary, index, then details."""
    assert isinstance(c, dict), c
    assert list(c)[:5] == ["name", "passed", "status", "summary", "index"], list(c)
    assert isinstance(c["name"], str)
    assert re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", c["name"]), c["name"]
    assert c["status"] in ("pass", "warn", "fail")
    assert c["passed"] is (c["status"] != "fail")
    assert isinstance(c["summary"], str)
    assert c["summary"]
    assert "\n" not in c["summary"]
    assert is_index(c["index"])
    if "file" in c:
        assert isinstance(c["file"], str)
    if "hint" in c:
        assert isinstance(c["hint"], str)
    if "tolerance" in c:
        tol = c["tolerance"]
        assert set(tol) - {"factor"} == {"rtol", "atol", "source"}
        assert is_number(tol.get("factor", 0.0))
        assert is_number(tol["rtol"])
        assert is_number(tol["atol"])
        assert isinstance(tol["source"], str)
    if "mismatch" in c:
        m = c["mismatch"]
        assert set(m) == MISMATCH_KEYS, set(m) ^ MISMATCH_KEYS
        for key in ("total", "mismatched", "nan_mismatches", "inf_mismatches"):
            assert type(m[key]) is int
            assert m[key] >= 0
        assert m["nan_mismatches"] + m["inf_mismatches"] <= m["mismatched"] <= m["total"]
        for key in ("max_abs_at", "max_rel_at", "worst_at"):
            assert is_index(m[key])
        for key in ("max_abs", "max_rel", "fraction"):
            assert is_number(m[key])
        for key in (
            "worst_actual",
            "worst_reference",
            "passing_atol",
            "passing_rtol",
            "passing_factor",
            "worst_allowed",
        ):
            assert is_number(m[key], optional=True)
        assert (m["worst_at"] is None) == (m["mismatched"] == 0)
        assert m["fraction"] == pytest.approx(m["mismatched"] / m["total"])
        if c["name"].endswith(".close"):
            shifted = c.get("shifted_slices", [])
            assert c["passed"] is (m["mismatched"] == 0 and not shifted)


def validate_case(doc: Any) -> None:
    """The part of a document that describes one case that could be checked."""
    assert isinstance(doc, dict)
    assert set(doc) >= CASE_KEYS, CASE_KEYS - set(doc)
    assert isinstance(doc["passed"], bool)
    assert isinstance(doc["export_dtype"], str)
    assert doc["reference"] in ("float32", "float64")
    assert isinstance(doc["fail_on"], list)
    assert set(doc["fail_on"]) <= set(KINDS)
    assert doc["fail_on_severity"] in (None, *SEVERITIES)
    assert isinstance(doc["checks"], list)
    assert doc["checks"]
    for c in doc["checks"]:
        validate_check(c)
    assert doc["passed"] is all(c["passed"] for c in doc["checks"])
    for f in doc["findings"]:
        assert list(f)[:3] == ["kind", "severity", "message"]
        assert f["kind"] in KINDS
        assert f["severity"] in SEVERITIES
        assert isinstance(f["message"], str)
    counts = doc["finding_counts"]
    assert isinstance(counts, dict)
    assert set(counts) <= set(KINDS)
    assert all(type(n) is int and n > 0 for n in counts.values())
    assert {f["kind"] for f in doc["findings"]} <= set(counts)


def validate_head(doc: Any) -> None:
    """What every check report starts with, for one case or a manifest."""
    assert isinstance(doc, dict)
    assert list(doc) == [
        "schema_version",
        "sdpa_version",
        "manifest",
        "passed",
        "exit_code",
        "cases",
    ]
    assert (doc["schema_version"], doc["sdpa_version"]) == (1, __version__)


def validate_document(doc: Any) -> None:
    """``sdpa check ... --format json`` for one case: the manifest's shape, its one
    case the command line's."""
    validate_head(doc)
    assert doc["exit_code"] in (0, 1)  # 2 and 3 never come with a document for one case
    case = only_case(doc)
    validate_case(case)
    assert case["error"] is None
    assert doc["passed"] is case["passed"] is (doc["exit_code"] == 0)


def validate_manifest_document(doc: Any) -> None:
    """``sdpa check --manifest ... --format json``."""
    validate_head(doc)
    assert isinstance(doc["manifest"], str)
    assert doc["exit_code"] in (0, 1, 2, 3)
    assert doc["passed"] is (doc["exit_code"] == 0)
    assert isinstance(doc["cases"], list)
    assert doc["cases"]
    for case in doc["cases"]:
        assert {"name", "passed", "error", "checks"} <= set(case)
        assert isinstance(case["name"], str)
        if case["error"] is None:
            validate_case(case)
        else:
            assert isinstance(case["error"], str)
            assert case["passed"] is False
            assert case["checks"] == []
    names = [c["name"] for c in doc["cases"]]
    assert len(names) == len(set(names))
    errors = any(c["error"] is not None for c in doc["cases"])
    failed = not all(c["passed"] for c in doc["cases"])
    if doc["exit_code"] != 3:
        assert doc["exit_code"] == (2 if errors else 1 if failed else 0)


# --- fixtures ----------------------------------------------------------------------------------

RNG_SEED = 20240612
H, L, S, E, EV = 2, 3, 5, 4, 3
QKV = ("q.npy", "k.npy", "v.npy")
SCALE = 1 / math.sqrt(E)

# Where each bad export is off, and by how much.
BAD_AT: dict[str, tuple[int, ...]] = {"output": (1, 2, 1), "weights": (0, 1, 2), "lse": (1, 0)}
DELTA = 0.01
FLAG = {"output": "--expect-output", "weights": "--expect-weights", "lse": "--expect-lse"}
SHAPES = {"output": (H, L, EV), "weights": (H, L, S), "lse": (H, L)}


def attention(q: F64, k: F64, v: F64, scale: float, causal: bool = False) -> dict[str, F64]:
    """Output, weights and logsumexp per row, from the formula (one head axis)."""
    logits = np.einsum("HLE,HSE->HLS", q, k) * scale
    if causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:], dtype=bool)), logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    e = np.exp(logits - m)
    total = e.sum(axis=-1, keepdims=True)
    weights = e / total
    return {
        "output": np.einsum("HLS,HSD->HLD", weights, v),
        "weights": weights,
        "lse": (m + np.log(total))[..., 0],
    }


def write_exports(d: Path, *, causal: bool = False, suffix: str = "") -> dict[str, F64]:
    """q, k, v and the exports (good, off by DELTA at BAD_AT, and of a wrong shape) in ``d``."""
    rng = np.random.default_rng(RNG_SEED)
    q = rng.standard_normal((H, L, E))
    k = rng.standard_normal((H, S, E))
    v = rng.standard_normal((H, S, EV))
    for name, arr in {"q": q, "k": k, "v": v}.items():
        np.save(d / f"{name}.npy", arr)
    exports = attention(q, k, v, SCALE, causal)
    for name, good in exports.items():
        np.save(d / f"{name}{suffix}.npy", good)
        bad = good.copy()
        bad[BAD_AT[name]] += DELTA
        np.save(d / f"{name}{suffix}_bad.npy", bad)
        np.save(d / f"{name}{suffix}_shape.npy", good[:, :2])  # L = 2, not 3
    return {"q": q, "k": k, "v": v, **exports}


@pytest.fixture
def exports(workdir: Path) -> dict[str, F64]:
    """q.npy k.npy v.npy, and output/weights/lse exports: good, ``_bad`` and ``_shape``."""
    return write_exports(workdir)


# The sample's outlier activations: QKᵀ = ±67600 at [0, 0] and [0, 1], past float16's 65504.
OUTLIER_Q = [[130.0] * 4, [1.0, 2.0, 3.0, 4.0]]
OUTLIER_K = [[130.0] * 4, [-130.0] * 4, [1.0] * 4]
OUTLIER_V = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]


@pytest.fixture
def outliers(workdir: Path) -> None:
    """The same values as float16 (``q16.npy`` ...) and as float64 (``q64.npy`` ...)."""
    for name, values in {"q": OUTLIER_Q, "k": OUTLIER_K, "v": OUTLIER_V}.items():
        np.save(workdir / f"{name}16.npy", np.array(values, dtype=np.float16))
        np.save(workdir / f"{name}64.npy", np.array(values, dtype=np.float64))


QKV16 = ("q16.npy", "k16.npy", "v16.npy")
QKV64 = ("q64.npy", "k64.npy", "v64.npy")


# --- exit codes for each kind of check ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["output", "weights", "lse"])
def test_an_export_that_matches_exits_0(exports: dict[str, F64], kind: str) -> None:
    doc = check_json(*QKV, FLAG[kind], f"{kind}.npy", code=ExitCode.OK)
    checks = by_name(doc)
    close = checks[f"{kind}.close"]
    assert close["status"] == "pass"
    assert close["file"] == f"{kind}.npy"
    assert close["tolerance"] == {"rtol": 1e-7, "atol": 1e-7, "source": "float64 defaults"}
    assert close["mismatch"]["mismatched"] == 0
    assert close["index"] is None
    assert (doc["export_dtype"], doc["reference"]) == ("float64", "float64")
    assert doc["fail_on"] == []  # with an expectation, findings gate nothing by default
    assert all(c["status"] == "pass" for c in doc["checks"])


@pytest.mark.parametrize("kind", ["output", "weights", "lse"])
def test_an_export_off_by_one_element_exits_1(exports: dict[str, F64], kind: str) -> None:
    doc = check_json(*QKV, FLAG[kind], f"{kind}_bad.npy", code=ExitCode.CHECK_FAILED)
    close = by_name(doc)[f"{kind}.close"]
    at = list(BAD_AT[kind])
    assert close["status"] == "fail"
    assert close["index"] == at
    m = close["mismatch"]
    assert (m["mismatched"], m["total"]) == (1, math.prod(SHAPES[kind]))
    assert (m["nan_mismatches"], m["inf_mismatches"]) == (0, 0)
    assert m["worst_at"] == m["max_abs_at"] == at
    assert m["max_abs"] == pytest.approx(DELTA, rel=1e-9)
    assert m["worst_actual"] - m["worst_reference"] == pytest.approx(DELTA, rel=1e-9)
    assert m["worst_reference"] == pytest.approx(float(exports[kind][BAD_AT[kind]]), abs=1e-12)
    # The smallest atol that would pass at the same rtol is the miss, less rtol·|reference|.
    assert m["passing_atol"] == pytest.approx(DELTA - 1e-7 * abs(m["worst_reference"]), rel=1e-6)
    assert close["summary"].startswith(f"1 of {m['total']} ")
    # The flawed element fails nothing else but what it must.
    failed = {c["name"] for c in doc["checks"] if not c["passed"]}
    assert failed == ({"weights.close", "weights.rows"} if kind == "weights" else {f"{kind}.close"})


@pytest.mark.parametrize("kind", ["output", "weights", "lse"])
def test_an_export_of_the_wrong_shape_exits_2(exports: dict[str, F64], kind: str) -> None:
    line = assert_one_error_line(check(*QKV, FLAG[kind], f"{kind}_shape.npy"))
    got = (H, 2, *SHAPES[kind][2:])
    assert line == (
        f"sdpa: error: {kind}_shape.npy: has shape {got}; "
        f"the computation's {kind} is {SHAPES[kind]}"
    )


@pytest.mark.parametrize("kind", ["output", "weights", "lse"])
def test_a_missing_export_exits_2(exports: dict[str, F64], kind: str) -> None:
    line = assert_one_error_line(check(*QKV, FLAG[kind], "nope.npy"))
    assert line == "sdpa: error: nope.npy: no such file"


def test_every_export_at_once(exports: dict[str, F64]) -> None:
    doc = check_json(
        *QKV,
        "--expect-output",
        "output.npy",
        "--expect-weights",
        "weights.npy",
        "--expect-lse",
        "lse.npy",
        code=ExitCode.OK,
    )
    assert [c["name"] for c in doc["checks"]] == [
        "output.finite",
        "output.range",
        "output.close",
        "weights.finite",
        "weights.range",
        "weights.rows",
        "weights.close",
        "lse.close",
        "lse.weights",
        "findings",
    ]


def test_lse_inconsistent_with_the_weights_fails(exports: dict[str, F64]) -> None:
    doc = check_json(
        *QKV,
        "--expect-weights",
        "weights.npy",
        "--expect-lse",
        "lse_bad.npy",
        code=ExitCode.CHECK_FAILED,
    )
    checks = by_name(doc)
    assert checks["lse.close"]["status"] == "fail"
    assert checks["lse.weights"]["status"] == "fail"
    assert checks["lse.weights"]["file"] == "lse_bad.npy"
    assert checks["weights.close"]["status"] == "pass"


def test_findings_gate_passes_clean_inputs(exports: dict[str, F64]) -> None:
    doc = check_json(*QKV, code=ExitCode.OK)
    assert doc["fail_on"] == ["nonfinite", "overflow"]  # the default without expectations
    assert [c["name"] for c in doc["checks"]] == [
        "findings.nonfinite",
        "findings.overflow",
        "findings",
    ]
    assert all(c["status"] == "pass" for c in doc["checks"])


def test_findings_gate_fails_a_nan_in_k(exports: dict[str, F64], workdir: Path) -> None:
    k = exports["k"].copy()
    k[0, 1, 2] = np.nan
    np.save(workdir / "k_nan.npy", k)
    doc = check_json("q.npy", "k_nan.npy", "v.npy", code=ExitCode.CHECK_FAILED)
    nonfinite = by_name(doc)["findings.nonfinite"]
    assert nonfinite["status"] == "fail"
    assert nonfinite["index"] == [0, 1, 2]
    assert "k_nan.npy" in nonfinite["summary"]
    assert nonfinite["count"] == doc["finding_counts"]["nonfinite"] >= 1
    assert by_name(doc)["findings.overflow"]["status"] == "pass"


def test_findings_gate_bad_input_exits_2(exports: dict[str, F64], workdir: Path) -> None:
    np.save(workdir / "k_e5.npy", np.zeros((H, S, 5)))
    line = assert_one_error_line(check("q.npy", "k_e5.npy", "v.npy"))
    assert line.startswith("sdpa: error: k_e5.npy: ")
    assert f"E = {E}" in line


def test_fp16_overflow_fails_by_default(outliers: None) -> None:
    doc = check_json(*QKV16, code=ExitCode.CHECK_FAILED)
    assert doc["export_dtype"] == "float16"
    overflow = by_name(doc)["findings.overflow"]
    assert overflow["status"] == "fail"
    assert "overflows float16" in overflow["summary"]
    assert overflow["index"] == [0, 0]
    assert by_name(doc)["findings.nonfinite"]["status"] == "pass"


def test_float64_inputs_with_the_same_values_pass_with_a_warning(outliers: None) -> None:
    doc = check_json(*QKV64, code=ExitCode.OK)
    assert doc["export_dtype"] == "float64"
    checks = by_name(doc)
    # Overflow in float16 is not the run's own format: listed, warned about, not failing.
    assert checks["findings.overflow"]["status"] == "pass"
    assert "float64" in checks["findings.overflow"]["summary"]
    assert checks["findings"]["status"] == "warn"
    assert checks["findings"]["passed"] is True
    assert "overflow" in checks["findings"]["kinds"]
    assert any(f["kind"] == "overflow" and f["dtype"] == "float16" for f in doc["findings"])
    result = check(*QKV64)
    assert result.exit_code == 0
    assert re.search(r"findings\s+WARN", result.stdout)
    assert "PASS: 3 checks passed (1 warning)" in result.stdout


def test_fail_on_none_lets_fp16_overflow_pass(outliers: None) -> None:
    doc = check_json(*QKV16, "--fail-on", "none", code=ExitCode.OK)
    assert doc["fail_on"] == []
    assert [c["name"] for c in doc["checks"]] == ["findings"]
    assert doc["checks"][0]["status"] == "warn"


def test_fail_on_one_kind_gates_that_kind_only(outliers: None) -> None:
    doc = check_json(*QKV16, "--fail-on", "nonfinite", code=ExitCode.OK)
    assert doc["fail_on"] == ["nonfinite"]
    doc = check_json(*QKV64, "--fail-on", "overflow,saturated", code=ExitCode.CHECK_FAILED)
    # Named explicitly, overflow counts in every format checked, float16's included.
    assert by_name(doc)["findings.overflow"]["status"] == "fail"
    assert by_name(doc)["findings.saturated"]["status"] == "fail"


def test_fail_on_applies_beside_expectations(exports: dict[str, F64], workdir: Path) -> None:
    k = exports["k"].copy()
    k[1, 0, 0] = np.inf
    np.save(workdir / "k_inf.npy", k)
    args = ("q.npy", "k_inf.npy", "v.npy", "--expect-output", "output.npy")
    doc = check_json(*args, "--fail-on", "none", code=ExitCode.CHECK_FAILED)
    assert by_name(doc)["output.close"]["status"] == "fail"
    doc = check_json(*args, "--fail-on", "nonfinite", code=ExitCode.CHECK_FAILED)
    assert by_name(doc)["findings.nonfinite"]["status"] == "fail"


def test_fail_on_severity_warning(outliers: None, exports: dict[str, F64]) -> None:
    doc = check_json(*QKV64, "--fail-on-severity", "warning", code=ExitCode.CHECK_FAILED)
    assert doc["fail_on_severity"] == "warning"
    severity = by_name(doc)["findings.severity"]
    assert severity["status"] == "fail"
    assert severity["count"] >= 1
    doc = check_json(*QKV, "--fail-on-severity", "warning", code=ExitCode.OK)
    assert by_name(doc)["findings.severity"]["status"] == "pass"
    assert "warning or worse" in by_name(doc)["findings.severity"]["summary"]


def test_nan_exports_and_equal_nan(exports: dict[str, F64], workdir: Path) -> None:
    k = exports["k"].copy()
    k[0, 1, 2] = np.nan  # head 0 turns NaN throughout
    np.save(workdir / "k_nan.npy", k)
    out = exports["output"].copy()
    out[0] = np.nan
    np.save(workdir / "out_nan.npy", out)
    args = ("q.npy", "k_nan.npy", "v.npy", "--expect-output", "out_nan.npy")
    doc = check_json(*args, code=ExitCode.CHECK_FAILED)
    close = by_name(doc)["output.close"]
    assert close["mismatch"]["nan_mismatches"] == L * EV
    assert close["mismatch"]["worst_actual"] == "NaN"  # a string: the JSON stays standard
    assert close["mismatch"]["passing_atol"] is None
    table = check(*args).stdout
    assert "would pass with: no tolerance (non-finite mismatches)" in table
    doc = check_json(*args, "--equal-nan", code=ExitCode.CHECK_FAILED)
    assert by_name(doc)["output.close"]["status"] == "pass"
    assert by_name(doc)["output.finite"]["status"] == "fail"  # NaN is still not finite


# --- dtype-aware tolerances on a real float16 output -----------------------------------------


def float16_output(
    q: NDArray[np.float16], k: NDArray[np.float16], v: NDArray[np.float16], source: str
) -> NDArray[Any]:
    """A float16 attention output: PyTorch's CPU kernel, or the float64 formula rounded."""
    if source == "torch":
        torch: Any = importlib.import_module("torch")
        out = torch.nn.functional.scaled_dot_product_attention(
            torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)
        )
        assert out.dtype == torch.float16
        result: NDArray[Any] = out.numpy()
        return result
    exact = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), 1 / 4.0)
    return exact["output"].astype(np.float16)


def torch_available() -> bool:
    try:
        importlib.import_module("torch")
    except ImportError:
        return False
    return True


@pytest.fixture(
    params=[
        pytest.param(
            "torch",
            marks=pytest.mark.skipif(not torch_available(), reason="PyTorch is not importable"),
        ),
        "numpy",
    ]
)
def fp16_export(request: pytest.FixtureRequest, workdir: Path) -> str:
    """hq/hk/hv.npy in float16 (E = 16) and ho.npy, their float16 output; the source."""
    source: str = request.param
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 8, 16)).astype(np.float16)
    k = rng.standard_normal((2, 12, 16)).astype(np.float16)
    v = rng.standard_normal((2, 12, 8)).astype(np.float16)
    out = float16_output(q, k, v, source)
    assert out.dtype == np.float16
    assert out.shape == (2, 8, 8)
    for name, arr in {"hq": q, "hk": k, "hv": v, "ho": out}.items():
        np.save(workdir / f"{name}.npy", arr)
    return source


FP16 = ("hq.npy", "hk.npy", "hv.npy", "--expect-output", "ho.npy")


def test_float16_output_passes_by_default_against_the_plain_float16_computation(
    fp16_export: str,
) -> None:
    doc = check_json(*FP16, code=ExitCode.OK)
    assert (doc["export_dtype"], doc["reference"]) == ("float16", "float32")
    close = by_name(doc)["output.close"]
    assert close["tolerance"]["factor"] == 2.0
    assert close["tolerance"]["source"].startswith("kernel: ≤ 2× the plain float16")
    # every element within 2 ulp of its row's scale: the plain computation not needed
    assert close["plain_rms_error"] is None
    assert "no plain float16 computation needed" in close["summary"]
    assert 0 < close["rms_error"] < 2**-10
    assert close["shifted_slices"] == []
    stats = close["error_stats"]
    assert 0 < stats["abs"]["median"] <= stats["abs"]["p90"] <= stats["abs"]["p99"]
    assert stats["abs"]["p99"] <= stats["abs"]["max"] == close["mismatch"]["max_abs"]
    assert 0.999 < stats["cosine"]["min"] <= 1.0


def test_float16_output_passes_at_the_float16_defaults(fp16_export: str) -> None:
    doc = check_json(*FP16, "--tolerance", "dtype", code=ExitCode.OK)
    assert (doc["export_dtype"], doc["reference"]) == ("float16", "float32")
    close = by_name(doc)["output.close"]
    assert close["tolerance"] == {"rtol": 1e-3, "atol": 1e-3, "source": "float16 defaults"}
    assert 0 < close["mismatch"]["max_abs"] < 1e-3


def test_float16_output_fails_at_float32_tolerances(fp16_export: str) -> None:
    args = (*FP16, "--rtol", "1.3e-6", "--atol", "1e-5")
    doc = check_json(*args, code=ExitCode.CHECK_FAILED)
    close = by_name(doc)["output.close"]
    assert close["tolerance"] == {"rtol": 1.3e-6, "atol": 1e-5, "source": "given"}
    m = close["mismatch"]
    assert m["mismatched"] > 0
    assert m["passing_atol"] > 1e-5
    table = check(*args)
    assert table.exit_code == ExitCode.CHECK_FAILED
    assert "tolerance: rtol 1.3e-06, atol 1e-05 (given)" in table.stdout
    assert "would pass with: atol ≥" in table.stdout


def test_float16_output_with_a_float64_reference_and_measured_tolerance(fp16_export: str) -> None:
    doc = check_json(*FP16, "--reference", "float64", code=ExitCode.OK)
    assert doc["reference"] == "float64"
    # The usual aliases name the reference too, reported by the format's name.
    assert check_json(*FP16, "--reference", "fp64", code=ExitCode.OK)["reference"] == "float64"
    assert check_json(*FP16, "--reference", "single", code=ExitCode.OK)["reference"] == "float32"
    doc = check_json(*FP16, "--tolerance", "measured", code=ExitCode.OK)
    tol = by_name(doc)["output.close"]["tolerance"]
    assert tol["source"].startswith("measured ×2")
    assert tol["rtol"] >= 2e-3
    assert tol["atol"] >= 2e-3  # floored at the float16 defaults, times the fudge


# --- the table ---------------------------------------------------------------------------------


def test_table_of_a_failure_has_the_mismatch_report(exports: dict[str, F64]) -> None:
    result = check(*QKV, "--expect-output", "output_bad.npy")
    assert result.exit_code == ExitCode.CHECK_FAILED
    assert result.stderr == ""
    out = result.stdout
    assert ANSI not in out
    assert re.search(r"output\.finite\s+PASS", out)
    assert re.search(r"output\.close\s+FAIL", out)
    assert f"mismatched elements: 1 / {H * L * EV}" in out
    assert "greatest absolute difference: 0.01 at index [1, 2, 1]" in out
    assert "greatest relative difference: " in out
    assert "worst element: index [1, 2, 1]: got " in out
    assert "tolerance: rtol 1e-07, atol 1e-07 (float64 defaults)" in out
    assert "would pass with: atol ≥ 0.01 (rtol 1e-07) or rtol ≥ " in out
    assert "output_bad.npy" in out
    assert out.rstrip().splitlines()[-1] == "FAIL: 1 of 4 checks failed"


def test_table_of_a_pass(exports: dict[str, F64]) -> None:
    result = check(*QKV, "--expect-weights", "weights.npy")
    assert result.exit_code == 0
    assert result.stderr == ""
    assert "FAIL" not in result.stdout
    assert "mismatched elements" not in result.stdout
    assert result.stdout.rstrip().splitlines()[-1] == "PASS: 5 checks passed"


# --- JSON, JUnit, GitHub annotations ----------------------------------------------------------


def test_json_is_the_only_thing_on_stdout(exports: dict[str, F64]) -> None:
    result = check(*QKV, "--expect-lse", "lse_bad.npy", "--format", "json")
    assert result.exit_code == ExitCode.CHECK_FAILED
    assert result.stderr == ""
    assert result.stdout.endswith("}\n")
    assert result.stdout.count("\n") == 1
    validate_document(strict_json(result.stdout))


def test_report_file_is_the_json_document(exports: dict[str, F64], workdir: Path) -> None:
    args = (*QKV, "--expect-output", "output_bad.npy")
    json_out = check(*args, "--format", "json").stdout
    result = check(*args, "--report", "report.json")
    assert result.exit_code == ExitCode.CHECK_FAILED
    assert "FAIL" in result.stdout  # the table still goes to stdout
    text = (workdir / "report.json").read_text()
    assert text == json_out
    validate_document(strict_json(text))


def junit(path: Path) -> ET.Element:
    """Parse a JUnit file; check its counts against its elements; return the root."""
    raw = path.read_bytes()
    assert raw.startswith(b"<?xml")
    root = ET.fromstring(raw)
    assert root.tag == "testsuites"
    totals = {"tests": 0, "failures": 0, "errors": 0}
    for suite in root:
        assert suite.tag == "testsuite"
        cases = suite.findall("testcase")
        assert len(suite) == len(cases)
        counts = {
            "tests": len(cases),
            "failures": sum(tc.find("failure") is not None for tc in cases),
            "errors": sum(tc.find("error") is not None for tc in cases),
        }
        for key, n in counts.items():
            assert suite.get(key) == str(n), (suite.get("name"), key)
            totals[key] += n
        for tc in cases:
            assert tc.get("classname") == f"sdpa.check.{suite.get('name')}"
    for key, n in totals.items():
        assert root.get(key) == str(n), key
    return root


def test_junit_single_case(exports: dict[str, F64], workdir: Path) -> None:
    result = check(
        *QKV,
        "--expect-output",
        "output_bad.npy",
        "--expect-weights",
        "weights.npy",
        "--junit",
        "report.xml",
    )
    assert result.exit_code == ExitCode.CHECK_FAILED
    root = junit(workdir / "report.xml")
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("8", "1", "0")
    (suite,) = root
    names = [tc.get("name") for tc in suite]
    assert names[:3] == ["output.finite", "output.range", "output.close"]
    close = suite[2]
    assert close.get("file") == "output_bad.npy"
    failure = close.find("failure")
    assert failure is not None
    doc = check_json(*QKV, "--expect-output", "output_bad.npy", code=ExitCode.CHECK_FAILED)
    assert failure.get("message") == by_name(doc)["output.close"]["summary"]
    assert failure.get("type") == "output.close"
    text = failure.text or ""
    assert "mismatched elements: 1 / 18" in text
    assert "worst element: index [1, 2, 1]" in text
    assert "file: output_bad.npy" in text


def test_junit_of_a_pass_has_no_failures(exports: dict[str, F64], workdir: Path) -> None:
    result = check(*QKV, "--expect-lse", "lse.npy", "--junit", "report.xml")
    assert result.exit_code == 0
    root = junit(workdir / "report.xml")
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("2", "0", "0")


def test_junit_warning_is_a_passing_testcase(outliers: None, workdir: Path) -> None:
    assert check(*QKV64, "--junit", "r.xml").exit_code == 0
    root = junit(workdir / "r.xml")
    (suite,) = root
    (warned,) = [tc for tc in suite if tc.get("name") == "findings"]
    out = warned.find("system-out")
    assert out is not None
    assert (out.text or "").startswith("WARN: ")
    assert root.get("failures") == "0"


def unescape(text: str) -> str:
    """Undo GitHub's workflow-command escaping of a message."""
    return text.replace("%0A", "\n").replace("%0D", "\r").replace("%25", "%")


def test_github_annotations_in_table_mode(exports: dict[str, F64]) -> None:
    args = (*QKV, "--expect-output", "output_bad.npy")
    summary = by_name(check_json(*args, code=1))["output.close"]["summary"]
    result = check(*args, env=GITHUB)
    assert result.exit_code == ExitCode.CHECK_FAILED
    assert result.stderr == ""
    lines = [x for x in result.stdout.splitlines() if x.startswith("::")]
    prefix = "::error file=output_bad.npy,title=sdpa check output.close::"
    assert len(lines) == 1
    assert lines[0].startswith(prefix)
    assert "%25" in lines[0]  # the "%" of "5.56%" is escaped
    assert unescape(lines[0].removeprefix(prefix)) == summary
    assert "FAIL: 1 of 4 checks failed" in result.stdout  # the table follows


def test_github_annotations_go_to_stderr_beside_json(exports: dict[str, F64]) -> None:
    result = check(*QKV, "--expect-output", "output_bad.npy", "--format", "json", env=GITHUB)
    assert result.exit_code == ExitCode.CHECK_FAILED
    validate_document(strict_json(result.stdout))  # stdout stays one JSON document
    assert result.stderr.startswith("::error file=output_bad.npy,title=sdpa check output.close::")
    assert result.stderr.count("\n") == 1


def test_github_warning_annotation(outliers: None) -> None:
    result = check(*QKV64, env=GITHUB)
    assert result.exit_code == 0
    lines = [x for x in result.stdout.splitlines() if x.startswith("::")]
    assert len(lines) == 1
    assert lines[0].startswith("::warning title=sdpa check findings::")
    assert "overflow" in lines[0]


def test_no_annotations_outside_github_actions(exports: dict[str, F64]) -> None:
    result = check(*QKV, "--expect-output", "output_bad.npy")
    assert not any(x.startswith("::") for x in result.stdout.splitlines())
    result = check(*QKV, "--expect-output", "output.npy", env=GITHUB)  # nothing to say
    assert not any(x.startswith("::") for x in result.stdout.splitlines())


# --- reports are written atomically, and only for a run that ran ---------------------------------


@pytest.mark.parametrize("flag", ["--junit", "--report"])
@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(("nope.npy", "k.npy", "v.npy"), id="missing-input"),
        pytest.param((*QKV, "--expect-output", "output_shape.npy"), id="wrong-shape"),
        pytest.param((*QKV, "--rtol", "1e-3"), id="rtol-without-atol"),
    ],
)
def test_a_bad_run_writes_no_report(
    exports: dict[str, F64], workdir: Path, flag: str, bad: tuple[str, ...]
) -> None:
    before = sorted(os.listdir(workdir))
    assert_one_error_line(check(*bad, flag, "new.out"))
    assert sorted(os.listdir(workdir)) == before  # no report, no temporary file
    (workdir / "keep.out").write_text("an earlier report")
    assert_one_error_line(check(*bad, flag, "keep.out"))
    assert (workdir / "keep.out").read_text() == "an earlier report"


def test_a_report_into_a_missing_directory_is_one_error_line(exports: dict[str, F64]) -> None:
    line = assert_one_error_line(check(*QKV, "--junit", "nodir/r.xml"))
    assert line == "sdpa: error: nodir/r.xml: cannot be written: directory 'nodir' does not exist"


def test_no_report_at_all_when_one_cannot_be_written(
    exports: dict[str, F64], workdir: Path
) -> None:
    result = check(*QKV, "--junit", "ok.xml", "--report", "nodir/r.json")
    assert_one_error_line(result)
    assert not (workdir / "ok.xml").exists()


def test_a_failing_run_replaces_an_old_report(exports: dict[str, F64], workdir: Path) -> None:
    (workdir / "r.xml").write_text("old")
    assert check(*QKV, "--expect-output", "output_bad.npy", "--junit", "r.xml").exit_code == 1
    junit(workdir / "r.xml")
    assert sorted(os.listdir(workdir)) == sorted(
        [f"{n}.npy" for n in "qkv"]
        + [f"{k}{s}.npy" for k in ("output", "weights", "lse") for s in ("", "_bad", "_shape")]
        + ["r.xml"]
    )


# --- bad usage ------------------------------------------------------------------------------------

KIND_LIST = ", ".join(KINDS)

USAGE: list[tuple[str, list[str], str]] = [
    (
        "rtol-without-atol",
        [*QKV, "--rtol", "1e-3"],
        "--rtol/--atol: give both rtol and atol, or neither (defaults by the dtype)",
    ),
    (
        "atol-without-rtol",
        [*QKV, "--expect-output", "output.npy", "--atol", "1e-3"],
        "--rtol/--atol: give both rtol and atol, or neither (defaults by the dtype)",
    ),
    ("rtol-word", [*QKV, "--rtol", "abc", "--atol", "1"], "--rtol: expected a number, got 'abc'"),
    (
        "unknown-fail-on",
        [*QKV, "--fail-on", "overflow,bogus"],
        f"--fail-on: unknown finding kind 'bogus'; choose from {KIND_LIST}",
    ),
    (
        "manifest-with-qkv",
        [*QKV, "--manifest", "m.yaml"],
        "--manifest: the manifest lists inputs and expectations; give no Q K V, --bias, "
        "--mask, --sinks, --segment-ids, --segment-ids-kv, --dropout-mask, --block-table, --qv, "
        "--q-descale, --k-descale, --v-descale or --expect-* beside it",
    ),
    (
        "manifest-with-expect",
        ["--manifest", "m.yaml", "--expect-output", "output.npy"],
        "--manifest: the manifest lists inputs and expectations; give no Q K V, --bias, "
        "--mask, --sinks, --segment-ids, --segment-ids-kv, --dropout-mask, --block-table, --qv, "
        "--q-descale, --k-descale, --v-descale or --expect-* beside it",
    ),
    ("missing-file", ["nope.npy", "k.npy", "v.npy"], "nope.npy: no such file"),
    ("no-inputs", [], "give Q K V (or one case file), or --manifest FILE"),
    (
        "measured-with-rtol",
        [*QKV, "--tolerance", "measured", "--rtol", "1", "--atol", "1"],
        "--tolerance: measured computes rtol and atol; drop --rtol/--atol",
    ),
    (
        "fudge-below-one",
        [*QKV, "--tolerance", "measured", "--fudge", "0.5"],
        "--fudge: must be a finite number ≥ 1, got 0.5",
    ),
    (
        "bad-reference",
        [*QKV, "--reference", "float16"],
        "--reference: must be float32 or float64, got 'float16'",
    ),
    (
        "bad-format",
        [*QKV, "--format", "xml"],
        "Invalid value for '--format': 'xml' is not one of 'table', 'json'.",
    ),
    (
        "jobs-zero",
        ["--manifest", "m.yaml", "--jobs", "0"],
        "Invalid value for '--jobs': 0 is not in the range x>=1.",
    ),
]


@pytest.mark.parametrize(("args", "message"), [u[1:] for u in USAGE], ids=[u[0] for u in USAGE])
def test_bad_usage_is_one_error_line_and_exit_2(
    exports: dict[str, F64], args: list[str], message: str
) -> None:
    assert assert_one_error_line(check(*args)) == f"sdpa: error: {message}"


def test_help_lists_the_exit_codes() -> None:
    result = check("--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "Example" in text
    listed = text[text.index("Exit codes:") :]
    for code, meaning in [
        (0, "passed"),
        (1, "a check failed"),
        (2, "bad usage"),
        (3, "internal error"),
        (130, "interrupted"),
    ]:
        assert re.search(rf"(^|· |: ){code} [^·]*{meaning}", listed), (code, listed)
    assert "never 1" in listed


def test_internal_error_exits_3(exports: dict[str, F64], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr("sdpa_cli.api.judge.run_checks", broken)
    line = assert_one_error_line(check(*QKV), code=ExitCode.INTERNAL)
    assert line.startswith("sdpa: error: internal error: RuntimeError: boom")


def test_interrupt_exits_130(exports: dict[str, F64], monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr("sdpa_cli.api.judge.run_checks", interrupted)
    result = check(*QKV)
    assert result.exit_code == ExitCode.INTERRUPTED
    assert result.stdout == ""
    # click ends the ^C line first; then the one message.
    assert result.stderr.lstrip("\n") == "sdpa: error: interrupted\n"


# --- manifests --------------------------------------------------------------------------------------


def write_yaml(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path.relative_to(Path.cwd()))


@pytest.fixture
def cases(workdir: Path) -> Path:
    """``sub/``: q/k/v, exports, and causal exports (``output_c.npy`` ...), for manifests
    run from the working directory (paths in a manifest are relative to it)."""
    sub = workdir / "sub"
    sub.mkdir()
    write_exports(sub)
    write_exports(sub, causal=True, suffix="_c")
    return sub


TWO_CASES = """\
defaults:
  q: q.npy
  k: k.npy
  v: v.npy
cases:
  - name: good
    expect-output: output.npy
  - name: bad
    expect-output: output_bad.npy
    expect-weights: weights.npy
"""


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_manifest_with_a_passing_and_a_failing_case(cases: Path, jobs: str) -> None:
    manifest = write_yaml(cases / "m.yaml", TWO_CASES)
    doc = check_json("--manifest", manifest, "--jobs", jobs, code=ExitCode.CHECK_FAILED)
    assert doc["manifest"] == "sub/m.yaml"
    assert [(c["name"], c["passed"], c["error"]) for c in doc["cases"]] == [
        ("good", True, None),
        ("bad", False, None),
    ]
    bad = by_name(doc["cases"][1])
    assert bad["output.close"]["file"] == "sub/output_bad.npy"
    assert bad["output.close"]["index"] == [1, 2, 1]
    assert bad["weights.close"]["status"] == "pass"
    result = check("--manifest", manifest, "--jobs", jobs)
    assert result.exit_code == ExitCode.CHECK_FAILED
    assert result.stderr == ""
    assert re.search(r"good\s+PASS\s+4/4", result.stdout)
    assert re.search(r"bad\s+FAIL\s+7/8\s+output\.close: ", result.stdout)
    assert "bad › output.close" in result.stdout
    assert "greatest absolute difference: 0.01 at index [1, 2, 1]" in result.stdout
    assert result.stdout.rstrip().splitlines()[-1] == "FAIL: 1 of 2 cases failed"


def test_manifest_with_an_unreadable_case(cases: Path, workdir: Path) -> None:
    manifest = write_yaml(
        cases / "m.yaml",
        TWO_CASES + "  - name: broken\n    q: missing.npy\n",
    )
    result = check("--manifest", manifest, "--jobs", "2", "--format", "json", "--junit", "r.xml")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr == "sdpa: error: broken: sub/missing.npy: no such file\n"
    doc = strict_json(result.stdout)
    validate_manifest_document(doc)
    assert doc["exit_code"] == 2
    assert doc["passed"] is False
    good, bad, broken = doc["cases"]
    assert (good["name"], good["passed"], len(good["checks"])) == ("good", True, 4)
    assert (bad["name"], bad["passed"]) == ("bad", False)
    assert (broken["name"], broken["passed"], broken["checks"]) == ("broken", False, [])
    assert (
        broken["error"] == "sub/missing.npy: no such file"
    )  # the path as the manifest resolves it
    # JUnit: the unreadable case is one testcase "load" with an <error>.
    root = junit(workdir / "r.xml")
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("13", "1", "1")
    suite = root[2]
    assert suite.get("name") == "broken"
    (load,) = suite
    assert load.get("name") == "load"
    error = load.find("error")
    assert error is not None
    assert error.get("message") == "sub/missing.npy: no such file"
    # The table: an ERROR row, the others still there.
    result = check("--manifest", manifest, "--jobs", "1")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr == "sdpa: error: broken: sub/missing.npy: no such file\n"
    assert re.search(r"broken\s+ERROR\s+-\s+sub/missing\.npy: no such file", result.stdout)
    assert re.search(r"good\s+PASS", result.stdout)
    assert re.search(r"bad\s+FAIL", result.stdout)
    assert result.stdout.rstrip().splitlines()[-1] == (
        "ERROR: 1 case could not be checked; 1 of 3 failed"
    )


def test_manifest_cases_all_have_the_documented_keys(cases: Path) -> None:
    manifest = write_yaml(cases / "m.yaml", TWO_CASES + "  - name: broken\n    q: missing.npy\n")
    doc = check_json("--manifest", manifest, "--jobs", "1", code=ExitCode.BAD_INPUT)
    for case in doc["cases"]:
        assert {"name", "passed", "error", "checks", "findings", "finding_counts"} <= set(case)


def test_manifest_annotations_name_the_case(cases: Path) -> None:
    manifest = write_yaml(cases / "m.yaml", TWO_CASES + "  - name: broken\n    q: missing.npy\n")
    result = check("--manifest", manifest, "--jobs", "1", env=GITHUB)
    lines = [x for x in result.stdout.splitlines() if x.startswith("::")]
    assert lines == [
        lines[0],
        "::error file=sub/m.yaml,title=sdpa check::broken: sub/missing.npy: no such file",
    ]
    assert lines[0].startswith(
        "::error file=sub/output_bad.npy,title=sdpa check output.close::bad: 1 of 18 "
    )


def test_a_long_case_error_stays_one_line(cases: Path) -> None:
    deep = "a_rather_long_directory_name/" * 3
    manifest = write_yaml(
        cases / "m.yaml",
        f"cases:\n  - name: broken\n    q: {deep}missing.npy\n    k: k.npy\n    v: v.npy\n",
    )
    result = check("--manifest", manifest, "--jobs", "1")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr == f"sdpa: error: broken: sub/{deep}missing.npy: no such file\n"


def test_manifest_options_settings_and_flags(cases: Path) -> None:
    manifest = write_yaml(
        cases / "m.yaml",
        """\
defaults:
  q: q.npy
  k: k.npy
  v: v.npy
  rtol: 0.02
  atol: 0.02
cases:
  - name: causal
    causal: true
    expect-output: output_c.npy
  - name: loose
    expect-output: output_bad.npy
  - name: strict
    expect-output: output_bad.npy
    rtol: 1e-7
    atol: 1e-7
""",
    )
    doc = check_json("--manifest", manifest, "--jobs", "1", code=ExitCode.CHECK_FAILED)
    assert [c["passed"] for c in doc["cases"]] == [True, True, False]
    tol = by_name(doc["cases"][2])["output.close"]["tolerance"]
    assert (tol["rtol"], tol["atol"]) == (1e-7, 1e-7)
    # Flags override every case: check settings and options alike.
    doc = check_json("--manifest", manifest, "--rtol", "1", "--atol", "1", code=ExitCode.OK)
    assert all(c["passed"] for c in doc["cases"])
    doc = check_json("--manifest", manifest, "--no-causal", code=ExitCode.CHECK_FAILED)
    assert doc["cases"][0]["passed"] is False
    assert by_name(doc["cases"][0])["output.close"]["status"] == "fail"


def test_manifest_case_file_entries(cases: Path, workdir: Path) -> None:
    (cases / "c").mkdir()
    write_yaml(cases / "c" / "case.yaml", "q: ../q.npy\nk: ../k.npy\nv: ../v.npy\ncausal: true\n")
    manifest = write_yaml(
        workdir / "m.json",
        json.dumps(
            {
                "cases": [
                    {"name": "via-case", "case": "sub/c/case.yaml", "expect-lse": "sub/lse_c.npy"}
                ]
            }
        ),
    )
    doc = check_json("--manifest", manifest, code=ExitCode.OK)
    assert doc["cases"][0]["name"] == "via-case"
    assert by_name(doc["cases"][0])["lse.close"]["status"] == "pass"


def test_manifest_default_names_and_findings_gate(cases: Path) -> None:
    k = np.load(cases / "k.npy")
    k[1, 4, 3] = np.nan
    np.save(cases / "k_nan.npy", k)
    manifest = write_yaml(
        cases / "m.yaml",
        "cases:\n  - {q: q.npy, k: k.npy, v: v.npy}\n  - {q: q.npy, k: k_nan.npy, v: v.npy}\n",
    )
    doc = check_json("--manifest", manifest, "--jobs", "2", code=ExitCode.CHECK_FAILED)
    assert [(c["name"], c["passed"]) for c in doc["cases"]] == [
        ("case-1", True),
        ("case-2", False),
    ]
    assert by_name(doc["cases"][1])["findings.nonfinite"]["index"] == [1, 4, 3]


def test_manifest_internal_error_exits_3_and_reports_the_case(
    cases: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr("sdpa_cli.api.judge.run_checks", broken)
    manifest = write_yaml(cases / "m.yaml", TWO_CASES)
    result = check("--manifest", manifest, "--jobs", "1", "--format", "json")
    assert result.exit_code == ExitCode.INTERNAL
    doc = strict_json(result.stdout)
    validate_manifest_document(doc)
    assert doc["exit_code"] == 3
    assert [c["error"] for c in doc["cases"]] == ["internal error: RuntimeError: boom"] * 2
    assert result.stderr.splitlines() == [
        "sdpa: error: good: internal error: RuntimeError: boom",
        "sdpa: error: bad: internal error: RuntimeError: boom",
    ]


MALFORMED: list[tuple[str, str, str]] = [
    (
        "unknown-key",
        "cases:\n  - {q: q.npy, k: k.npy, v: v.npy, frob: 1}\n",
        "m.yaml: cases[1]: frob: unknown key; expected name, case or q/k/v, bias, mask, sinks, "
        "segment-ids, segment-ids-kv, dropout-mask, block-table, qv, q-descale, k-descale, "
        "v-descale, expect-output, expect-weights, "
        "expect-lse, "
        "expect-dq, expect-dk, expect-dv, expect-dbias, expect-dsinks, dout, expect-partials, "
        "decode, an option of compute or a setting of check",
    ),
    (
        "missing-q",
        "cases:\n  - {k: k.npy, v: v.npy}\n",
        "m.yaml: cases[1]: needs q, k and v (or case); missing q",
    ),
    (
        "duplicate-names",
        "cases:\n  - {name: a, q: q.npy, k: k.npy, v: v.npy}\n"
        "  - {name: a, q: q.npy, k: k.npy, v: v.npy}\n",
        "m.yaml: cases[2]: the name 'a' is used twice",
    ),
    (
        "unknown-top-level-key",
        "cases:\n  - {q: q.npy, k: k.npy, v: v.npy}\nextra: 1\n",
        "m.yaml: unknown key 'extra'; expected cases and defaults",
    ),
    ("no-cases", "cases: []\n", "m.yaml: lists no cases"),
    (
        "not-a-list",
        "cases: {q: q.npy}\n",
        "m.yaml: a manifest is a mapping with a list of cases under 'cases'",
    ),
    (
        "bad-setting",
        "cases:\n  - {q: q.npy, k: k.npy, v: v.npy, rtol: lots}\n",
        "m.yaml: cases[1]: rtol: expected a number, got 'lots'",
    ),
]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        *(pytest.param(*m[1:], id=m[0]) for m in MALFORMED),
        pytest.param(
            "cases:\n  - {q: q.npy, k: k.npy, v: v.npy, fail-on: bogus}\n",
            "m.yaml: cases[1]: fail-on: unknown finding kind 'bogus'; choose from " + KIND_LIST,
            id="bad-fail-on-kind",
        ),
    ],
)
def test_a_malformed_manifest_exits_2_before_running(
    cases: Path, monkeypatch: pytest.MonkeyPatch, text: str, message: str
) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a case ran")

    monkeypatch.setattr("sdpa_cli.api.manifest.run_case", never)
    manifest = write_yaml(cases / "m.yaml", text)
    line = assert_one_error_line(check("--manifest", manifest, "--jobs", "1"))
    assert line == f"sdpa: error: sub/{message}"


def test_bad_flags_beside_a_manifest_exit_2_before_running(
    cases: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sdpa_cli.api.check.run_cases", None)  # calling it would be a TypeError
    manifest = write_yaml(cases / "m.yaml", TWO_CASES)
    line = assert_one_error_line(check("--manifest", manifest, "--fail-on", "bogus"))
    assert line.startswith("sdpa: error: --fail-on: unknown finding kind 'bogus'")


def test_a_missing_manifest_is_bad_input(workdir: Path) -> None:
    line = assert_one_error_line(check("--manifest", "nope.yaml"))
    assert line == "sdpa: error: nope.yaml: no such file"


# --- the config file -------------------------------------------------------------------------------


def test_sdpa_yaml_check_section_applies_and_flags_override(
    exports: dict[str, F64], workdir: Path
) -> None:
    (workdir / "sdpa.yaml").write_text("check:\n  rtol: 0.02\n  atol: 0.02\n")
    args = (*QKV, "--expect-output", "output_bad.npy")
    doc = check_json(*args, code=ExitCode.OK)
    tol = by_name(doc)["output.close"]["tolerance"]
    assert (tol["rtol"], tol["atol"], tol["source"]) == (0.02, 0.02, "given")
    doc = check_json(*args, "--rtol", "1e-7", "--atol", "1e-7", code=ExitCode.CHECK_FAILED)
    assert by_name(doc)["output.close"]["tolerance"]["atol"] == 1e-7


def test_pyproject_check_section_applies(outliers: None, workdir: Path) -> None:
    (workdir / "pyproject.toml").write_text('[tool.sdpa.check]\nfail-on = "none"\n')
    doc = check_json(*QKV16, code=ExitCode.OK)
    assert doc["fail_on"] == []
    check_json(*QKV16, "--fail-on", "overflow", code=ExitCode.CHECK_FAILED)


def test_config_applies_to_every_manifest_case(cases: Path, workdir: Path) -> None:
    (workdir / "sdpa.yaml").write_text("check:\n  rtol: 0.02\n  atol: 0.02\n")
    manifest = write_yaml(cases / "m.yaml", TWO_CASES)
    doc = check_json("--manifest", manifest, "--jobs", "2", code=ExitCode.OK)
    assert all(c["passed"] for c in doc["cases"])


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("sdpa.yaml", "check:\n  rtl: 0.1\n", "sdpa.yaml: check: rtl"),
        (
            "pyproject.toml",
            "[tool.sdpa.check]\nrtl = 0.1\n",
            "pyproject.toml [tool.sdpa]: check: rtl",
        ),
    ],
)
def test_an_unknown_config_key_is_one_error_line(
    exports: dict[str, F64], workdir: Path, name: str, text: str, where: str
) -> None:
    (workdir / name).write_text(text)
    line = assert_one_error_line(check(*QKV))
    assert line == (
        f"sdpa: error: {where}: unknown check setting; expected rtol, atol, reference, "
        "tolerance, fudge, fail-on, fail-on-severity, equal-nan, max-error"
    )


def test_a_bad_config_value_names_the_file(exports: dict[str, F64], workdir: Path) -> None:
    (workdir / "sdpa.yaml").write_text("check:\n  fail-on: bogus\n")
    line = assert_one_error_line(check(*QKV))
    assert line.startswith("sdpa: error: sdpa.yaml: check: fail-on: ")


def test_tolerance_flag_overrides_config_tolerances(exports: dict[str, F64], workdir: Path) -> None:
    (workdir / "sdpa.yaml").write_text("check:\n  rtol: 0.02\n  atol: 0.02\n")
    doc = check_json(*QKV, "--expect-output", "output.npy", "--tolerance", "measured", code=0)
    assert by_name(doc)["output.close"]["tolerance"]["source"].startswith("measured")


def test_max_error_adds_an_error_check_per_export(exports: dict[str, F64], workdir: Path) -> None:
    """--max-error limits the error statistics: output.error passes within them and
    fails beyond, naming the statistic; the config file gives the same."""
    args = (*QKV, "--expect-output", "output.npy")
    doc = check_json(*args, "--max-error", "abs_max=1,cosine_min=0.5", code=0)
    c = by_name(doc)["output.error"]
    assert c["status"] == "pass"
    assert c["limits"] == {"abs_max": 1.0, "cosine_min": 0.5}
    assert c["error_stats"]["abs"]["max"] <= 1.0
    doc = check_json(*args, "--max-error", "abs_max=0", code=ExitCode.CHECK_FAILED)
    c = by_name(doc)["output.error"]
    assert c["status"] == "fail"
    assert c["summary"].startswith("abs_max ")
    assert c["summary"].endswith(" > 0")
    (workdir / "sdpa.yaml").write_text("check:\n  max-error: {rel_max: 0}\n")
    doc = check_json(*args, code=ExitCode.CHECK_FAILED)
    assert by_name(doc)["output.error"]["summary"].endswith(" > 0")


def test_an_unknown_error_statistic_is_one_line() -> None:
    result = invoke("check", *QKV, "--expect-output", "output.npy", "--max-error", "p99=1")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr.startswith("sdpa: error: --max-error: unknown error statistic 'p99'")
    assert result.stderr.count("\n") == 1


# --- end to end: the installed entry point ------------------------------------------------------


def sdpa_executable() -> str:
    beside = Path(sys.executable).parent / "sdpa"
    if not beside.exists():
        pytest.skip("the sdpa console script is not installed (pip install -e .)")
    return str(beside)


@pytest.mark.e2e
def test_e2e_failing_check_in_a_pipe(exports: dict[str, F64], workdir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env["COLUMNS"] = "100"
    proc = subprocess.run(
        [sdpa_executable(), "check", *QKV, "--expect-output", "output_bad.npy"],
        cwd=workdir,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ""
    assert ANSI not in proc.stdout
    assert re.search(r"output\.close\s+FAIL", proc.stdout)
    assert "greatest absolute difference: 0.01 at index [1, 2, 1]" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1] == "FAIL: 1 of 4 checks failed"


# --- --quiet, and findings counted in full --------------------------------------------------


def saturated_case(d: Path, n: int = 400) -> tuple[str, str, str]:
    """Q, K, V of ``n`` rows whose large scores make most causal rows one-hot."""
    rng = np.random.default_rng(0)
    for name, scale in (("q", 10.0), ("k", 10.0), ("v", 1.0)):
        np.save(d / f"{name}.npy", rng.standard_normal((1, 1, n, 8)) * scale)
    return ("q.npy", "k.npy", "v.npy")


def test_quiet_prints_nothing_and_exits_with_the_verdict(workdir: Path) -> None:
    qkv = saturated_case(workdir)
    passed = check(*qkv, "--causal", "--quiet", "--report", "r.json", "--junit", "r.xml")
    assert (passed.exit_code, passed.stdout, passed.stderr) == (0, "", "")
    assert json.loads((workdir / "r.json").read_text())["exit_code"] == 0
    assert (workdir / "r.xml").exists()
    failed = check(*qkv, "--causal", "-q", "--fail-on", "saturated", "--format", "json")
    assert (failed.exit_code, failed.stdout, failed.stderr) == (1, "", "")


def test_quiet_keeps_the_error_line(workdir: Path) -> None:
    line = assert_one_error_line(check("missing.npy", "k.npy", "v.npy", "-q"))
    assert line.startswith("sdpa: error: missing.npy")


def test_quiet_sends_github_annotations_to_stderr(workdir: Path) -> None:
    qkv = saturated_case(workdir)
    result = check(*qkv, "--causal", "-q", "--fail-on", "saturated", env=GITHUB)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("::error")


def test_findings_counts_are_the_totals_not_the_listing_cap(workdir: Path) -> None:
    """Regression: check said "50 info findings" where there were hundreds (50 is
    --max-findings, the rows listed per kind)."""
    qkv = saturated_case(workdir)
    doc = check_json(*qkv, "--causal", "--fail-on", "saturated", code=1)
    counts = doc["finding_counts"]
    listed = [f["kind"] for f in doc["findings"]]
    assert counts["saturated"] > 50 == listed.count("saturated")
    checks = by_name(doc)
    assert checks["findings.saturated"]["summary"].startswith(
        f"{counts['saturated']} saturated findings (50 listed); first: row [0, 0, 1] is one-hot"
    )
    assert checks["findings.saturated"]["count"] == counts["saturated"]

    doc = check_json(*qkv, "--causal", "--fail-on", "none", "--fail-on-severity", "warning", code=1)
    by_severity = {
        sev: [f["kind"] for f in doc["findings"] if f["severity"] == sev]
        for sev in ("warning", "info")
    }
    # One overflow (float16) is a warning, the other (float8) info; every saturated
    # row a warning, every underflow row info: those two kinds count their unlisted rows.
    assert sorted(set(by_severity["warning"])) == ["overflow", "saturated"]
    assert by_severity["warning"].count("overflow") == 1 == by_severity["info"].count("overflow")
    serious = counts["saturated"] + 1
    checks = by_name(doc)
    assert checks["findings.severity"]["summary"].startswith(
        f"{serious} findings (51 listed) at warning or worse; first: overflow: "
    )
    assert checks["findings.severity"]["count"] == serious
    assert sorted(set(by_severity["info"])) == ["overflow", "underflow"]
    info = counts["underflow"] + 1
    assert checks["findings"]["summary"] == (
        f"nothing worth a warning ({info} info findings, 51 listed)"
    )


def test_findings_counts_in_the_table(workdir: Path) -> None:
    qkv = saturated_case(workdir)
    text = " ".join(check(*qkv, "--causal", "--fail-on", "none").stdout.split())
    counts = check_json(*qkv, "--causal", "--fail-on", "none", code=0)["finding_counts"]
    assert f"{counts['saturated'] + 1} findings (51 listed) not gating" in text
