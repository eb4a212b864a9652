"""A backward kernel's exported dQ, dK and dV judged as the output is: against the float64
backward pass, by the kernel-relative rule with the plain backward computation in the
export's format as the yardstick.

PyTorch's own backward kernels (math and fused, on the CPU) are the witnesses: their
gradients pass, in float16, bfloat16 and float32, full, causal, with a boolean mask and
with grouped-query heads; the slips a backward kernel makes fail, each where it sits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clirunner import invoke
from numpy.typing import NDArray

from sdpa_cli.api.judge import judge
from sdpa_cli.check.gradients import GRADIENT_FACTORS, gradient_checks
from sdpa_cli.check.records import Check, Expected
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine.grad import backward, make_dout
from sdpa_cli.engine.grad_plain import plain_backward
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.errors import ExitCode, SpecError

torch = pytest.importorskip("torch")
attention_backends = pytest.importorskip("torch.nn.attention")

BACKENDS = {"math": "MATH", "fused": "FLASH_ATTENTION"}


def torch_backward(
    dtype: str,
    backend: str,
    *,
    heads: int = 4,
    kv_heads: int = 4,
    length: int = 48,
    keys: int = 48,
    causal: bool = False,
    masked: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Q, K, V, dO and the dQ, dK, dV of PyTorch's CPU backward (``backend``), as float32
    arrays holding ``dtype``'s values; the boolean mask when ``masked``."""
    g = torch.Generator().manual_seed(seed)
    t = getattr(torch, dtype)
    q = torch.randn(2, heads, length, 32, generator=g).to(t)
    k = torch.randn(2, kv_heads, keys, 32, generator=g).to(t)
    v = torch.randn(2, kv_heads, keys, 32, generator=g).to(t)
    dout = torch.randn(2, heads, length, 32, generator=g).to(t)
    mask = torch.rand(2, 1, length, keys, generator=g) < 0.8 if masked else None
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    kernel = getattr(attention_backends.SDPBackend, BACKENDS[backend])
    with attention_backends.sdpa_kernel(kernel):
        out = torch.nn.functional.scaled_dot_product_attention(
            *leaves, attn_mask=mask, is_causal=causal, enable_gqa=kv_heads != heads
        )
    out.backward(dout)
    arrays = {
        n: x.float().numpy() for n, x in zip(("q", "k", "v", "dout"), (q, k, v, dout), strict=True)
    }
    arrays |= {n: x.grad.float().numpy() for n, x in zip(("dq", "dk", "dv"), leaves, strict=True)}
    arrays["mask"] = None if mask is None else mask.numpy()
    return arrays


def judged(arrays: dict[str, Any], dtype: str, **options: Any) -> dict[str, Check]:
    spec = build_spec(
        arrays["q"],
        arrays["k"],
        arrays["v"],
        mask=arrays.get("mask"),
        options=parse_options({"dtype": dtype, **options}),
    )
    exports = [Expected(n, arrays[n], f"{n}.npy") for n in ("dq", "dk", "dv")]
    checks = gradient_checks(spec, exports, arrays["dout"], CheckSettings(), dtype)
    return {c.name: c for c in checks}


CASES: dict[str, dict[str, Any]] = {
    "full": {},
    "causal": {"causal": True},
    "masked": {"masked": True},
    "grouped_query": {"kv_heads": 2},
    "causal_decode": {"causal": True, "length": 16, "keys": 48},
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_pytorchs_backward_kernels_pass(dtype: str, backend: str, case: str) -> None:
    shape = CASES[case]
    arrays = torch_backward(dtype, backend, **shape)
    causal = bool(shape.get("causal"))
    checks = judged(arrays, dtype, causal=causal)
    assert [n for n, c in checks.items() if c.status != "pass"] == []
    assert set(checks) == {
        "dq.finite",
        "dq.close",
        "dk.finite",
        "dk.close",
        "dv.finite",
        "dv.close",
        "dv.sums",
    }


def test_the_16_bit_kernels_stay_well_inside_the_plain_backwards_error() -> None:
    """The plain backward rounds dA, dS and the products to the format, as kernels do,
    but in its own order: PyTorch's fused kernel needs about 1 of its largest error per
    slice here (1.8 at most on slices of 5 to 48 rows), where the rule allows 3. (A
    slice within 3× the floor needs no plain computation: its factor is then read
    against the floor alone.)"""
    for dtype in ("float16", "bfloat16"):
        checks = judged(torch_backward(dtype, "fused", causal=True), dtype, causal=True)
        for name in ("dq", "dk", "dv"):
            assert checks[f"{name}.close"].details["factor_needed"] < 1.5


def test_float32_gradients_get_their_own_factor() -> None:
    assert GRADIENT_FACTORS == {"float16": 3.0, "bfloat16": 3.0, "float32": 8.0}
    checks = judged(torch_backward("float32", "fused"), "float32")
    close = checks["dq.close"]
    assert close.tolerance is not None
    assert "≤ 8× the plain float32 computation's largest error" in close.tolerance.source


def slipped(name: str, change: Any) -> dict[str, Check]:
    arrays = torch_backward("float16", "fused", causal=True)
    arrays[name] = change(arrays)
    return judged(arrays, "float16", causal=True)


def test_dk_without_the_scale_fails_and_its_factor_is_found() -> None:
    """dK = dSᵀ · Q without the 1/√E: the export is √32 × the reference everywhere."""
    checks = slipped("dk", lambda a: a["dk"] * np.sqrt(32.0))
    assert checks["dk.close"].status == "fail"
    fit = checks["dk.close"].details["diagnosis"]["fit"]
    assert fit["factor"] == pytest.approx(np.sqrt(32.0), rel=1e-3)
    assert checks["dq.close"].status == checks["dv.close"].status == "pass"


def test_the_mask_left_out_of_the_backward_fails_dq() -> None:
    full = torch_backward("float16", "fused")  # the same inputs, no causal mask
    checks = slipped("dq", lambda a: full["dq"])
    assert checks["dq.close"].status == "fail"
    assert checks["dq.close"].details["diagnosis"]["error"] == "structural"


def test_dv_from_unnormalised_weights_breaks_its_column_sums() -> None:
    """Σ over keys of dV must equal Σ over rows of dO (each row's weights sum to 1): a
    dV 10% too large breaks it, and the close check too."""
    checks = slipped("dv", lambda a: a["dv"] * 1.1)
    assert checks["dv.sums"].status == "fail"
    assert "where each row's weights sum to 1: dV is not Pᵀ·dO" in checks["dv.sums"].summary
    assert checks["dv.close"].status == "fail"


def test_grouped_query_dk_not_summed_over_the_group_fails() -> None:
    """dK of a K/V head that two query heads share is the sum of their two: the first
    head's share alone fails."""
    arrays = torch_backward("float16", "fused", kv_heads=2)
    whole = torch_backward("float16", "fused", kv_heads=2)
    arrays["dk"] = whole["dk"] / 2  # as if one query head's share only (in expectation)
    checks = judged(arrays, "float16")
    assert checks["dk.close"].status == "fail"


def test_a_gradient_needs_dout_and_its_inputs_shape() -> None:
    arrays = torch_backward("float16", "fused")
    spec = build_spec(
        arrays["q"], arrays["k"], arrays["v"], options=parse_options({"dtype": "float16"})
    )
    dq = Expected("dq", arrays["dq"], "dq.npy")
    with pytest.raises(SpecError, match=r"dq\.npy: is a gradient \(dq\): give --dout FILE"):
        gradient_checks(spec, [dq], None, CheckSettings(), "float16")
    wrong = Expected("dq", arrays["dq"][:, :2], "dq.npy")
    with pytest.raises(
        SpecError, match=r"dq\.npy: has shape \(2, 2, 48, 32\); dq is shaped as its input"
    ):
        gradient_checks(spec, [wrong], arrays["dout"], CheckSettings(), "float16")


def test_a_gradient_saved_in_flash_attentions_layout_is_named_so() -> None:
    """flash_attn's gradients are (B, L, H, E): beside (B, H, L, E) inputs the refusal
    says which axes to swap, as it does for an output."""
    arrays = torch_backward("float16", "fused")
    spec = build_spec(arrays["q"], arrays["k"], arrays["v"], options=parse_options({}))
    dk = Expected("dk", np.swapaxes(arrays["dk"], 1, 2), "dk.npy")
    with pytest.raises(SpecError, match=r"looks saved as \(B, L, H, E\) \(FlashAttention's"):
        gradient_checks(spec, [dk], arrays["dout"], CheckSettings(), "float16")


def test_the_plain_backward_in_float64_is_the_backward_pass() -> None:
    """With no format to round to, the plain backward computes what the float64 pass
    does, to rounding."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 9, 4)) for _ in range(3))
    spec: AttentionSpec = build_spec(q, k, v, options=parse_options({"causal": True}))
    dout: NDArray[np.float64] = rng.standard_normal((2, 3, 9, 4))
    exact = backward(spec, make_dout(spec, dout, 0, "--dout"))
    plain = plain_backward(spec, dout)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(plain[name], getattr(exact, name), rtol=1e-12, atol=1e-14)


def test_the_cli_and_a_manifest_judge_gradients(workdir: Path) -> None:
    arrays = torch_backward("float16", "fused", causal=True)
    for name in ("q", "k", "v", "dout", "dq", "dk", "dv"):
        np.save(workdir / f"{name}.npy", arrays[name])
    np.save(workdir / "dk_bad.npy", arrays["dk"] * 2)
    args = ("q.npy", "k.npy", "v.npy", "--causal", "--dtype", "float16", "--dout", "dout.npy")
    good = invoke(
        "check", *args, "--expect-dq", "dq.npy", "--expect-dk", "dk.npy", "--expect-dv", "dv.npy"
    )
    assert good.exit_code == ExitCode.OK, good.output
    assert "dv.sums     PASS" in good.stdout
    bad = invoke("check", *args, "--expect-dk", "dk_bad.npy", "--format", "json")
    assert bad.exit_code == ExitCode.CHECK_FAILED
    checks = {c["name"]: c for c in json.loads(bad.stdout)["cases"][0]["checks"]}
    assert checks["dk.close"]["status"] == "fail"
    (workdir / "m.yaml").write_text(
        "defaults: {q: q.npy, k: k.npy, v: v.npy, causal: true, dtype: float16, dout: dout.npy}\n"
        "cases:\n  - {name: good, expect-dq: dq.npy, expect-dk: dk.npy}\n"
        "  - {name: bad, expect-dk: dk_bad.npy}\n"
    )
    run = invoke("check", "--manifest", "m.yaml", "--format", "json")
    cases = {c["name"]: c["passed"] for c in json.loads(run.stdout)["cases"]}
    assert cases == {"good": True, "bad": False}
    missing = invoke("check", "q.npy", "k.npy", "v.npy", "--expect-dq", "dq.npy")
    assert missing.exit_code == ExitCode.BAD_INPUT
    assert missing.stderr == (
        "sdpa: error: dq.npy: is a gradient (dq): give --dout FILE, the gradient of the output "
        "the backward kernel was given\n"
    )


# --- each backward slip, injected by hand and named ------------------------------------


def slip_inputs(kv_heads: int = 4) -> dict[str, Any]:
    """float16 Q, K, V, dO of a causal case, the float64 pieces a backward kernel reads
    (P, the scaled logits, the LSE, O), and PyTorch's faithful gradients."""
    arrays = torch_backward("float16", "fused", causal=True, kv_heads=kv_heads)
    r = 4 // kv_heads
    q = arrays["q"].astype(np.float64)
    k = np.repeat(arrays["k"].astype(np.float64), r, axis=1)
    v = np.repeat(arrays["v"].astype(np.float64), r, axis=1)
    scaled = q @ np.swapaxes(k, -1, -2) / np.sqrt(32.0)
    hidden = np.triu(np.ones((48, 48), dtype=np.bool_), 1)
    logits = np.where(hidden, -np.inf, scaled)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    p = np.exp(logits - lse[..., None])
    d_o = arrays["dout"].astype(np.float64)
    return {
        **arrays,
        "q64": q,
        "k64": k,
        "v64": v,
        "scaled": scaled,
        "lse": lse,
        "p": p,
        "d_o": d_o,
    }


def grads_from(a: dict[str, Any], p: F64, ds: F64, dv: F64) -> dict[str, F64]:
    f = 1 / np.sqrt(32.0)
    return {"dq": ds @ a["k64"] * f, "dk": np.swapaxes(ds, -1, -2) @ a["q64"] * f, "dv": dv}


F64 = NDArray[np.float64]


def named(arrays: dict[str, Any], slipped: dict[str, F64]) -> dict[str, str | None]:
    for name, values in slipped.items():
        arrays[name] = values.astype(np.float16).astype(np.float32)
    checks = judged(arrays, "float16", causal=True)
    return {n: checks[f"{n}.close"].hint for n in slipped}


def test_the_d_term_left_out_is_named() -> None:
    a = slip_inputs()
    da = a["d_o"] @ np.swapaxes(a["v64"], -1, -2)
    g = grads_from(a, a["p"], a["p"] * da, np.swapaxes(a["p"], -1, -2) @ a["d_o"])
    hints = named(a, {"dq": g["dq"], "dk": g["dk"]})
    assert all(h is not None and "leaves out D = rowsum(dO ⊙ O)" in h for h in hints.values())


def test_dv_from_unnormalised_weights_is_named() -> None:
    a = slip_inputs()
    hidden = np.triu(np.ones((48, 48), dtype=np.bool_), 1)
    logits = np.where(hidden, -np.inf, a["scaled"])
    e = np.exp(logits - logits.max(-1, keepdims=True))
    hints = named(a, {"dv": np.swapaxes(e, -1, -2) @ a["d_o"]})
    assert hints["dv"] is not None
    assert hints["dv"].startswith("dV from the unnormalised weights exp(S − max)")


def test_the_mask_left_out_of_the_backward_is_named() -> None:
    """P recomputed as exp(S − LSE) over every key, with the forward's (masked) LSE."""
    a = slip_inputs()
    p = np.exp(a["scaled"] - a["lse"][..., None])
    da = a["d_o"] @ np.swapaxes(a["v64"], -1, -2)
    d = np.einsum("...ij,...ij->...i", a["p"], da)[..., None]
    g = grads_from(a, p, p * (da - d), np.swapaxes(p, -1, -2) @ a["d_o"])
    hints = named(a, g)
    assert all(
        h is not None
        and h.startswith("the mask is applied in the forward pass but not in the backward")
        for h in hints.values()
    )


def test_dk_without_the_scale_is_named() -> None:
    a = slip_inputs()
    hints = named(a, {"dk": a["dk"].astype(np.float64) * np.sqrt(32.0)})
    assert hints["dk"] is not None
    assert hints["dk"].startswith("dK misses the scale: the export is dSᵀ·Q, not dSᵀ·Q·0.176777")


def test_grouped_query_gradients_not_summed_are_named() -> None:
    """Two K/V heads for four query heads: each K/V head's dK and dV hold the share of
    its first query head only."""
    a = slip_inputs(kv_heads=2)
    da = a["d_o"] @ np.swapaxes(a["v64"], -1, -2)
    d = np.einsum("...ij,...ij->...i", a["p"], da)[..., None]
    g = grads_from(a, a["p"], a["p"] * (da - d), np.swapaxes(a["p"], -1, -2) @ a["d_o"])
    hints = named(a, {"dk": g["dk"][:, ::2], "dv": g["dv"][:, ::2]})
    assert all(
        h is not None and "not the sum over the 2 query heads that share it" in h
        for h in hints.values()
    )


def test_faithful_gradients_get_no_hint() -> None:
    a = slip_inputs()
    checks = judged(a, "float16", causal=True)
    assert all(c.hint is None for c in checks.values())


def test_a_backward_of_unmasked_attention_is_named() -> None:
    """The kernel's backward ran without the causal mask at all: PyTorch's gradients of
    the same inputs with no mask."""
    a = slip_inputs()
    full = torch_backward("float16", "fused")
    hints = named(a, {n: full[n].astype(np.float64) for n in ("dq", "dk", "dv")})
    assert all(
        h is not None and h.startswith("the backward pass ran without the mask")
        for h in hints.values()
    )


# --- the bias, the sinks and a softcap ---------------------------------------------------


def extras_case(dtype: str) -> tuple[AttentionSpec, dict[str, F64]]:
    """Q, K, V with a (L, S) bias, gpt-oss sinks and a softcap, in ``dtype``, and dO."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 12, 8)).astype(dtype) for _ in range(3))
    bias = rng.standard_normal((12, 12)).astype(dtype)
    sinks = rng.standard_normal(2)
    spec = build_spec(
        q, k, v, bias=bias, sinks=sinks, options=parse_options({"causal": True, "softcap": 5.0})
    )
    return spec, {"dout": rng.standard_normal((1, 2, 12, 8))}


def test_the_plain_backward_in_float64_has_the_bias_sinks_and_softcap_gradients() -> None:
    spec, extra = extras_case("float64")
    exact = backward(spec, make_dout(spec, extra["dout"], 0, "--dout"))
    plain = plain_backward(spec, extra["dout"])
    assert set(plain) == {"dq", "dk", "dv", "dbias", "dsinks"}
    for name in plain:
        np.testing.assert_allclose(plain[name], getattr(exact, name), rtol=1e-11, atol=1e-13)


def test_dbias_and_dsinks_are_judged_and_a_doubled_dbias_fails() -> None:
    """float16 inputs; the exact gradients rounded to float16 stand for a faithful
    kernel; d(bias) twice what it is fails, d(sinks) passes."""
    spec, extra = extras_case("float16")
    exact = backward(
        build_spec(
            *(np.asarray(x, np.float64) for x in (spec.q, spec.k, spec.v)),
            bias=np.asarray(spec.bias, np.float64),
            sinks=spec.sinks,
            options=parse_options({"causal": True, "softcap": 5.0}),
        ),
        make_dout(spec, extra["dout"], 0, "--dout"),
    )
    exports = [
        Expected(n, np.asarray(getattr(exact, n)).astype(np.float16), f"{n}.npy")
        for n in ("dq", "dbias", "dsinks")
    ]
    assert exact.dbias is not None
    exports[1] = Expected("dbias", (2 * exact.dbias).astype(np.float16), "dbias.npy")
    checks = {
        c.name: c for c in gradient_checks(spec, exports, extra["dout"], CheckSettings(), "float16")
    }
    assert checks["dq.close"].status == "pass"
    assert checks["dsinks.close"].status == "pass"
    assert checks["dbias.close"].status == "fail"
    assert checks["dbias.close"].details["diagnosis"]["fit"]["factor"] == pytest.approx(
        2.0, rel=1e-2
    )


def test_a_run_of_gradients_alone_names_its_float64_reference() -> None:
    """Gradients are read against the float64 backward pass: the report says so."""
    arrays = torch_backward("float16", "fused")
    spec = build_spec(
        arrays["q"], arrays["k"], arrays["v"], options=parse_options({"dtype": "float16"})
    )
    report = judge(spec, [Expected("dk", arrays["dk"], "dk.npy")], dout=arrays["dout"])
    assert (report.export_dtype, report.reference) == ("float16", "float64")
    assert report.passed


DROPOUT = {"dropout": 0.2, "seed": 3}  # sdpa's own Philox mask


def dropout_judged(exact_with: dict[str, Any], names: tuple[str, ...]) -> dict[str, Check]:
    """float16 Q, K, V under --dropout 0.2 (seed 3), their exact gradients of the
    options ``exact_with`` rounded to float16 as a kernel exports them, judged."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float16) for _ in range(3))
    dout = rng.standard_normal((1, 2, 16, 8))
    spec = build_spec(q, k, v, options=parse_options(DROPOUT))
    wide = [np.asarray(x, np.float64) for x in (q, k, v)]
    exact = backward(
        build_spec(*wide, options=parse_options(exact_with)), make_dout(spec, dout, 0, "--dout")
    )
    exports = [
        Expected(n, np.asarray(getattr(exact, n)).astype(np.float16), f"{n}.npy") for n in names
    ]
    return {c.name: c for c in gradient_checks(spec, exports, dout, CheckSettings(), "float16")}


def test_dropout_not_replayed_in_the_backward_is_named() -> None:
    """Gradients computed as if nothing dropped: the exact ones of the same inputs
    without dropout."""
    checks = dropout_judged({}, ("dq", "dv"))
    for name in ("dq", "dv"):
        hint = checks[f"{name}.close"].hint
        assert hint is not None
        assert hint.startswith("the backward pass did not replay dropout's mask")


def test_dropout_replayed_passes() -> None:
    """The exact gradients with the same dropout mask: they pass, the plain backward
    replaying the mask as the kernel did."""
    checks = dropout_judged(DROPOUT, ("dq", "dk", "dv"))
    assert [n for n, c in checks.items() if c.status != "pass"] == []


def test_dv_sums_count_the_rows_a_finite_mask_weighs_alike() -> None:
    """A left-padded row hidden whole by Hugging Face's finfo.min float mask still has
    weights summing to 1 (uniform over its keys): its dO counts in Σ over rows. Under
    a boolean mask and −inf the same row weighs nothing, and its dO does not count."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 1, 6, 4)) for _ in range(3))
    dout = rng.standard_normal((1, 1, 6, 4))
    pad = np.zeros((1, 1, 6, 6))
    pad[..., :2] = np.finfo(np.float64).min  # keys 0, 1 padding: row 0, 1 see nothing real
    pad[..., :2, :] = np.finfo(np.float64).min
    for mask in (pad, pad == 0):
        spec = build_spec(q, k, v, mask=mask, options=parse_options({}))
        exact = backward(spec, make_dout(spec, dout, 0, "--dout"))
        exports = [Expected("dv", exact.dv, "dv.npy")]
        checks = {
            c.name: c for c in gradient_checks(spec, exports, dout, CheckSettings(), "float64")
        }
        assert checks["dv.sums"].status == "pass", checks["dv.sums"].summary


def test_the_d_term_left_out_under_a_softcap_is_named() -> None:
    """Gemma 2's softcap C·tanh(S / C): the slip's dS passes through the chain rule
    (1 − tanh²) as the faithful one does, and is still named."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, 10, 8)) * 2 for _ in range(3))
    dout = rng.standard_normal((1, 2, 10, 8))
    scaled = q @ np.swapaxes(k, -1, -2) / np.sqrt(8.0)
    t = np.tanh(scaled / 5.0)
    logits = np.where(np.triu(np.ones((10, 10), dtype=np.bool_), 1), -np.inf, 5.0 * t)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ds = p * (dout @ np.swapaxes(v, -1, -2)) * (1.0 - t * t)  # D left out
    slipped = {"dq": ds @ k / np.sqrt(8.0), "dk": np.swapaxes(ds, -1, -2) @ q / np.sqrt(8.0)}
    spec = build_spec(
        *(x.astype(np.float16) for x in (q, k, v)),
        options=parse_options({"causal": True, "softcap": 5.0}),
    )
    exports = [Expected(n, x.astype(np.float16), f"{n}.npy") for n, x in slipped.items()]
    checks = gradient_checks(spec, exports, dout, CheckSettings(), "float16")
    hints = [c.hint for c in checks if c.name.endswith(".close")]
    assert len(hints) == 2
    assert all(h is not None and "leaves out D = rowsum(dO ⊙ O)" in h for h in hints)


def test_gradients_in_flash_attentions_layout_are_judged_by_head_and_named_in_the_files() -> None:
    """(B, L, H, E) files under --layout bshd: compared as (batch, head) slices, the
    broken element named where it sits in the file."""
    arrays = torch_backward("float16", "fused", causal=True)
    bshd = {n: np.ascontiguousarray(np.swapaxes(arrays[n], 1, 2)) for n in ("q", "k", "v", "dout")}
    bshd |= {n: np.ascontiguousarray(np.swapaxes(arrays[n], 1, 2)) for n in ("dq", "dk", "dv")}
    checks = judged(bshd, "float16", causal=True, layout="bshd")
    assert all(checks[f"{n}.close"].status == "pass" for n in ("dq", "dk", "dv"))
    bshd["dk"][1, 7, 2, 5] += 4.0  # batch 1, key 7, head 2, feature 5
    close = judged(bshd, "float16", causal=True, layout="bshd")["dk.close"]
    assert close.status == "fail"
    assert close.index == (1, 7, 2, 5)
    assert close.details["error_stats"]["by_slice"][1 * 4 + 2]["beyond"] == 1


def test_dv_from_unnormalised_weights_is_named_with_a_sink() -> None:
    """With --sinks, the max a kernel subtracts takes the sink's logit in (gpt-oss
    concatenates it to the logits first): dV = exp(S − max(m, sink))ᵀ · dO."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float16) for _ in range(3))
    dout = rng.standard_normal((1, 2, 16, 8)).astype(np.float16)
    sinks = np.array([1.5, -0.5], np.float16)
    spec = build_spec(q, k, v, sinks=sinks, options=parse_options({}))
    exact = backward(spec.in_float64(), make_dout(spec, dout, 0, "--dout"))
    logits = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) / np.sqrt(8.0)
    top = np.maximum(logits.max(-1, keepdims=True), sinks.astype(np.float64)[:, None, None])
    dv = np.swapaxes(np.exp(logits - top), -1, -2) @ dout.astype(np.float64)
    exports = [
        Expected("dq", np.asarray(exact.dq).astype(np.float16), "dq.npy"),
        Expected("dv", dv.astype(np.float16), "dv.npy"),
    ]
    checks = {c.name: c for c in gradient_checks(spec, exports, dout, CheckSettings(), "float16")}
    assert checks["dq.close"].status == "pass"
    hint = checks["dv.close"].hint
    assert hint is not None
    assert hint.startswith("dV from the unnormalised weights")


@pytest.mark.parametrize(("queries", "keys"), [(0, 3), (4, 0)])
def test_gradients_of_no_queries_or_no_keys_are_judged(queries: int, keys: int) -> None:
    """No query row (dK, dV are 0) or no key (dQ is 0, and no row's weights sum to 1, so
    dv.sums asks nothing of dO): zeros pass, a dK of no queries that is not 0 fails."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, queries, 8)).astype(np.float16)
    k, v = (rng.standard_normal((1, 2, keys, 8)).astype(np.float16) for _ in range(2))
    dout = rng.standard_normal((1, 2, queries, 8)).astype(np.float16)
    spec = build_spec(q, k, v, options=parse_options({}))
    zeros = [
        Expected(n, np.zeros_like(x), f"{n}.npy") for n, x in (("dq", q), ("dk", k), ("dv", v))
    ]
    checks = gradient_checks(spec, zeros, dout, CheckSettings(), "float16")
    assert [c.name for c in checks if c.status != "pass"] == []
    if queries == 0:
        wrong = [Expected("dk", np.ones_like(k), "dk.npy")]
        (finite, close) = gradient_checks(spec, wrong, dout, CheckSettings(), "float16")
        assert (finite.status, close.status) == ("pass", "fail")
