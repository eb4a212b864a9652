"""``assert_attention_close``: its keywords, its failure message, its default tolerance.

The checks themselves are ``sdpa check``'s (``tests/check/test_check.py``); here, what
the assertion adds: an unknown keyword refused as Python refuses one, with the closest
valid name; a failure message with no line said twice; the tolerance left to ``sdpa
check``'s default unless one is asked for; a backward kernel's gradients judged from
torch tensors as they come (``q.grad``) and from numpy arrays, a gradient without
``dout`` refused. Exports come from the float64 loop oracle, gradients from it written
out (dV = Pᵀ·dO, dS = P ⊙ (dO·Vᵀ − rowsum), dQ = dS·K·scale, dK = dSᵀ·Q·scale) and
from PyTorch's own CPU backward kernels.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from reference import attention

from sdpa_cli import assert_attention_close
from sdpa_cli.check.records import Check, CheckReport, Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.errors import SpecError
from sdpa_cli.testing import report_text

F64 = NDArray[np.float64]


def normal(seed: int, *shape: int) -> F64:
    return np.random.default_rng(seed).normal(size=shape)


def qkv() -> tuple[F64, F64, F64]:
    """Q (2, 3, 4), K (2, 5, 4), V (2, 5, 3)."""
    return normal(1, 2, 3, 4), normal(2, 2, 5, 4), normal(3, 2, 5, 3)


def close_of(report: CheckReport) -> Check:
    (close,) = [c for c in report.checks if c.name == "output.close"]
    return close


# --- unknown keywords -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("casual", "causal"),  # an option
        ("key_length", "key_lengths"),
        ("softcapp", "softcap"),
        ("tolerence", "tolerance"),  # a setting of the check
        ("equal_nans", "equal_nan"),
        ("ouptut", "output"),  # an export
        ("d_out", "dout"),  # a backward kernel's
        ("dkk", "dk"),
    ],
)
def test_a_misspelt_keyword_raises_type_error_naming_the_closest(typed: str, meant: str) -> None:
    q, k, v = qkv()
    typo: dict[str, Any] = {typed: True}
    with pytest.raises(TypeError) as caught:
        assert_attention_close(q, k, v, **typo)
    assert str(caught.value) == (
        f"assert_attention_close() got an unexpected keyword argument {typed!r}; "
        f"did you mean {meant!r}?"
    )


def test_a_keyword_like_no_other_gets_no_suggestion() -> None:
    q, k, v = qkv()
    with pytest.raises(TypeError) as caught:
        assert_attention_close(q, k, v, zzyzx=1)
    assert (
        str(caught.value) == "assert_attention_close() got an unexpected keyword argument 'zzyzx'"
    )


def test_an_unknown_keyword_is_refused_before_anything_is_computed() -> None:
    """K's key dim (3) is not Q's (4): computing anything would raise SpecError first."""
    q, _, v = qkv()
    bad_k = normal(2, 2, 5, 3)
    with pytest.raises(SpecError):
        assert_attention_close(q, bad_k, v, causal=True)
    with pytest.raises(TypeError, match="did you mean 'causal'"):
        assert_attention_close(q, bad_k, v, casual=True)


def test_valid_options_are_still_taken_as_keywords() -> None:
    q, k, v = qkv()
    out = attention(q, k, v, causal=True, window=(1, 0)).output
    assert assert_attention_close(q, k, v, output=out, causal=True, window=(1, 0)).passed
    with pytest.raises(AssertionError):
        assert_attention_close(q, k, v, output=out, causal=True)


# --- the failure message ----------------------------------------------------------------


def blocks(message: str) -> dict[str, list[str]]:
    """The message's lines by check: its ``STATUS name: summary`` line, then its report."""
    out: dict[str, list[str]] = {}
    name = ""
    for line in message.splitlines()[1:]:
        if not line.startswith("         "):
            name = line.split()[1].rstrip(":")
        out.setdefault(name, []).append(line)
    return out


def test_a_failure_message_says_no_line_twice() -> None:
    """The export without the causal mask fails output.range, output.close,
    weights.rows and weights.close; a check with no mismatch report restated its
    summary under itself."""
    q, k, v = qkv()
    full = attention(q, k, v)
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(q, k, v, output=full.output, weights=full.weights, causal=True)
    message = str(caught.value)
    by_check = blocks(message)
    assert [n for n, lines in by_check.items() if lines[0].startswith("  FAIL")] == [
        "output.range",
        "output.close",
        "weights.rows",
        "weights.close",
    ]
    for lines in by_check.values():
        summary = lines[0].split(": ", 1)[1]
        details = [line.strip() for line in lines[1:]]
        assert summary not in details
        assert len(details) == len(set(details)), details
    assert by_check["output.range"][1:] == ["         index: [0, 0, 0]"]
    assert by_check["weights.rows"][1:] == ["         index: [0, 0]"]
    assert message.count("mismatched elements:") == 2  # one report per failed comparison


def test_a_failure_message_begins_with_how_many_checks_failed_of_how_many_and_which() -> None:
    # Regression: it began "sdpa check 4 failed (...)", a count with nothing counted.
    q, k, v = qkv()
    full = attention(q, k, v)
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(q, k, v, output=full.output, weights=full.weights, causal=True)
    assert str(caught.value).splitlines()[0] == (
        "sdpa check: 4 of 8 checks failed, output.range, output.close, weights.rows and "
        "weights.close (export float64, reference float64):"
    )


def test_a_report_with_one_check_says_which_one_failed_or_that_it_passed() -> None:
    q, k, v = qkv()
    spec = build_spec(q, k, v, options=parse_options({}))
    report = run_checks(spec, [])
    failed = Check("findings.nonfinite", "fail", "3 findings")
    text = report_text(
        CheckReport((failed,), report.diagnosis, "float64", "float64", ("nonfinite",), None)
    )
    assert text.splitlines()[0] == (
        "sdpa check: 1 of 1 check failed, findings.nonfinite (export float64, reference float64):"
    )
    passed = Check("findings", "pass", "nothing worth a warning")
    text = report_text(CheckReport((passed,), report.diagnosis, "float64", "float64", (), None))
    assert text.splitlines()[0] == (
        "sdpa check: the 1 check passed (export float64, reference float64):"
    )


def test_report_text_keeps_the_order_of_a_failures_lines() -> None:
    """Two findings with the same message: the second bullet goes, the rest stays in order."""
    q, k, v = qkv()
    spec = build_spec(q, k, v, options=parse_options({}))
    report = run_checks(spec, [])
    findings = [{"message": "a"}, {"message": "b", "hint": "fix b"}, {"message": "a"}]
    failed = Check("findings.nonfinite", "fail", "3 findings", details={"findings": findings})
    text = report_text(
        CheckReport((failed,), report.diagnosis, "float64", "float64", ("nonfinite",), None)
    )
    assert text.splitlines()[1:] == [
        "  FAIL findings.nonfinite: 3 findings",
        "         3 findings:",
        "         • a",
        "         • b",
        "           hint: fix b",
    ]


# --- the default tolerance --------------------------------------------------------------


def test_the_default_tolerance_is_sdpa_checks() -> None:
    assert inspect.signature(assert_attention_close).parameters["tolerance"].default is None
    q, k, v = qkv()
    out = attention(q, k, v, causal=True).output.astype(np.float16)
    spec = build_spec(q, k, v, options=parse_options({"causal": True}))
    by_check = close_of(run_checks(spec, [Expected("output", out, "output")], CheckSettings()))
    given = close_of(assert_attention_close(q, k, v, output=out, causal=True))
    assert given.status == by_check.status == "pass"
    assert given.tolerance == by_check.tolerance
    assert given.summary == by_check.summary


@pytest.mark.parametrize("tolerance", ["dtype", "measured"])
def test_a_tolerance_asked_for_is_passed_through(tolerance: str) -> None:
    q, k, v = qkv()
    out = attention(q, k, v, causal=True).output.astype(np.float16)
    report = assert_attention_close(q, k, v, output=out, causal=True, tolerance=tolerance)
    tol = close_of(report).tolerance
    assert tol is not None
    assert tol.source.startswith({"dtype": "float16 defaults", "measured": "measured"}[tolerance])


def test_a_bad_tolerance_name_is_a_spec_error() -> None:
    q, k, v = qkv()
    out: Any = attention(q, k, v).output
    with pytest.raises(SpecError):
        assert_attention_close(q, k, v, output=out, tolerance="loose")


# --- gradients ---------------------------------------------------------------------------


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


BACKENDS = {"math": "MATH", "fused": "FLASH_ATTENTION"}


def torch_backward(
    torch: Any, dtype: str, backend: str, *, kv_heads: int = 4, causal: bool = False
) -> dict[str, Any]:
    """Q, K, V (leaves, their ``.grad`` filled), the output and dO, as torch tensors in
    ``dtype``, from PyTorch's CPU ``backend``: four query heads, 48 rows and keys."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    t = getattr(torch, dtype)
    q, k, v = (
        torch.randn(2, h, 48, 32, generator=g).to(t).requires_grad_(True)
        for h in (4, kv_heads, kv_heads)
    )
    dout = torch.randn(2, 4, 48, 32, generator=g).to(t)
    with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=kv_heads != 4
        )
    out.backward(dout)
    return {"q": q, "k": k, "v": v, "output": out, "dout": dout}


GRADIENT_CHECKS = ["dq.finite", "dq.close", "dk.finite", "dk.close", "dv.finite", "dv.close"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(("causal", "kv_heads"), [(True, 4), (False, 2), (True, 2)])
def test_pytorchs_backward_kernels_pass_as_tensors(
    torch: Any, dtype: str, backend: str, causal: bool, kv_heads: int
) -> None:
    t = torch_backward(torch, dtype, backend, kv_heads=kv_heads, causal=causal)
    q, k, v = t["q"], t["k"], t["v"]
    report = assert_attention_close(
        q, k, v, output=t["output"], dout=t["dout"], dq=q.grad, dk=k.grad, dv=v.grad, causal=causal
    )
    assert report.export_dtype == dtype  # a bfloat16 tensor's format, too
    names = [c.name for c in report.checks]
    assert names[3:10] == [*GRADIENT_CHECKS, "dv.sums"]  # after the output's, before findings
    assert names[:3] == ["output.finite", "output.range", "output.close"]


def test_any_of_the_gradients_without_the_output(torch: Any) -> None:
    t = torch_backward(torch, "float16", "fused", causal=True)
    report = assert_attention_close(
        t["q"], t["k"], t["v"], dout=t["dout"], dk=t["k"].grad, causal=True
    )
    assert [c.name for c in report.checks if not c.name.startswith("findings")] == [
        "dk.finite",
        "dk.close",
    ]


def test_dk_without_its_scale_fails_naming_dk_close_its_worst_element_and_not_rounding(
    torch: Any,
) -> None:
    """dK = dSᵀ · Q without the 1/√E: √32 × the reference everywhere."""
    t = torch_backward(torch, "float16", "fused", causal=True)
    q, k, v = t["q"], t["k"], t["v"]
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(
            q, k, v, dout=t["dout"], dq=q.grad, dk=k.grad * 32**0.5, dv=v.grad, causal=True
        )
    message = str(caught.value)
    assert message.splitlines()[0] == (
        "sdpa check: 1 of 8 checks failed, dk.close (export float16, reference float64):"
    )
    by_check = blocks(message)
    assert [n for n, lines in by_check.items() if lines[0].startswith("  FAIL")] == ["dk.close"]
    details = [line.strip() for line in by_check["dk.close"][1:]]
    assert any(line.startswith("worst element: index [") for line in details), details
    (not_rounding,) = [line for line in details if line.startswith("not rounding: ")]
    assert "the export is 5.657× the reference throughout" in not_rounding


@pytest.mark.parametrize("gradients", [("dq",), ("dk", "dv"), ("dq", "dk", "dv")])
def test_a_gradient_without_dout_is_a_type_error_before_anything_is_computed(
    gradients: tuple[str, ...],
) -> None:
    """As a missing argument is; K's key dim (3) is not Q's, which would raise SpecError
    if anything were computed."""
    q, _, v = qkv()
    bad_k = normal(2, 2, 5, 3)
    given: dict[str, Any] = {n: np.zeros(1) for n in gradients}
    named = {1: "{}", 2: "{} and {}", 3: "{}, {} and {}"}[len(gradients)].format(*gradients)
    with pytest.raises(TypeError) as caught:
        assert_attention_close(q, bad_k, v, causal=True, **given)
    assert str(caught.value) == (
        f"assert_attention_close() got {named} without dout: give dout=, the gradient of the "
        "output the backward kernel was given"
    )


def test_dout_without_a_gradient_is_a_type_error() -> None:
    """It would judge nothing of the backward kernel, silently."""
    q, k, v = qkv()
    out = attention(q, k, v).output
    with pytest.raises(TypeError) as caught:
        assert_attention_close(q, k, v, output=out, dout=out)
    assert str(caught.value) == (
        "assert_attention_close() got dout without a gradient to judge: give dq=, dk=, dv= or "
        "dbias=, the gradients the backward kernel computed from it"
    )


def test_a_dout_not_shaped_as_the_output_is_a_spec_error_naming_dout() -> None:
    q, k, v = qkv()
    with pytest.raises(SpecError) as caught:
        assert_attention_close(q, k, v, dout=normal(4, 2, 3, 4), dv=v)
    assert str(caught.value) == (
        "dout: dO should have the output's shape (2, 3, 3): but got (2, 3, 4)"
    )


def gradients(q: F64, k: F64, v: F64, dout: F64, causal: bool) -> dict[str, F64]:
    """dQ, dK, dV of Σ O ⊙ dO in float64, from the loop oracle's weights P:
    dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ⊙ (dP − Σⱼ P ⊙ dP), dQ = dS·K·s, dK = dSᵀ·Q·s."""
    p = attention(q, k, v, causal=causal).weights
    scale = q.shape[-1] ** -0.5
    dp = np.einsum("BLF,BSF->BLS", dout, v)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    return {
        "dq": np.einsum("BLS,BSE->BLE", ds, k) * scale,
        "dk": np.einsum("BLS,BLE->BSE", ds, q) * scale,
        "dv": np.einsum("BLS,BLF->BSF", p, dout),
    }


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_numpy_gradients_pass_and_a_slip_fails(dtype: str) -> None:
    """Float64 gradients of the inputs as a kernel in ``dtype`` saw them, rounded to it."""
    wanted = np.dtype(dtype)
    q, k, v = (x.astype(wanted) for x in qkv())
    dout = normal(4, 2, 3, 3).astype(wanted)
    wq, wk, wv, wd = (x.astype(np.float64) for x in (q, k, v, dout))
    exact = gradients(wq, wk, wv, wd, causal=True)
    out = attention(wq, wk, wv, causal=True).output.astype(wanted)
    grads: dict[str, Any] = {n: g.astype(wanted) for n, g in exact.items()}
    report = assert_attention_close(q, k, v, output=out, dout=dout, causal=True, **grads)
    assert report.export_dtype == dtype
    assert {c.name for c in report.checks} >= {*GRADIENT_CHECKS, "dv.sums"}
    grads["dq"] = (exact["dq"] * 1.5).astype(wanted)
    with pytest.raises(AssertionError, match=r"failed, dq\.close \("):
        assert_attention_close(q, k, v, output=out, dout=dout, causal=True, **grads)


# --- the inputs beside Q, K, V: a paged cache, the qv term, FP8 descales -----------------


def test_a_paged_cache_is_taken_as_it_is() -> None:
    """K and V as pages (4, 2, 1, 3) read through a block table; the export computed on
    the keys gathered by hand passes, one with two pages swapped fails."""
    rng = np.random.default_rng(5)
    pages_k, pages_v = rng.normal(size=(4, 2, 1, 3)), rng.normal(size=(4, 2, 1, 3))
    q = rng.normal(size=(2, 1, 1, 3))  # (B, L, H, E)
    table = np.array([[2, 0], [3, 1]])
    lengths = (3, 4)

    def export(order: NDArray[Any]) -> F64:
        k = np.stack([np.concatenate([pages_k[p] for p in row]) for row in order])
        v = np.stack([np.concatenate([pages_v[p] for p in row]) for row in order])
        qh, kh, vh = (np.swapaxes(a, 1, 2) for a in (q, k, v))
        out = attention(qh, kh, vh, key_lengths=lengths).output
        return np.asarray(np.swapaxes(out, 1, 2), dtype=np.float64)

    options: dict[str, Any] = {"block_table": table, "key_lengths": lengths, "layout": "bshd"}
    assert_attention_close(q, pages_k, pages_v, output=export(table), **options)
    with pytest.raises(AssertionError, match=r"output\.close"):
        assert_attention_close(q, pages_k, pages_v, output=export(table[:, ::-1]), **options)


def test_the_qv_term_and_fp8_descales_are_keywords() -> None:
    q, k, v = qkv()
    qv = normal(9, 2, 3, 3)
    want = attention(np.concatenate([q, qv], -1), np.concatenate([k, v], -1), v).output
    assert_attention_close(q, k, v, output=want, qv=qv)
    with pytest.raises(TypeError, match="did you mean 'qv'"):
        assert_attention_close(q, k, v, output=want, qvv=qv)
    fp8 = np.array([[0.5, -1.0], [2.0, 0.25]])  # e4m3 values, exact
    descaled = attention(fp8 * 0.5, fp8 * 2.0, fp8 * 4.0).output
    report = assert_attention_close(
        fp8, fp8, fp8, output=descaled, q_descale=0.5, k_descale=2.0, v_descale=4.0
    )
    assert report.passed
