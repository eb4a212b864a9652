"""Properties of attention that hold for any inputs, checked with hypothesis."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from numpy.typing import NDArray

from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import Trace, trace

F64 = NDArray[np.float64]
BOUNDED = settings(max_examples=50, deadline=None)
VALUES = st.floats(-4, 4, allow_nan=False, allow_infinity=False)


@dataclass(frozen=True)
class Case:
    """Inputs (H, L, E), (H, S, E), (H, S, Ev), a boolean mask (H, L, S) and options."""

    q: F64
    k: F64
    v: F64
    mask: NDArray[np.bool_]
    options: Options

    def run(self, **changes: Any) -> Trace:
        case = replace(self, **changes)
        spec = build_spec(case.q, case.k, case.v, mask=case.mask, options=case.options)
        return trace(spec)


@st.composite
def cases(draw: st.DrawFn, positional: bool = True) -> Case:
    """Small random attention problems; ``positional`` allows causal, window and ALiBi."""
    H, L, S = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    E, Ev = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    q = draw(arrays(np.float64, (H, L, E), elements=VALUES))
    k = draw(arrays(np.float64, (H, S, E), elements=VALUES))
    v = draw(arrays(np.float64, (H, S, Ev), elements=VALUES))
    mask = draw(arrays(np.bool_, (H, L, S), elements=st.booleans()))
    options: dict[str, Any] = {
        "scale": draw(st.sampled_from(["sqrt-dk", "dk", "none", 0.7])),
        "softcap": draw(st.none() | st.sampled_from([1.0, 5.0])),
    }
    if positional:
        options["causal"] = draw(st.booleans())
        options["causal_align"] = draw(st.sampled_from(["upper-left", "lower-right"]))
        options["alibi"] = draw(st.booleans())
        options["window"] = draw(st.none() | st.tuples(st.integers(0, 3), st.integers(0, 3)))
    return Case(q, k, v, mask, Options(**options))


@BOUNDED
@given(cases())
def test_rows_sum_to_one_over_visible_keys_and_zero_without_any(case: Case) -> None:
    got = case.run()
    assert got.weights is not None
    sums = got.weights.sum(axis=-1)
    assert got.visible is not None
    any_visible = got.visible.any(axis=-1)
    np.testing.assert_allclose(sums[any_visible], 1.0, rtol=1e-13)
    assert np.all(sums[~any_visible] == 0.0)
    assert np.all(got.weights[~got.visible] == 0.0)


@BOUNDED
@given(cases())
def test_weights_lie_in_zero_one(case: Case) -> None:
    got = case.run()
    assert got.weights is not None
    assert np.all((got.weights >= 0.0) & (got.weights <= 1.0))


@BOUNDED
@given(cases(), st.data())
def test_adding_a_constant_per_row_changes_nothing(case: Case, data: st.DataObject) -> None:
    """softmax(x + c) = softmax(x): a per-row constant through the bias or a float mask."""
    H, L = case.q.shape[:2]
    shift = data.draw(arrays(np.float64, (H, L, 1), elements=st.floats(-50, 50)))
    via = data.draw(st.sampled_from(["bias", "mask"]))
    plain = case.run(mask=None)
    if via == "bias":
        spec = build_spec(case.q, case.k, case.v, bias=shift, options=case.options)
    else:
        spec = build_spec(case.q, case.k, case.v, mask=shift, options=case.options)
    shifted = trace(spec)
    assert plain.weights is not None
    assert shifted.weights is not None
    assert plain.output is not None
    assert shifted.output is not None
    np.testing.assert_allclose(shifted.weights, plain.weights, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(shifted.output, plain.output, rtol=1e-9, atol=1e-11)


@BOUNDED
@given(cases(positional=False), st.randoms(use_true_random=False))
def test_permuting_keys_and_values_permutes_weights_and_keeps_output(
    case: Case, random: Any
) -> None:
    S = case.k.shape[1]
    perm = np.array(random.sample(range(S), S))
    plain = case.run()
    permuted = case.run(k=case.k[:, perm], v=case.v[:, perm], mask=case.mask[:, :, perm])
    assert plain.weights is not None
    assert permuted.weights is not None
    assert plain.output is not None
    assert permuted.output is not None
    np.testing.assert_allclose(permuted.weights, plain.weights[..., perm], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(permuted.output, plain.output, rtol=1e-12, atol=1e-12)


@BOUNDED
@given(cases())
def test_output_lies_within_the_values_of_the_visible_keys(case: Case) -> None:
    got = case.run()
    assert got.output is not None
    H, L, _ = got.output.shape
    assert got.visible is not None
    for h in range(H):
        for i in range(L):
            seen = case.v[h][got.visible[h, i]]
            if len(seen) == 0:
                assert np.all(got.output[h, i] == 0.0)
                continue
            low, high = seen.min(axis=0), seen.max(axis=0)
            slack = 1e-12 * (1 + np.abs(seen).max())
            assert np.all(got.output[h, i] >= low - slack)
            assert np.all(got.output[h, i] <= high + slack)
