"""``sdpa check`` of FP8 exports with descales: FlashAttention-3's FP8 forward
(bench/gate_fp8.py: blocked, its online softmax rounding each key block's P to e4m3
against the running max) passes the kernel-relative rule by default, judged against
the plain computation in FP8 (P rounded against the final max, engine/fp8.py) with
bfloat16's floor; the kernel's slips with the descales fail it.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from clirunner import invoke
from flash_reference import attention_ref

from sdpa_cli.check.compare import FACTOR
from sdpa_cli.check.records import Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.engine.grad_plain import plain_backward
from sdpa_cli.engine.inputs import load_spec
from sdpa_cli.errors import SpecError

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    """A module of bench/, which import one another by their plain names."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


fp8 = load("gate_fp8")
gk = load("gate_kernels")

# small: two key blocks of the kernel's online softmax, grouped-query, causal at the
# bottom right; and per tensor, one key block and a half
PER_HEAD = fp8.Shape(2, 4, 2, 48, 192, 32, causal=True, per_head=True)
PER_TENSOR = fp8.Shape(1, 2, 2, 32, 160, 64, causal=False, per_head=False)


def export(shape: Any, bug: str | None = None, seed: int = 5) -> tuple[dict[str, Any], list[str]]:
    """The kernel's arrays (q, k, v, out, lse, and the per-head descales) and the flags."""
    arrays = fp8.inputs(shape, seed)
    out, lse = fp8.fa3_fp8_forward(arrays, shape.embed**-0.5, shape.causal, bug)
    flags = ["--dtype", "float8_e4m3fn"]
    if shape.causal:
        flags += ["--causal", "--causal-align", "lower-right"]
    saved = {n: arrays[n] for n in "qkv"}
    for n in gk.DESCALE_ARRAYS:
        if shape.per_head:
            saved[n] = arrays[n]
        else:
            flags += [f"--{n.replace('_', '-')}", repr(float(arrays[n][0, 0]))]
    return {**saved, "out": out, "lse": lse}, flags


def verdict(arrays: dict[str, Any], flags: list[str], folder: Path) -> tuple[int, dict[str, Any]]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, values in arrays.items():
        paths[name] = folder / f"{name}.npy"
        np.save(paths[name], values)
    args = gk.check_args(paths, flags)
    result = invoke(*args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)["cases"][0]


def close(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"] if c["name"].endswith(".close")}


def test_the_kernel_emulation_is_flash_attentions_reference() -> None:
    """Without its slips the blocked kernel is FlashAttention's attention_ref with the
    descales and P in e4m3 to within P's roundings (a running max rounds P otherwise):
    an RMS difference under a tenth of the output's RMS, and LSE to float32's."""
    arrays = fp8.inputs(PER_HEAD, 5)
    out, _lse = fp8.fa3_fp8_forward(arrays, PER_HEAD.embed**-0.5, True)
    q, k, v = (np.swapaxes(np.asarray(arrays[n], np.float64), 1, 2) for n in "qkv")
    want = attention_ref(
        q,
        k,
        v,
        causal=True,
        q_descale=arrays["q_descale"],
        k_descale=arrays["k_descale"],
        v_descale=arrays["v_descale"],
        p_format=ml_dtypes.float8_e4m3fn,
    )
    err = np.swapaxes(out, 1, 2) - want
    assert np.sqrt(np.mean(err**2)) < 0.1 * np.sqrt(np.mean(want**2))


@pytest.mark.parametrize("shape", [PER_HEAD, PER_TENSOR], ids=["per-head", "per-tensor"])
def test_a_faithful_fp8_export_passes_by_default(shape: Any, tmp_path: Path) -> None:
    """Judged in bfloat16 (the kernel's output), against the plain FP8 computation,
    within the factor: measured, the running max's P roughly matches the final max's
    (the largest error per slice 1 to 1.25× the plain computation's)."""
    code, report = verdict(*export(shape), tmp_path)
    assert code == 0, report["checks"]
    checks = close(report)
    assert set(checks) == {"output.close", "lse.close"}
    assert checks["output.close"]["factor_needed"] < 0.75 * FACTOR
    assert "bfloat16" in checks["output.close"]["tolerance"]["source"]


@pytest.mark.parametrize("bug", fp8.BUGS)
def test_a_descale_slip_fails(bug: str, tmp_path: Path) -> None:
    code, report = verdict(*export(PER_HEAD, bug), tmp_path)
    assert code == 1
    assert close(report)["output.close"]["status"] == "fail"


def test_the_plain_fp8_computation_rounds_p_so_the_allowance_is_realistic(
    tmp_path: Path,
) -> None:
    """The plain computation's error is P's e4m3 rounding (a few percent of a row's
    scale), not bfloat16's alone: a check that judged against a bfloat16 kernel's
    plain computation would fail the faithful kernel."""
    arrays, flags = export(PER_TENSOR)
    for n in "qkv":
        np.save(tmp_path / f"{n}.npy", arrays[n])
    tensors = {n: flags[flags.index(f"--{n.replace('_', '-')}") + 1] for n in gk.DESCALE_ARRAYS}
    paths = tuple(str(tmp_path / f"{n}.npy") for n in "qkv")
    spec, _ = load_spec(paths, tensors, {"dtype": "float8_e4m3fn"})
    report = run_checks(spec, [Expected("output", arrays["out"], "out.npy")])
    details = next(c for c in report.checks if c.name == "output.close").details
    assert details is not None
    plain, rms = details["plain_rms_error"], details["rms_error"]
    assert plain is not None
    assert 0.5 < rms / plain < 2
    scale = float(np.sqrt(np.mean(np.asarray(arrays["out"], np.float64) ** 2)))
    assert plain > 4 * 2.0**-9 * scale  # well above bfloat16's own rounding


def test_without_dtype_the_descales_say_the_export_is_fp8(tmp_path: Path) -> None:
    """The inputs are FP8 with descales: the export's format is theirs, not the
    bfloat16 output file's (judged as a bfloat16 kernel, the faithful FP8 one fails)."""
    arrays, flags = export(PER_HEAD)
    flags = [f for f in flags if f not in ("--dtype", "float8_e4m3fn")]
    code, report = verdict(arrays, flags, tmp_path)
    assert code == 0, report["checks"]
    assert report["export_dtype"] == "float8_e4m3fn"


def test_an_fp8_kernels_gradients_are_not_emulated(tmp_path: Path) -> None:
    arrays, _ = export(PER_TENSOR)
    for n in "qkv":
        np.save(tmp_path / f"{n}.npy", arrays[n])
    paths = tuple(str(tmp_path / f"{n}.npy") for n in "qkv")
    spec, _ = load_spec(paths, {"k_descale": "0.01"}, {"dtype": "float8_e4m3fn"})
    with pytest.raises(SpecError, match="FP8 with descales has no backward kernel"):
        plain_backward(spec, np.ones(spec.output_shape))


@pytest.mark.parametrize("quoted", [False, True])
def test_a_manifest_takes_descales_as_numbers_and_files(tmp_path: Path, quoted: bool) -> None:
    """Per tensor, numbers (`q-descale: 0.01`, or quoted, `"0.01"`: a number still, not a
    file beside the manifest); per head, files relative to the manifest."""
    lines = ["defaults:\n  dtype: float8_e4m3fn\ncases:\n"]
    for name, shape in (("per-tensor", PER_TENSOR), ("per-head", PER_HEAD)):
        arrays, flags = export(shape)
        folder = tmp_path / name
        folder.mkdir()
        entry = f"  - name: {name}\n"
        for key, values in arrays.items():
            np.save(folder / f"{key}.npy", values)
            option = {"out": "expect-output", "lse": "expect-lse"}.get(key, key)
            entry += f"    {option.replace('_', '-')}: {name}/{key}.npy\n"
        for i, flag in enumerate(flags):
            if flag.endswith("descale"):
                value = f'"{flags[i + 1]}"' if quoted else flags[i + 1]
                entry += f"    {flag.removeprefix('--')}: {value}\n"
        if shape.causal:
            entry += "    causal: true\n    causal-align: lower-right\n"
        lines.append(entry)
    manifest = tmp_path / "m.yaml"
    manifest.write_text("".join(lines))
    result = invoke("check", "--manifest", str(manifest), "--format", "json")
    assert result.exit_code == 0, result.stdout
    cases = json.loads(result.stdout)["cases"]
    assert [(c["name"], c["passed"]) for c in cases] == [("per-tensor", True), ("per-head", True)]


def test_an_fp8_kernel_holds_no_score_in_fp8_but_a_plain_fp8_run_does() -> None:
    """FlashAttention-3's FP8 kernel keeps its scores in float32: no score overflows
    e4m3 there (a false error before); a plain --dtype float8_e4m3fn run stores them in
    e4m3, and its overflow stays an error."""
    from sdpa_cli.diagnosis.rules import diagnose
    from sdpa_cli.engine.trace import trace

    sample = Path(__file__).parents[2] / "samples" / "fp8"
    kernel, _ = load_spec((str(sample / "fp8.yaml"),))
    plain, _ = load_spec(
        tuple(f"{sample / 'qkv.safetensors'}:{n}" for n in "qkv"),
        flags={"dtype": "float8_e4m3fn", "causal": True},
    )

    def fp8_severities(spec: Any) -> set[str]:
        found = diagnose(trace(spec, stages=())).findings
        return {f.severity for f in found if f.dtype == "float8_e4m3fn"}

    assert fp8_severities(kernel) <= {"info"}
    assert "error" in fp8_severities(plain)
