"""``explain --plot``: every stage of the explained rows as a heatmap, via matplotlib.

matplotlib is an optional extra (``pip install 'sdpa-cli[plot]'``); importing this
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
from sdpa_cli.render.common import STAGE_TITLES, slice_label

COLUMNS = 3


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
        title, formula = STAGE_TITLES[stage.step]
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
        if len(ex.rows) <= 16:
            ax.set_yticks(list(ex.rows))
        fig.colorbar(image, ax=ax, shrink=0.8)

    def write(fh: BinaryIO) -> None:
        fig.savefig(fh, format="png", dpi=110)

    return write
