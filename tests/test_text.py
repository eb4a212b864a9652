"""The one formatter: numbers, plurals, indices and values as every message reads them."""

from __future__ import annotations

import math
import os

import pytest

from sdpa_cli.text import (
    ceil_sig,
    compact,
    decimals,
    finite_or_none,
    format_index,
    headroom_bits,
    integer_ticks,
    json_number,
    percent,
    plural,
    printable,
    prose,
    run_text,
    runs,
    shape,
    share,
    shown,
    sig,
)


def test_sig_is_plain_ascii_significant_digits() -> None:
    assert sig(0.123456) == "0.1235"
    assert sig(-1e-9) == "-1e-09"
    assert sig(123456.0, 3) == "1.23e+05"
    assert sig(math.inf) == "inf"


def test_compact_shortens_the_exponent_and_dashes_a_missing_value() -> None:
    assert compact(-450200.0) == "-4.502e5"
    assert compact(1.2e-8, 3) == "1.2e-8"
    assert compact(0.5) == "0.5"
    assert compact(65504.0, 6) == "65504"
    assert compact(math.inf) == "inf"
    assert compact(math.nan) == "—"


def test_headroom_bits_are_signed_tenths_with_infinity_and_a_dash() -> None:
    assert headroom_bits(3.25) == "+3.2"
    assert headroom_bits(-1.0) == "-1.0"
    assert headroom_bits(0.0) == "+0.0"
    assert headroom_bits(math.inf) == "∞"
    assert headroom_bits(math.nan) == "—"


def test_prose_uses_the_true_minus_and_infinity() -> None:
    assert prose(-0.5) == "−0.5"
    assert prose(-math.inf) == "−∞"
    assert prose(math.inf) == "∞"
    assert prose(math.nan) == "nan"
    assert prose(-0.000123456, 3) == "−0.000123"


@pytest.mark.parametrize(
    ("x", "precision", "expected"),
    [
        (0.0, 4, "0.0000"),
        (0.88159, 4, "0.8816"),
        (-1.0, 4, "-1.0000"),
        (0.00001, 4, "1.00e-05"),
        (2.5e6, 4, "2.50e+06"),
        (math.nan, 4, "nan"),
        (-math.inf, 2, "-inf"),
        (0.004, 2, "4.0e-03"),
    ],
)
def test_decimals_fall_back_to_scientific_when_they_would_hide_the_number(
    x: float, precision: int, expected: str
) -> None:
    assert decimals(x, precision) == expected


def test_ceil_sig_rounds_up_so_the_tolerance_passes() -> None:
    assert ceil_sig(0.9061) == "0.907"
    assert float(ceil_sig(332.513)) >= 332.513
    assert ceil_sig(0.001) == "0.001"
    assert ceil_sig(0.0) == "0"


def test_percentages_keep_two_significant_digits_when_small() -> None:
    assert percent(0.9336) == "93.36%"
    assert percent(0.0) == "0.00%"
    assert percent(0.000061) == "0.0061%"
    assert share(1, 3) == "33.3%"
    assert share(1, 0) == "0%"


def test_plurals_indices_and_shapes() -> None:
    assert plural(1, "row") == "1 row"
    assert plural(0, "row") == "0 rows"
    assert format_index((0, 2, 5)) == "[0, 2, 5]"
    assert format_index(None) == "[]"
    assert shape((2, 4)) == "(2, 4)"


def test_json_numbers_spell_what_json_cannot() -> None:
    assert json_number(1.5) == 1.5
    assert json_number(math.nan) == "NaN"
    assert json_number(-math.inf) == "-Infinity"
    assert finite_or_none(math.inf) is None
    assert finite_or_none(2) == 2.0


def test_values_from_files_stay_one_short_line() -> None:
    assert shown(10**5000) == "an integer of about 5001 digits"
    assert len(shown(list(range(1000)))) < 80
    assert len(shown([10**5000])) < 60
    assert printable("a\nb") == "a\\nb"
    assert printable("q.npy") == "q.npy"


def test_printable_shows_the_bytes_of_a_non_utf8_file_name_as_the_shell_does() -> None:
    """os.fsdecode(b"q\xff.npy") is "q\udcff.npy": shown as ls -b shows it, not as \udcff."""
    assert printable(os.fsdecode(b"q\xff\xfe.npy")) == "q\\xff\\xfe.npy"
    assert printable(os.fsdecode(b"\x80dir/\xe9t\xe9.npy")) == "\\x80dir/\\xe9t\\xe9.npy"
    assert printable("caf\u00e9.npy") == "caf\u00e9.npy"  # UTF-8 names as they are


def test_runs_join_consecutive_integers() -> None:
    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 2), (5, 5), (7, 8)]
    assert runs([]) == []
    assert [run_text(*r) for r in runs([3, 9, 10])] == ["3", "9–10"]


# --- ticks: which positions an axis labels (explain --plot, the pages) ----------------


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
        (0, 8192, [0, 2000, 4000, 6000, 8000]),  # a page's axis of 8,192 positions
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
