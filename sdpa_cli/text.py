"""Numbers, plurals, indices and values as people read them: the one formatter.

Every renderer and every message (findings, errors, reports) writes numbers through
these functions, so a number reads the same wherever it appears. Pure Python: no
numpy, no rich; the lowest layer, beside :mod:`sdpa_cli.errors`.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

MINUS = "−"
"""The true minus sign, for prose (notes, explanations); tables keep ASCII ``-``."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong = 40


def sig(x: float, digits: int = 4, *, zeros: bool = False) -> str:
    """``x`` in ``digits`` significant digits, ASCII: ``0.1235``, ``1e-09``, ``inf``;
    with ``zeros`` its trailing zeros kept (``-0.652100``), so that two values shown
    side by side show as many digits."""
    return f"{x:#.{digits}g}" if zeros and math.isfinite(x) else f"{x:.{digits}g}"


def compact(x: float, digits: int = 4) -> str:
    """``x`` in ``digits`` significant digits with a short exponent, for a cell that
    must not wrap: ``-4.502e5``, ``1.2e-8``; ``—`` for a statistic with no value (NaN)."""
    if math.isnan(x):
        return "—"
    text = sig(x, digits)
    mantissa, e, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if e else text


def prose(x: float, digits: int = 4) -> str:
    """``x`` in ``digits`` significant digits for a sentence, with a true minus sign
    and ``∞``: ``−0.5``, ``−∞``, ``nan``."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "∞" if x > 0 else MINUS + "∞"
    return sig(x, digits).replace("-", MINUS)


def decimals(x: float, precision: int) -> str:
    """A table cell: ``precision`` decimals, or scientific when that would hide the
    number (below half a unit of the last decimal, or a million and above)."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return f"{0:.{precision}f}"
    if abs(x) < 0.5 * 10.0**-precision or abs(x) >= 1e6:
        return f"{x:.{max(precision - 2, 1)}e}"
    return f"{x:.{precision}f}"


def ceil_sig(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, rounded up: a tolerance that passes."""
    if not math.isfinite(x) or x <= 0:
        return f"{x:g}"
    step = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    k = math.ceil(x / step)
    while float(f"{k * step:.{digits}g}") < x:  # decimal rounding fell below x
        k += 1
    return f"{k * step:.{digits}g}"


def headroom_bits(bits: float) -> str:
    """Bits of headroom below a format's max, signed, to a tenth: ``+3.2``, ``-1.0``;
    ``∞`` when nothing is nonzero, ``—`` when nothing was measured (NaN)."""
    if math.isnan(bits):
        return "—"
    return "∞" if math.isinf(bits) else f"{bits:+.1f}"


def si(x: float, unit: str = "") -> str:
    """``12.3 MB``, ``456 k``: powers of 1000 (k, M, G), three significant digits, then
    the unit (``B``); below 1000 the number as it is."""
    for prefix, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g} {prefix}{unit}"
    text = f"{x:.3g}"
    return f"{text} {unit}" if unit else text


def percent(fraction: float) -> str:
    """``0.90%``, ``84.84%``; two significant digits below 0.01 %: ``0.0061%``."""
    x = 100 * fraction
    return f"{x:.2f}%" if x == 0 or x >= 0.01 else f"{x:.2g}%"


def share(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole`` in 3 significant digits; ``0%`` of nothing."""
    return f"{100 * part / whole:.3g}%" if whole else "0%"


def plural(n: int, unit: str) -> str:
    """``1 row``, ``3 rows``."""
    return f"{n} {unit}{'' if n == 1 else 's'}"


def format_index(at: Sequence[int] | None) -> str:
    """``[0, 2, 5]``."""
    return "[" + ", ".join(str(i) for i in (at or ())) + "]"


def runs(values: Iterable[int]) -> list[tuple[int, int]]:
    """Ascending integers as their runs of consecutive values, ``(first, last)``:
    ``0, 1, 2, 5`` → ``(0, 2), (5, 5)``."""
    found: list[tuple[int, int]] = []
    for v in values:
        if found and v == found[-1][1] + 1:
            found[-1] = (found[-1][0], v)
        else:
            found.append((v, v))
    return found


def run_text(first: int, last: int) -> str:
    """``3`` or ``0–2``."""
    return str(first) if first == last else f"{first}–{last}"


def shape(s: Sequence[int]) -> str:
    """``(2, 4, 6, 8)``."""
    return str(tuple(int(n) for n in s))


def finite_or_none(x: float) -> float | None:
    """A float for a JSON field that holds only finite numbers (null otherwise)."""
    return float(x) if math.isfinite(x) else None


def json_number(x: float) -> float | str:
    """A float for JSON: non-finite values as the strings ``"NaN"``, ``"Infinity"`` and
    ``"-Infinity"`` (standard JSON has no literal for them)."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


NON_FINITE_JSON = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
"""What :func:`json_number` writes for a non-finite number, read back."""


_ECHO: ContextVar[bool] = ContextVar("sdpa_echo", default=True)


@contextlib.contextmanager
def unechoed() -> Iterator[None]:
    """While reading files the user did not name (those a manifest or a case file
    names), :func:`shown` says what kind of value it found, not the value: an error
    must not copy a file's content into a public CI log."""
    token = _ECHO.set(False)
    try:
        yield
    finally:
        _ECHO.reset(token)


def echoed() -> bool:
    """Whether values read now may appear in messages (see :func:`unechoed`)."""
    return _ECHO.get()


def shown(value: Any) -> str:
    """``repr(value)`` cut short: a 5000-digit number or a list nested 900 deep read
    from a case file still makes one short line (and no RecursionError). Inside
    :func:`unechoed`, only the value's kind: ``a str of 12 characters``."""
    if not _ECHO.get():
        return _kind(value)
    try:
        return _REPR.repr(value)
    except ValueError:  # an integer past Python's 4,300-digit limit for str()
        if isinstance(value, int):
            return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
        return f"a {type(value).__name__} too long to show"


def _kind(value: Any) -> str:
    """What :func:`shown` says of a value it may not echo."""
    name = type(value).__name__
    if isinstance(value, (str, bytes, list, tuple, dict)):
        return f"a {name} of length {len(value)} (content not shown)"
    return f"a {name} (content not shown)"


def printable(text: str) -> str:
    """``text`` (a path, a key) as it reads in a one-line message: control characters,
    a newline in a file name among them, escaped; the bytes of a file name that is not
    UTF-8 (Python's surrogate escapes, ``\\udcff``) as the shell shows them, ``\\xff``."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


def readable(text: str) -> str:
    """A text read from a file (a case file's description), safe to print: its lines
    stay lines, every other control character (an escape sequence's ESC, a carriage
    return, a bidirectional override) and every lone surrogate escaped as
    :func:`printable` escapes them."""
    return "\n".join(printable(line) for line in text.split("\n"))


def _escaped(c: str) -> str:
    """One unprintable character: a surrogate-escaped byte as ``\\xNN``, else as repr."""
    if "\udc80" <= c <= "\udcff":
        return f"\\x{ord(c) - 0xDC00:02x}"
    return repr(c)[1:-1]


def as_typed(value: Any) -> str:
    """A value as typed (``0.5``, not ``'0.5'``), on one short line."""
    text = printable(str(value))
    return text if len(text) <= 60 else text[:40] + "..."


def one_line(problem: object, limit: int = 200) -> str:
    """A parser's message on one short line (PyYAML's may take several; numpy's quote
    a header of up to 10,000 characters)."""
    text = " ".join(str(problem).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shared_parts(names: Sequence[str], blank: str = "name") -> tuple[list[str], str | None]:
    """``names`` less the dotted parts all of them share at either end, and the pattern
    they share (``model.layers.‹name›.self_attn``, ``blank`` in the gap); the names and
    None when there is nothing to leave out (one name, or none shared)."""
    parts = [n.split(".") for n in names]
    shortest = min((len(p) for p in parts), default=0)
    head = tail = 0
    if len(names) > 1:
        while head < shortest - 1 and len({p[head] for p in parts}) == 1:
            head += 1
        while tail < shortest - 1 - head and len({p[-1 - tail] for p in parts}) == 1:
            tail += 1
    if not head and not tail:
        return list(names), None
    first = parts[0]
    note = ".".join([*first[:head], f"‹{blank}›", *first[len(first) - tail :]])
    return [".".join(p[head : len(p) - tail]) for p in parts], note


def integer_ticks(first: int, count: int, most: int = 8) -> list[int]:
    """Tick positions for the indices ``first .. first + count - 1``: whole numbers
    only, every 1, 2 or 5 × 10ᵏ of them (the smallest step giving at most ``most``),
    on multiples of the step. Eight at most by default: three- and four-digit indices
    stay apart on a picture's axis (16 ran together: "90100110120")."""
    if count <= 0:
        return []
    step = 1
    while count > step * most:
        step = _next_step(step)
    start = -(-first // step) * step  # the first multiple of step at or after first
    return list(range(start, first + count, step))


def _next_step(step: int) -> int:
    """1 → 2 → 5 → 10 → 20 → 50 → ..."""
    digits = str(step)
    return step * 5 // 2 if digits[0] == "2" else step * 2
