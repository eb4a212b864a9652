"""check/diff.py: two calls compared. Q, K and V differ by the largest relative RMS
difference of a (batch, head) slice over the rows both runs use; padded positions,
repeated grouped K/V heads and the way a mask is given count for nothing; what the
mask hides is compared; shapes and the scale are compared; a run's verdict and its
one-line conclusion."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from sdpa_cli.check.diff import BOUND, CallDiff, Difference, Kernel, RunDiff, compare_call, mismatch
from sdpa_cli.check.pairing import Pairing
from sdpa_cli.engine import precision
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.errors import ExitCode

B, H, G, L, E = 2, 4, 2, 6, 8
U = precision.fmt("bfloat16").unit_roundoff


def inputs(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, H, L, E)),
        rng.standard_normal((B, G, L, E)),
        rng.standard_normal((B, G, L, E)),
    )


def spec(q: np.ndarray, k: np.ndarray, v: np.ndarray, **options: object) -> AttentionSpec:
    mask = options.pop("mask", None)
    return build_spec(q, k, v, mask=mask, options=Options(**options))  # type: ignore[arg-type]


def compared(a: AttentionSpec, b: AttentionSpec) -> tuple[dict[str, Difference], int, int]:
    return compare_call(a, b, (None, None), U)


def test_the_same_call_differs_by_nothing() -> None:
    a = spec(*inputs(), causal=True)
    found, rows, mask_rows = compared(a, a)
    assert {n: d.relative for n, d in found.items()} == {"q": 0.0, "k": 0.0, "v": 0.0}
    assert (rows, mask_rows) == (B * H * L, 0)


def test_rounding_to_bfloat16_differs_by_under_one_unit_roundoff() -> None:
    q, k, v = inputs()
    rounded = [x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in (q, k, v)]
    found, _, _ = compared(spec(q, k, v, causal=True), spec(*rounded, causal=True))
    for d in found.values():
        assert 0.3 < d.units < 1.0  # RMS of a rounding to nearest: about u/√3


def test_a_run_that_repeats_grouped_k_v_heads_pairs_with_one_that_does_not() -> None:
    """Hugging Face's SDPA path repeats K and V over the query heads when it passes a
    mask; its eager path gives them grouped."""
    q, k, v = inputs()
    repeated = spec(q, np.repeat(k, H // G, axis=1), np.repeat(v, H // G, axis=1), causal=True)
    found, _, _ = compared(spec(q, k, v, causal=True), repeated)
    assert all(d.relative == 0.0 for d in found.values())


def test_padded_positions_count_for_nothing_and_the_mask_s_form_neither() -> None:
    """A: a float mask of finfo.min (eager attention); B: a boolean mask, and garbage
    where the padding is (a model's padded positions differ freely)."""
    q, k, v = inputs()
    pad = 2  # item 1 left-padded
    keep = np.tril(np.ones((L, L), dtype=bool))[None, None].repeat(B, axis=0)
    keep[1, :, :, :pad] = False
    additive = np.where(keep, 0.0, np.finfo(np.float32).min)
    garbage = [x.copy() for x in (q, k, v)]
    for x in garbage:
        x[1, :, :pad] = 1e3
    a = spec(q, k, v, mask=additive)
    b = spec(*garbage, mask=keep)
    found, rows, mask_rows = compared(a, b)
    assert all(d.relative == 0.0 for d in found.values())
    assert rows == B * H * L - H * pad  # the padded queries see no key in either run
    assert mask_rows == 0


def test_a_mask_that_hides_other_keys_is_counted_by_rows() -> None:
    q, k, v = inputs()
    window = spec(q, k, v, causal=True, window=(2, 0))
    found, rows, mask_rows = compared(spec(q, k, v, causal=True), window)
    assert mask_rows == B * H * (L - 3)  # rows 3.. see fewer keys
    call = CallDiff("x", "x", "bfloat16", found, rows, mask_rows, limit=BOUND * U)
    assert (call.differing(), call.where) == (("mask",), "upstream")
    assert call.reason() == (
        f"the mask hides other keys on {mask_rows} of {rows} rows; Q, K, V agree within 0u"
    )


def test_the_worst_slice_is_named_and_a_value_one_run_lost_is_infinitely_off() -> None:
    q, k, v = inputs()
    off = q.copy()
    off[1, 3] *= 1.5
    lost = v.copy()
    lost[0, 1, 2, 0] = np.nan
    found, _, _ = compared(spec(q, k, v), spec(off, k, lost))
    assert found["q"].at == (1, 3)
    assert found["q"].relative == pytest.approx(0.5)
    assert found["v"].relative == math.inf
    assert found["v"].at[1] in (2, 3)  # a query head of K/V head 1


def test_nan_in_both_runs_at_one_place_is_no_difference() -> None:
    q, k, v = inputs()
    q[0, 0, 0, 0] = np.nan
    found, _, _ = compared(spec(q, k, v), spec(q.copy(), k, v))
    assert found["q"].relative == 0.0


def test_shapes_and_scales_that_differ_are_said_in_words() -> None:
    q, k, v = inputs()
    a = spec(q, k, v)
    assert mismatch(a, spec(q.copy(), k, v)) is None
    assert mismatch(a, spec(q[:, :, :4], k, v)) == (
        "the shapes differ: (2, 4) × L 6 × S 6, E 8, Ev 8 in A, (2, 4) × L 4 × S 6, E 8, Ev 8 in B"
    )
    assert mismatch(a, spec(q, k, v, scale=0.125)) == (
        "the scale differs: 0.353553 in A, 0.125 in B"
    )
    assert mismatch(spec(q[None], k[None], v[None]), a) is None  # leading 1s aside


def test_what_is_added_to_the_logits_is_compared_as_an_input() -> None:
    """Falcon's SDPA path passes ALiBi inside the float mask: the same Q, K, V with
    and without it compute different attention, and read as a divergence upstream."""
    q, k, v = inputs()
    distance = -np.abs(np.arange(L)[:, None] - np.arange(L)[None, :]).astype(np.float64)
    alibi = np.where(np.tril(np.ones((L, L), dtype=bool)), 0.5 * distance, -np.inf)
    a = spec(q, k, v, causal=True)
    b = spec(q, k, v, mask=alibi)
    found, rows, mask_rows = compared(a, b)
    assert mask_rows == 0  # both hide the future keys
    assert found["bias"].relative == math.inf  # A adds nothing where B adds ALiBi
    call = CallDiff("x", "x", "bfloat16", found, rows, mask_rows, limit=BOUND * U)
    assert (call.differing(), call.where) == (("bias",), "upstream")
    found, _, _ = compared(b, spec(q, k, v, mask=alibi * (1 + U)))  # rounding of ALiBi's slope
    assert found["bias"].units == pytest.approx(1.0)


def test_options_that_change_the_computation_are_said_in_words() -> None:
    q, k, v = inputs()
    a = spec(q, k, v, causal=True)
    assert mismatch(a, spec(q, k, v, causal=True, temperature=2.0)) == (
        "the scale differs: 0.353553 in A, 0.176777 in B"  # 1/√8, and ÷ the temperature 2
    )
    assert mismatch(a, spec(q, k, v, causal=True, alibi=True)) == (
        "the ALiBi differs: none in A, given in B"
    )


# --- verdicts ------------------------------------------------------------------------


def diff(
    units: dict[str, float], kernel: Kernel | None = None, kernel_a: Kernel | None = None
) -> CallDiff:
    found = {n: Difference(x * U, (0, 0), U) for n, x in units.items()}
    name = "model.layers.2.self_attn"
    return CallDiff(
        name, name, "bfloat16", found, 12, 0, limit=BOUND * U, kernel=kernel, kernel_a=kernel_a
    )


def test_an_input_past_the_limit_diverges_upstream() -> None:
    call = diff({"q": 258, "k": 263, "v": 3.7, "output": 72}, Kernel("b", True))
    assert call.where == "upstream"
    assert call.differing() == ("Q", "K")
    assert call.reason() == "Q, K differ by 258u, 263u; V agrees"


def test_inputs_that_agree_and_an_output_that_fails_its_check_diverge_in_the_kernel() -> None:
    call = diff({"q": 1.3, "k": 1.4, "v": 1.2}, Kernel("b", False, "output.close", "236 of 256"))
    assert call.where == "kernel"
    assert call.reason() == (
        "Q, K, V agree within 1.4u; B's output fails against its own inputs: output.close"
    )
    assert diff({"q": 1.0}, Kernel("b", True)).where is None
    assert diff({"q": 1.0}, None).where is None  # no output recorded: nothing to judge


def runs(*calls: CallDiff) -> RunDiff:
    pairing = Pairing(tuple((i, i) for i in range(len(calls))), "name")
    return RunDiff("a.yaml", "b.yaml", pairing, calls)


def test_a_run_names_its_first_divergence_and_exits_as_check_does() -> None:
    fine = diff({"q": 1.0, "k": 2.0, "v": 1.5}, Kernel("b", True))
    upstream = diff({"q": 258, "k": 263, "v": 3.7}, Kernel("b", True))
    assert runs(fine).exit_code == ExitCode.OK
    assert runs(fine).conclusion() == (
        "no divergence: 1 of 1 calls compared, Q, K and V within 2u of A's; 1 of B's "
        "outputs pass against their own inputs"
    )
    both = runs(fine, upstream, fine)
    assert both.first is upstream
    assert both.exit_code == ExitCode.CHECK_FAILED
    assert both.conclusion() == (
        "first divergence: model.layers.2.self_attn — upstream of attention (Q, K differ "
        "by 258u, 263u; V agrees)"
    )
    unread = CallDiff("x", "x", error="x.safetensors: cannot be read")
    assert runs(upstream, unread).exit_code == ExitCode.BAD_INPUT
    document = both.to_dict()
    assert document["first"] == {"a": upstream.a, "b": upstream.b, "where": "upstream"}
    assert document["calls"][1]["differ"] == ["q", "k"]


def test_a_s_own_kernel_failing_is_named_as_a_s() -> None:
    call = diff({"q": 1.0}, Kernel("b", True), kernel_a=Kernel("a", False, "output.close"))
    assert call.where == "kernel"
    assert (
        runs(call)
        .conclusion()
        .startswith(
            "first divergence: model.layers.2.self_attn — in run A's kernel (Q agrees within 1u; "
            "A's output fails"
        )
    )


def test_a_lost_value_and_nothing_compared_read_as_words() -> None:
    assert Difference(math.inf, (0, 0), U).text() == "inf"
    assert Difference(math.nan, (), U).text() == "—"
    call = diff({"q": math.inf, "k": 1.0, "v": math.nan})
    assert call.differing() == ("Q",)
    assert call.reason() == "Q differs by inf; K, V agree"
