"""Hints on failed comparisons: the slip a kernel made, named from the export alone.

Each buggy export is computed by the float64 loop oracle of ``tests/reference.py``
(or PyTorch, or plain numpy where the oracle has no such option) with the bug put in
by hand: the window one key off, K/V heads tiled with ``np.tile``, the tensors in
FlashAttention's (B, L, H, E) layout, a (B, S) mask used as (B, 1, 1, S), the bias
inside the softcap. The check is then run with the correct options, and the hint
must name the fix; a faithful export must get no option hint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clirunner import invoke
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.check import alternatives as alternatives_module
from sdpa_cli.check import hints as hints_module
from sdpa_cli.check.alternatives import alternatives
from sdpa_cli.check.hints import MATCH_GAIN, export_matches
from sdpa_cli.check.records import Check, Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine import precision
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import Trace, trace
from sdpa_cli.errors import ExitCode

F64 = NDArray[np.float64]
STRICT = CheckSettings(rtol=1e-9, atol=1e-9)
"""Tighter than any export of these cases but an exact one: every check fails."""


def normal(seed: int, *shape: int, scale: float = 1.0) -> F64:
    return scale * np.random.default_rng(seed).normal(size=shape)


def spec_of(
    q: NDArray[Any],
    k: NDArray[Any],
    v: NDArray[Any],
    bias: NDArray[Any] | None = None,
    mask: NDArray[Any] | None = None,
    segment_ids: NDArray[Any] | None = None,
    **options: Any,
) -> AttentionSpec:
    return build_spec(
        q, k, v, bias=bias, mask=mask, options=parse_options(options), segment_ids=segment_ids
    )


def close_check(
    spec: AttentionSpec,
    export: NDArray[Any],
    name: str = "output",
    settings: CheckSettings | None = None,
) -> Check:
    """``sdpa check`` of one export against ``spec``: its ``NAME.close`` check."""
    report = run_checks(spec, [Expected(name, export, f"{name}.npy")], settings)
    (close,) = [c for c in report.checks if c.name == f"{name}.close"]
    return close


def capped_bias_first(
    q: F64, k: F64, v: F64, bias: F64, softcap: float, scale: float
) -> tuple[F64, F64]:
    """softmax(C·tanh((Q Kᵀ·scale + bias) / C))·V by plain numpy: the output and weights."""
    logits = softcap * np.tanh((np.einsum("...LE,...SE->...LS", q, k) * scale + bias) / softcap)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights = e / e.sum(axis=-1, keepdims=True)
    return np.einsum("...LS,...SE->...LE", weights, v), weights


# --- the match criterion -----------------------------------------------------------------


def test_an_export_equal_to_the_alternative_matches() -> None:
    ref = np.zeros(2000)
    alt = np.full(2000, 0.5)
    assert export_matches(alt.copy(), alt, ref, "float64")


def test_two_outliers_in_2000_match_and_three_do_not() -> None:
    """0.1% of 2000 is 2: a third element outside 4 × float16's (1e-3, 1e-3) is one too many."""
    ref, alt = np.zeros(2000), np.full(2000, 0.5)
    export = alt.copy()
    export[:2] += 1.0
    assert export_matches(export, alt, ref, "float16")
    export[2] += 1.0
    assert not export_matches(export, alt, ref, "float16")


def test_the_tolerance_is_four_times_the_formats_default() -> None:
    """float16: |Δ| ≤ 4e-3 + 4e-3 · |alternative| = 6e-3 at 0.5."""
    ref, alt = np.zeros(10), np.full(10, 0.5)
    assert export_matches(alt + 5.9e-3, alt, ref, "float16")
    assert not export_matches(alt + 6.1e-3, alt, ref, "float16")
    assert not export_matches(alt + 5.9e-3, alt, ref, "float64")


def test_the_tolerance_is_taken_at_the_rows_scale() -> None:
    """bfloat16: 4e-3 + 0.064 · (the row's largest |alternative|, 2.0) = 0.132 for every
    element of a row, the one near zero too (its own scale would allow 0.004): a 16-bit
    kernel rounds at the row's scale. Each row's small element 0.05 off matches; 0.14
    off does not."""
    alt = np.tile([2.0, 0.001], (1000, 1))
    ref = alt + 1.0
    assert export_matches(alt + np.array([0.0, 0.05]), alt, ref, "bfloat16")
    assert not export_matches(alt + np.array([0.0, 0.14]), alt, ref, "bfloat16")


def test_the_alternative_must_be_ten_times_closer_than_the_reference() -> None:
    """Every element within float16's loosened tolerance, but the RMS error must also be
    at most a tenth of the reference's (0.02 here): 0.0019 passes, 0.0021 does not."""
    assert MATCH_GAIN == 10
    export = np.full(100, 0.5)
    ref = export - 0.02
    assert export_matches(export, export - 0.0019, ref, "float16")
    assert not export_matches(export, export - 0.0021, ref, "float16")


def test_an_alternative_that_changes_nothing_never_matches() -> None:
    """An export failing for another reason (one NaN) and an alternative equal to the
    reference: the RMS errors tie (both 0), so it does not match."""
    ref = np.full(5000, 0.25)
    export = ref.copy()
    export[7] = math.nan
    assert not export_matches(export, ref.copy(), ref, "float16")


def test_a_non_finite_element_on_one_side_counts_as_a_miss() -> None:
    ref, alt = np.zeros(10), np.full(10, 0.5)
    export = alt.copy()
    export[3] = math.inf
    assert not export_matches(export, alt, ref, "float64")
    alt_nan, export_nan = alt.copy(), alt.copy()
    alt_nan[3] = export_nan[3] = math.nan  # NaN on both sides: not counted at all
    assert export_matches(export_nan, alt_nan, ref, "float64")


def test_nothing_finite_matches_nothing() -> None:
    nan = np.full(4, math.nan)
    assert not export_matches(nan, nan, np.zeros(4), "float64")


# --- which alternatives apply --------------------------------------------------------------


def labels(spec: AttentionSpec) -> list[str]:
    return [a.label for a in alternatives(spec, "float64")]


def test_a_plain_case_gets_only_the_option_alternatives() -> None:
    q, k, v = normal(1, 2, 3, 4), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    assert labels(spec_of(q, k, v)) == [
        "--scale dk (scale 1/E: 1/√E applied twice)",
        "--scale none (scale 1: the scale omitted)",
        "--causal",
        LSE_BASE_TWO,
    ]


def test_every_alternative_applies_where_its_option_or_shape_is_given() -> None:
    """A window with keys on both sides, grouped-query heads, a (B, S) mask (B = L = 3),
    a softcap with a bias: each brings its alternatives, in order."""
    q, k, v = normal(1, 3, 4, 3, 4), normal(2, 3, 2, 5, 4), normal(3, 3, 2, 5, 2)
    mask = np.ones((3, 5), dtype=np.bool_)
    spec = spec_of(q, k, v, bias=normal(4, 3, 5), mask=mask, window=(2, 1), softcap=5.0)
    assert labels(spec)[3:] == [
        "--causal-align lower-right",
        "--mask-true-means masked",
        "no --bias (the bias left out)",
        "--window 1,1 (one key fewer on the left: Hugging Face's sliding_window counts the query itself)",
        "--window 3,1 (one key more on the left: FlashAttention's window_size leaves the query itself out)",
        "--window 2,0 (one key fewer on the right)",
        "--window 2,2 (one key more on the right)",
        "K/V heads tiled (head h uses K/V head h mod G) instead of interleaved (h div r)",
        LSE_BASE_TWO,
        "the mask is a (B, S) key-padding mask: give it as (B, 1, 1, S)",
        "the bias was added before the softcap (softcap(QKᵀ·scale + bias)); sdpa adds it after",
    ]


LSE_BASE_TWO = (
    "the LSE is in base 2 (log₂ Σ eˣ, as FlashAttention's kernels keep it inside): "
    "multiply it by ln 2"
)


def test_an_lse_in_base_two_is_named() -> None:
    """log₂ of the row sums where ln was meant: the export is the LSE ÷ ln 2, which the
    hint names, and the diagnosis finds the constant factor 1/ln 2 = 1.443."""
    q, k, v = normal(1, 2, 6, 4, scale=2.0), normal(2, 2, 6, 4), normal(3, 2, 6, 3)
    masked = attention(q, k, v, causal=True).masked
    top = masked.max(axis=-1)
    lse = top + np.log(np.exp(masked - top[..., None]).sum(axis=-1))
    close = close_check(
        spec_of(q, k, v, causal=True), (lse / math.log(2)).astype(np.float16), "lse"
    )
    assert close.status == "fail"
    assert close.hint is not None
    assert close.hint.startswith(LSE_BASE_TWO)
    fit = close.details["diagnosis"]["fit"]
    assert fit["factor"] == pytest.approx(1 / math.log(2), rel=1e-3)  # the float16 rounding
    assert "1/ln 2: a base-2 logarithm" in fit["words"]


def test_a_window_with_nothing_on_the_left_is_not_narrowed() -> None:
    q = normal(1, 4, 4)
    windows = [lab for lab in labels(spec_of(q, q, q, window=(0, 0))) if "--window" in lab]
    assert [w.split(" (")[0] for w in windows] == ["--window 1,0"]


def test_the_layout_alternative_needs_four_dimensional_q_k_v_without_a_mask() -> None:
    q4, q3 = normal(1, 2, 5, 3, 4), normal(1, 5, 3, 4)
    layout = "Q, K, V and the output look like (B, L, H, E) (FlashAttention's layout): pass --layout bshd"
    assert layout in labels(spec_of(q4, q4, q4))
    assert layout not in labels(spec_of(q3, q3, q3))
    assert layout not in labels(spec_of(q4, q4, q4, mask=np.ones((3, 3), dtype=np.bool_)))


# --- each slip, injected and named ---------------------------------------------------------

Case = tuple[AttentionSpec, NDArray[Any], str]
"""The spec of the correct options, the buggy export (output), the fix its hint names."""


def scale_twice() -> Case:
    q, k, v = normal(1, 2, 3, 4), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    return (
        spec_of(q, k, v),
        attention(q, k, v, scale="dk").output,
        "--scale dk (scale 1/E: 1/√E applied twice)",
    )


def scale_omitted() -> Case:
    q, k, v = normal(1, 2, 3, 4), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    return (
        spec_of(q, k, v),
        attention(q, k, v, scale="none").output,
        "--scale none (scale 1: the scale omitted)",
    )


def causal_forgotten() -> Case:
    q, k, v = normal(1, 2, 4, 4), normal(2, 2, 4, 4), normal(3, 2, 4, 3)
    return spec_of(q, k, v, causal=True), attention(q, k, v).output, "--no-causal"


def causal_added() -> Case:
    q, k, v = normal(1, 2, 4, 4), normal(2, 2, 4, 4), normal(3, 2, 4, 3)
    return spec_of(q, k, v), attention(q, k, v, causal=True).output, "--causal"


def causal_lower_right() -> Case:
    q, k, v = normal(1, 2, 3, 4), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    out = attention(q, k, v, causal=True, causal_align="lower-right").output
    return spec_of(q, k, v, causal=True), out, "--causal-align lower-right"


def mask_inverted() -> Case:
    q, k, v = normal(1, 2, 3, 4), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    mask = np.array([[1, 0, 1, 0, 1], [0, 1, 1, 0, 0], [1, 1, 0, 1, 0]], dtype=np.bool_)
    out = attention(q, k, v, mask=mask, mask_true_means="masked").output
    return spec_of(q, k, v, mask=mask), out, "--mask-true-means masked"


def padding_attended() -> Case:
    q, k, v = normal(1, 2, 1, 3, 4), normal(2, 2, 1, 5, 4), normal(3, 2, 1, 5, 3)
    out = attention(q, k, v).output
    return spec_of(q, k, v, key_lengths=(2, 4)), out, "no --key-lengths (padding keys attended)"


def bias_dropped() -> Case:
    q, k, v = normal(1, 2, 3, 4), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    bias = normal(4, 3, 5, scale=2.0)
    return spec_of(q, k, v, bias=bias), attention(q, k, v).output, "no --bias"


def window(given: tuple[int, int], used: tuple[int, int], fix: str) -> Callable[[], Case]:
    def case() -> Case:
        q, k, v = normal(1, 2, 8, 4, scale=2.0), normal(2, 2, 8, 4), normal(3, 2, 8, 3)
        return spec_of(q, k, v, window=given), attention(q, k, v, window=used).output, fix

    return case


def tiled_heads() -> Case:
    """H = 4 query heads over G = 2 K/V heads: the kernel gave head h K/V head h mod 2."""
    q, k, v = normal(1, 1, 4, 3, 4, scale=2.0), normal(2, 1, 2, 5, 4), normal(3, 1, 2, 5, 3)
    out = attention(q, np.tile(k, (1, 2, 1, 1)), np.tile(v, (1, 2, 1, 1))).output
    fix = "K/V heads tiled (head h uses K/V head h mod G) instead of interleaved (h div r)"
    return spec_of(q, k, v), out, fix


def flash_layout() -> Case:
    """B = 2, H = 3, L = S = 5: the files hold (B, L, H, E); sdpa reads (B, H, L, E)."""
    q, k, v = normal(1, 2, 3, 5, 4), normal(2, 2, 3, 5, 4), normal(3, 2, 3, 5, 2)
    out = attention(q, k, v, causal=True).output
    files = [np.swapaxes(a, 1, 2) for a in (q, k, v)]
    fix = "pass --layout bshd"
    return spec_of(*files, causal=True), np.swapaxes(out, 1, 2), fix


def key_padding_as_rows() -> Case:
    """A (B, S) = (3, 5) padding mask, read by broadcasting as (L, S) (L = 3)."""
    q, k, v = normal(1, 3, 2, 3, 4), normal(2, 3, 2, 5, 4), normal(3, 3, 2, 5, 3)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=np.bool_)
    out = attention(q, k, v, mask=mask.reshape(3, 1, 1, 5)).output
    fix = "the mask is a (B, S) key-padding mask: give it as (B, 1, 1, S)"
    return spec_of(q, k, v, mask=mask), out, fix


def bias_inside_softcap() -> Case:
    q, k, v = normal(1, 2, 3, 4, scale=2.0), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    bias = normal(4, 3, 5, scale=2.0)
    out, _ = capped_bias_first(q, k, v, bias, softcap=1.5, scale=0.5)
    fix = "the bias was added before the softcap (softcap(QKᵀ·scale + bias)); sdpa adds it after"
    return spec_of(q, k, v, bias=bias, softcap=1.5), out, fix


def causal_mask_transposed() -> Case:
    """torch.triu where torch.tril was meant: each query sees itself and later keys."""
    q, k, v = normal(1, 2, 4, 4, scale=2.0), normal(2, 2, 4, 4), normal(3, 2, 4, 3)
    out = attention(q, k, v, mask=np.triu(np.ones((4, 4), dtype=np.bool_))).output
    return spec_of(q, k, v, causal=True), out, "the causal mask transposed"


def causal_mask_inverted() -> Case:
    """~tril (L = 3 < S = 5, so that every query still sees a key): the later keys only."""
    q, k, v = normal(1, 2, 3, 4, scale=2.0), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    later = np.arange(5)[None, :] > np.arange(3)[:, None]
    out = attention(q, k, v, mask=later).output
    return spec_of(q, k, v, causal=True), out, "the causal mask inverted"


def mask_transposed() -> Case:
    """A square boolean mask file read with its query and key axes swapped."""
    q, k, v = normal(1, 2, 4, 4, scale=2.0), normal(2, 2, 4, 4), normal(3, 2, 4, 3)
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 1]], dtype=np.bool_)
    out = attention(q, k, v, mask=mask.T).output
    return spec_of(q, k, v, mask=mask), out, "the mask transposed"


def documents_leak() -> Case:
    """Two packed documents (rows 0–1 and 2–4) under --causal: the kernel ignored them."""
    q, k, v = normal(1, 2, 5, 4, scale=2.0), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    out = attention(q, k, v, causal=True).output
    segments = np.array([0, 0, 1, 1, 1])
    spec = spec_of(q, k, v, causal=True, segment_ids=segments)
    return spec, out, "the segment ids ignored (attention leaks across the packed documents)"


def temperature_forgotten() -> Case:
    q, k, v = normal(1, 2, 3, 4, scale=2.0), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    out = attention(q, k, v).output
    return spec_of(q, k, v, temperature=4.0), out, "no --temperature"


HF = "--window 2,0 (one key fewer on the left: Hugging Face's sliding_window counts the query itself)"
FA = "--window 4,0 (one key more on the left: FlashAttention's window_size leaves the query itself out)"
CASES: dict[str, Callable[[], Case]] = {
    "scale_applied_twice": scale_twice,
    "scale_omitted": scale_omitted,
    "causal_mask_forgotten": causal_forgotten,
    "causal_mask_added": causal_added,
    "causal_aligned_lower_right": causal_lower_right,
    "mask_polarity_inverted": mask_inverted,
    "padding_keys_attended": padding_attended,
    "bias_dropped": bias_dropped,
    "window_one_fewer_on_the_left": window((3, 0), (2, 0), HF),
    "window_one_more_on_the_left": window((3, 0), (4, 0), FA),
    "window_one_fewer_on_the_right": window(
        (2, 2), (2, 1), "--window 2,1 (one key fewer on the right)"
    ),
    "window_one_more_on_the_right": window(
        (2, 2), (2, 3), "--window 2,3 (one key more on the right)"
    ),
    "kv_heads_tiled": tiled_heads,
    "flash_attention_layout": flash_layout,
    "key_padding_mask_as_rows": key_padding_as_rows,
    "bias_inside_the_softcap": bias_inside_softcap,
    "causal_mask_transposed": causal_mask_transposed,
    "causal_mask_inverted": causal_mask_inverted,
    "mask_transposed": mask_transposed,
    "packed_documents_leak": documents_leak,
    "temperature_forgotten": temperature_forgotten,
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_hint_names_the_fix(case: Callable[[], Case]) -> None:
    spec, export, fix = case()
    close = close_check(spec, export)
    assert close.status == "fail"
    assert close.hint is not None
    assert fix in close.hint


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_hint_holds_for_a_float16_export_under_any_tolerance(case: Callable[[], Case]) -> None:
    """The buggy export rounded to float16 and judged at 1e-9: the check's tolerance is
    far tighter than the export can be, yet the hint is the same (it judges by float16's
    own defaults, ×4)."""
    spec, export, fix = case()
    close = close_check(spec, export.astype(np.float16), settings=STRICT)
    assert close.status == "fail"
    assert close.hint is not None
    assert fix in close.hint


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_faithful_float16_export_gets_no_hint(case: Callable[[], Case]) -> None:
    """The correct computation rounded to float16, judged at 1e-9: it fails on rounding
    alone, and no alternative explains it better than the reference does."""
    spec, _, _ = case()
    out = oracle_output(spec).astype(np.float16)
    close = close_check(spec, out, settings=STRICT)
    assert close.status == "fail"
    assert close.hint is None


def oracle_output(spec: AttentionSpec) -> F64:
    """The float64 oracle's output of ``spec``'s own inputs and options (for the bias
    inside the softcap: sdpa's order, the cap then the bias)."""
    o = spec.options
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (spec.q, spec.k, spec.v))
    mask = None if spec.mask is None else np.asarray(spec.mask)
    if spec.segment_ids is not None:  # the documents as a boolean mask of their own
        assert mask is None
        ids_q, ids_k = (np.asarray(ids).reshape(-1) for ids in spec.segment_ids)
        mask = ids_q[:, None] == ids_k[None, :]
    bias = None if spec.bias is None else np.asarray(spec.bias, dtype=np.float64)
    return attention(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        scale=o.scale,
        temperature=o.temperature,
        softcap=o.softcap,
        causal=o.causal,
        causal_align=o.causal_align,
        mask_true_means=o.mask_true_means,
        key_lengths=o.key_lengths,
        window=o.window,
    ).output


def test_the_weights_and_lse_get_the_hint_too() -> None:
    """The bias inside the softcap, exported as weights and LSE as well as the output."""
    q, k, v = normal(1, 2, 3, 4, scale=2.0), normal(2, 2, 5, 4), normal(3, 2, 5, 3)
    bias = normal(4, 3, 5, scale=2.0)
    out, weights = capped_bias_first(q, k, v, bias, softcap=1.5, scale=0.5)
    logits = 1.5 * np.tanh((np.einsum("...LE,...SE->...LS", q, k) * 0.5 + bias) / 1.5)
    lse = np.log(np.exp(logits).sum(axis=-1))
    spec = spec_of(q, k, v, bias=bias, softcap=1.5)
    exports = [
        Expected("output", out, "o"),
        Expected("weights", weights, "w"),
        Expected("lse", lse, "l"),
    ]
    report = run_checks(spec, exports)
    for name in ("output", "weights", "lse"):
        (close,) = [c for c in report.checks if c.name == f"{name}.close"]
        assert close.status == "fail"
        assert close.hint is not None
        assert "the bias was added before the softcap" in close.hint


def test_the_measured_tolerance_hint_still_fires_on_the_defaults() -> None:
    """A float16 export a little off everywhere, judged by float16's defaults
    (``tolerance="dtype"``): no slip explains it, and it passes the measured tolerance,
    so the hint says so."""
    q, k, v = (
        normal(seed, 2, 6, dim, scale=x).astype(np.float16)
        for seed, dim, x in ((1, 8, 3.0), (2, 8, 3.0), (3, 4, 1.0))
    )
    export = (attention(q, k, v).output + 1.2e-3).astype(np.float16)
    spec = spec_of(q, k, v)
    close = close_check(spec, export, settings=CheckSettings(tolerance="dtype"))
    assert close.status == "fail"
    assert close.tolerance is not None
    assert close.tolerance.source == "float16 defaults"
    assert close.hint is not None
    assert close.hint.startswith("it passes --tolerance measured")


# --- through the command line, and against PyTorch -----------------------------------------


def test_the_cli_names_the_window_fix(workdir: Path) -> None:
    spec, export, fix = window((3, 0), (2, 0), HF)()
    for name, a in (("q", spec.q), ("k", spec.k), ("v", spec.v), ("out", export)):
        np.save(workdir / f"{name}.npy", a)
    args = ("q.npy", "k.npy", "v.npy", "--window", "3,0", "--expect-output", "out.npy")
    result = invoke("check", *args, "--format", "json")
    assert result.exit_code == ExitCode.CHECK_FAILED, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["cases"][0]["checks"]}
    assert checks["output.close"]["hint"].startswith(
        f"the export matches the computation with {fix}: "
    )


def test_a_hugging_face_sliding_window_in_torch_gets_the_window_hint() -> None:
    """Hugging Face's sliding_window = W: query i sees keys i − W < j ≤ i, W keys with
    itself. Given as --window W,0 it is one key too wide."""
    torch = pytest.importorskip("torch")
    W, L = 3, 8
    q, k, v = (torch.from_numpy(normal(s, 1, 2, L, 4)) for s in (1, 2, 3))
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    hf_mask = (j <= i) & (j > i - W)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=hf_mask)
    spec = spec_of(q.numpy(), k.numpy(), v.numpy(), window=(W, 0))
    close = close_check(spec, out.numpy())
    assert close.hint is not None
    assert "--window 2,0 (one key fewer on the left" in close.hint


def test_torch_heads_repeated_not_interleaved_get_the_tiled_hint() -> None:
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(normal(1, 2, 6, 4, 8, scale=2.0))
    k, v = torch.from_numpy(normal(2, 2, 2, 5, 8)), torch.from_numpy(normal(3, 2, 2, 5, 3))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1)
    )
    spec = spec_of(q.numpy(), k.numpy(), v.numpy())
    close = close_check(spec, out.numpy())
    assert close.hint is not None
    assert "K/V heads tiled (head h uses K/V head h mod G)" in close.hint
    good = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert close_check(spec, good.numpy()).status == "pass"


# --- a narrow computation stored wide ------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_a_narrow_output_stored_as_float32_is_named(fmt: str) -> None:
    """A float32 export whose every value is a bfloat16 (or float16) number: it was
    computed in that format; the check fails at float32's precision and says so."""
    q, k, v = (normal(s, 1, 2, 16, 8).astype(np.float32) for s in (71, 72, 73))
    narrow = precision.round_to(attention(q, k, v).output, fmt).astype(np.float32)
    spec = build_spec(q, k, v)
    report = run_checks(spec, [Expected("output", narrow, "out.npy")])
    c = next(c for c in report.checks if c.name == "output.close")
    assert c.status == "fail"
    assert c.hint == (
        f"every exported value is a {fmt} number: the export looks computed in {fmt} "
        f"and stored as float32; if so, check it with --dtype {fmt}"
    )


def test_a_float32_output_gets_no_narrow_format_hint() -> None:
    q, k, v = (normal(s, 1, 2, 16, 8).astype(np.float32) for s in (71, 72, 73))
    wrong = (attention(q, k, v).output * 1.01).astype(np.float32)
    report = run_checks(build_spec(q, k, v), [Expected("output", wrong, "out.npy")])
    c = next(c for c in report.checks if c.name == "output.close")
    assert c.status == "fail"
    assert c.hint is None or "number" not in c.hint


def test_a_large_case_is_hinted_from_its_worst_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the limit of scores, the alternatives are computed on the slices whose
    error is largest, as many as the limit holds: here one (batch, head) slice of 5 × 5
    scores of the 3 × 2, the only one the kernel got wrong, and the hint still names
    the fix."""
    monkeypatch.setattr(hints_module, "_SUSPECT_LIMIT", 30)
    q, k, v = normal(1, 3, 2, 5, 4, scale=2.0), normal(2, 3, 2, 5, 4), normal(3, 3, 2, 5, 3)
    out = attention(q, k, v).output
    out[2, 1] = attention(q, k, v, causal=True).output[2, 1]  # one head made causal
    traced: list[object] = []

    def tracing(*args: Any, **kwargs: Any) -> Trace:
        traced.append(kwargs["leads"])
        return trace(*args, **kwargs)

    monkeypatch.setattr(alternatives_module, "trace", tracing)
    close = close_check(spec_of(q, k, v), out)
    assert close.status == "fail"
    assert close.hint is not None
    assert "--causal" in close.hint
    assert traced
    assert all(leads == [(2, 1)] for leads in traced)


def test_an_outputs_alternatives_trace_no_score_sized_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: each alternative traced the masked scores and the weights, (L, S)
    arrays, to compare an output: a failing (1, 2, 8192, 64) check held 2.4 GiB. An
    output's alternatives trace the output alone, and still name the slip."""
    traced: list[tuple[str, ...]] = []

    def spy(spec: AttentionSpec, stages: tuple[str, ...], **kw: Any) -> Trace:
        traced.append(tuple(stages))
        return trace(spec, stages, **kw)

    monkeypatch.setattr(alternatives_module, "trace", spy)
    q, k, v = normal(1, 2, 16, 4), normal(2, 2, 16, 4), normal(3, 2, 16, 4)
    exported = attention(q, k, v, causal=False).output
    close = close_check(spec_of(q, k, v, causal=True), exported)
    assert close.hint is not None
    assert "--no-causal" in close.hint
    assert traced
    assert set(traced) == {("output",)}
