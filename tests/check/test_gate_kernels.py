"""`sdpa check`'s default verdict on real kernels: a small, fast subset of `make bench-gate`.

Faithful exports of PyTorch's CPU SDPA (fused and math) and of Hugging Face's eager
attention in a tiny random Gemma 2 pass `sdpa check` with no tolerance flag; three bugs
injected into them fail it (issue 17). The exports come from bench/gate_kernels.py, whose
own mapping (flags, masks, the float64 reference) is tested here first, apart from sdpa.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from clirunner import invoke

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    """A module of bench/, which import one another by their plain names."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


gk = load("gate_kernels")


def case(key: str) -> Any:
    """The case KERNEL/DTYPE/NAME of gate_kernels."""
    found = [c for c in gk.torch_cases() + gk.hf_cases() if c.key == key]
    assert found, key
    return found[0]


def verdict(export: Any, folder: Path, base: Any = None) -> tuple[int, dict[str, Any]]:
    """`sdpa check` on the export as the benchmark runs it: exit code and JSON report."""
    paths = gk.save(export, folder, base)
    result = invoke(*gk.check_args(paths, export.flags), "--format", "json")
    return result.exit_code, json.loads(result.stdout)["cases"][0]  # the one case


def said(report: dict[str, Any]) -> list[str]:
    return [f"{c['name']} {c['status']}: {c['summary']}" for c in report["checks"]]


# ---------------------------------------------------------------------------- the exports


@pytest.mark.parametrize(
    "key", ["torch-flash/bfloat16/causal", "torch-math/float16/decode-lower-right"]
)
def test_faithful_exports_are_close_to_float64_and_bugs_are_not(key: str) -> None:
    c = case(key)
    faithful = c.run(None)
    exact = gk.attention64(faithful)
    assert gk.relative_error(faithful, exact) < 1e-2
    for bug in c.bugs:
        assert gk.relative_error(c.run(bug), exact) > 0.1, bug


def test_export_bugs_change_what_they_say() -> None:
    faithful = case("torch-flash/bfloat16/causal").run(None)
    exact = gk.attention64(faithful)
    out = faithful.arrays["out"].astype(np.float64)

    rolled = gk.inject(faithful, gk.ROW_ROLL, exact).arrays["out"].astype(np.float64)
    changed = np.argwhere((rolled != out).any(axis=-1))
    assert changed.tolist() == [[0, 0, out.shape[-2] // 2]]

    shifted = gk.inject(faithful, gk.shift_bug(8), exact).arrays["out"].astype(np.float64)
    b, h = gk.SHIFTED
    rms = gk.head_rms_error(faithful, exact)[b, h]
    assert np.mean(shifted[b, h] - out[b, h]) == pytest.approx(8 * rms, rel=0.1)
    assert np.array_equal(np.delete(shifted, h, axis=1), np.delete(out, h, axis=1))

    claimed = gk.inject(faithful, gk.BF16_AS_F32, exact)
    assert "--dtype" in faithful.flags
    assert "--dtype" not in claimed.flags
    assert claimed.arrays["out"] is faithful.arrays["out"]


def test_the_lower_right_case_says_so_and_gives_the_kernel_its_mask() -> None:
    export = case("torch-flash/float16/decode-lower-right").run(None)
    assert export.flags == ("--causal", "--causal-align", "lower-right")
    assert export.arrays["q"].shape[-2] < export.arrays["k"].shape[-2]
    assert "lse" in export.arrays  # the fused op's output equals F.sdpa's


# ---------------------------------------------------------------------------- the verdicts


@pytest.mark.parametrize(
    "key",
    [
        "torch-flash/bfloat16/causal",
        "torch-math/float16/gqa-causal",
        "torch-flash/float16/decode-lower-right",
    ],
)
def test_a_faithful_torch_export_passes_by_default(key: str, tmp_path: Path) -> None:
    code, report = verdict(case(key).run(None), tmp_path)
    assert code == 0, said(report)


def test_a_faithful_gemma2_export_passes_by_default(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    export = case("hf-gemma2/bfloat16/layer0-sliding-softcap").run(None)
    assert export.flags == (
        "--scale",
        "0.125",
        "--softcap",
        "5.0",
        "--causal",
        "--window",
        "15,0",
        "--dtype",
        "bfloat16",
    )
    code, report = verdict(export, tmp_path)
    assert code == 0, said(report)


def test_the_scale_1_over_dk_fails_by_default(tmp_path: Path) -> None:
    code, report = verdict(case("torch-flash/float16/causal").run(gk.SCALE_DK), tmp_path)
    assert code == 1, said(report)


def test_a_rolled_row_fails_by_default(tmp_path: Path) -> None:
    faithful = case("torch-math/bfloat16/causal").run(None)
    paths = gk.save(faithful, tmp_path / "faithful")
    bug = gk.inject(faithful, gk.ROW_ROLL, gk.attention64(faithful))
    code, report = verdict(bug, tmp_path / "bug", (faithful, paths))
    assert code == 1, said(report)


def test_a_bfloat16_kernel_claimed_as_float32_fails_by_default(tmp_path: Path) -> None:
    faithful = case("torch-flash/bfloat16/causal").run(None)
    bug = gk.inject(faithful, gk.BF16_AS_F32, gk.attention64(faithful))
    code, report = verdict(bug, tmp_path)
    assert code == 1, said(report)
    assert report["export_dtype"] == "float32"
