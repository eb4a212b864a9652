"""A reference held as its float16 difference from the export, scaled per slice
(``sdpa_cli.check.residual``): read back to 2⁻¹¹ of each error (of the value, where
the export is off by more than it), in any shape."""

import numpy as np
import pytest

from sdpa_cli.check.residual import Residual


def held(export: np.ndarray, reference: np.ndarray, slices: int = 2) -> Residual:
    r = Residual(export, slices)
    r.put(0, r.n, reference)
    return r


def test_each_error_is_kept_to_its_own_eleventh_bit() -> None:
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(2, 3, 40, 8))
    # errors of every size in one slice: 1e-9 to 1e-3 of the values
    error = reference * 10.0 ** rng.uniform(-9, -3, size=reference.shape)
    export = (reference + error).astype(np.float32)
    back = np.asarray(held(export, reference))
    true_error = reference - export.astype(np.float64)
    got_error = back - export.astype(np.float64)
    largest = np.abs(true_error).reshape(6, -1).max(axis=1).reshape(2, 3, 1, 1)
    allowed = np.maximum(np.abs(true_error) * 2.0**-11, largest * 2.0**-40)
    assert np.all(np.abs(got_error - true_error) <= allowed)


def test_one_slice_far_off_leaves_the_others_exact_to_their_own_scale() -> None:
    reference = np.ones((1, 2, 4, 4))
    export = reference + 1e-7
    export[0, 0] = 1e6  # a broken slice
    back = np.asarray(held(export, reference))
    assert back[0, 1] == pytest.approx(reference[0, 1], abs=1e-7 * 2.0**-11)
    assert back[0, 0] == pytest.approx(reference[0, 0], rel=2.0**-11)


def test_a_non_finite_export_keeps_the_reference_value_and_infinities_stay() -> None:
    reference = np.array([[1.5, -2.0], [np.inf, 3.0]])
    export = np.array([[np.nan, -2.0], [1.0, np.inf]])
    back = np.asarray(held(export, reference))
    assert back[0, 0] == 1.5
    assert back[0, 1] == -2.0
    assert back[1, 0] == np.inf
    assert back[1, 1] == 3.0


def test_it_reads_in_runs_of_slices_flat_runs_and_single_elements() -> None:
    rng = np.random.default_rng(1)
    reference = rng.normal(size=(2, 3, 5, 4))
    export = reference + rng.normal(scale=1e-4, size=reference.shape)
    r = held(export, reference)
    whole = np.asarray(r)
    by_slice = r.reshape(6, 5, 4)
    assert np.array_equal(by_slice[2:4], whole.reshape(6, 5, 4)[2:4])
    flat = r.reshape(-1)
    assert np.array_equal(flat[7:53], whole.reshape(-1)[7:53])
    assert float(r[(1, 2, 3, 1)]) == whole[1, 2, 3, 1]
    with pytest.raises(IndexError):
        flat[::2]


def test_odd_slices_keep_their_neighbours_bits() -> None:
    rng = np.random.default_rng(2)
    reference = rng.normal(size=(3, 3, 3))
    export = reference.copy()
    export[1, 0, 0] = 50.0  # held as itself: off by more than its value
    r = Residual(export, 2)
    for k in range(3):
        r.put(k, 1, reference[k])
    assert np.allclose(np.asarray(r), reference, rtol=2.0**-11, atol=0)


def test_slices_with_no_values_are_slices_still() -> None:
    """(1, 2, 0, 8): two slices of no values put and read back without an error."""
    r = Residual(np.zeros((1, 2, 0, 8), np.float16), 2)
    assert r.n == 2
    r.put(1, 1, np.zeros((0, 8)))
    assert np.asarray(r).shape == (1, 2, 0, 8)
