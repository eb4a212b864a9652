"""Whole arrays from blocks: :func:`trace` keeps the stages a command asks for (and
the statistics of every block) by walking the computation with the block driver.

Nothing score-sized is kept unless asked for; what would not fit in memory is refused
before anything is allocated (:func:`_check_fits`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import row_stats
from sdpa_cli.engine.arrays import NUMPY
from sdpa_cli.engine.block import Block, applicable_stages, attend_block
from sdpa_cli.engine.driver import KeyMode, Place, Progress, sweep
from sdpa_cli.engine.forward import first_moments, forward, lean_backend, query_block
from sdpa_cli.engine.records import Moments
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError
from sdpa_cli.files import limits
from sdpa_cli.names import STAGES


@dataclass(frozen=True)
class Trace:
    """Every stage of the computation, as whole arrays.

    Score-shaped stages are ``(*lead, L, S)``, ``output`` is ``(*lead, L, Ev)``.
    Stages that the options do not bring about (``capped``, ``biased``, ``dropped``)
    and stages not asked for are ``None``. With ``--dtype`` the stages are the
    emulated values. ``visible`` (which keys each row may see) is kept beside
    score-shaped stages only. ``stats`` holds the per-row and per-stage statistics of
    every block, gathered as it was computed, for the diagnostics.
    """

    spec: AttentionSpec
    raw: F64 | None
    scaled: F64 | None
    capped: F64 | None
    biased: F64 | None
    masked: F64 | None
    visible: NDArray[np.bool_] | None
    weights: F64 | None
    dropped: F64 | None
    output: F64 | None
    stats: Stats
    summaries: Mapping[str, Moments] = field(default_factory=dict)
    """Per stage asked to be summarised: range, mean and non-finite count of its
    visible values over the whole tensor (gathered block by block)."""
    hidden: int = 0
    """The score entries (query, key) no summary counts: those a mask, the causal
    diagonal, a window or padding hides (their −inf is not counted as non-finite).
    0 when no score-shaped stage is summarised."""

    def stage(self, name: str) -> F64 | None:
        return getattr(self, name)  # type: ignore[no-any-return]

    @property
    def merged_output(self) -> F64 | None:
        """The output as returned: heads merged back, ``(..., L, heads · Ev)``, under
        ``--heads``; ``(..., L, H, Ev)`` under ``--layout bshd``."""
        return None if self.output is None else merge_heads(self.spec, self.output)


def merge_heads(spec: AttentionSpec, output: F64) -> F64:
    """An output ``(..., H, L, Ev)`` in the layout it is returned in: ``(..., L, heads ·
    Ev)`` under ``--heads``, ``(..., L, H, Ev)`` under ``--layout bshd`` (a view), as it
    is otherwise."""
    if not spec.output_rearranged:
        return output
    swapped = np.swapaxes(output, -3, -2)
    return swapped if spec.options.heads is None else swapped.reshape(spec.merged_output_shape)


def split_heads_of_output(spec: AttentionSpec, values: NDArray[Any]) -> NDArray[Any]:
    """An array shaped like the output as returned (heads merged under ``--heads``,
    ``(..., L, H, Ev)`` under ``--layout bshd``, leading 1s optional) → the engine's
    layout ``(*lead, L, Ev)``."""
    if spec.output_rearranged:
        L, H, Ev = spec.L, spec.lead[-1], spec.Ev
        parts = values.reshape(*spec.lead[:-1], L, H, Ev)
        values = np.swapaxes(parts, -3, -2)
    return values.reshape(spec.output_shape)


def loaded_index(spec: AttentionSpec, name: str, index: tuple[int, ...]) -> tuple[int, ...]:
    """Where the element at ``index`` of operand ``name`` (or of its gradient) in the
    engine's layout sits in the array :meth:`AttentionSpec.as_loaded` gives: one
    element's index, for what is read slice by slice and still names the file's."""
    *lead, row, col = index
    shape = tuple(getattr(spec, name).shape)
    at, arranged = (*lead, row, col), shape
    if name in ("q", "k", "v") and len(shape) >= 3:
        *outer, heads, length, depth = shape
        if spec.options.heads is not None:  # (…, L, heads · D), as the file has it
            at = (*lead[:-1], row, lead[-1] * depth + col)
            arranged = (*outer, length, heads * depth)
        elif spec.options.layout == "bshd" and len(spec.shapes.get(name, ())) >= 3:
            at, arranged = (*lead[:-1], row, lead[-1], col), (*outer, length, heads, depth)
    loaded = spec.shapes.get(name)
    if loaded is None or math.prod(loaded) != math.prod(arranged):
        return at
    flat = int(np.ravel_multi_index(at, arranged))
    return tuple(int(i) for i in np.unravel_index(flat, loaded))


ROW_STATS_BYTES = row_stats.bytes_per_row(formats=2)
"""What the statistics keep per query row: every row statistic, two narrow formats
checked (float16 and the run's)."""


def _check_fits(spec: AttentionSpec, keep: set[str]) -> None:
    """Refuse, before allocating, a trace that cannot fit in memory (rather than be
    killed): 8 bytes a value kept, the visibility, the per-row statistics."""
    scores = math.prod(spec.weights_shape)
    need = scores if keep - {"output"} else 0  # the boolean visibility
    need += ROW_STATS_BYTES * math.prod((*spec.lead, spec.L))  # always gathered
    values = sum(math.prod(spec.output_shape) if s == "output" else scores for s in keep)
    need += 8 * values
    check_memory(
        need,
        f"scores {spec.weights_shape}",
        f"keeping {len(keep)} stage(s) whole in float64, with the per-row statistics,",
        "ask for fewer --stages, or slice the inputs",
    )


def check_memory(need: int, where: str, what: str, advice: str) -> None:
    """Refuse ``need`` bytes the machine's memory cannot hold, before allocating them.

    Raises:
        SpecError: at ``where``: "``what`` needs X GiB, but Y GiB of memory is
            available; ``advice``".
    """
    available = limits.available_memory()
    if available is not None and need > available:
        gib = 2.0**30
        raise SpecError(
            where,
            f"{what} needs {need / gib:.1f} GiB, but {available / gib:.1f} GiB of memory is "
            f"available; {advice}",
        )


def trace(
    spec: AttentionSpec,
    stages: tuple[str, ...] | None = None,
    rows: int | None = None,
    *,
    gather_stats: bool = True,
    summarize: tuple[str, ...] = (),
    jobs: int = 1,
    progress: Progress | None = None,
    leads: Sequence[Index] | None = None,
) -> Trace:
    """Run the engine over every block and keep the stages asked for (default: all).

    Statistics for the diagnostics are gathered from every block as it is computed.
    With ``--dtype`` each block is computed twice, emulated (kept) and in float64
    (compared against, then dropped). With no stage kept, nothing score-sized
    outlives its block, and keys hidden from a whole block (causal, window,
    padding) are not computed at all.

    Args:
        spec: the validated computation.
        stages: names from :data:`STAGES` to keep; the others are not stored.
        rows: query rows per block (default :func:`block_rows`); any value gives the
            same numbers to rounding.
        gather_stats: False for a trace used only for its values (a reference to
            compare against): no statistics, no float64 twin of an emulated block.
        summarize: stages whose whole-tensor range is gathered (kept or not).
        jobs: threads computing blocks.
        progress: told the scores done after each block.
        leads: the (batch, head) slices to compute (default every one); the kept
            stages hold NaN in the others.
    """
    keep = set(applicable_stages(spec) if stages is None else stages) & set(applicable_stages(spec))
    ws, os_ = spec.weights_shape, spec.output_shape
    _check_fits(spec, keep)
    blank = np.empty if leads is None else functools.partial(np.full, fill_value=np.nan)
    arrays: dict[str, Any] = {
        s: blank(os_ if s == "output" else ws, dtype=np.float64) for s in STAGES if s in keep
    }
    visible = np.empty(ws, dtype=np.bool_) if keep - {"output"} else None
    stats = Stats.empty(spec)
    summaries = {s: Moments() for s in summarize if s in applicable_stages(spec)}

    # The lean pass where nothing score-sized is kept or summarised.
    lean = visible is None and not (summaries.keys() - {"output"}) and gather_stats

    def visit(place: Place) -> Any:
        if lean:
            found = forward(place, spec, stats)
            records, values, where = found.records, {"output": found.output}, None
        else:
            block = place.attend(spec)
            records = stats.measure(block, place.twin(spec, block)) if gather_stats else None
            values = {name: getattr(block, name) for name in (*summaries, *arrays)}
            where = block.visible
            if visible is not None:
                visible[place.at] = block.visible
        seen = {s: Moments() for s in summaries}
        for name, moments in seen.items():
            moments.add(values[name], None if name == "output" else where)
        for name, arr in arrays.items():
            arr[place.at] = values[name]
        n_seen = 0 if where is None else int(np.count_nonzero(where))
        return records, seen, first_moments(place, stats if gather_stats else None), n_seen

    # Score-shaped stages are kept whole, every key of them; otherwise only the keys a
    # block can see are computed (the output is the same either way).
    keys: KeyMode = "all" if visible is not None else "visible"
    rows = rows or (query_block(spec) if lean else None)
    backend = lean_backend(spec) if lean else NUMPY
    walk = sweep(
        spec,
        visit,
        jobs=jobs,
        rows=rows,
        leads=leads,
        keys=keys,
        progress=progress,
        backend=backend,
    )
    n_visible = 0
    for records, seen, moments, n_seen in walk:
        n_visible += n_seen
        if records is not None:
            stats.merge(records)
        if moments is not None:
            stats.moments.merge(moments)
        for name, summary in seen.items():
            summaries[name].merge(summary)
    # Counted from the visible entries: blocks of keys hidden whole are never computed.
    scored = summaries.keys() - {"output"}
    hidden = math.prod(spec.weights_shape) - n_visible if scored else 0
    return Trace(
        spec=spec,
        visible=visible,
        stats=stats,
        summaries=summaries,
        hidden=hidden,
        **{s: arrays.get(s) for s in STAGES},
    )


def shown_blocks(
    spec: AttentionSpec, positions: list[tuple[int, ...]], rows: range
) -> dict[tuple[int, ...], Block]:
    """What a table shows: query rows ``rows`` of each slice at ``positions``, every key."""
    return {lead: attend_block(spec, lead, slice(rows.start, rows.stop)) for lead in positions}
