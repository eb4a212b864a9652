"""``explain --plot``: every stage of the explained rows as a heatmap, via matplotlib.

matplotlib is an optional extra (``pip install matplotlib``); importing this
module raises ImportError without it. The figure API is used directly (no pyplot),
so nothing global changes and no display is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import BinaryIO

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sdpa_cli.diagnosis.explained import Explanation
from sdpa_cli.render.common import slice_label, stage_heading

COLUMNS = 3
MOST_TICKS = 16
"""Most tick labels on an axis."""


def integer_ticks(first: int, count: int, most: int = MOST_TICKS) -> list[int]:
    """Tick positions for the indices ``first .. first + count - 1``: whole numbers
    only, every 1, 2 or 5 × 10ᵏ of them (the smallest step giving at most ``most``),
    on multiples of the step."""
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


def heatmaps(ex: Explanation, keys: slice | None = None) -> Callable[[BinaryIO], None]:
    """Draw the figure now; return the writer of its PNG (for an atomic write).

    Score stages show the keys ``keys`` (default all); hidden keys are grey from
    the masked stage on (before it they hold real scores)."""
    stages = ex.stages
    n = len(stages)
    cols = min(COLUMNS, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    where = slice_label(ex.spec, ex.lead)
    span = f"rows {ex.rows.start}–{ex.rows.stop - 1} of {ex.spec.L}"
    fig.suptitle(" · ".join(x for x in ("sdpa explain", where, span) if x))
    for n_ax, stage in enumerate(stages):
        ax = fig.add_subplot(rows, cols, n_ax + 1)
        title, formula = stage_heading(stage.step, dropout=ex.spec.options.dropout > 0)
        ax.set_title(f"{title}\n{formula}", fontsize=9)
        values = np.array(stage.values, dtype=np.float64)
        if not values.size:
            ax.text(0.5, 0.5, "empty (L or S is 0)", ha="center", va="center")
            ax.set_axis_off()
            continue
        is_output = stage.step == "output"
        first = 0
        if stage.step in ("masked", "weights", "dropped"):
            values[~ex.visible] = np.nan  # hidden keys: drawn grey
        if not is_output and keys is not None:
            values = values[:, keys]
            first = keys.start
        values[~np.isfinite(values)] = np.nan
        if stage.step in ("weights", "dropped"):
            top = float(np.nanmax(values, initial=0.0))
            name, vmin, vmax = "magma", 0.0, top if top > 0 else 1.0
        else:
            top = float(np.nanmax(np.abs(values), initial=0.0)) or 1.0
            name, vmin, vmax = "RdBu_r", -top, top
        cmap = colormaps[name].with_extremes(bad="#9e9e9e")  # hidden keys: grey
        # Axes in the tensor's own indices: rows from --rows, keys from --keys.
        extent = (
            first - 0.5,
            first + values.shape[1] - 0.5,
            ex.rows.stop - 0.5,
            ex.rows.start - 0.5,
        )
        image = ax.imshow(
            values,
            cmap=cmap,
            vmin=vmin,
            vmax=vmax,
            aspect="auto",
            interpolation="nearest",
            extent=extent,
        )
        ax.set_ylabel("query")
        ax.set_xlabel("value column" if is_output else "key")
        # Ticks on whole indices only: matplotlib's own fall on the cells' edges (0.5).
        ax.set_yticks(integer_ticks(ex.rows.start, len(ex.rows)))
        ax.set_xticks(integer_ticks(first, values.shape[1]))
        fig.colorbar(image, ax=ax, shrink=0.8)

    def write(fh: BinaryIO) -> None:
        fig.savefig(fh, format="png", dpi=110)

    return write
