"""Picking part of a computation, as its options name it: query rows and keys (``I`` or
``START:STOP``), a batch item or a head, the stages to show; each checked against the
computation's shape, naming the option. Plain Python: the command line's views and
the API's explanations pick alike."""

from __future__ import annotations

from sdpa_cli.errors import SpecError
from sdpa_cli.names import STAGES


def parse_rows(
    text: str | None, n: int, option: str = "--rows", what: str = "query rows"
) -> slice | None:
    """``I`` or ``START:STOP`` (either may be empty) → a slice within 0..n."""
    if text is None:
        return None
    if not n:
        raise SpecError(option, f"there are no {what} to pick (0 of them)")
    try:
        if ":" in text:
            a, _, b = text.partition(":")
            start = int(a) if a.strip() else 0
            stop = int(b) if b.strip() else n
        else:
            start = int(text)
            stop = start + 1
    except ValueError:
        raise SpecError(option, f"expected I or START:STOP, got {text!r}") from None
    if not (0 <= start < stop <= n):
        raise SpecError(option, f"{text!r} is outside the {n} {what} (0..{n - 1})")
    return slice(start, stop)


def parse_stages(text: str | None, available: tuple[str, ...]) -> tuple[str, ...]:
    """``--stages raw,weights`` → the stage names, checked; ``available`` when not given."""
    if text is None:
        return available
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in chosen if s not in STAGES]
    if unknown or not chosen:
        raise SpecError(
            "--stages",
            f"unknown stage {unknown[0] if unknown else text!r}; choose from {', '.join(STAGES)}",
        )
    return chosen


def check_slice(
    lead: tuple[int, ...], batch: int | None, head: int | None, *, zero_without_axis: bool = False
) -> None:
    """``--batch`` and ``--head`` within the leading axes ``lead`` (``(..., B, H)``);
    with ``zero_without_axis``, 0 is taken where the axis is absent (``explain``'s
    default slice).

    Raises:
        SpecError: naming the option that picks what the inputs do not have.
    """
    for option, value, axis, what in (
        ("--head", head, -1, "head"),
        ("--batch", batch, -2, "batch item"),
    ):
        if value is None:
            continue
        if len(lead) < -axis:
            if zero_without_axis and value == 0:
                continue
            raise SpecError(option, f"the inputs have no {what} axis")
        size = lead[axis]
        if not 0 <= value < size:
            raise SpecError(
                option, f"{value} is out of range: the inputs have {size} {what}s (0..{size - 1})"
            )
