"""``sdpa compute --frameworks``: what each framework would output for a case, and where
they disagree.

Each framework of :data:`~sdpa_cli.engine.conventions.CONVENTIONS` runs the case under
its own conventions (:func:`options_as`); every pair of outputs is compared row by
row, and each row that differs is put down to the first convention that explains it:

1. ``empty``: the row has no visible key under either framework: the mask value
   decides (zeros under −inf, the mean of V under a finite value);
2. ``alignment``: the two put the causal diagonal (and the window) in different
   places when L ≠ S;
3. ``window``: the two count a window's size differently (Hugging Face's
   ``sliding_window`` counts the query itself).

Pure numpy: the records here are what ``render/frameworks.py`` draws and
``report.py``'s JSON holds.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from sdpa_cli.engine.conventions import CONVENTIONS, Convention
from sdpa_cli.engine.masks import document_of
from sdpa_cli.engine.options import Options, parse_mask_value
from sdpa_cli.engine.positions import documents, item_offsets
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import trace
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.names import FRAMEWORK_DIFFERENCES, FRAMEWORKS
from sdpa_cli.text import json_number, plural

AGREE = 1e-9
"""Two outputs' rows agree when no element differs by more than this, relative to the
largest |V| (at least 1): the same computation under two conventions that do not
touch a row gives the same bits; a convention that does moves it by O(|V|)."""

TITLES = {
    "empty": "rows with no visible key",
    "alignment": "causal alignment when L ≠ S",
    "window": "window counting",
}
OTHER = "other"
"""A row two frameworks differ on that no difference of
:data:`~sdpa_cli.names.FRAMEWORK_DIFFERENCES` explains (none is known)."""


def options_as(o: Options, conv: Convention) -> Options:
    """The case's options under ``conv``'s conventions: its alignment (unless
    ``--query-offset`` places the queries), its mask value, and the window's numbers
    as given read in its terms (given under ``--as``: in that framework's terms)."""
    typed = o.window_as_typed
    window = None if typed is None else conv.window(typed)
    align = o.causal_align if o.query_offset is not None else conv.causal_align
    return dataclasses.replace(
        o,
        framework=conv.name,
        causal_align=align,
        mask_value=parse_mask_value(conv.mask_value, "--as"),
        window=window,
    )


@dataclass(frozen=True)
class Answer:
    """One framework's output for the case.

    Attributes:
        convention: the framework.
        output: ``(*lead, L, Ev)``, the engine's layout.
        empty: ``(*lead, L)``: rows with no visible key under its masks.
        rows: how many rows differ from the first framework's (PyTorch's).
        max_diff: the largest |difference| from the first framework's output.
        window: the window as this framework reads the numbers given (keys left
            and right of the query, the query itself not counted), or None.
        align: the alignment it gives this case (FlashAttention's per-item diagonals
            read ``lower-right`` where every item has the padded lengths).
    """

    convention: Convention
    output: F64
    empty: np.ndarray
    rows: int
    max_diff: float
    window: tuple[int, int] | None = None
    align: str = "upper-left"


@dataclass(frozen=True)
class Disagreement:
    """One kind of disagreement: how the frameworks split, and the rows it moves.

    Attributes:
        kind: one of :data:`~sdpa_cli.names.FRAMEWORK_DIFFERENCES` (or :data:`OTHER`).
        groups: (what the frameworks do, their names), one per side.
        rows: the (batch…, head, query) index of every row it moves, in C order.
        max_diff: the largest |difference| between two frameworks on those rows.
    """

    kind: str
    groups: tuple[tuple[str, tuple[str, ...]], ...]
    rows: tuple[Index, ...]
    max_diff: float

    @property
    def title(self) -> str:
        return TITLES.get(self.kind, "other")


@dataclass(frozen=True)
class Comparison:
    """Every framework's answer (PyTorch's first) and their disagreements by kind."""

    answers: tuple[Answer, ...]
    disagreements: tuple[Disagreement, ...]
    n_rows: int

    @property
    def agree(self) -> bool:
        return not self.disagreements

    @cached_property
    def _differing(self) -> list[Index]:
        return sorted(set().union(*(d.rows for d in self.disagreements)))

    def differing(self, most: int | None = None) -> list[Index]:
        """The (batch…, head, query) index of every row two frameworks differ on, in C
        order (the first ``most``)."""
        return self._differing if most is None else self._differing[:most]

    def side_by_side(self, most: int | None = None) -> list[tuple[Index, dict[str, F64]]]:
        """Each differing row (the first ``most``) and every framework's output for it:
        what each would hand back, side by side."""
        return [
            (row, {a.convention.name: a.output[row] for a in self.answers})
            for row in self.differing(most)
        ]

    @property
    def verdict(self) -> str:
        """``all five agree``, or how many rows they disagree on and why."""
        n = _COUNTS.get(len(self.answers), str(len(self.answers)))
        if self.agree:
            return f"all {n} agree"
        rows = len(set().union(*(d.rows for d in self.disagreements)))
        kinds = ", ".join(d.title for d in self.disagreements)
        return f"the {n} disagree on {rows} of {plural(self.n_rows, 'row')}: {kinds}"


_COUNTS = {2: "two", 3: "three", 4: "four", 5: "five"}


def compare_frameworks(spec: AttentionSpec, jobs: int = 1) -> Comparison:
    """Run ``spec`` under each framework's conventions and compare the outputs."""
    outputs: dict[str, F64] = {}
    empties: dict[str, np.ndarray] = {}
    aligns = {name: _alignment(spec, CONVENTIONS[name]) for name in FRAMEWORKS}
    # The alignments move the diagonal only when they place some item's differently
    # and no --query-offset places them.
    placed = spec.options.query_offset is not None
    placed = placed or len({item_offsets(spec, a) for a in aligns.values()}) == 1
    runs: dict[tuple[Any, ...], tuple[F64, np.ndarray]] = {}
    windows: dict[str, tuple[int, int] | None] = {}
    for name in FRAMEWORKS:
        o = options_as(spec.options, CONVENTIONS[name])
        windows[name] = o.window
        # frameworks whose conventions compute the same numbers here share one run
        same = (o.mask_value, o.window, None if placed else aligns[name])
        if same not in runs:
            run = trace(dataclasses.replace(spec, options=o), stages=("output",), jobs=jobs)
            assert run.output is not None
            runs[same] = run.output, run.stats.empty_rows
        outputs[name], empties[name] = runs[same]
    scale = max(1.0, float(np.max(np.abs(spec.v), initial=0.0)))
    moved: dict[str, np.ndarray] = {}
    largest: dict[str, float] = {}
    for a, b in itertools.combinations(FRAMEWORKS, 2):
        diff = _row_diff(outputs[a], outputs[b])
        differs = diff > AGREE * scale
        a_b = (CONVENTIONS[a], CONVENTIONS[b])
        moves = None if placed else _moving_rows(spec, aligns[a], aligns[b])
        for kind, rows in _by_kind(*a_b, differs, empties[a] & empties[b], moves):
            if rows.any():
                moved[kind] = moved.get(kind, np.zeros_like(rows)) | rows
                largest[kind] = max(largest.get(kind, 0.0), float(diff[rows].max()))
    first = FRAMEWORKS[0]
    answers = []
    for name in FRAMEWORKS:
        diff = _row_diff(outputs[name], outputs[first])
        answers.append(
            Answer(
                CONVENTIONS[name],
                outputs[name],
                empties[name],
                int(np.count_nonzero(diff > AGREE * scale)),
                float(diff.max(initial=0.0)),
                windows[name],
                aligns[name],
            )
        )
    disagreements = tuple(
        Disagreement(
            kind,
            _groups(kind, aligns),
            tuple(tuple(int(i) for i in at) for at in np.argwhere(moved[kind])),
            largest[kind],
        )
        for kind in (*FRAMEWORK_DIFFERENCES, OTHER)
        if kind in moved
    )
    n_rows = int(np.prod((*spec.lead, spec.L)))
    return Comparison(tuple(answers), disagreements, n_rows)


def _row_diff(a: F64, b: F64) -> F64:
    """Per row, the largest |a − b| (NaN on one side only counts as infinite)."""
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b)
    d = np.where(np.isnan(d) & ~(np.isnan(a) & np.isnan(b)), np.inf, np.nan_to_num(d, nan=0.0))
    return np.asarray(d.max(axis=-1, initial=0.0), dtype=np.float64)


def _alignment(spec: AttentionSpec, conv: Convention) -> str:
    """The alignment ``conv`` gives this case, named as the simplest alignment that
    places every item's diagonal where it does: FlashAttention's per-item diagonals are
    ``lower-right`` when every item has the padded lengths."""
    align = conv.causal_align
    if align == "lower-right-per-item" and item_offsets(spec, align) == item_offsets(
        spec, "lower-right"
    ):
        return "lower-right"
    return align


def _moving_rows(spec: AttentionSpec, a: str, b: str) -> np.ndarray:
    """The rows whose diagonal the alignments ``a`` and ``b`` place differently: those
    of the batch items (packed documents) whose offsets differ, ``(*lead, L)``."""
    shape = (*spec.lead, spec.L)
    pairs = zip(item_offsets(spec, a), item_offsets(spec, b), strict=True)
    differs = np.array([x != y for x, y in pairs])
    docs = documents(spec)
    if docs is not None:  # one offset per document along L
        return np.broadcast_to(differs[document_of(docs.cu_q, np.arange(spec.L))], shape)
    if len(differs) == 1:
        return np.broadcast_to(differs[0], shape)
    items = [1] * len(shape)
    items[len(spec.lead) - 2] = len(differs)  # the batch axis of (..., B, H, L)
    return np.broadcast_to(differs.reshape(items), shape)


def _by_kind(
    a: Convention,
    b: Convention,
    differs: np.ndarray,
    both_empty: np.ndarray,
    moves: np.ndarray | None,
) -> list[tuple[str, np.ndarray]]:
    """The rows two frameworks differ on, put down to the first convention that explains
    them (``moves``: the rows whose diagonal their alignments place differently; None
    where no alignment moves any)."""
    out = [("empty", differs & both_empty)]
    rest = differs & ~both_empty
    if moves is not None and moves.any():
        out.append(("alignment", rest & moves))
        rest = rest & ~moves
    if a.window_counts_query != b.window_counts_query:
        return [*out, ("window", rest)]
    return [*out, (OTHER, rest)]


def _groups(kind: str, aligns: Mapping[str, str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """How the frameworks split on the convention behind ``kind`` (``aligns``: the
    alignment each gives the case)."""
    if kind == OTHER:
        return ()

    def what(c: Convention) -> str:
        if kind == "empty":
            return c.empty_row
        if kind == "alignment":
            return aligns[c.name]
        return c.window_label

    split: dict[str, list[str]] = {}
    for name, conv in CONVENTIONS.items():
        split.setdefault(what(conv), []).append(name)
    return tuple((k, tuple(v)) for k, v in split.items())


OUTPUT_ROWS = 256
"""Differing rows whose outputs the JSON holds (each framework's): the first, in C order."""


def frameworks_payload(comparison: Comparison) -> dict[str, Any]:
    """The ``frameworks`` key of ``sdpa compute --frameworks --format json``."""
    differing = comparison.differing()
    return {
        "verdict": comparison.verdict,
        "agree": comparison.agree,
        "rows": comparison.n_rows,
        "answers": [
            {
                "as": a.convention.name,
                "function": a.convention.title,
                "causal_align": a.align,
                "mask_value": a.convention.mask_value,
                "window": a.convention.window_label,
                "window_keys": None if a.window is None else list(a.window),
                "empty_row": a.convention.empty_row,
                "rows_differing": a.rows,
                "max_difference": json_number(a.max_diff),
            }
            for a in comparison.answers
        ],
        "disagreements": [
            {
                "kind": d.kind,
                "title": d.title,
                "groups": {what: list(names) for what, names in d.groups},
                "rows": [list(r) for r in d.rows],
                "max_difference": json_number(d.max_diff),
            }
            for d in comparison.disagreements
        ],
        "outputs": [
            {
                "row": list(row),
                "by_framework": {
                    name: [json_number(float(x)) for x in values] for name, values in out.items()
                },
            }
            for row, out in comparison.side_by_side(OUTPUT_ROWS)
        ],
        "outputs_rows": len(differing),
    }
