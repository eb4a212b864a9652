"""Mask and bias builders against small matrices written out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from reference import paper_alibi_slopes

from sdpa_cli.engine import masks

T, F = True, False


@pytest.mark.parametrize(
    ("L", "S", "align", "expected"),
    [
        (3, 3, "upper-left", [[T, F, F], [T, T, F], [T, T, T]]),
        (3, 3, "lower-right", [[T, F, F], [T, T, F], [T, T, T]]),
        (2, 4, "upper-left", [[T, F, F, F], [T, T, F, F]]),
        (2, 4, "lower-right", [[T, T, T, F], [T, T, T, T]]),
        (4, 2, "upper-left", [[T, F], [T, T], [T, T], [T, T]]),
        (4, 2, "lower-right", [[F, F], [F, F], [T, F], [T, T]]),
    ],
)
def test_causal_both_alignments(L: int, S: int, align: str, expected: list[list[bool]]) -> None:
    np.testing.assert_array_equal(masks.causal(0, L, L, S, align), expected)


def test_causal_block_is_the_rows_of_the_whole_mask() -> None:
    whole = masks.causal(0, 6, 6, 9, "lower-right")
    np.testing.assert_array_equal(masks.causal(2, 5, 6, 9, "lower-right"), whole[2:5])
    np.testing.assert_array_equal(
        masks.window(3, 4, 6, 9, 1, 2), masks.window(0, 6, 6, 9, 1, 2)[3:4]
    )


def test_align_offset() -> None:
    assert masks.align_offset("upper-left", 3, 7) == 0
    assert masks.align_offset("lower-right", 3, 7) == 4
    assert masks.align_offset("lower-right", 7, 3) == -4


@pytest.mark.parametrize(
    ("L", "S", "left", "right", "align", "expected"),
    [
        (
            4, 4, 1, 0, "upper-left",
            [[T, F, F, F], [T, T, F, F], [F, T, T, F], [F, F, T, T]],
        ),
        (
            3, 5, 0, 2, "upper-left",
            [[T, T, T, F, F], [F, T, T, T, F], [F, F, T, T, T]],
        ),
        (
            2, 4, 1, 0, "lower-right",
            [[F, T, T, F], [F, F, T, T]],
        ),
        (
            3, 3, 0, 0, "upper-left",
            [[T, F, F], [F, T, F], [F, F, T]],
        ),
    ],
)  # fmt: skip
def test_window(
    L: int, S: int, left: int, right: int, align: str, expected: list[list[bool]]
) -> None:
    np.testing.assert_array_equal(masks.window(0, L, L, S, left, right, align), expected)


def test_key_padding() -> None:
    np.testing.assert_array_equal(masks.key_padding(2, 3, 4), [[T, T, F, F]] * 3)
    np.testing.assert_array_equal(masks.key_padding(0, 1, 2), [[F, F]])


def test_alibi_bias_is_distance_from_the_lower_right_diagonal() -> None:
    # L = 2, S = 4: query 0 sits at key 2, query 1 at key 3.
    np.testing.assert_array_equal(
        masks.alibi(0, 2, 2, 4, 0.5), [[-1.0, -0.5, 0.0, -0.5], [-1.5, -1.0, -0.5, 0.0]]
    )
    np.testing.assert_array_equal(masks.alibi(1, 2, 2, 4, 0.25), [[-0.75, -0.5, -0.25, 0.0]])


HAND_SLOPES = {
    1: [2**-8],
    2: [2**-4, 2**-8],
    4: [2**-2, 2**-4, 2**-6, 2**-8],
    8: [2**-1, 2**-2, 2**-3, 2**-4, 2**-5, 2**-6, 2**-7, 2**-8],
    # Not a power of 2: those of 4, then every other one of 8's.
    6: [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3],
    # Those of 8, then every other one of 16's: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
    12: [*(2.0**-n for n in range(1, 9)), *(2.0 ** -(n + 0.5) for n in range(4))],
}


@pytest.mark.parametrize("H", HAND_SLOPES)
def test_alibi_slopes_by_hand(H: int) -> None:
    np.testing.assert_allclose(masks.alibi_slopes(H), HAND_SLOPES[H], rtol=1e-15)
    np.testing.assert_allclose(paper_alibi_slopes(H), HAND_SLOPES[H], rtol=1e-15)


@pytest.mark.parametrize("H", range(1, 33))
def test_alibi_slopes_follow_the_papers_reference_code(H: int) -> None:
    np.testing.assert_allclose(masks.alibi_slopes(H), paper_alibi_slopes(H), rtol=1e-14)
    assert len(masks.alibi_slopes(H)) == H


def test_alibi_slopes_power_of_two_formula() -> None:
    assert masks.alibi_slopes(16)[3] == pytest.approx(2 ** (-8 * 4 / 16), rel=1e-15)
    assert masks.alibi_slopes(16)[3] == pytest.approx(1 / math.sqrt(2) ** 4, rel=1e-15)
