"""Tests of the command line: exit codes, error lines, JSON/YAML/npz output, help, color.

Most tests drive ``sdpa_cli.cli.cli`` through click's ``CliRunner`` (which calls the
group's ``main``, so ``exit_code`` is what a user sees and ``stderr`` is separate from
``stdout``); a few run the installed ``sdpa`` entry point in a subprocess.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from clirunner import (
    ANSI,
    assert_one_error_line,
    clean_environ,
    decode_non_finite,
    invoke,
    strict_json,
)
from numpy.typing import NDArray

from sdpa_cli import __version__
from sdpa_cli.cli import COMMANDS, cli
from sdpa_cli.errors import ExitCode

F64 = NDArray[np.float64]


def softmax(x: F64) -> F64:
    """Row softmax with zero rows for rows that see no key."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    total = e.sum(axis=-1, keepdims=True)
    result: F64 = e / np.where(total == 0, 1.0, total)
    return result


def reference(
    q: F64, k: F64, v: F64, *, scale: float, visible: NDArray[np.bool_] | None = None
) -> dict[str, F64]:
    """Attention stage by stage, written from the formula (one head axis, no GQA)."""
    raw = np.einsum("HLE,HSE->HLS", q, k)
    scaled = raw * scale
    masked = scaled if visible is None else np.where(visible, scaled, -np.inf)
    weights = softmax(masked)
    output = np.einsum("HLS,HSD->HLD", weights, v)
    return {"raw": raw, "scaled": scaled, "masked": masked, "weights": weights, "output": output}


# --- fixtures --------------------------------------------------------------------------

RNG_SEED = 20240611
H, L, S, E, EV = 2, 3, 5, 4, 3


@pytest.fixture
def qkv(workdir: Path) -> dict[str, F64]:
    """q.npy (H, L, E), k.npy (H, S, E), v.npy (H, S, Ev) in the working directory."""
    rng = np.random.default_rng(RNG_SEED)
    arrays = {
        "q": rng.standard_normal((H, L, E)),
        "k": rng.standard_normal((H, S, E)),
        "v": rng.standard_normal((H, S, EV)),
    }
    for name, arr in arrays.items():
        np.save(workdir / f"{name}.npy", arr)
    return arrays


QKV = ("q.npy", "k.npy", "v.npy")


# --- exit codes and the error catalogue --------------------------------------------------


def make_bad_inputs(d: Path) -> None:
    """Every file the error catalogue below refers to."""
    (d / "case_dtype.yaml").write_text("q: [1]\nk: [[1]]\nv: [[1]]\ndtype: float128\n")
    rng = np.random.default_rng(1)

    def save(name: str, shape: tuple[int, ...], dtype: Any = np.float64) -> None:
        np.save(d / name, rng.standard_normal(shape).astype(dtype))

    save("k_e5.npy", (H, S, 5))
    save("v_s6.npy", (H, 6, EV))
    save("q_h4.npy", (1, 4, L, E))
    save("k_g3.npy", (1, 3, S, E))
    save("v_g3.npy", (1, 3, S, EV))
    save("qb.npy", (2, H, L, E))
    save("kb.npy", (2, H, S, E))
    save("vb.npy", (2, H, S, EV))
    save("bias_bad.npy", (L, 4))
    save("fmask.npy", (L, S))
    save("qc.npy", (H, L, E), np.complex128)
    np.save(d / "mask_bad.npy", np.ones((4, S), dtype=bool))
    np.save(d / "evil.npy", np.array([1, "x"], dtype=object), allow_pickle=True)
    with (d / "trunc.npy").open("wb") as fh:
        header = {"descr": "<f8", "fortran_order": False, "shape": (10**6, 10**6)}
        np.lib.format.write_array_header_1_0(fh, header)
        fh.write(b"\0" * 32)
    (d / "q.txt").write_text("[[1, 2]]")
    (d / "empty.json").write_text("")
    (d / "bad.json").write_text('{"q": [[1, 2]],\n "k": [[1, 2]] "v": []}')
    tensors = "q: q.npy\nk: k.npy\nv: v.npy\n"
    (d / "case_unknown.yaml").write_text(tensors + "foo: 1\n")
    (d / "case_scale.yaml").write_text(tensors + "scale: 0\n")
    (d / "case_causal.yaml").write_text(tensors + "causal: 3\n")
    (d / "case_ref.yaml").write_text("q: data/missing.npy\nk: k.npy\nv: v.npy\n")
    (d / "keep.npz").write_bytes(b"an earlier result that must survive")


# (id, arguments after `compute`, how the line starts after "sdpa: error: ", a fragment)
CATALOGUE: list[tuple[str, list[str], str, str]] = [
    ("missing-file", ["nope.npy", "k.npy", "v.npy"], "nope.npy: ", "no such file"),
    ("missing-bias", [*QKV, "--bias", "nope.npy"], "nope.npy: ", "no such file"),
    ("bad-extension", ["q.txt", "k.npy", "v.npy"], "q.txt: ", "unknown format '.txt'"),
    ("pickled-npy", ["evil.npy", "k.npy", "v.npy"], "evil.npy: ", "pickle"),
    ("truncated-npy", ["trunc.npy", "k.npy", "v.npy"], "trunc.npy: ", "truncated"),
    ("complex-npy", ["qc.npy", "k.npy", "v.npy"], "qc.npy: ", "complex"),
    ("shape-E", ["q.npy", "k_e5.npy", "v.npy"], "k_e5.npy: ", f"E = {E}"),
    ("shape-S", ["q.npy", "k.npy", "v_s6.npy"], "v_s6.npy: ", f"S = {S}"),
    ("gqa-not-dividing", ["q_h4.npy", "k_g3.npy", "v_g3.npy"], "k_g3.npy: ", "4 heads"),
    ("bias-broadcast", [*QKV, "--bias", "bias_bad.npy"], "bias_bad.npy: ", "broadcast"),
    ("mask-broadcast", [*QKV, "--mask", "mask_bad.npy"], "mask_bad.npy: ", "broadcast"),
    ("scale-zero", [*QKV, "--scale", "0"], "--scale: ", "'0'"),
    ("scale-nan", [*QKV, "--scale", "nan"], "--scale: ", "'nan'"),
    ("scale-word", [*QKV, "--scale", "foo"], "--scale: ", "'foo'"),
    ("temperature-negative", [*QKV, "--temperature", "-1"], "--temperature: ", "'-1'"),
    ("temperature-inf", [*QKV, "--temperature", "inf"], "--temperature: ", "finite"),
    ("softcap-zero", [*QKV, "--softcap", "0"], "--softcap: ", "positive"),
    ("dropout-one", [*QKV, "--dropout", "1"], "--dropout: ", "[0, 1)"),
    ("window-words", [*QKV, "--window", "a,b"], "--window: ", "'a'"),
    ("window-three", [*QKV, "--window", "1,2,3"], "--window: ", "'1,2,3'"),
    ("window-negative", [*QKV, "--window", "-1"], "--window: ", "got -1"),
    ("mask-value-positive", [*QKV, "--mask-value", "5"], "--mask-value: ", "negative"),
    (
        "key-lengths-count",
        ["qb.npy", "kb.npy", "vb.npy", "--key-lengths", "1,2,3"],
        "--key-lengths: ",
        "3 lengths",
    ),
    ("key-lengths-no-batch", [*QKV, "--key-lengths", "1,2"], "--key-lengths: ", "no batch"),
    ("key-lengths-too-long", [*QKV, "--key-lengths", "9"], "--key-lengths: ", f"S = {S}"),
    ("key-lengths-empty-item", [*QKV, "--key-lengths", "1,,2"], "--key-lengths: ", "'1,,2'"),
    ("heads-not-dividing", [*QKV, "--heads", "3"], "--heads: ", "not divisible by 3"),
    ("heads-zero", [*QKV, "--heads", "0"], "--heads: ", "got 0"),
    ("seed-negative", [*QKV, "--seed", "-1"], "--seed: ", "got -1"),
    ("rows-out-of-range", [*QKV, "--rows", "7"], "--rows: ", "'7'"),
    ("rows-garbage", [*QKV, "--rows", "x"], "--rows: ", "'x'"),
    ("head-out-of-range", [*QKV, "--head", "5"], "--head: ", "out of range"),
    ("batch-without-axis", [*QKV, "--batch", "0"], "--batch: ", "no batch"),
    (
        "batch-out-of-range",
        ["qb.npy", "kb.npy", "vb.npy", "--batch", "2"],
        "--batch: ",
        "out of range",
    ),
    ("stages-unknown", [*QKV, "--stages", "raw,bogus"], "--stages: ", "'bogus'"),
    ("two-inputs", ["q.npy", "k.npy"], "q.npy k.npy: expected Q K V", "got 2 inputs"),
    ("one-non-case", ["q.npy"], "q.npy: ", "case file"),
    (
        "mask-true-means-float",
        [*QKV, "--mask", "fmask.npy", "--mask-true-means", "masked"],
        "--mask-true-means: ",
        "boolean",
    ),
    ("case-unknown-key", ["case_unknown.yaml"], "case_unknown.yaml: ", "unknown key 'foo'"),
    ("case-bad-scale", ["case_scale.yaml"], "case_scale.yaml: scale: ", "positive"),
    ("case-bad-bool", ["case_causal.yaml"], "case_causal.yaml: causal: ", "true or false"),
    ("case-missing-ref", ["case_ref.yaml"], "data/missing.npy: ", "no such file"),
    ("case-invalid-json", ["bad.json"], "bad.json: ", "line 2 column"),
    ("case-empty", ["empty.json"], "empty.json: ", "empty"),
    ("choice", [*QKV, "--causal-align", "bogus"], "Invalid value for '--causal-align'", "bogus"),
    ("format", [*QKV, "--format", "xml"], "Invalid value for '--format'", "xml"),
    ("int-range", [*QKV, "--max-rows", "0"], "Invalid value for '--max-rows'", "0 is not"),
    ("unknown-option", [*QKV, "--foo"], "No such option", "--foo"),
    ("no-inputs", [], "Missing argument", "Q K V"),
    ("dtype-unknown", [*QKV, "--dtype", "float12"], "--dtype: ", "'float12'"),
    (
        "accumulate-mismatch",
        [*QKV, "--dtype", "float16", "--accumulate", "bfloat16"],
        "--accumulate: ",
        "float16",
    ),
    ("logits-dtype-mismatch", [*QKV, "--logits-dtype", "float16"], "--logits-dtype: ", "float64"),
    ("softmax-dtype-unknown", [*QKV, "--softmax-dtype", "half"], "--softmax-dtype: ", "'half'"),
    ("saturation-above-one", [*QKV, "--saturation", "1.5"], "--saturation: ", "1.5"),
    ("uniform-zero", [*QKV, "--uniform", "0"], "--uniform: ", "(0, 1]"),
    ("head-fraction-text", [*QKV, "--head-fraction", "most"], "--head-fraction: ", "'most'"),
    ("max-findings-negative", [*QKV, "--max-findings", "-1"], "--max-findings: ", "≥ 0"),
    ("case-bad-dtype", ["case_dtype.yaml"], "case_dtype.yaml: dtype: ", "'float128'"),
]


@pytest.mark.parametrize(
    ("args", "head", "fragment"),
    [pytest.param(a, h, f, id=i) for i, a, h, f in CATALOGUE],
)
def test_error_catalogue(
    qkv: dict[str, F64], workdir: Path, args: list[str], head: str, fragment: str
) -> None:
    make_bad_inputs(workdir)
    before = sorted(p.name for p in workdir.iterdir())
    kept = (workdir / "keep.npz").read_bytes()
    line = assert_one_error_line(invoke("compute", *args, "--save", "keep.npz"))
    assert line.startswith("sdpa: error: " + head), line
    assert fragment in line[len("sdpa: error: " + head) :], line
    # A failed run neither clobbers the --save file nor leaves a temporary file behind.
    assert (workdir / "keep.npz").read_bytes() == kept
    assert sorted(p.name for p in workdir.iterdir()) == before


def test_failed_run_creates_no_save_file(qkv: dict[str, F64], workdir: Path) -> None:
    assert_one_error_line(invoke("compute", *QKV, "--dropout", "2", "--save", "new.npz"))
    assert sorted(p.name for p in workdir.iterdir()) == ["k.npy", "q.npy", "v.npy"]


def test_catalogue_is_large_and_distinct() -> None:
    assert len(CATALOGUE) >= 20
    assert len({i for i, *_ in CATALOGUE}) == len(CATALOGUE)


def test_exit_code_enum_values() -> None:
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0,
        "CHECK_FAILED": 1,
        "BAD_INPUT": 2,
        "INTERNAL": 3,
        "INTERRUPTED": 130,
    }


def test_help_lists_every_exit_code() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "Exit codes:" in text
    for code in ExitCode:
        assert re.search(rf"(?<![\d.]){int(code)} [a-z]", text), code


def test_success_exits_zero_with_a_silent_stderr(qkv: dict[str, F64]) -> None:
    result = invoke("compute", *QKV, "--no-color")
    assert result.exit_code == ExitCode.OK
    assert result.stderr == ""
    assert result.stdout.strip()


def test_internal_error_is_one_line_and_exit_3(
    qkv: dict[str, F64], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sdpa_cli.api.compute

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(sdpa_cli.api.compute, "trace", broken)
    line = assert_one_error_line(invoke("compute", *QKV), code=ExitCode.INTERNAL)
    assert line.startswith("sdpa: error: internal error: RuntimeError: boom")
    assert "report" in line
    debug = invoke("--debug", "compute", *QKV)
    assert debug.exit_code == ExitCode.INTERNAL
    assert "Traceback" in debug.stderr
    assert debug.stderr.rstrip("\n").splitlines()[-1].startswith("sdpa: error: internal error")


def test_interrupt_exits_130(qkv: dict[str, F64], monkeypatch: pytest.MonkeyPatch) -> None:
    import sdpa_cli.api.compute

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(sdpa_cli.api.compute, "trace", interrupted)
    result = invoke("compute", *QKV)
    assert result.exit_code == ExitCode.INTERRUPTED
    assert result.stdout == ""
    # click ends the ^C line first; then the one message.
    assert result.stderr.lstrip("\n") == "sdpa: error: interrupted\n"


# --- JSON and YAML -----------------------------------------------------------------------

PAYLOAD_KEYS = {
    "schema_version",
    "sdpa_version",
    "shapes",
    "scale",
    "scale_rule",
    "temperature",
    "options",
    "options_typed",
    "backend",
    "device",
    "stages",
    "findings",
    "finding_counts",
    "findings_truncated",
    "thresholds",
    "heads",
    "headroom_bits",
    "emulation",
}


def run_json(*args: str) -> dict[str, Any]:
    result = invoke("compute", *args, "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.count("\n") == 1  # one object, one line
    data = strict_json(result.stdout)
    assert isinstance(data, dict)
    return data


def test_json_contract_matches_numpy(qkv: dict[str, F64]) -> None:
    data = run_json(*QKV, "--causal")
    stages = ["raw", "scaled", "masked", "weights", "output"]
    assert set(data) == PAYLOAD_KEYS | set(stages) | {"visible"}
    assert (data["schema_version"], data["sdpa_version"]) == (1, __version__)
    assert data["shapes"] == {
        "q": [H, L, E],
        "k": [H, S, E],
        "v": [H, S, EV],
        "weights": [H, L, S],
        "output": [H, L, EV],
    }
    assert data["scale"] == pytest.approx(1 / math.sqrt(E))
    assert data["scale_rule"] == "sqrt-dk"
    assert data["temperature"] == 1.0
    assert data["options"]["causal"] is True
    assert data["options"]["causal_align"] == "upper-left"
    assert data["options"]["mask_value"] == "-Infinity"
    assert data["stages"] == stages
    # Random data: at most short causal rows that happen to be nearly uniform (info).
    assert {f["kind"] for f in data["findings"]} <= {"near_uniform"}
    assert all(f["severity"] == "info" and f["stage"] == "weights" for f in data["findings"])

    visible = np.arange(S)[None, :] <= np.arange(L)[:, None]  # upper-left: j ≤ i
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=1 / math.sqrt(E), visible=visible)
    assert np.array_equal(np.array(data["visible"]), np.broadcast_to(visible, (H, L, S)))
    for name in stages:
        got = np.array(decode_non_finite(data[name]), dtype=np.float64)
        assert list(got.shape) == (data["shapes"]["output" if name == "output" else "weights"])
        np.testing.assert_allclose(got, expected[name], rtol=1e-12, atol=1e-12)
    # Hidden logits travel as the string "-Infinity", never as a bare -Infinity literal.
    assert data["masked"][0][0][1] == "-Infinity"
    assert data["weights"][0][0][1] == 0


def test_json_lower_right_alignment_matches_numpy(qkv: dict[str, F64]) -> None:
    data = run_json(*QKV, "--causal", "--causal-align", "lower-right", "--scale", "dk")
    visible = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=1 / E, visible=visible)
    assert data["scale_rule"] == "dk"
    assert data["options"]["causal_align"] == "lower-right"
    np.testing.assert_allclose(np.array(data["weights"]), expected["weights"], atol=1e-12)
    np.testing.assert_allclose(np.array(data["output"]), expected["output"], atol=1e-12)


def test_json_without_masks_has_no_visible(qkv: dict[str, F64]) -> None:
    data = run_json(*QKV, "--scale", "0.25", "--temperature", "2")
    assert "visible" not in data
    assert data["scale"] == 0.25
    assert data["scale_rule"] == "given"
    assert data["temperature"] == 2.0
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=0.125)
    np.testing.assert_allclose(np.array(data["scaled"]), expected["scaled"], atol=1e-12)
    np.testing.assert_allclose(np.array(data["output"]), expected["output"], atol=1e-12)


def test_json_of_the_output_alone_has_no_visible_even_when_masked(qkv: dict[str, F64]) -> None:
    """``visible`` is score-shaped: it comes with score-shaped stages only (a causal
    output of a long sequence would otherwise carry an L × S list)."""
    alone = run_json(*QKV, "--causal", "--stages", "output")
    assert "visible" not in alone
    visible = np.arange(S)[None, :] <= np.arange(L)[:, None]
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=1 / math.sqrt(E), visible=visible)
    np.testing.assert_allclose(np.array(alone["output"]), expected["output"], atol=1e-12)
    with_weights = run_json(*QKV, "--causal", "--stages", "weights,output")
    np.testing.assert_array_equal(
        np.array(with_weights["visible"]), np.broadcast_to(visible, (H, L, S))
    )


def test_json_heads_split_and_merge(workdir: Path) -> None:
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((4, 6)) for _ in range(3))
    for name, arr in (("q", q), ("k", k), ("v", v)):
        np.save(workdir / f"{name}.npy", arr)
    data = run_json(*QKV, "--heads", "2")
    assert data["shapes"]["weights"] == [2, 4, 4]
    assert data["shapes"]["output"] == [4, 6]

    def split(a: F64) -> F64:
        return a.reshape(4, 2, 3).transpose(1, 0, 2)

    expected = reference(split(q), split(k), split(v), scale=1 / math.sqrt(3))
    merged = expected["output"].transpose(1, 0, 2).reshape(4, 6)
    np.testing.assert_allclose(np.array(data["output"]), merged, atol=1e-12)


def test_json_non_finite_values_are_strings(workdir: Path) -> None:
    q = np.array([[np.inf, 1.0], [0.0, 1.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    v = np.ones((3, 1))
    for name, arr in (("q", q), ("k", k), ("v", v)):
        np.save(workdir / f"{name}.npy", arr)
    result = invoke("compute", *QKV, "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert "NaN" in result.stdout  # inf · 0
    data = strict_json(result.stdout)
    with np.errstate(invalid="ignore"):
        raw = q @ k.T
    got = np.array(decode_non_finite(data["raw"]), dtype=np.float64)
    np.testing.assert_array_equal(got, raw)  # equal_nan by default
    assert data["raw"][0] == ["Infinity", "NaN", "-Infinity"]


def test_yaml_contract_equals_json(qkv: dict[str, F64]) -> None:
    result = invoke("compute", *QKV, "--causal", "--format", "yaml")
    assert result.exit_code == 0, result.stderr
    data = yaml.safe_load(result.stdout)
    assert set(data) == PAYLOAD_KEYS | {"raw", "scaled", "masked", "weights", "output", "visible"}
    # Infinities are native YAML floats, not strings.
    assert data["masked"][0][0][1] == -math.inf
    assert data["options"]["mask_value"] == -math.inf
    visible = np.arange(S)[None, :] <= np.arange(L)[:, None]
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=1 / math.sqrt(E), visible=visible)
    for name, arr in expected.items():
        np.testing.assert_allclose(np.array(data[name], dtype=np.float64), arr, atol=1e-12)
    assert data == decode_non_finite(run_json(*QKV, "--causal"))


def test_json_stages_filter(qkv: dict[str, F64]) -> None:
    data = run_json(*QKV, "--stages", "weights,output")
    assert data["stages"] == ["weights", "output"]
    for name in ("raw", "scaled", "masked"):
        assert name not in data
    assert "weights" in data
    assert "output" in data


def test_json_stages_keep_the_order_of_computation(qkv: dict[str, F64]) -> None:
    data = run_json(*QKV, "--stages", "output,raw")
    assert data["stages"] == ["raw", "output"]


# --- --save ---------------------------------------------------------------------------------


def test_save_npz_contents(qkv: dict[str, F64], workdir: Path) -> None:
    result = invoke("compute", *QKV, "--causal", "--save", "trace.npz", "--no-color")
    assert result.exit_code == 0, result.stderr
    visible = np.arange(S)[None, :] <= np.arange(L)[:, None]
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=1 / math.sqrt(E), visible=visible)
    with np.load(workdir / "trace.npz", allow_pickle=False) as npz:
        assert set(npz.files) == {"raw", "scaled", "masked", "weights", "output", "visible"}
        for name, arr in expected.items():
            np.testing.assert_allclose(npz[name], arr, atol=1e-12)
        assert npz["visible"].dtype == np.bool_
        np.testing.assert_array_equal(npz["visible"], np.broadcast_to(visible, (H, L, S)))
    assert sorted(p.name for p in workdir.iterdir()) == ["k.npy", "q.npy", "trace.npz", "v.npy"]


def test_save_npz_with_every_optional_stage(qkv: dict[str, F64], workdir: Path) -> None:
    bias = np.random.default_rng(5).standard_normal((L, S))
    np.save(workdir / "bias.npy", bias)
    args = ["--softcap", "2", "--bias", "bias.npy", "--dropout", "0.5", "--seed", "7"]
    result = invoke("compute", *QKV, *args, "--save", "t.npz", "--format", "json")
    assert result.exit_code == 0, result.stderr
    with np.load(workdir / "t.npz") as npz:
        assert set(npz.files) == {
            "raw", "scaled", "capped", "biased", "masked", "weights", "dropped", "output",
            "visible",
        }  # fmt: skip
        scaled = np.einsum("HLE,HSE->HLS", qkv["q"], qkv["k"]) / math.sqrt(E)
        capped = 2 * np.tanh(scaled / 2)
        np.testing.assert_allclose(npz["capped"], capped, atol=1e-12)
        np.testing.assert_allclose(npz["biased"], capped + bias, atol=1e-12)
        weights = softmax(capped + bias)
        np.testing.assert_allclose(npz["weights"], weights, atol=1e-12)
        dropped = npz["dropped"]
        kept = dropped != 0
        assert 0 < kept.sum() < kept.size
        np.testing.assert_allclose(dropped[kept], weights[kept] / 0.5, rtol=1e-12)
        expected_out = np.einsum("HLS,HSD->HLD", dropped, qkv["v"])
        np.testing.assert_allclose(npz["output"], expected_out, atol=1e-12)
    # The JSON printed alongside agrees with the file.
    data = strict_json(result.stdout)
    np.testing.assert_allclose(np.array(data["dropped"]), dropped, atol=0)


def test_save_replaces_an_existing_file(qkv: dict[str, F64], workdir: Path) -> None:
    (workdir / "trace.npz").write_bytes(b"old")
    result = invoke("compute", *QKV, "--save", "trace.npz", "--format", "json")
    assert result.exit_code == 0, result.stderr
    with np.load(workdir / "trace.npz") as npz:
        assert "weights" in npz.files


def test_save_into_a_missing_directory_leaves_nothing(qkv: dict[str, F64], workdir: Path) -> None:
    before = sorted(p.name for p in workdir.iterdir())
    line = assert_one_error_line(invoke("compute", *QKV, "--save", "nodir/trace.npz"))
    assert line.startswith("sdpa: error: nodir/trace.npz: ")
    assert "nodir" in line[len("sdpa: error: nodir/trace.npz: ") :]
    assert sorted(p.name for p in workdir.iterdir()) == before
    assert not (workdir / "nodir").exists()


def test_save_onto_a_directory_is_a_bad_input(qkv: dict[str, F64], workdir: Path) -> None:
    (workdir / "out.npz").mkdir()
    line = assert_one_error_line(invoke("compute", *QKV, "--save", "out.npz"))
    assert line.startswith("sdpa: error: out.npz: ")
    assert list((workdir / "out.npz").iterdir()) == []


# --- case files ------------------------------------------------------------------------------


def write_case(path: Path, qkv: dict[str, F64], extra: str) -> None:
    path.write_text(
        "description: a small causal case\n"
        f"q: {json.dumps(qkv['q'].tolist())}\n"
        f"k: {json.dumps(qkv['k'].tolist())}\n"
        f"v: {json.dumps(qkv['v'].tolist())}\n" + extra
    )


def test_case_file_options_apply(qkv: dict[str, F64], workdir: Path) -> None:
    write_case(workdir / "case.yaml", qkv, "causal: true\ncausal-align: lower-right\n")
    data = run_json("case.yaml")
    assert data["options"]["causal"] is True
    assert data["options"]["causal_align"] == "lower-right"
    visible = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=1 / math.sqrt(E), visible=visible)
    np.testing.assert_allclose(np.array(data["weights"]), expected["weights"], atol=1e-12)


def test_command_line_flags_override_the_case_file(qkv: dict[str, F64], workdir: Path) -> None:
    write_case(workdir / "case.yaml", qkv, "causal: true\nscale: dk\n")
    data = run_json("case.yaml", "--no-causal", "--scale", "none")
    assert data["options"]["causal"] is False
    assert data["scale_rule"] == "none"
    assert data["scale"] == 1.0
    assert "visible" not in data
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=1.0)
    np.testing.assert_allclose(np.array(data["weights"]), expected["weights"], atol=1e-12)


def test_an_error_names_where_the_bad_value_came_from(qkv: dict[str, F64], workdir: Path) -> None:
    write_case(workdir / "case.yaml", qkv, "window: nope\ncausal_align: sideways\n")
    # From the case file: the file and the key as written.
    line = assert_one_error_line(invoke("compute", "case.yaml", "--causal-align", "lower-right"))
    assert line == "sdpa: error: case.yaml: window: expected an integer, got 'nope'"
    # A flag overriding the case file is named by its flag, not by the case file.
    line = assert_one_error_line(
        invoke("compute", "case.yaml", "--window", "x,1", "--causal-align", "upper-left")
    )
    assert line == "sdpa: error: --window: expected an integer, got 'x'"


def test_case_file_with_relative_paths_from_another_directory(
    qkv: dict[str, F64], workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = workdir / "cases"
    cases.mkdir()
    np.savez(cases / "kv.npz", k=qkv["k"], v=qkv["v"])
    shutil.copy(workdir / "q.npy", cases / "query.npy")
    (cases / "case.json").write_text(
        json.dumps(
            {"q": "query.npy", "k": "kv.npz:k", "v": "kv.npz:v", "causal_align": "lower-right"}
        )
    )
    other = workdir / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    data = run_json("../cases/case.json", "--causal")
    visible = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=1 / math.sqrt(E), visible=visible)
    np.testing.assert_allclose(np.array(data["output"]), expected["output"], atol=1e-12)


def test_case_description_is_shown(qkv: dict[str, F64], workdir: Path) -> None:
    write_case(workdir / "case.yaml", qkv, "")
    result = invoke("compute", "case.yaml")
    assert result.exit_code == 0, result.stderr
    assert "a small causal case" in result.stdout


# --- table output ----------------------------------------------------------------------------


def save_labelled(workdir: Path) -> dict[tuple[int, int, int, int], int]:
    """Inputs (2, 2, 3, 2) whose raw score at (b, h, i, j) is 5000 + 1000b + 100h + 10j + i.

    Every score is a distinct 4-digit integer, so a table shows which slice and rows it is.
    """
    B, Hh, Ll, Ss = 2, 2, 3, 4
    q = np.zeros((B, Hh, Ll, 2))
    k = np.zeros((B, Hh, Ss, 2))
    q[..., 0] = 1.0
    q[..., 1] = np.arange(Ll)
    for b in range(B):
        for h in range(Hh):
            k[b, h, :, 0] = 5000 + 1000 * b + 100 * h + 10 * np.arange(Ss)
    k[..., 1] = 1.0
    np.save(workdir / "q.npy", q)
    np.save(workdir / "k.npy", k)
    np.save(workdir / "v.npy", np.ones((B, Hh, Ss, 1)))
    raw = np.einsum("BHLE,BHSE->BHLS", q, k)
    labels = {
        idx: 5000 + 1000 * idx[0] + 100 * idx[1] + 10 * idx[3] + idx[2]
        for idx in np.ndindex(raw.shape)
    }
    assert all(raw[idx] == value for idx, value in labels.items())
    return labels


def shown_numbers(text: str) -> set[int]:
    return {int(m) for m in re.findall(r"(?<![\d.])\d{4}(?![\d.])", text)}


def test_batch_head_rows_select_the_table(workdir: Path) -> None:
    labels = save_labelled(workdir)
    result = invoke(
        "compute", *QKV, "--stages", "raw", "--scale", "none", "--precision", "0",
        "--batch", "1", "--head", "0", "--rows", "1:3", "--no-color",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    shown = shown_numbers(result.stdout)
    wanted = {v for (b, h, i, _), v in labels.items() if (b, h) == (1, 0) and i in (1, 2)}
    others = set(labels.values()) - wanted - {min(labels.values()), max(labels.values())}
    assert wanted <= shown
    assert not (others & shown), sorted(others & shown)


def test_single_row_selection(workdir: Path) -> None:
    labels = save_labelled(workdir)
    result = invoke(
        "compute", *QKV, "--stages", "raw", "--scale", "none", "--precision", "0",
        "--batch", "0", "--head", "1", "--rows", "2", "--no-color",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    shown = shown_numbers(result.stdout)
    wanted = {v for (b, h, i, _), v in labels.items() if (b, h, i) == (0, 1, 2)}
    others = set(labels.values()) - wanted - {min(labels.values()), max(labels.values())}
    assert wanted <= shown
    assert not (others & shown)


def test_table_stages_filter(qkv: dict[str, F64]) -> None:
    from sdpa_cli.render.common import stage_heading

    result = invoke("compute", *QKV, "--stages", "weights", "--no-color")
    assert result.exit_code == 0, result.stderr

    def title_line(stage: str) -> str:
        title, formula = stage_heading(stage)
        return f"{title}  {formula}"

    assert title_line("weights") in result.stdout
    for other in ("raw", "scaled", "masked", "output"):
        assert title_line(other) not in result.stdout
    everything = invoke("compute", *QKV, "--no-color")
    for stage in ("raw", "scaled", "weights", "output"):
        assert title_line(stage) in everything.stdout


def test_large_input_is_summarised_not_flooded(workdir: Path) -> None:
    rng = np.random.default_rng(11)
    for name in "qkv":
        np.save(workdir / f"{name}.npy", rng.standard_normal((2, 8, 64, 64)).astype(np.float32))
    result = invoke("compute", *QKV, "--no-color")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "…" in result.stdout
    assert len(lines) < 150, len(lines)


def test_large_input_is_cut_with_an_ellipsis(workdir: Path) -> None:
    rng = np.random.default_rng(11)
    for name in "qkv":
        np.save(workdir / f"{name}.npy", rng.standard_normal((2, 8, 64, 64)).astype(np.float32))
    result = invoke("compute", *QKV, "--no-color")
    assert result.exit_code == 0, result.stderr
    assert "…" in result.stdout
    # Far fewer lines than one line per query row of every slice and stage.
    assert len(result.stdout.splitlines()) < 2 * 8 * 64


@pytest.mark.parametrize(
    ("align", "absent"), [("upper-left", "lower-right"), ("lower-right", "upper-left")]
)
def test_header_names_the_alignment_when_l_differs_from_s(
    qkv: dict[str, F64], align: str, absent: str
) -> None:
    result = invoke("compute", *QKV, "--causal", "--causal-align", align, "--no-color")
    assert result.exit_code == 0, result.stderr
    assert align in result.stdout
    assert absent not in result.stdout


def test_header_default_alignment_is_named(qkv: dict[str, F64]) -> None:
    result = invoke("compute", *QKV, "--causal", "--no-color")
    assert result.exit_code == 0, result.stderr
    assert "upper-left" in result.stdout


# --- color ---------------------------------------------------------------------------------


def test_no_ansi_codes_in_a_pipe_by_default(qkv: dict[str, F64]) -> None:
    result = invoke("compute", *QKV, "--causal")
    assert result.exit_code == 0
    assert ANSI not in result.stdout


def test_color_flag_forces_codes_into_a_pipe(qkv: dict[str, F64]) -> None:
    result = invoke("compute", *QKV, "--causal", "--color")
    assert result.exit_code == 0
    assert ANSI in result.stdout


def test_no_color_flag_removes_codes_even_when_forced(qkv: dict[str, F64]) -> None:
    result = invoke("compute", *QKV, "--causal", "--no-color", env={"FORCE_COLOR": "1"})
    assert result.exit_code == 0
    assert ANSI not in result.stdout


def test_no_color_env_in_a_pipe(qkv: dict[str, F64]) -> None:
    result = invoke("compute", *QKV, "--causal", env={"NO_COLOR": "1"})
    assert result.exit_code == 0
    assert ANSI not in result.stdout


def test_errors_carry_no_ansi_codes(qkv: dict[str, F64]) -> None:
    result = invoke("compute", *QKV, "--scale", "0", "--color")
    assert_one_error_line(result)
    assert ANSI not in result.stderr


# --- help and version ----------------------------------------------------------------------


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert __version__ in result.stdout
    assert result.stdout.startswith("sdpa")


def test_group_help_has_an_example() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    assert "Example" in result.stdout
    assert "compute" in result.stdout


COMMAND_LINES = 65
"""About 60 lines for a command's function, docstring included: parsing, one call into
:mod:`sdpa_cli.api`, rendering and an exit code."""


def test_every_command_is_a_thin_skin_over_the_api() -> None:
    """A command's function is short and takes its options as records (a case, the
    outputs, a view...), not one parameter each."""
    import ast
    import inspect as inspecting

    for name in COMMANDS:
        command = cli.commands[name]
        callbacks = [command.callback]
        if hasattr(command, "commands"):
            callbacks += [c.callback for c in command.commands.values()]
        for callback in callbacks:
            assert callback is not None
            function = inspecting.unwrap(callback)
            tree = ast.parse(inspecting.getsource(function).lstrip())
            definition = tree.body[0]
            assert isinstance(definition, ast.FunctionDef)
            length = (definition.end_lineno or 0) - definition.lineno + 1
            assert length <= COMMAND_LINES, (function.__qualname__, length)
            assert len(inspecting.signature(function).parameters) <= 10, function.__qualname__


def test_the_listing_of_sdpa_help_is_each_commands_own_first_paragraph() -> None:
    """sdpa --help lists the commands from COMMANDS without importing them: the texts
    there must be the commands' own (the first paragraph of each docstring)."""
    for name, command in cli.commands.items():
        assert command.name == name
        first = (command.help or "").strip().split("\n\n")[0]
        assert " ".join(first.split()) == COMMANDS[name], name


def test_sdpa_help_imports_no_command() -> None:
    """Each command's module is imported when it runs, not to list it; nor are the
    options the commands share (dataclasses, the conventions' tables) or the machine's
    limits (pathlib): ``sdpa --help`` went from 1.25× to 1.5× ``import click`` the day
    those came in through two constants (make bench, "Start-up")."""
    code = (
        "import sys; from sdpa_cli.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('sdpa_cli.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = out.stdout.strip().splitlines()[-1]
    # cli/completion.py holds the completers every option uses too: always imported
    commands = set(COMMANDS) - {"completion"}
    assert not any(f"'sdpa_cli.cli.{name}'" in imported for name in commands), imported
    for module in ("sdpa_cli.cli.options", "sdpa_cli.files.limits"):
        assert f"'{module}'" not in imported, imported


def test_every_command_has_help_with_an_example() -> None:
    assert cli.commands, "no commands registered"
    for name, command in cli.commands.items():
        assert command.help, name
        assert command.help.strip(), name
        assert "Example" in command.help, name
        result = invoke(name, "--help")
        assert result.exit_code == 0, (name, result.stderr)
        assert "Example" in result.stdout, name
        assert f"sdpa {name}" in result.stdout, name


def test_compute_help_mentions_every_input_format() -> None:
    result = invoke("compute", "--help")
    assert result.exit_code == 0
    for word in (".npy", ".npz", ".json", ".yaml", "--format", "--save"):
        assert word in result.stdout, word


# --- end to end: the installed entry point ---------------------------------------------------


def sdpa_executable() -> str:
    beside = Path(sys.executable).parent / "sdpa"
    found = str(beside) if beside.exists() else shutil.which("sdpa")
    if found is None:
        pytest.skip("the sdpa console script is not installed (pip install -e .)")
    return found


def subprocess_env(**extra: str) -> dict[str, str]:
    return clean_environ(**{"COLUMNS": "100", **extra})


def run_process(args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), cwd=cwd, capture_output=True, text=True, env=subprocess_env(), timeout=60
    )


@pytest.mark.e2e
def test_e2e_version(tmp_path: Path) -> None:
    for argv in ([sdpa_executable()], [sys.executable, "-m", "sdpa_cli"]):
        proc = run_process([*argv, "--version"], tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert __version__ in proc.stdout


@pytest.mark.e2e
def test_e2e_json_run(qkv: dict[str, F64], workdir: Path) -> None:
    proc = run_process([sdpa_executable(), "compute", *QKV, "--format", "json"], workdir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    data = strict_json(proc.stdout)
    expected = reference(qkv["q"], qkv["k"], qkv["v"], scale=1 / math.sqrt(E))
    np.testing.assert_allclose(np.array(data["weights"]), expected["weights"], atol=1e-12)


@pytest.mark.e2e
def test_e2e_python_m_bad_input(qkv: dict[str, F64], workdir: Path) -> None:
    for argv in ([sdpa_executable()], [sys.executable, "-m", "sdpa_cli"]):
        proc = run_process([*argv, "compute", *QKV, "--window", "1,2,3"], workdir)
        assert proc.returncode == 2
        assert proc.stdout == ""
        assert proc.stderr == "sdpa: error: --window: expected W or LEFT,RIGHT, got '1,2,3'\n"


@pytest.mark.e2e
def test_e2e_help_does_not_import_numpy(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from sdpa_cli.cli import COMMANDS, main\n"
        "for args in (['--help'], *([c, '--help'] for c in COMMANDS), ['report', 'merge', '--help'],\n"
        "             ['report', 'model', '--help']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, exc.code\n"
        "heavy = sorted(m for m in ('numpy', 'rich', 'yaml') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    proc = run_process([sys.executable, "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Example" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1] == "HEAVY="


def run_in_pty(args: Sequence[str], cwd: Path, **extra: str) -> bytes:
    """Run ``args`` with stdout on a pseudo-terminal; return what it wrote there."""
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    env = subprocess_env(TERM="xterm-256color", **extra)
    env.pop("COLUMNS", None)
    with subprocess.Popen(
        list(args), cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE, env=env
    ) as proc:
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO once the child has closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(master)
        assert proc.wait(timeout=60) == 0
    return b"".join(chunks)


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_e2e_terminal_gets_color(qkv: dict[str, F64], workdir: Path) -> None:
    out = run_in_pty([sdpa_executable(), "compute", *QKV, "--causal"], workdir)
    assert ANSI.encode() in out


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_e2e_no_color_env_on_a_terminal(qkv: dict[str, F64], workdir: Path) -> None:
    out = run_in_pty([sdpa_executable(), "compute", *QKV, "--causal"], workdir, NO_COLOR="1")
    assert out.strip()
    assert ANSI.encode() not in out


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_e2e_no_color_flag_on_a_terminal(qkv: dict[str, F64], workdir: Path) -> None:
    out = run_in_pty([sdpa_executable(), "compute", *QKV, "--causal", "--no-color"], workdir)
    assert out.strip()
    assert ANSI.encode() not in out


# --- findings ------------------------------------------------------------------------------

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def sample(name: str) -> str:
    return str(SAMPLES / name)


def test_json_findings_follow_the_contract() -> None:
    data = run_json(sample("scale_comparison.yaml"), "--scale", "none")
    kinds = {f["kind"] for f in data["findings"]}
    assert kinds == {"overflow", "unscaled", "saturated", "underflow"}
    (saturated,) = [f for f in data["findings"] if f["kind"] == "saturated"]
    assert saturated["severity"] == "warning"
    assert saturated["index"] == [0]
    assert saturated["stage"] == "weights"
    assert saturated["details"]["key"] == 2
    assert saturated["details"]["max_weight"] == pytest.approx(1.0)
    assert "1/√d_k" in saturated["hint"]
    (underflow,) = [f for f in data["findings"] if f["kind"] == "underflow"]
    # weights [2.6e-56, 1.6e-28, 1]: two flush to zero in float16.
    assert (underflow["dtype"], underflow["count"], underflow["severity"]) == ("float16", 2, "info")
    for f in data["findings"]:
        assert list(f)[:3] == ["kind", "severity", "message"]
        assert f["severity"] in ("info", "warning", "error")
    assert data["finding_counts"] == {"overflow": 1, "unscaled": 1, "saturated": 1, "underflow": 1}
    assert data["findings_truncated"] is False
    assert data["headroom_bits"]["float16"]["raw"] == pytest.approx(math.log2(65504 / 128))


def test_max_findings_lists_fewer_and_counts_all(workdir: Path) -> None:
    x = np.zeros((6, 4))  # every row uniform: six near-uniform rows, one dead head
    for name in "qkv":
        np.save(workdir / f"{name}.npy", x)
    data = run_json(*QKV, "--max-findings", "2")
    uniform = [f for f in data["findings"] if f["kind"] == "near_uniform"]
    assert [f["index"] for f in uniform] == [[0], [1]]
    assert data["finding_counts"]["near_uniform"] == 6
    assert data["finding_counts"]["dead_head"] == 1
    assert data["findings_truncated"] is True


def test_emulation_reports_the_first_stage_that_overflowed() -> None:
    data = run_json(sample("fp16_overflow.yaml"), "--dtype", "float16")
    emulation = data["emulation"]
    assert emulation["dtype"] == "float16"
    assert emulation["accumulate"] == "float32"
    assert emulation["first_problem"] == {"stage": "raw", "problem": "overflowed"}
    raw = next(f for f in data["findings"] if f["kind"] == "overflow" and f["stage"] == "raw")
    assert (raw["dtype"], raw["severity"], raw["count"]) == ("float16", "error", 2)
    assert data["output"][0] == ["NaN", "NaN"]  # the emulated kernel's answer


def test_prescale_keeps_the_raw_scores_in_range() -> None:
    data = run_json(sample("fp16_overflow.yaml"), "--dtype", "float16", "--prescale")
    assert data["emulation"]["first_problem"] is None
    assert data["options"]["prescale"] is True
    assert all(f["kind"] != "nonfinite" for f in data["findings"])
    # Q·√0.5 and K·√0.5 first: the raw product is the scaled logits, 33800.
    assert data["raw"][0][0] == pytest.approx(33800, rel=1e-3)


def test_dtype_takes_the_usual_aliases_and_reports_the_formats_name() -> None:
    # Regression: --dtype fp16 and bf16 were refused; they now mean float16, bfloat16.
    data = run_json(
        sample("scorecard.yaml"),
        "--dtype",
        "fp16",
        "--accumulate",
        "half",
        "--softmax-dtype",
        "fp32",
    )
    assert data["options"]["dtype"] == "float16"
    assert data["options"]["accumulate"] == "float16"
    assert data["options"]["softmax_dtype"] == "float32"
    assert run_json(sample("scorecard.yaml"), "--dtype", "bf16")["options"]["dtype"] == "bfloat16"


def test_an_unknown_dtype_is_refused_with_the_formats_names() -> None:
    line = assert_one_error_line(invoke("compute", sample("scorecard.yaml"), "--dtype", "fp12"))
    assert line == (
        "sdpa: error: --dtype: expected one of float64, float32, float16, bfloat16, "
        "float8_e4m3fn, float8_e5m2, got 'fp12'"
    )


def test_without_dtype_there_is_no_emulation_report() -> None:
    data = run_json(sample("scorecard.yaml"))
    assert data["emulation"] is None
    assert data["findings"] == []


def test_table_marks_flagged_rows_and_shows_the_panel() -> None:
    result = invoke("compute", sample("scale_comparison.yaml"), "--stages", "weights")
    assert result.exit_code == 0  # findings never fail compute
    assert "one-hot" in result.stdout
    assert "findings: " in result.stdout
    assert "saturated (1 row)" in result.stdout


def test_a_clean_run_says_there_are_no_findings() -> None:
    result = invoke("compute", sample("scorecard.yaml"))
    assert "findings  none" in result.stdout


def test_sdpa_yaml_thresholds_apply(qkv: dict[str, F64], workdir: Path) -> None:
    # The scorecard's one row has max weight 0.8816: one-hot only below that threshold.
    (workdir / "sdpa.yaml").write_text("saturation: 0.85\n")
    data = run_json(sample("scorecard.yaml"))
    assert [f["kind"] for f in data["findings"]] == ["saturated"]
    assert data["thresholds"]["saturation"] == 0.85
    data = run_json(sample("scorecard.yaml"), "--saturation", "0.9")  # the flag wins
    assert data["findings"] == []


def test_pyproject_tool_sdpa_thresholds_apply(workdir: Path) -> None:
    (workdir / "pyproject.toml").write_text("[tool.sdpa]\nsaturation = 0.85\n")
    data = run_json(sample("scorecard.yaml"))
    assert [f["kind"] for f in data["findings"]] == ["saturated"]


def test_a_bad_config_file_is_one_error_line(workdir: Path) -> None:
    (workdir / "sdpa.yaml").write_text("saturaton: 0.9\n")
    line = assert_one_error_line(invoke("compute", sample("scorecard.yaml")))
    assert line.startswith("sdpa: error: ")
    assert "sdpa.yaml: saturaton: unknown setting" in line


def test_max_findings_zero_still_says_what_was_counted(workdir: Path) -> None:
    x = np.zeros((4, 2))  # four uniform rows and a dead head
    for name in "qkv":
        np.save(workdir / f"{name}.npy", x)
    result = invoke("compute", *QKV, "--max-findings", "0")
    assert "none listed (--max-findings 0): 4 near uniform" in result.stdout
    assert "findings  none" not in result.stdout


# --- conventions: bare commands, usage errors, exports, help ---------------------------


def test_bare_sdpa_prints_the_help_on_stdout_and_exits_0() -> None:
    result = invoke()
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Usage: sdpa [OPTIONS] COMMAND [ARGS]...")
    assert "Commands:" in result.stdout
    assert result.stderr == ""


def test_bare_sdpa_report_prints_its_help() -> None:
    result = invoke("report")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Usage: sdpa report [OPTIONS] COMMAND [ARGS]...")
    assert "merge" in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("args", "first", "command"),
    [
        (("check", "--bogus"), "No such option '--bogus'.", "sdpa check"),
        (("compute",), "Missing argument 'Q K V | CASE'.", "sdpa compute"),
        (("compute", *QKV, "--max-rows", "0"), "Invalid value for '--max-rows'", "sdpa compute"),
        (("report", "merge"), "Missing argument 'SHARD.json...'.", "sdpa report merge"),
        (("nonesuch",), "No such command 'nonesuch'.", "sdpa"),
    ],
)
def test_a_usage_error_names_the_commands_help(
    qkv: dict[str, F64], args: tuple[str, ...], first: str, command: str
) -> None:
    result = invoke(*args)
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stdout == ""
    error, try_line = result.stderr.splitlines()
    assert error.startswith(f"sdpa: error: {first}")
    assert try_line == f"Try '{command} --help' for help."


def test_a_bad_input_has_no_try_line(workdir: Path) -> None:
    line = assert_one_error_line(invoke("compute", "missing.npy"))
    assert "Try" not in line
    assert invoke("compute", "missing.npy").stderr.count("\n") == 1


def test_head_fraction_help_is_a_whole_sentence() -> None:
    text = " ".join(invoke("compute", "--help-all").stdout.split())
    assert (
        "--head-fraction F Flag a head when at least this fraction of its rows is flagged "
        "the same way: one-hot (collapsed head), near-uniform (dead head), or, in sdpa "
        "grad, vanishing (default 0.9)."
    ) in text


def test_the_output_of_a_dropout_run_reads_the_dropped_weights(qkv: dict[str, F64]) -> None:
    plain = invoke("compute", *QKV, "--stages", "output").stdout
    dropped = invoke("compute", *QKV, "--dropout", "0.5", "--stages", "output").stdout
    assert "output  weights · V" in plain
    assert "output  dropped · V" in dropped
    assert "weights · V" not in dropped


def exported(workdir: Path, stem: str) -> tuple[str, str]:
    """The SVG and the HTML page written as ``stem.svg``, ``stem.html``."""
    svg = (workdir / f"{stem}.svg").read_text(encoding="utf-8")
    html = (workdir / f"{stem}.html").read_text(encoding="utf-8")
    assert svg.startswith("<svg")
    assert "</svg>" in svg
    assert html.lstrip().startswith("<!DOCTYPE html>")
    return svg, html


@pytest.mark.parametrize(
    ("command", "extra", "words"),
    [
        ("compute", ("--stages", "weights"), ("softmax", "over", "keys")),
        ("compute", ("--frameworks",), ("torch", "flash")),
        ("grad", (), ("dQ",)),
        ("check", (), ("findings.nonfinite", "PASS")),
        ("inspect", (), ("q.npy", "float64")),
    ],
)
@pytest.mark.parametrize("fmt", ["table", "json"])
def test_exports_of_every_command(
    workdir: Path,
    qkv: dict[str, F64],
    command: str,
    extra: tuple[str, ...],
    words: tuple[str, ...],
    fmt: str,
) -> None:
    """Written as explain writes them, in color, beside tables or JSON on stdout."""
    args = ["--export-svg", "t.svg", "--export-html", "t.html", "--format", fmt]
    result = invoke(command, *QKV, *extra, *args)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    svg, html = exported(workdir, "t")
    for word in words:
        assert word in html  # the SVG places text in runs, not always whole words
        if fmt == "table":
            assert word in result.stdout
    if fmt == "json":
        assert isinstance(json.loads(result.stdout), dict)
    assert "<span" in svg or "<text" in svg
    assert "color: #" in html  # in color, though stdout is no terminal


@pytest.mark.parametrize("command", ["compute", "grad", "check", "inspect"])
def test_an_export_onto_an_input_is_refused_and_nothing_runs(
    workdir: Path, qkv: dict[str, F64], command: str
) -> None:
    before = (workdir / "k.npy").read_bytes()
    line = assert_one_error_line(invoke(command, *QKV, "--export-html", "k.npy"))
    assert line.startswith("sdpa: error: --export-html k.npy: is the same file as the input")
    assert (workdir / "k.npy").read_bytes() == before


def test_two_exports_onto_one_file_are_refused(workdir: Path, qkv: dict[str, F64]) -> None:
    line = assert_one_error_line(
        invoke("grad", *QKV, "--export-svg", "x.out", "--export-html", "x.out")
    )
    assert "--export-html x.out" in line
    assert not (workdir / "x.out").exists()


def test_inspect_writes_no_export_when_a_file_cannot_be_read(
    workdir: Path, qkv: dict[str, F64]
) -> None:
    result = invoke("inspect", "q.npy", "missing.npy", "--export-svg", "t.svg")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert "q.npy" in result.stdout
    assert not (workdir / "t.svg").exists()
