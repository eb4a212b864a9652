"""One slice's stages as pictures (``explain --html``): every stage pooled over a
window of the slice by the value of largest magnitude, the hidden scores blank,
against the float64 loop's whole arrays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from reference import attention

from sdpa_cli.diagnosis.pictures import PICTURE_SIDE, pooled_to, pooling, slice_pictures
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.types import F64


def largest_magnitude(a: F64, fr: int, fc: int) -> F64:
    """The loop's pooling: each cell its value of largest |x| (NaN: every one NaN)."""
    rows, cols = -(-a.shape[0] // fr), -(-a.shape[1] // fc)
    out = np.full((rows, cols), np.nan)
    for i in range(rows):
        for j in range(cols):
            cell = a[i * fr : (i + 1) * fr, j * fc : (j + 1) * fc].ravel()
            cell = cell[~np.isnan(cell)]
            if cell.size:
                out[i, j] = cell[np.argmax(np.abs(cell))]
    return out


@pytest.mark.parametrize(
    ("rows", "keys"),
    [(None, None), (range(3, 650), range(10, 1000)), (range(0, 5), range(0, 9))],
    ids=["whole", "window", "small-window"],
)
def test_the_slices_stages_pooled_over_a_window(rows: range | None, keys: range | None) -> None:
    rng = np.random.default_rng(0)
    L, S = 700, 1100
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for n in (L, S, S))
    spec = build_spec(q, k, v, options=parse_options({"causal": True}))
    pictures = slice_pictures(spec, (0, 1), rows, keys, jobs=2)
    rows, keys = rows or range(L), keys or range(S)
    assert pictures.pool == pooling(len(rows), len(keys))
    ref = attention(q, k, v, causal=True)
    window = (0, 1, slice(rows.start, rows.stop), slice(keys.start, keys.stop))
    masked = np.where(ref.visible[window], ref.masked[window], np.nan)  # hidden: blank
    p = pictures.pool
    expected: dict[str, Any] = {
        "scores": largest_magnitude(ref.scaled[window], p, p),
        "masked": largest_magnitude(masked, p, p),
        "weights": largest_magnitude(ref.weights[window], p, p),
        "output": largest_magnitude(ref.output[0, 1, rows.start : rows.stop], p, 1),
    }
    for name, want in expected.items():
        got = pictures.stages[name]
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=name)


def test_a_long_slice_is_pooled_by_a_power_of_two_to_fit() -> None:
    assert pooling(PICTURE_SIDE, PICTURE_SIDE) == 1
    assert pooling(PICTURE_SIDE + 1, 3) == 2
    assert pooling(8192, 8192) == 16


def test_pooling_keeps_a_sink_a_diagonal_and_a_lone_spike() -> None:
    """A mean over 64 × 64 positions would fade a one-key column to 1/64 of its height;
    the largest keeps it whole."""
    n = 512
    w = np.full((n, n), 1e-4)
    w[:, 0] = 0.9  # a sink
    w[np.arange(n), np.arange(n)] = 0.5  # a diagonal
    w[300, 77] = 0.7  # one spike
    pooled, fr, fc = pooled_to(w, 8, 8)
    assert (fr, fc) == (64, 64)
    assert pooled.shape == (8, 8)
    assert np.all(pooled[:, 0] == 0.9)
    assert np.all(np.diag(pooled)[1:] == 0.5)
    assert pooled[300 // 64, 77 // 64] == 0.7
    assert pooled[0, 5] == pytest.approx(1e-4)


def test_pooling_pads_a_ragged_edge_and_keeps_no_value_blank() -> None:
    a = np.arange(15.0).reshape(3, 5)
    a[2, :] = np.nan
    pooled, fr, fc = pooled_to(a, 2, 2)
    assert (fr, fc) == (2, 3)
    assert pooled.tolist()[0] == [7.0, 9.0]
    assert np.isnan(pooled[1]).all()  # every position of those cells is NaN
