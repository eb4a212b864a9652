"""A paged cache's findings: the pages its block table shares amiss (``page_shared``),
and the page behind a key that another finding names (:func:`page_of`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sdpa_cli.diagnosis.findings import Finding
from sdpa_cli.engine.paged import Shared
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.text import plural


def page_of(spec: AttentionSpec, item: int, key: int) -> tuple[str, dict[str, Any]]:
    """Where key ``key`` of item ``item`` sits in a paged cache, for a finding's message
    (``, item 1 key 517: page 3 of its table (physical page 42, slot 5)``) and its
    details; nothing when K and V are not paged."""
    paging = spec.paging
    if paging is None:
        return "", {}
    logical, physical, slot = paging.locate(item, key)
    details = {"item": item, "key": key, "page": logical, "physical_page": physical, "slot": slot}
    return f", {paging.where(item, key)}", details


def input_page(spec: AttentionSpec, name: str, at: tuple[int, ...]) -> tuple[str, dict[str, Any]]:
    """:func:`page_of` for an index into K or V as loaded: ``(B, S, G, ·)`` under
    ``--layout bshd``, ``(B, G, S, ·)`` otherwise."""
    if spec.paging is None or name not in ("k", "v") or len(at) != 4:
        return "", {}
    return page_of(spec, at[0], at[1] if spec.options.layout == "bshd" else at[2])


def score_page(spec: AttentionSpec, at: tuple[int, ...] | None) -> tuple[str, dict[str, Any]]:
    """:func:`page_of` for an index into the scores, ``(..., B, H, i, j)``."""
    if spec.paging is None or at is None or len(at) < 4:
        return "", {}
    return page_of(spec, at[-4], at[-1])


def page_sharing(spec: AttentionSpec) -> Iterator[Finding]:
    """The pages several items read other than as a common prefix: at different
    positions of their tables, or at one position with different numbers of slots (one
    item's tail is another's keys: its next token overwrites them)."""
    paging = spec.paging
    if paging is None or not paging.shared_count:
        return
    first = paging.shared[0]
    more = paging.shared_count - 1
    yield Finding(
        "page_shared",
        "warning",
        f"the block table ({paging.label}) shares {plural(paging.shared_count, 'page')} "
        f"other than as a common prefix: {_uses(first)}"
        + (f"; and {plural(more, 'more page')}" if more else ""),
        hint="items share a page only as a prefix: at one position of every table that "
        "reads it, with the same slots (vLLM's prefix caching); a page read elsewhere was "
        "handed out while still in use",
        stage="input",
        count=paging.shared_count,
        details={
            "tensor": "block_table",
            "pages": [
                {"page": s.page, "problem": s.problem, "uses": [list(u) for u in s.uses]}
                for s in paging.shared
            ],
        },
    )


def _uses(shared: Shared) -> str:
    """``physical page 7 is page 2 of item 0's table (4 slots) and page 0 of item 1's
    (4 slots)``."""
    uses = [f"page {p} of item {b}'s table ({plural(n, 'slot')})" for b, p, n in shared.uses]
    how = "at different positions" if shared.problem == "positions" else "with different slots"
    return f"physical page {shared.page} is {', '.join(uses[:-1])} and {uses[-1]}, {how}"
