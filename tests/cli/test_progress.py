"""The progress bar a long run draws on a terminal's stderr: how far (a percentage), how
fast (scores a second) and how long is left at the pace since the start, which settles
where rich's estimate from the last seconds swung (0:00:28 → 0:00:58 → 0:00:46)."""

from __future__ import annotations

import io

from rich.console import Console

from sdpa_cli.cli.run import progress_display
from sdpa_cli.text import si


class Clock:
    """A time source the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def shown(bar: object) -> str:
    """The bar's line as a person reads it."""
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(bar.make_tasks_table(bar.tasks))  # type: ignore[attr-defined]
    return " ".join(console.file.getvalue().split())  # type: ignore[attr-defined]


def test_the_bar_says_how_far_how_fast_and_how_long() -> None:
    clock = Clock()
    bar = progress_display(Console(file=io.StringIO()), clock)
    task = bar.add_task("checking", total=8_000_000_000)
    bar.start_task(task)
    assert "left …" in shown(bar)  # nothing done: no pace yet
    clock.now = 10.0
    bar.advance(task, 2_000_000_000)
    line = shown(bar)
    assert line.startswith("checking")
    assert "25%" in line
    assert "200 M scores/s" in line
    assert "0:00:30 left" in line  # 6 G scores left at 200 M a second


def test_the_estimate_is_the_pace_since_the_start_not_the_last_blocks() -> None:
    """A slow block after fast ones moves the estimate a little, not by half."""
    clock = Clock()
    bar = progress_display(Console(file=io.StringIO()), clock)
    task = bar.add_task("checking", total=100)
    bar.start_task(task)
    for _ in range(9):  # nine blocks of 5 scores, a second each
        clock.now += 1.0
        bar.advance(task, 5)
    assert "0:00:11 left" in shown(bar)  # 55 left at 5 a second
    clock.now += 4.0  # then one block four times slower
    bar.advance(task, 5)
    assert "0:00:13 left" in shown(bar)  # 50 left at 50 in 13 s (the last block alone: 40 s)


def test_rates_read_in_three_digits_and_a_unit() -> None:
    assert [si(x) for x in (950, 12_345, 2.5e6, 7.81e9)] == [
        "950",
        "12.3 k",
        "2.5 M",
        "7.81 G",
    ]
