"""`sdpa check`'s default verdict on real kernels: a small, fast subset of `make bench-gate`.

Faithful exports of PyTorch's CPU SDPA (fused and math) and of Hugging Face's eager
attention in tiny random Gemma 2, BERT and ModernBERT models pass `sdpa check` with no
tolerance flag; bugs injected into them fail it (issue 17), and the slips of issue 32
(the causal mask transposed, a (B, L, H, E) export, packed documents leaking, an LSE in
base 2, the temperature forgotten) fail it with a hint that names them. The exports come
from bench/gate_kernels.py, whose own mapping (flags, masks, the float64 reference) is
tested here first, apart from sdpa.
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
    found = [c for c in gk.torch_cases() + gk.hf_cases() + gk.noise_cases() if c.key == key]
    assert found, key
    return found[0]


def verdict(export: Any, folder: Path, base: Any = None) -> tuple[int, dict[str, Any]]:
    """`sdpa check` on the export as the benchmark runs it: exit code and JSON report."""
    paths = gk.save(export, folder, base)
    result = invoke(*gk.check_args(paths, export.flags), "--format", "json")
    return result.exit_code, json.loads(result.stdout)["cases"][0]  # the one case


def said(report: dict[str, Any]) -> list[str]:
    return [f"{c['name']} {c['status']}: {c['summary']}" for c in report["checks"]]


def hints(report: dict[str, Any]) -> list[str]:
    return [c["hint"] for c in report["checks"] if c.get("hint")]


def injected(key: str, bug: str, tmp_path: Path) -> tuple[int, dict[str, Any]]:
    """The verdict on `bug` injected into the faithful export of case `key`."""
    faithful = case(key).run(None)
    paths = gk.save(faithful, tmp_path / "faithful")
    export = gk.inject(faithful, bug, gk.attention64(faithful))
    return verdict(export, tmp_path / bug, (faithful, paths))


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


def test_the_layout_bugs_transpose_what_they_say_and_the_base_2_lse_divides() -> None:
    faithful = case("torch-flash/float16/causal").run(None)
    exact = gk.attention64(faithful)
    a = faithful.arrays

    whole = gk.inject(faithful, gk.LAYOUT_BSHD, exact).arrays
    assert set(whole) == {"q", "k", "v", "out"}  # the LSE left out
    for n in "qkv":
        assert np.array_equal(whole[n], np.swapaxes(a[n], 1, 2))
    assert np.array_equal(whole["out"], np.swapaxes(a["out"], 1, 2))

    alone = gk.inject(faithful, gk.OUTPUT_BSHD, exact).arrays
    assert alone["out"].shape == (1, 128, 4, 64)
    assert all(alone[n] is a[n] for n in ("q", "k", "v", "lse"))
    assert gk.expected_exit(gk.OUTPUT_BSHD) == 2
    assert gk.expected_exit(gk.LAYOUT_BSHD) == gk.expected_exit(gk.LSE_BASE2) == 1

    lse = gk.inject(faithful, gk.LSE_BASE2, exact).arrays["lse"]
    np.testing.assert_allclose(lse * np.log(2.0), a["lse"], rtol=1e-6)


def test_the_export_bugs_go_where_they_apply() -> None:
    # A mask file, or L ≠ S, leaves (B, L, H, E) Q, K and V no computation to read.
    for key, expected in [
        ("torch-flash/float16/causal", True),
        ("torch-flash/float16/bool-mask", False),
        ("torch-flash/float16/decode-lower-right", False),
        ("torch-flash/float16/packed-documents", False),
    ]:
        bugs = gk.export_bugs(case(key).run(None))
        assert (gk.LAYOUT_BSHD in bugs) is expected, key
        assert gk.OUTPUT_BSHD in bugs
        assert gk.LSE_BASE2 in bugs
    assert gk.LSE_BASE2 not in gk.export_bugs(case("torch-math/float16/causal").run(None))


def test_the_packed_and_temperature_cases_describe_their_kernels() -> None:
    packed = case("torch-math/float32/packed-documents")
    export = packed.run(None)
    assert export.flags == ("--causal",)
    assert export.arrays["segments"].tolist() == [0] * 40 + [1] * 50 + [2] * 38
    exact = gk.attention64(export)
    assert gk.relative_error(export, exact) < 1e-5
    assert gk.relative_error(packed.run(gk.SEGMENTS_IGNORED), exact) > 0.1

    warm = case("torch-math/float32/temperature")
    export = warm.run(None)
    assert export.flags == ("--temperature", "2")
    assert export.reference.scale == pytest.approx(64**-0.5 / 2)
    exact = gk.attention64(export)
    assert gk.relative_error(export, exact) < 1e-5
    for bug in (gk.TEMPERATURE_FORGOTTEN, gk.SCALE_DK):
        assert gk.relative_error(warm.run(bug), exact) > 0.1, bug


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


# ---------------------------------------------------------------------------- issue 32


@pytest.mark.parametrize(
    ("key", "bug", "words"),
    [
        ("torch-flash/float16/causal", gk.CAUSAL_TRANSPOSED, "the causal mask transposed"),
        ("torch-math/float16/packed-documents", gk.SEGMENTS_IGNORED, "leaks across the packed"),
        ("torch-flash/bfloat16/temperature", gk.TEMPERATURE_FORGOTTEN, "no --temperature"),
    ],
)
def test_a_computed_slip_fails_with_a_hint_that_names_it(
    key: str, bug: str, words: str, tmp_path: Path
) -> None:
    c = case(key)
    code, report = verdict(c.run(None), tmp_path / "faithful")
    assert code == 0, said(report)
    code, report = verdict(c.run(bug), tmp_path / bug)
    assert code == 1, said(report)
    assert any(words in h for h in hints(report)), hints(report)


@pytest.mark.parametrize(
    ("bug", "words"), [(gk.LAYOUT_BSHD, "--layout bshd"), (gk.LSE_BASE2, "base 2")]
)
def test_an_export_slip_fails_with_a_hint_that_names_it(
    bug: str, words: str, tmp_path: Path
) -> None:
    code, report = injected("torch-flash/float16/causal", bug, tmp_path)
    assert code == 1, said(report)
    assert any(words in h for h in hints(report)), hints(report)


def test_an_output_alone_saved_bshd_is_refused_naming_the_layout(tmp_path: Path) -> None:
    faithful = case("torch-flash/float16/causal").run(None)
    export = gk.inject(faithful, gk.OUTPUT_BSHD, gk.attention64(faithful))
    result = invoke(*gk.check_args(gk.save(export, tmp_path), export.flags), "--format", "json")
    assert result.exit_code == 2
    assert "--layout bshd" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "key",
    ["hf-bert/float16/layer0-padded-seed17", "hf-modernbert/float32/layer1-local-padded-seed17"],
)
def test_a_faithful_encoder_export_passes_with_its_weights(key: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    c = case(key)
    assert c.bugs == ()  # faithful only
    assert not c.inject
    export = c.run(None)
    assert export.arrays["q"].shape == (2, 4, 9, 8)
    assert export.arrays["weights"].shape == (2, 4, 9, 9)
    assert export.flags == ()  # the mask file says it all
    code, report = verdict(export, tmp_path)
    assert code == 0, said(report)
    assert [c["name"] for c in report["checks"] if c["name"].endswith(".close")] == [
        "output.close",
        "weights.close",
    ]


def test_causal_random_data_raises_no_finding(tmp_path: Path) -> None:
    code, report = verdict(case("torch-flash/float16/causal-seed101").run(None), tmp_path)
    assert code == 0, said(report)
    assert report["findings"] == [], report["findings"]
    assert [c["status"] for c in report["checks"] if c["name"] == "findings"] == ["pass"]
