"""The lean backward block equals the per-stage one (``sdpa_cli.engine.grad_block``).

:func:`~sdpa_cli.engine.grad_block.lean_backward_block` takes its weights from the
lean forward pass (the scale folded into Q, every statistic read from the softmax)
and forms dS in place; :func:`~sdpa_cli.engine.grad_block.backward_block` computes
every stage. On every mask option (rows that see no key, windows, padding, packed
documents, grouped heads), block by block, the two give the same dQ, dK, dV to
rounding, the same per-row and per-key records (the visible keys, the top key,
the largest weight, the gain 1 − Σ A², ‖dA‖, ‖dS‖), and the same forward
statistics. Where the lean block does not apply it says so (None), and
:func:`~sdpa_cli.engine.grad.backward` gives the per-stage answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal, getcontext
from typing import Any

import numpy as np
import pytest
from attention_cases import CASES, make_spec

from sdpa_cli.engine import grad_block
from sdpa_cli.engine.block import key_range, operands
from sdpa_cli.engine.driver import Place, SliceInputs
from sdpa_cli.engine.grad import backward, make_dout
from sdpa_cli.engine.grad_block import (
    BlockGrad,
    backward_block,
    lean_backward_block,
    norm,
    row_norm,
)
from sdpa_cli.engine.options import FINFO_MIN
from sdpa_cli.engine.positions import valid_queries
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats

GRAD_CASES = {name: case for name, case in CASES.items() if not case.get("float32")}
"""The float64 cases: the backward pass runs in float64 whatever ``--dtype`` says."""

ROW_RECORDS = ("da_norm", "ds_norm", "gain", "max_weight", "rest", "key_weight")
EXACT_RECORDS = ("argmax", "n_visible", "key_seen")


def places(spec: AttentionSpec, step: int) -> Iterator[Place]:
    inputs = SliceInputs()
    for lead in np.ndindex(*spec.lead):
        li = tuple(int(x) for x in lead)
        for i0 in range(0, spec.L, step):
            rows = slice(i0, min(i0 + step, spec.L))
            yield Place(li, rows, key_range(spec, li, rows), inputs)


def assert_same_block(got: BlockGrad, want: BlockGrad) -> None:
    for name in ("dq", "dk", "dv", *ROW_RECORDS):
        np.testing.assert_allclose(
            getattr(got, name), getattr(want, name), rtol=1e-11, atol=1e-13, err_msg=name
        )
    for name in EXACT_RECORDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


@pytest.mark.parametrize("step", [5, 64])
@pytest.mark.parametrize("case", GRAD_CASES.values(), ids=GRAD_CASES.keys())
def test_every_lean_block_equals_the_per_stage_block(case: dict[str, Any], step: int) -> None:
    spec = make_spec(3, **case)
    dout = make_dout(spec, "random", 5, "--dout")
    lean_stats, stage_stats = Stats.empty(spec), Stats.empty(spec)
    for place in places(spec, step):
        inputs = operands(spec, place.lead, emulate=False)
        g = dout[place.at]
        got = lean_backward_block(spec, place, g, inputs, lean_stats)
        assert got is not None, "the lean block applies to every mask option"
        want = backward_block(
            spec, place.lead, place.rows, g, keys=place.keys, inputs=inputs, stats=stage_stats
        )
        assert_same_block(got, want)
    for name in ("n_visible", "argmax"):
        np.testing.assert_array_equal(getattr(lean_stats, name), getattr(stage_stats, name))
    for name in ("max_weight", "entropy"):
        np.testing.assert_allclose(
            getattr(lean_stats, name), getattr(stage_stats, name), rtol=1e-12, atol=1e-13
        )
    for d in lean_stats.narrow:
        np.testing.assert_array_equal(lean_stats.underflow[d], stage_stats.underflow[d])


@pytest.mark.parametrize("mask_value", [-1e9, FINFO_MIN], ids=["-1e9", "finfo-min"])
@pytest.mark.parametrize("case", GRAD_CASES.values(), ids=GRAD_CASES.keys())
def test_under_a_finite_mask_value_a_lean_block_equals_the_per_stage_block(
    case: dict[str, Any], mask_value: float
) -> None:
    """Hidden keys weigh 0 where a row sees a key; a block with a row that sees none
    (uniform over every key) is left to the per-stage block."""
    spec = make_spec(3, **case, mask_value=mask_value)
    dout = make_dout(spec, "random", 5, "--dout")
    lean_stats, stage_stats = Stats.empty(spec), Stats.empty(spec)
    for place in places(spec, 5):
        inputs = operands(spec, place.lead, emulate=False)
        g = dout[place.at]
        want = backward_block(
            spec, place.lead, place.rows, g, keys=place.keys, inputs=inputs, stats=stage_stats
        )
        got = lean_backward_block(spec, place, g, inputs, lean_stats)
        if got is None:
            assert (want.n_visible[: valid_queries(spec, place.lead) - place.rows.start] == 0).any()
            got = backward_block(
                spec, place.lead, place.rows, g, keys=place.keys, inputs=inputs, stats=lean_stats
            )
        assert_same_block(got, want)
    np.testing.assert_array_equal(lean_stats.argmax, stage_stats.argmax)
    np.testing.assert_allclose(lean_stats.entropy, stage_stats.entropy, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lean_stats.hidden_weight, stage_stats.hidden_weight, atol=1e-12)


def test_the_lean_blocks_make_the_same_gradients_as_the_per_stage_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_spec(4, **CASES["causal-window-padding"])
    dout = make_dout(spec, "random", 6, "--dout")
    lean = backward(spec, dout, rows=4, jobs=2)
    monkeypatch.setattr("sdpa_cli.engine.grad.lean_backward_block", lambda *a: None)
    per_stage = backward(spec, dout, rows=4)
    for name in ("dq", "dk", "dv", "da_norm", "ds_norm", "gain", "rest", "key_weight"):
        np.testing.assert_allclose(
            getattr(lean, name), getattr(per_stage, name), rtol=1e-11, atol=1e-13, err_msg=name
        )
    np.testing.assert_array_equal(lean.argmax, per_stage.argmax)


NOT_LEAN = {
    "softcap": {"softcap": 5.0},
    "dropout": {"dropout": 0.1},
    # −1 leaves hidden keys weight (a finite mask value far below the scores does not)
    "mask-value-near-the-scores": {"causal": True, "mask_value": -1.0},
    "float-mask": {"mask": "float"},
}


@pytest.mark.parametrize("case", NOT_LEAN.values(), ids=NOT_LEAN.keys())
def test_options_the_lean_block_does_not_compute_say_so(case: dict[str, Any]) -> None:
    spec = make_spec(5, **case)
    dout = make_dout(spec, "random", 7, "--dout")
    place = next(places(spec, 4))
    inputs = operands(spec, place.lead, emulate=False)
    assert lean_backward_block(spec, place, dout[place.at], inputs, None) is None


def test_a_non_finite_dout_takes_the_per_stage_block() -> None:
    spec = make_spec(6, causal=True)
    dout = make_dout(spec, "random", 8, "--dout")
    dout[0, 0, 2, 1] = np.nan
    place = next(places(spec, 4))
    inputs = operands(spec, place.lead, emulate=False)
    assert lean_backward_block(spec, place, dout[place.at], inputs, None) is None


def test_a_row_with_no_visible_key_records_minus_one_and_passes_nothing() -> None:
    spec = make_spec(7, **CASES["causal-lower-right-L>S"])  # rows 0..16 see no key
    dout = make_dout(spec, "random", 9, "--dout")
    place = next(places(spec, 8))
    inputs = operands(spec, place.lead, emulate=False)
    got = lean_backward_block(spec, place, dout[place.at], inputs, None)
    assert got is not None
    assert np.all(got.argmax == -1)
    assert np.all(got.n_visible == 0)
    assert np.all(got.dq == 0)
    assert np.all(got.gain == 0)


@pytest.mark.parametrize("scale", [1e-200, 1e-160, 1.0, 1e160, 1e200])
def test_row_norm_is_the_careful_norm_at_every_magnitude(scale: float) -> None:
    """Squares of 1e-200 underflow and of 1e200 overflow: those rows take the scaled
    path; every row agrees with :func:`norm` to rounding."""
    x = np.random.default_rng(0).normal(size=(6, 50)) * scale
    x[1] = 0.0
    x[2, 3] = np.inf
    x[3, 4] = np.nan
    got, want = row_norm(x), norm(x, axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-14)
    assert got[1] == 0
    assert got[2] == np.inf
    assert np.isnan(got[3])
    assert np.all(np.isfinite(got[[0, 4, 5]]))
    assert np.all(got[[0, 4, 5]] > 0)


def test_softmax_backward_leaves_da_as_it_was() -> None:
    a = np.array([[0.7, 0.2, 0.1], [1.0, 0.0, 0.0]])
    da = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    before = da.copy()
    ds, top = grad_block.softmax_backward(a, da)
    np.testing.assert_array_equal(da, before)
    np.testing.assert_array_equal(top, [0, 0])
    # dS = A ⊙ (dA − Σ A dA): row 0 Σ = 0.7 + 0.4 + 0.3 = 1.4
    np.testing.assert_allclose(ds[0], [0.7 * -0.4, 0.2 * 0.6, 0.1 * 1.6], rtol=1e-14)
    np.testing.assert_array_equal(ds[1], [0.0, 0.0, 0.0])


def _decimal_ds(logits: list[float], da: list[float]) -> list[Decimal]:
    """dS = A ⊙ (dA − Σ A dA) to 50 digits, the weights from the logits."""
    getcontext().prec = 50
    top = max(logits)
    e = [(Decimal(x) - Decimal(top)).exp() for x in logits]
    a = [x / sum(e) for x in e]
    mean = sum(w * Decimal(d) for w, d in zip(a, da, strict=True))
    return [w * (Decimal(d) - mean) for w, d in zip(a, da, strict=True)]


def test_softmax_backward_gives_a_saturated_rows_tiny_ds_to_full_precision() -> None:
    """Row 0 is saturated (its top logit 40 above the rest: 1 − A_top ≈ 10⁻¹⁸), so
    dA_top − Σ A dA cancels: centred on the top key, its dS keeps every digit, the
    top key's included. Row 1 (no weight above a half) is not centred, and its dS is
    as precise."""
    logits = np.array([[40.0, 0.5, -0.25, 0.0], [0.3, 0.1, -0.2, 0.25]])
    da = np.array([[1.25, -0.75, 2.0, 0.5], [1.25, -0.75, 2.0, 0.5]])
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    a = e / e.sum(axis=1, keepdims=True)
    ds, top = grad_block.softmax_backward(a, da)
    np.testing.assert_array_equal(top, [0, 0])
    for i in range(2):
        want = np.array([float(x) for x in _decimal_ds(list(logits[i]), list(da[i]))])
        np.testing.assert_allclose(ds[i], want, rtol=1e-13, err_msg=f"row {i}")
    assert 1e-19 < abs(ds[0, 0]) < 1e-16  # the top key's dS: what plain rounding loses
    in_place = da.copy()
    again, _ = grad_block.softmax_backward(a, in_place, in_place=True)
    assert again is in_place
    np.testing.assert_array_equal(again, ds)


def test_the_norm_of_a_large_tensor_goes_slice_by_slice_to_the_same_value() -> None:
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2, 3, 400, 1000))  # 2.4M elements: one slice at a time
    assert x.size > grad_block.NORM_SLICES
    assert norm(x) == pytest.approx(float(np.sqrt(np.sum(x * x))), rel=1e-13)
    per_slice = norm(x, axis=(-2, -1))
    np.testing.assert_allclose(per_slice, np.sqrt(np.sum(x * x, axis=(-2, -1))), rtol=1e-13)
    # squares that underflow: scaled per slice and across slices, as in one piece
    tiny = x * 1e-200
    assert norm(tiny) == pytest.approx(norm(x) * 1e-200, rel=1e-12)
    tiny[1, 2, 5, 7] = np.inf
    assert norm(tiny) == np.inf
    assert np.isinf(norm(tiny, axis=(-2, -1))[1, 2])
