"""Tests of ``explain --plot``'s axes: tick labels on whole indices only, at most 8 a
side (16 three-digit labels ran together, "90100110120", in a 4-inch axis)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from sdpa_cli.render.plot import integer_ticks


@pytest.mark.parametrize(
    ("first", "count", "ticks"),
    [
        (0, 3, [0, 1, 2]),
        (5, 4, [5, 6, 7, 8]),
        (0, 8, list(range(8))),
        (0, 16, list(range(0, 16, 2))),
        (0, 17, list(range(0, 17, 5))),
        (3, 40, [5, 10, 15, 20, 25, 30, 35, 40]),
        (0, 100, list(range(0, 100, 20))),
        (100, 16, list(range(100, 116, 2))),
        (0, 1000, list(range(0, 1000, 200))),
        (0, 0, []),
    ],
)
def test_ticks_are_whole_indices_on_round_steps(first: int, count: int, ticks: list[int]) -> None:
    assert integer_ticks(first, count) == ticks


@pytest.mark.parametrize("count", [1, 2, 7, 16, 17, 33, 99, 101, 250, 4096])
@pytest.mark.parametrize("first", [0, 3, 100])
def test_ticks_stay_inside_the_axis_and_few(first: int, count: int) -> None:
    ticks = integer_ticks(first, count)
    assert ticks
    assert all(isinstance(t, int) for t in ticks)
    assert first <= ticks[0]
    assert ticks[-1] <= first + count - 1
    assert len(ticks) <= 8
