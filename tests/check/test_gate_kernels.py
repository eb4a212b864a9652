"""`sdpa check`'s default verdict on real kernels: a small, fast subset of `make bench-gate`.

Faithful exports of PyTorch's CPU SDPA (fused and math) and of Hugging Face's eager
attention in tiny random Gemma 2, BERT and ModernBERT models pass `sdpa check` with no
tolerance flag; bugs injected into them fail it (issue 17), and the slips of issue 32
(the causal mask transposed, a (B, L, H, E) export, packed documents leaking, an LSE in
base 2, the temperature forgotten) fail it with a hint that names them. The exports come
from bench/gate_kernels.py, whose own mapping (flags, masks, the float64 reference) is
tested here first, apart from sdpa. So are the backward exports (issue 33): backward64
against PyTorch's float64 autograd, the slips where they apply and what they change, a
faithful PyTorch and Mistral backward export passing and a dK without its scale failing
with its factor found.
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

torch = pytest.importorskip("torch")

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


# ---------------------------------------------------------------------------- backward


def backward_case(key: str) -> Any:
    """The backward case backward/KERNEL/DTYPE/NAME of gate_kernels."""
    every = gk.torch_backward_cases() + gk.eager_backward_cases() + gk.hf_backward_cases()
    found = [c for c in every if c.key == key]
    assert found, key
    return found[0]


def torch_float64_gradients(export: Any) -> dict[str, Any]:
    """dQ, dK, dV of Σ O ⊙ dO by PyTorch's float64 autograd on the export's inputs: a
    reference apart from backward64's numpy."""
    q, k, v = (
        torch.tensor(export.arrays[n], dtype=torch.float64, requires_grad=True) for n in "qkv"
    )
    mask = export.reference.visible
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * export.reference.scale
    if mask is not None:
        s = s.masked_fill(~torch.from_numpy(np.broadcast_to(mask, s.shape).copy()), -torch.inf)
    out = torch.softmax(s, dim=-1) @ v.repeat_interleave(group, 1)
    out.backward(torch.tensor(export.arrays["dout"], dtype=torch.float64))
    return {n: x.grad.numpy() for n, x in zip(("dq", "dk", "dv"), (q, k, v), strict=True)}


@pytest.mark.parametrize(
    "key",
    [
        "backward/torch-flash/float32/gqa-causal-seed37",
        "backward/torch-math/float16/bool-mask-seed47",
    ],
)
def test_backward64_is_pytorchs_float64_autograd_and_the_kernel_is_close(key: str) -> None:
    export = backward_case(key).run()
    assert export.backward
    assert export.name == f"{key}/faithful"
    assert set(export.arrays) >= {"q", "k", "v", "dout", "dq", "dk", "dv"}
    assert "out" not in export.arrays
    exact = gk.backward64(export)
    autograd = torch_float64_gradients(export)
    for name in gk.GRADIENTS:
        np.testing.assert_allclose(exact[name], autograd[name], rtol=1e-10, atol=1e-12)
    assert gk.gradient_error(export, exact) < (1e-5 if "float32" in key else 1e-3)


def test_each_backward_slip_changes_what_it_says() -> None:
    export = backward_case("backward/torch-flash/float16/gqa-causal-seed37").run()
    exact = gk.backward64(export)
    no_dropout = tuple(s for s in gk.BACKWARD_SLIPS if s != gk.DROPOUT_NOT_REPLAYED)
    assert gk.backward_slips(export) == (*no_dropout, *gk.DQ_SHIFT_SLIPS)

    def changed(slip: str) -> set[str]:
        arrays = gk.inject_backward(export, slip, exact).arrays
        return {n for n, a in arrays.items() if a is not export.arrays[n]}

    assert changed(gk.DK_NO_SCALE) == {"dk"}
    assert changed(gk.D_FORGOTTEN) == {"dq", "dk"}
    assert changed(gk.DV_UNNORMALISED) == {"dv"}
    assert changed(gk.MASK_FORGOTTEN) == changed(gk.BACKWARD_UNMASKED) == {"dq", "dk", "dv"}
    assert changed(gk.GQA_UNSUMMED) == {"dk", "dv"}
    assert changed(gk.dq_shift(2)) == {"dq"}

    dk = gk.inject_backward(export, gk.DK_NO_SCALE, exact).arrays["dk"].astype(np.float64)
    ratio = dk / export.arrays["dk"].astype(np.float64)
    assert np.nanmedian(ratio) == pytest.approx(8.0, rel=1e-3)  # 1/scale = √64

    shifted = gk.inject_backward(export, gk.dq_shift(4), exact).arrays["dq"].astype(np.float64)
    moved = np.argwhere(np.any(shifted != export.arrays["dq"], axis=(-2, -1)))
    assert moved.tolist() == [list(gk.SHIFTED)]

    # The slips in float64, before rounding: each is its formula.
    share = gk.backward64(export, gk.GQA_UNSUMMED)
    assert not np.allclose(share["dk"], exact["dk"])
    # Σ over keys of dV is Σ over rows of dO (per K/V head) only when the weights sum to 1.
    d_rows = export.arrays["dout"].astype(np.float64).sum(axis=-2).reshape(1, 2, 2, -1).sum(2)
    np.testing.assert_allclose(exact["dv"].sum(axis=-2), d_rows, rtol=1e-9, atol=1e-9)
    unnormalised = gk.backward64(export, gk.DV_UNNORMALISED)["dv"]
    assert not np.allclose(unnormalised.sum(axis=-2), d_rows, rtol=1e-3)
    no_d = gk.backward64(export, gk.D_FORGOTTEN)
    np.testing.assert_array_equal(no_d["dv"], exact["dv"])


def test_the_mask_slips_apply_to_masked_exports_and_the_group_slip_to_grouped_ones() -> None:
    full = backward_case("backward/torch-math/float32/full-seed17").run()
    assert gk.backward_slips(full) == (
        gk.DK_NO_SCALE,
        gk.D_FORGOTTEN,
        gk.DV_UNNORMALISED,
        *gk.DQ_SHIFT_SLIPS,
    )
    exact = gk.backward64(full)
    for slip in (gk.MASK_FORGOTTEN, gk.BACKWARD_UNMASKED):  # no mask: nothing to forget
        for name, a in gk.backward64(full, slip).items():
            np.testing.assert_allclose(a, exact[name], rtol=1e-12, atol=1e-12)
    masked = backward_case("backward/torch-math/float32/bool-mask-seed47").run()
    assert gk.MASK_FORGOTTEN in gk.backward_slips(masked)
    assert gk.GQA_UNSUMMED not in gk.backward_slips(masked)


def test_the_second_torch_seed_is_faithful_only() -> None:
    cases = {c.key: c.slips for c in gk.torch_backward_cases()}
    assert len(cases) == 2 * 3 * len(gk.TORCH_BACKWARD_CASES) * gk.BACKWARD_SEEDS
    assert cases["backward/torch-flash/float16/causal-seed27"]
    assert not cases["backward/torch-flash/float16/causal-seed28"]


@pytest.mark.parametrize(
    "key",
    [
        "backward/torch-flash/float32/causal-seed27",
        "backward/torch-math/bfloat16/gqa-causal-seed37",
    ],
)
def test_a_faithful_torch_backward_export_passes_by_default(key: str, tmp_path: Path) -> None:
    export = backward_case(key).run()
    code, report = verdict(export, tmp_path)
    assert code == 0, said(report)
    assert {"dq.close", "dk.close", "dv.close", "dv.sums"} <= {c["name"] for c in report["checks"]}


def test_a_dk_without_its_scale_fails_and_the_fit_finds_the_factor(tmp_path: Path) -> None:
    faithful = backward_case("backward/torch-flash/float16/causal-seed27").run()
    paths = gk.save(faithful, tmp_path / "faithful")
    slip = gk.inject_backward(faithful, gk.DK_NO_SCALE, gk.backward64(faithful))
    code, report = verdict(slip, tmp_path / "slip", (faithful, paths))
    assert code == 1, said(report)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["dk.close"]["status"] == "fail"
    assert checks["dq.close"]["status"] == checks["dv.close"]["status"] == "pass"
    fit = (checks["dk.close"].get("diagnosis") or checks["dk.close"]["details"]["diagnosis"])["fit"]
    assert fit["factor"] == pytest.approx(8.0, rel=1e-2)


def test_an_hf_eager_backward_export_is_its_forward_with_gradients(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    export = backward_case("backward/hf-mistral/float16/layer0-sliding").run()
    forward = case("hf-mistral/float16/layer0-sliding").run(None)
    assert export.flags == forward.flags == ("--causal", "--window", "15,0")
    for n in "qkv":
        np.testing.assert_array_equal(export.arrays[n], forward.arrays[n])
    assert export.arrays["dk"].shape == export.arrays["k"].shape == (2, 2, 64, 32)
    assert gk.gradient_error(export, gk.backward64(export)) < 1e-2
    code, report = verdict(export, tmp_path)
    assert code == 0, said(report)


def test_gemma2s_soft_capped_backward_is_among_the_cases() -> None:
    pytest.importorskip("transformers")
    cases, _ = gk.backward_cases()
    assert {c.key for c in cases if "gemma2" in c.key} >= {
        "backward/hf-gemma2/bfloat16/layer0-sliding-softcap",
        "backward/hf-gemma2/float32/layer1-global-softcap",
    }


@pytest.mark.parametrize("name", ["sinks", "dropout"])
def test_the_eager_backward_is_backward64_to_its_format(name: str) -> None:
    """Attention in PyTorch ops with gpt-oss's sinks, or dropout from a keep mask, in
    float32: its autograd gradients are the independent float64 recomputation's to
    float32's rounding; dropout's slip changes every gradient."""
    export = backward_case(f"backward/torch-eager/float32/{name}-seed17").run()
    exact = gk.backward64(export)
    assert gk.gradient_error(export, exact) < 1e-5
    if name == "dropout":
        assert gk.DROPOUT_NOT_REPLAYED in gk.backward_slips(export)
        slipped = gk.inject_backward(export, gk.DROPOUT_NOT_REPLAYED, exact)
        assert all(slipped.arrays[n] is not export.arrays[n] for n in gk.GRADIENTS)
        assert gk.gradient_error(slipped, exact) > 0.1
