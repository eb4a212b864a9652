"""``--sinks`` through the commands: the error line, case files, check and grad."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from clirunner import assert_one_error_line, invoke, strict_json


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """gpt-oss's eager attention in float64: the sink as one more softmax column."""
    s = np.einsum("hle,hse->hls", q, k) / math.sqrt(q.shape[-1])
    m = np.maximum(s.max(-1, keepdims=True), sinks[:, None, None])
    e = np.exp(s - m)
    out: np.ndarray = (e / (e.sum(-1, keepdims=True) + np.exp(sinks[:, None, None] - m))) @ v
    return out


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    rng = np.random.default_rng(5)
    arrays = {
        "q": rng.standard_normal((2, 3, 4)),
        "k": rng.standard_normal((2, 5, 4)),
        "v": rng.standard_normal((2, 5, 4)),
        "sinks": np.array([2.0, -0.5]),
    }
    arrays["out"] = _reference(arrays["q"], arrays["k"], arrays["v"], arrays["sinks"])
    s = np.einsum("hle,hse->hls", arrays["q"], arrays["k"]) / 2.0
    sink = np.broadcast_to(arrays["sinks"][:, None, None], (*s.shape[:2], 1))
    both = np.concatenate([s, sink], axis=-1)
    top = both.max(-1)
    arrays["lse"] = top + np.log(np.exp(both - top[..., None]).sum(-1))
    paths = {}
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
        paths[name] = str(tmp_path / f"{name}.npy")
    return paths


def test_sinks_of_the_wrong_shape_are_one_error_line(files: dict[str, str], tmp_path: Path) -> None:
    np.save(tmp_path / "three.npy", np.zeros(3))
    qkv = (files["q"], files["k"], files["v"])
    line = assert_one_error_line(invoke("compute", *qkv, "--sinks", str(tmp_path / "three.npy")))
    assert line == "sdpa: error: --sinks: shape (3,), expected (H,) = (2,) or (1,)"


def test_check_reference_includes_the_sinks(files: dict[str, str]) -> None:
    qkv = (files["q"], files["k"], files["v"])
    expect = ("--expect-output", files["out"], "--expect-lse", files["lse"])
    assert invoke("check", *qkv, "--sinks", files["sinks"], *expect).exit_code == 0
    assert invoke("check", *qkv, *expect).exit_code == 1


def test_a_case_file_holds_sinks(files: dict[str, str], tmp_path: Path) -> None:
    case = tmp_path / "case.json"
    keys = ("q", "k", "v", "sinks")
    case.write_text(json.dumps({n: files[n] for n in keys}), encoding="utf-8")
    result = invoke("check", str(case), "--expect-output", files["out"])
    assert result.exit_code == 0, result.output


def test_grad_reports_and_saves_dsinks(files: dict[str, str], tmp_path: Path) -> None:
    qkv = (files["q"], files["k"], files["v"])
    sinks = ("--sinks", files["sinks"])
    result = invoke("grad", *qkv, *sinks, "--format", "json")
    assert result.exit_code == 0, result.output
    data = strict_json(result.stdout)
    assert len(data["gradients"]["dsinks"]) == 2
    assert data["options"]["sinks"] == [2.0, -0.5]
    saved = tmp_path / "grads.npz"
    assert invoke("grad", *qkv, *sinks, "--save", str(saved)).exit_code == 0
    with np.load(saved) as z:
        np.testing.assert_allclose(z["dsinks"], data["gradients"]["dsinks"], rtol=1e-12)


def test_a_manifest_case_holds_sinks(files: dict[str, str], tmp_path: Path) -> None:
    manifest = tmp_path / "checks.yaml"
    case = {n: files[n] for n in ("q", "k", "v", "sinks")}
    manifest.write_text(
        json.dumps({"cases": [{"name": "sink", **case, "expect-output": files["out"]}]}),
        encoding="utf-8",
    )
    result = invoke("check", "--manifest", str(manifest))
    assert result.exit_code == 0, result.output
    refused = invoke("check", "--manifest", str(manifest), "--sinks", files["sinks"])
    assert refused.exit_code == 2
