"""V's range over the keys a row weighs, the bound of each output element
(``sdpa_cli.check.elements.VBounds``): one row a slice while every row weighs every key,
a row per query once one weighs fewer."""

import numpy as np

from sdpa_cli.check.elements import VBounds


def test_a_slice_whose_rows_weigh_every_key_keeps_one_row() -> None:
    bounds = VBounds(rows=6, dtype=np.dtype(np.float32), sinks=False)
    lo, hi = np.array([-1.0, -2.0]), np.array([3.0, 4.0])
    bounds.put((0, 0), slice(0, 3), lo, hi)
    bounds.put((0, 0), slice(3, 6), lo, hi)
    got_lo, got_hi = bounds[(0, 0)]
    assert got_lo.shape == (1, 2)
    assert np.array_equal(np.broadcast_to(got_lo, (6, 2)), np.tile(lo, (6, 1)))
    assert np.array_equal(got_hi[0], hi)


def test_a_masked_block_after_a_full_one_keeps_both_rows_right() -> None:
    bounds = VBounds(rows=4, dtype=np.dtype(np.float32), sinks=False)
    bounds.put((1,), slice(0, 2), np.array([-5.0]), np.array([5.0]))  # every key
    causal_lo, causal_hi = np.array([[0.5], [-0.5]]), np.array([[0.5], [1.5]])
    bounds.put((1,), slice(2, 4), causal_lo, causal_hi)  # fewer keys
    bounds.put((1,), slice(0, 1), np.array([-5.0]), np.array([5.0]))  # every key again
    lo, hi = bounds[(1,)]
    assert lo[:, 0].tolist() == [-5.0, -5.0, 0.5, -0.5]
    assert hi[:, 0].tolist() == [5.0, 5.0, 0.5, 1.5]


def test_a_sink_puts_zero_in_every_range() -> None:
    bounds = VBounds(rows=2, dtype=np.dtype(np.float32), sinks=True)
    bounds.put((), slice(0, 2), np.array([1.0, -3.0]), np.array([2.0, -1.0]))
    lo, hi = bounds[()]
    assert lo.tolist() == [[0.0, -3.0]]
    assert hi.tolist() == [[2.0, 0.0]]
