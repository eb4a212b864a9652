"""The emulated pipeline (``--dtype``) end to end, against kernels written here from casts.

A kernel in float16 or bfloat16, as the emulation models it by default:

    q, k, v  cast to the format
    raw      = q @ kᵀ accumulated in float32, stored in the format
    scaled   = raw · scale, stored in the format
    masked   = hidden keys set to the mask value, stored in the format
    weights  = softmax in float32 (max-subtracted), stored in the format
    output   = weights @ v accumulated in float32, stored in the format

:func:`kernel` below writes this out with numpy float32 arithmetic and ml_dtypes casts;
the float64 answer is a plain numpy softmax. PyTorch (where importable) is the second
witness: its float16/bfloat16 operators, and its fused CPU SDPA.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from sdpa_cli.diagnosis.findings import Emulation
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine import precision
from sdpa_cli.engine.block import attend_block, softmax
from sdpa_cli.engine.driver import iter_blocks
from sdpa_cli.engine.options import Options, parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import Trace, trace
from sdpa_cli.errors import SpecError

F64 = NDArray[np.float64]
F32 = np.float32
DTYPES: dict[str, Any] = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
"""Spacing of the format at 1: one ulp of a value in [1, 2)."""
U16 = 2.0**-11
"""float16's unit roundoff."""


def normal(seed: int, *shape: int, sd: float = 1.0) -> F64:
    return np.random.default_rng(seed).normal(size=shape) * sd


def causal_visible(L: int, S: int) -> NDArray[np.bool_]:
    """Upper-left causal: query i sees keys j ≤ i."""
    return np.arange(S)[None, :] <= np.arange(L)[:, None]


def run(q: F64, k: F64, v: F64, **options: Any) -> tuple[Trace, Emulation]:
    """sdpa's trace with options parsed as the command line does, and its emulation report."""
    t = trace(build_spec(q, k, v, options=parse_options(options)))
    emulation = diagnose(t).emulation
    assert emulation is not None
    return t, emulation


# --- the witnesses: a kernel from casts, and float64 ------------------------------------------


@dataclass(frozen=True)
class Kernel:
    raw: F64
    scaled: F64
    masked: F64
    weights: F64
    output: F64


def kernel(q: F64, k: F64, v: F64, name: str, visible: NDArray[np.bool_] | None = None) -> Kernel:
    """The default emulated kernel, written with float32 arithmetic and direct casts."""
    dt = DTYPES[name]

    def store(x: NDArray[Any]) -> F64:
        with np.errstate(over="ignore"):
            return np.asarray(x).astype(dt).astype(np.float64)

    qf, kf, vf = (store(a).astype(F32) for a in (q, k, v))
    scale = F32(1 / math.sqrt(q.shape[-1]))
    raw = store(qf @ kf.swapaxes(-1, -2))
    scaled = store(raw.astype(F32) * scale)
    masked = scaled if visible is None else store(np.where(visible, scaled, -np.inf))
    x = masked.astype(F32)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    weights = store(e / e.sum(axis=-1, keepdims=True, dtype=F32))
    output = store(weights.astype(F32) @ vf)
    return Kernel(raw, scaled, masked, weights, output)


def float64_attention(
    q: F64, k: F64, v: F64, visible: NDArray[np.bool_] | None = None
) -> tuple[F64, F64]:
    """(weights, output) in float64 with numpy: the answer the emulation is judged against."""
    logits = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    if visible is not None:
        logits = np.where(visible, logits, -np.inf)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights = e / e.sum(axis=-1, keepdims=True)
    return weights, weights @ v


def ulps(a: F64, b: F64, name: str) -> NDArray[np.int64]:
    """How many values of the format lie between a and b (both values of the format)."""

    def ordered(x: F64) -> NDArray[np.int64]:
        bits = x.astype(DTYPES[name]).view(np.int16).astype(np.int64)
        steps: NDArray[np.int64] = np.where(bits < 0, -(bits & 0x7FFF), bits)
        return steps

    distance: NDArray[np.int64] = np.abs(ordered(a) - ordered(b))
    return distance


def ulps_of_max(a: F64, b: F64, name: str) -> float:
    """max |a − b| in ulps of the format at max |b|: a normwise distance."""
    top = float(np.abs(b).max())
    spacing = EPS[name] * 2.0 ** math.floor(math.log2(top))
    return float(np.abs(a - b).max()) / spacing


def stages(t: Trace) -> Iterator[tuple[str, F64]]:
    for name in ("raw", "scaled", "masked", "weights", "output"):
        arr = t.stage(name)
        assert arr is not None
        yield name, arr


# --- 4. the emulated pipeline equals a kernel written from casts -------------------------------


CASES = {
    "plain": (False, 16, 64, 16),
    "causal": (True, 16, 64, 16),
    "long": (False, 4, 512, 64),
    "scale-not-a-power-of-two": (False, 16, 64, 48),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_emulation_equals_a_kernel_written_from_casts(
    name: str, case: tuple[bool, int, int, int]
) -> None:
    """Stage by stage: the same values, but for a rare one-ulp step where float32's exp
    (numpy's) and the emulation's exp (float64, then rounded) land on either side of a
    rounding boundary of the format."""
    causal, L, S, E = case
    q, k, v = normal(1, 2, 3, L, E, sd=1.5), normal(2, 2, 3, S, E), normal(3, 2, 3, S, 8)
    visible = causal_visible(L, S) if causal else None
    t, _ = run(q, k, v, dtype=name, causal=causal)
    want = kernel(q, k, v, name, visible)
    for stage, got in stages(t):
        expected = getattr(want, stage)
        if stage in ("raw", "scaled"):
            np.testing.assert_array_equal(got, expected, err_msg=stage)
        elif stage == "masked":
            np.testing.assert_array_equal(got, expected, err_msg=stage)
            if causal:
                assert np.all(got[..., ~causal_visible(L, S)] == -np.inf)
        elif stage == "weights":
            steps = ulps(got, expected, name)
            assert steps.max() <= 1, stage
            assert np.mean(steps == 0) >= 0.999, stage
        else:
            # A weight one ulp off moves the output by far less than an ulp of the row's
            # largest output; most outputs are identical.
            assert ulps_of_max(got, expected, name) <= 0.5
            assert np.mean(got == expected) >= 0.99


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_every_emulated_stage_holds_values_of_the_format(name: str) -> None:
    q, k, v = normal(4, 3, 8, 16), normal(5, 40, 16), normal(6, 40, 4)
    t, _ = run(q, k, v, dtype=name, causal=True)
    for stage, arr in stages(t):
        finite = arr[np.isfinite(arr)]
        np.testing.assert_array_equal(
            finite, finite.astype(DTYPES[name]).astype(np.float64), err_msg=stage
        )


def test_accumulate_same_sums_raw_one_term_at_a_time_in_float16() -> None:
    """``accumulate: same``: Q Kᵀ in a float16 accumulator, rounded after each term."""
    q, k, v = normal(7, 4, 48, sd=2), normal(8, 6, 48), normal(9, 6, 3)
    t, emulation = run(q, k, v, dtype="float16", accumulate="same")
    assert emulation.accumulate == "float16"
    qh, kh = q.astype(np.float16), k.astype(np.float16)
    want = np.zeros((4, 6))
    for i in range(4):
        for j in range(6):
            acc = np.float16(0)
            for e in range(48):
                acc = np.float16(float(acc) + float(qh[i, e]) * float(kh[j, e]))
            want[i, j] = float(acc)
    assert t.raw is not None
    np.testing.assert_array_equal(t.raw, want)


def balanced_sum16(row: list[float]) -> float:
    """A float16 sum by recursive halving, each partial sum rounded (lengths 2ⁿ)."""
    if len(row) == 1:
        return row[0]
    mid = len(row) // 2
    return float(np.float16(balanced_sum16(row[:mid]) + balanced_sum16(row[mid:])))


def test_softmax_in_float16_rounds_every_step() -> None:
    """softmax(x, "float16"): x − max, exp, the pairwise sum and the quotient, each rounded
    to float16 (exp and the quotient computed exactly, then rounded once)."""
    logits = normal(10, 3, 64, sd=3).astype(np.float16).astype(np.float64)
    got = softmax(logits, "float16")
    for i, row in enumerate(logits.tolist()):
        top = max(row)
        e = [float(np.float16(math.exp(float(np.float16(x - top))))) for x in row]
        total = balanced_sum16(e)
        want = [float(np.float16(x / total)) for x in e]
        np.testing.assert_array_equal(got[i], want)


# --- 5. PyTorch in float16 and bfloat16 --------------------------------------------------------


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


def torch_dtype(torch: Any, name: str) -> Any:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]


TORCH_CASES = {"plain": (False, 16, 128), "causal": (True, 16, 128), "long": (False, 4, 1024)}


@pytest.mark.parametrize("case", TORCH_CASES.values(), ids=TORCH_CASES.keys())
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_emulation_equals_pytorch_operators_in_the_format(
    torch: Any, name: str, case: tuple[bool, int, int]
) -> None:
    """PyTorch's own float16/bfloat16 operators, one per stage (matmul, multiply, softmax,
    matmul) are the kernel the emulation models: the same values but for a rare ulp, and
    the error the emulation reports is the error PyTorch's result has."""
    causal, L, S = case
    q = normal(11, 2, 2, L, 64, sd=1.5).astype(DTYPES[name]).astype(np.float64)
    k = normal(12, 2, 2, S, 64).astype(DTYPES[name]).astype(np.float64)
    v = normal(13, 2, 2, S, 64).astype(DTYPES[name]).astype(np.float64)
    tq, tk, tv = (torch.from_numpy(a).to(torch_dtype(torch, name)) for a in (q, k, v))
    raw = tq @ tk.transpose(-1, -2)
    logits = raw * (1 / 8)
    if causal:
        hidden = torch.from_numpy(~causal_visible(L, S))
        logits = logits.masked_fill(hidden, -math.inf)
    weights = torch.softmax(logits, dim=-1)
    out = (weights @ tv).double().numpy()

    t, emulation = run(q, k, v, dtype=name, causal=causal)
    assert t.raw is not None
    assert t.weights is not None
    assert t.output is not None
    # PyTorch's own 16-bit matmul sums in an order its CPU kernel picks: on OpenBLAS's
    # Haswell kernel a rare score lands 2 ulps from the emulation's (1.35 ulps from the
    # exact sum, where the emulation's float32 sum rounds to 0.65)
    raw_steps = ulps(t.raw, raw.double().numpy(), name)
    assert raw_steps.max() <= 2
    assert np.mean(raw_steps <= 1) >= 0.999
    steps = ulps(t.weights, weights.double().numpy(), name)
    assert steps.max() <= 1
    assert np.mean(steps == 0) >= 0.99
    assert ulps_of_max(t.output, out, name) <= 0.5
    assert np.mean(t.output == out) >= 0.98

    _, exact = float64_attention(q, k, v, causal_visible(L, S) if causal else None)
    reported = emulation.stage("output")
    assert reported is not None
    actual = float(np.abs(out - exact).max())
    assert actual / 1.1 <= reported.max_abs <= 1.1 * actual


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_softcap_rounds_each_step_as_gemma2s_eager_attention(torch: Any, name: str) -> None:
    """Gemma 2's eager attention caps the logits with three tensor ops in the model's
    dtype (÷C, tanh, ×C), each rounded: the emulation stores each step in the format
    too, so its capped logits are PyTorch's but for a rare ulp (the matmul's sum or
    tanh, computed wider and rounded, may land on the other side of a tie)."""
    q = normal(21, 1, 2, 32, 32, sd=2.0).astype(DTYPES[name]).astype(np.float64)
    k = normal(22, 1, 2, 32, 32, sd=2.0).astype(DTYPES[name]).astype(np.float64)
    v = normal(23, 1, 2, 32, 32).astype(DTYPES[name]).astype(np.float64)
    tq, tk = (torch.from_numpy(a).to(torch_dtype(torch, name)) for a in (q, k))
    logits = (tq @ tk.transpose(-1, -2)) * 0.125
    logits = logits / 5.0
    logits = torch.tanh(logits)
    logits = logits * 5.0
    t, _ = run(q, k, v, dtype=name, scale=0.125, softcap=5.0)
    assert t.capped is not None
    assert t.scaled is not None
    steps = ulps(t.capped, logits.double().numpy(), name)
    assert steps.max() <= 1
    assert np.mean(steps == 0) >= 0.998
    # rounding only once, at the end, misses many more
    once = precision.round_to(5.0 * np.tanh(t.scaled / 5.0), name)
    assert np.mean(ulps(once, logits.double().numpy(), name) == 0) < 0.99


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_emulation_is_within_a_few_ulps_of_pytorch_sdpa(
    torch: Any, name: str, causal: bool
) -> None:
    """PyTorch's fused CPU SDPA keeps logits and weights in float32 and rounds only the
    output: it is more accurate than the emulated kernel, which stores both in the format.
    Measured: ≤ 2.3 ulps of max |output| apart over 80 seeds; the emulation's error is 1.3
    to 7 times PyTorch's, and both are within 2.5 ulps of float64."""
    L, S = 16, 128
    q = normal(14, 2, 2, L, 64, sd=1.5).astype(DTYPES[name]).astype(np.float64)
    k = normal(15, 2, 2, S, 64).astype(DTYPES[name]).astype(np.float64)
    v = normal(16, 2, 2, S, 64).astype(DTYPES[name]).astype(np.float64)
    tq, tk, tv = (torch.from_numpy(a).to(torch_dtype(torch, name)) for a in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    theirs = sdpa(tq, tk, tv, is_causal=causal).double().numpy()

    t, emulation = run(q, k, v, dtype=name, causal=causal)
    assert t.output is not None
    _, exact = float64_attention(q, k, v, causal_visible(L, S) if causal else None)
    assert ulps_of_max(t.output, theirs, name) <= 3
    assert ulps_of_max(theirs, exact, name) <= 1  # PyTorch: one rounding, and a little
    assert ulps_of_max(t.output, exact, name) <= 3
    reported = emulation.stage("output")
    assert reported is not None
    actual = float(np.abs(theirs - exact).max())
    assert actual <= reported.max_abs <= 8 * actual


# --- what the emulation reports: the error against float64, and where -------------------------


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_reported_errors_are_the_errors_against_float64(name: str) -> None:
    L, S = 12, 96
    q, k, v = normal(17, 2, L, 32, sd=2), normal(18, 2, S, 32), normal(19, 2, S, 8)
    visible = causal_visible(L, S)
    t, emulation = run(q, k, v, dtype=name, causal=True)
    assert (emulation.dtype, emulation.accumulate, emulation.softmax_dtype) == (
        name,
        "float32",
        "float32",
    )
    exact = dict(zip(("weights", "output"), float64_attention(q, k, v, visible), strict=True))
    for stage in ("weights", "output"):
        got = t.stage(stage)
        assert got is not None
        diff = np.abs(got - exact[stage])
        report = emulation.stage(stage)
        assert report is not None
        assert report.max_abs == pytest.approx(diff.max(), rel=1e-9)
        assert report.max_abs_at == tuple(
            int(i) for i in np.unravel_index(diff.argmax(), diff.shape)
        )
        assert report.normwise == pytest.approx(diff.max() / np.abs(exact[stage]).max(), rel=1e-9)
        row_rel = diff.max(axis=-1) / np.abs(exact[stage]).max(axis=-1)
        assert report.max_row_rel == pytest.approx(row_rel.max(), rel=1e-9)
        assert report.max_row_rel_at is not None
        assert report.max_row_rel_at[:-1] == np.unravel_index(row_rel.argmax(), row_rel.shape)
        assert report.new_nonfinite == 0
        assert report.problem is None


# --- 6. overflow, and --prescale ---------------------------------------------------------------


def overflowing_logits() -> tuple[F64, F64, F64]:
    """E = 4, q = 130 everywhere, k = 130·c with c from 0.5 to 1: q·k = 67600·c overflows
    float16 (≥ 65520) for c > 0.969, the last key; the scaled logits (÷ 2) fit."""
    q = np.full((3, 4), 130.0)
    k = 130.0 * np.linspace(0.5, 1.0, 6)[:, None] * np.ones((6, 4))
    return q, k, normal(20, 6, 2)


def test_raw_overflows_in_float16_and_is_the_first_problem() -> None:
    q, k, v = overflowing_logits()
    exact_raw = q @ k.T
    assert np.all(exact_raw[:, :5] < 65504)
    assert np.all(exact_raw[:, 5] > 65520)
    t, emulation = run(q, k, v, dtype="float16")
    assert t.raw is not None
    assert t.weights is not None
    assert np.all(t.raw[:, 5] == np.inf)
    assert np.all(np.isfinite(t.raw[:, :5]))
    first = emulation.first_problem
    assert first is not None
    assert (first.stage, first.problem) == ("raw", "overflowed")
    assert (first.new_nonfinite, first.new_nonfinite_at) == (3, (0, 5))
    assert np.all(np.isnan(t.weights))  # inf − inf in the softmax: every row is lost


def test_prescale_keeps_the_raw_product_in_range() -> None:
    """Q and K each scaled by √(1/2) first: the product is the scaled logit, ≤ 33800."""
    q, k, v = overflowing_logits()
    t, emulation = run(q, k, v, dtype="float16", prescale=True)
    assert emulation.prescale
    assert t.raw is not None
    assert t.output is not None
    assert np.all(np.isfinite(t.raw))
    assert np.all(np.isfinite(t.output))
    np.testing.assert_array_equal(t.raw, t.scaled)  # one stage: the product is the logit
    root = math.sqrt(0.5)
    q16 = np.float16(130 * root)
    k16 = ((130 * np.linspace(0.5, 1.0, 6)).astype(np.float16).astype(np.float64) * root).astype(
        np.float16
    )
    want = (4 * (F32(q16) * k16.astype(F32))).astype(np.float16).astype(np.float64)
    np.testing.assert_array_equal(t.raw, np.broadcast_to(want, (3, 6)))
    raw = emulation.stage("raw")
    assert raw is not None
    assert raw.new_nonfinite == 0
    assert raw.problem != "overflowed"
    assert all(s.problem != "overflowed" for s in emulation.stages)


def test_bfloat16_does_not_overflow_there() -> None:
    q, k, v = overflowing_logits()
    t, emulation = run(q, k, v, dtype="bfloat16")
    assert t.output is not None
    assert np.all(np.isfinite(t.output))
    assert all(s.new_nonfinite == 0 for s in emulation.stages)


# --- 7. the mask value, stored in the format -------------------------------------------------


@pytest.mark.parametrize(
    ("mask_value", "dtype", "stored"),
    [
        ("-inf", "float16", -math.inf),
        ("-1e9", "float16", -math.inf),  # beyond float16's range
        ("-1e9", "bfloat16", -998244352.0),  # bfloat16 has float32's range
        ("finfo-min", "float16", -65504.0),
        ("finfo-min", "bfloat16", -((2 - 2.0**-7) * 2.0**127)),
    ],
)
def test_hidden_logits_hold_the_mask_value_as_the_format_stores_it(
    mask_value: str, dtype: str, stored: float
) -> None:
    q, k, v = normal(21, 4, 8), normal(22, 5, 8), normal(23, 5, 2)
    if mask_value == "finfo-min":
        options = parse_options({"mask_value": mask_value, "dtype": dtype})
        assert options.effective_mask_value == stored
    t, _ = run(q, k, v, mask_value=mask_value, dtype=dtype, causal=True)
    assert t.masked is not None
    assert t.weights is not None
    hidden = ~causal_visible(4, 5)
    assert np.all(t.masked[hidden] == stored)
    assert np.all(t.weights[hidden] == 0.0)
    np.testing.assert_allclose(t.weights.sum(axis=-1), 1.0, atol=4 * EPS[dtype])


@pytest.mark.parametrize("mask_value", ["-inf", "-1e9"])
def test_a_row_with_no_visible_key_gets_zero_weights_when_the_mask_value_is_inf(
    mask_value: str,
) -> None:
    """−1e9 is −inf in float16: such a row is all −inf, and gets zeros, not NaN."""
    q, k, v = normal(24, 2, 1, 3, 8), normal(25, 2, 1, 5, 8), normal(26, 2, 1, 5, 2)
    t, _ = run(q, k, v, dtype="float16", key_lengths="0,5", mask_value=mask_value)
    assert t.weights is not None
    assert t.output is not None
    assert np.all(t.weights[0] == 0.0)
    assert np.all(t.output[0] == 0.0)
    np.testing.assert_allclose(t.weights[1].sum(axis=-1), 1.0, atol=4 * EPS["float16"])


def test_a_row_with_no_visible_key_is_uniform_with_finfo_min() -> None:
    q, k, v = normal(27, 3, 8), normal(28, 5, 8), normal(29, 5, 2)
    t, _ = run(q, k, v, dtype="float16", key_lengths="0", mask_value="finfo-min")
    assert t.weights is not None
    np.testing.assert_array_equal(t.weights, np.full((3, 5), np.float16(0.2)))


def test_float8_e4m3fn_masks_hidden_keys_without_nan() -> None:
    q, k, v = normal(30, 4, 8), normal(31, 6, 8), normal(32, 6, 2)
    t, emulation = run(q, k, v, dtype="float8_e4m3fn", causal=True)
    assert t.weights is not None
    assert not np.isnan(t.weights).any()
    assert np.all(t.weights[..., ~causal_visible(4, 6)] == 0.0)
    assert all(s.new_nonfinite == 0 for s in emulation.stages)


def test_float8_e5m2_masks_hidden_keys_with_its_inf() -> None:
    q, k, v = normal(30, 4, 8), normal(31, 6, 8), normal(32, 6, 2)
    t, _ = run(q, k, v, dtype="float8_e5m2", causal=True)
    assert t.masked is not None
    assert t.weights is not None
    assert np.all(t.masked[~causal_visible(4, 6)] == -math.inf)
    assert np.all(t.weights[..., ~causal_visible(4, 6)] == 0.0)


# --- 8. narrower accumulators and softmax; the combinations allowed --------------------------


def long_rows(sd: float) -> tuple[F64, F64, F64]:
    return normal(33, 8, 64, sd=sd), normal(34, 4096, 64), normal(35, 4096, 16)


def test_float16_accumulation_loses_more_than_float32_over_4096_keys() -> None:
    q, k, v = long_rows(1.0)
    _, default = run(q, k, v, dtype="float16")
    _, same = run(q, k, v, dtype="float16", accumulate="same")
    assert same.accumulate == "float16"
    for stage in ("raw", "output"):
        a, b = same.stage(stage), default.stage(stage)
        assert a is not None
        assert b is not None
        assert a.normwise > 3 * b.normwise, stage
    out = same.stage("output")
    assert out is not None
    assert out.normwise > 16 * U16
    assert out.problem == "lost precision"
    assert default.first_problem is None


def test_float16_softmax_loses_more_than_float32_softmax_over_4096_keys() -> None:
    """Small logits are stored almost exactly; what is left is the softmax's own rounding:
    4096 exponentials rounded, summed over 12 rounded levels, divided and rounded."""
    q, k, v = long_rows(0.1)
    _, default = run(q, k, v, dtype="float16")
    _, narrow = run(q, k, v, dtype="float16", softmax_dtype="float16")
    a, b = narrow.stage("weights"), default.stage("weights")
    assert a is not None
    assert b is not None
    assert a.normwise > 2 * b.normwise
    assert b.normwise <= U16  # the default: one rounding of each weight


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"dtype": "float16", "accumulate": "bfloat16"}, "--accumulate"),
        ({"dtype": "bfloat16", "softmax_dtype": "float16"}, "--softmax-dtype"),
        ({"accumulate": "float16"}, "--accumulate"),  # dtype float64
        ({"dtype": "float16", "accumulate": "float8_e5m2"}, "--accumulate"),
    ],
)
def test_an_accumulator_narrower_than_float32_must_be_the_dtype(
    options: dict[str, str], where: str
) -> None:
    with pytest.raises(SpecError) as info:
        parse_options(options)
    assert where in str(info.value)


@pytest.mark.parametrize(
    ("options", "accumulate", "softmax_dtype"),
    [
        ({"dtype": "float16"}, "float32", "float32"),
        ({"dtype": "float16", "accumulate": "same", "softmax_dtype": "same"}, "float16", "float16"),
        ({"dtype": "bfloat16", "accumulate": "bfloat16"}, "bfloat16", "float32"),
        ({"dtype": "float16", "accumulate": "float64"}, "float64", "float32"),
    ],
)
def test_allowed_combinations_resolve(
    options: dict[str, str], accumulate: str, softmax_dtype: str
) -> None:
    o = parse_options(options)
    assert (o.accumulate, o.softmax_dtype) == (accumulate, softmax_dtype)


# --- 9. float64 is not emulated; float32 is float64 to float32 rounding ----------------------


def test_dtype_float64_is_bit_identical_to_the_plain_pipeline() -> None:
    q, k, v = normal(36, 2, 6, 16), normal(37, 2, 9, 16), normal(38, 2, 9, 4)
    plain = trace(build_spec(q, k, v, options=Options(causal=True)))
    as_float64 = trace(
        build_spec(
            q,
            k,
            v,
            options=Options(
                causal=True, dtype="float64", accumulate="float32", softmax_dtype="float32"
            ),
        )
    )
    for (name, a), (_, b) in zip(stages(plain), stages(as_float64), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert diagnose(as_float64).emulation is None


def test_an_emulated_spec_computes_float64_when_not_emulating() -> None:
    """``attend_block(emulate=False)``, the reference every emulated block is compared to."""
    q, k, v = normal(39, 5, 16), normal(40, 7, 16), normal(41, 7, 4)
    plain = build_spec(q, k, v, options=Options(causal=True))
    emulated = build_spec(q, k, v, options=parse_options({"causal": True, "dtype": "float16"}))
    for lead, rows in iter_blocks(plain):
        a = attend_block(plain, lead, rows)
        b = attend_block(emulated, lead, rows, emulate=False)
        np.testing.assert_array_equal(a.output, b.output)
        np.testing.assert_array_equal(a.weights, b.weights)


def test_float32_emulation_is_float64_to_float32_rounding() -> None:
    q, k, v = normal(42, 2, 16, 64, sd=1.5), normal(43, 2, 128, 64), normal(44, 2, 128, 16)
    t, emulation = run(q, k, v, dtype="float32")
    weights, output = float64_attention(q, k, v)
    u32 = 2.0**-24
    assert t.weights is not None
    assert t.output is not None
    assert np.abs(t.weights - weights).max() <= 32 * u32 * np.abs(weights).max()
    assert np.abs(t.output - output).max() <= 32 * u32 * np.abs(output).max()
    assert np.abs(t.output - output).max() > 0  # and it did round
    assert emulation.first_problem is None
    assert all(s.normwise <= 16 * u32 for s in emulation.stages)


# --- 10. "lost precision" ----------------------------------------------------------------------


def test_large_logits_in_float16_lose_precision_first_in_the_weights() -> None:
    """Logits near 100 are stored to 1/32 in float16, so exp changes weights by ~3%:
    the weights' normwise error passes 16 unit roundoffs, the logits' stays ~1."""
    q = 1 + normal(45, 8, 64, sd=0.1)
    k = 12.5 + normal(46, 32, 64)
    v = normal(47, 32, 8)
    t, emulation = run(q, k, v, dtype="float16")
    assert t.scaled is not None
    assert 60 < np.abs(t.scaled).max() < 128

    want = kernel(q, k, v, "float16")
    raw64 = q @ k.T
    exact = {"raw": raw64, "scaled": raw64 / 8, "masked": raw64 / 8}
    exact["weights"], exact["output"] = float64_attention(q, k, v)
    normwise = {
        s: float(np.abs(getattr(want, s) - exact[s]).max() / np.abs(exact[s]).max()) for s in exact
    }
    first = next(
        s for s in ("raw", "scaled", "masked", "weights", "output") if normwise[s] > 16 * U16
    )
    assert first == "weights"
    problem = emulation.first_problem
    assert problem is not None
    assert (problem.stage, problem.problem) == ("weights", "lost precision")
    assert problem.normwise == pytest.approx(normwise["weights"], rel=0.05)
    for s in ("raw", "scaled", "masked"):
        report = emulation.stage(s)
        assert report is not None
        assert report.problem is None


def test_well_scaled_inputs_report_no_problem() -> None:
    q, k, v = normal(48, 2, 16, 64), normal(49, 2, 64, 64), normal(50, 2, 64, 16)
    _, emulation = run(q, k, v, dtype="float16")
    assert emulation.first_problem is None
    assert all(s.normwise < 4 * U16 for s in emulation.stages)


# --- logits in float32 (fused kernels) and the mask value's own overflow -------------------


def _large_logits() -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Integer Q, K and V (exact in float16) whose logits, 2·Σk/√3, lie near 100 a
    unit or so apart: only storing the logits in float16 (spacing 0.0625) loses anything."""
    rng = np.random.default_rng(7)
    q = np.full((4, 3), 2.0)
    k = rng.integers(28, 33, size=(16, 3)).astype(np.float64)
    v = rng.integers(-4, 5, size=(16, 3)).astype(np.float64)
    return q, k, v


def test_logits_in_float32_keep_what_float16_logits_lose() -> None:
    q, k, v = _large_logits()
    same = diagnose(trace(build_spec(q, k, v, options=parse_options({"dtype": "float16"}))))
    fused = diagnose(
        trace(
            build_spec(
                q, k, v, options=parse_options({"dtype": "float16", "logits_dtype": "float32"})
            )
        )
    )
    assert same.emulation is not None
    assert fused.emulation is not None
    assert fused.emulation.logits_dtype == "float32"
    w_same, w_fused = same.emulation.stage("weights"), fused.emulation.stage("weights")
    assert w_same is not None
    assert w_fused is not None
    # Rounding logits of ~100 to float16 moves them by up to 0.03, and the weights
    # with them; float32 logits leave only the rounding of the weights themselves.
    assert w_fused.normwise < w_same.normwise / 8
    first = same.emulation.first_problem
    assert first is not None
    assert first.problem == "lost precision"
    assert fused.emulation.first_problem is None


def test_options_built_directly_are_checked_too() -> None:
    assert Options(dtype="float16", accumulate="same").accumulate == "float16"
    assert Options(dtype="float16").logits_dtype == "float16"
    with pytest.raises(SpecError, match="accumulate"):
        Options(dtype="float16", accumulate="bfloat16")


def test_a_mask_value_that_overflows_is_the_first_problem() -> None:
    # -1e9 is -inf in float16: a fully masked row turns from uniform (float64) to zeros.
    x = np.eye(3)
    spec = build_spec(
        x,
        x,
        x,
        options=parse_options({"dtype": "float16", "mask_value": "-1e9", "key_lengths": 0}),
    )
    result = trace(spec)
    emulation = diagnose(result).emulation
    assert emulation is not None
    assert emulation.first_problem is not None
    assert (emulation.first_problem.stage, emulation.first_problem.problem) == (
        "masked",
        "overflowed",
    )
    assert np.all(result.weights == 0)  # float16's -inf: a safe softmax gives zeros
