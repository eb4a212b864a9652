"""``explain --plot``: the stages of the explained slice as heatmaps, via matplotlib:
the whole slice by default (or the ``--rows``/``--keys`` window), pooled as the page's
are (:mod:`~sdpa_cli.diagnosis.pictures`).

matplotlib is an optional extra (``pip install matplotlib``); importing this
module raises ImportError without it. The figure API is used directly (no pyplot),
so nothing global changes and no display is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sdpa_cli.diagnosis.pictures import SlicePictures
from sdpa_cli.text import integer_ticks

COLUMNS = 2

TITLES = {
    "scores": "scores, Q·Kᵀ × scale",
    "masked": "masked scores (grey: hidden)",
    "weights": "weights, softmax over the keys",
    "output": "output, weights · V",
}


def heatmaps(pictures: SlicePictures, where: str) -> Callable[[BinaryIO], None]:
    """Draw the figure now; return the writer of its PNG (for an atomic write).

    The stages of the slice's window (:func:`~sdpa_cli.diagnosis.pictures.slice_pictures`:
    the whole slice by default, pooled past 512 positions a side by the value of largest
    magnitude), on axes in the tensor's own indices; hidden scores grey."""
    p = pictures
    fig = Figure(figsize=(4.4 * COLUMNS, 3.6 * 2), layout="constrained")
    FigureCanvasAgg(fig)
    pooled = f", each cell the largest of {p.pool} × {p.pool}" if p.pool > 1 else ""
    span = f"queries {p.rows.start}–{p.rows.stop - 1}, keys {p.keys.start}–{p.keys.stop - 1}"
    fig.suptitle(" · ".join(x for x in ("sdpa explain", where, span + pooled) if x))
    for n_ax, (name, title) in enumerate(TITLES.items()):
        ax = fig.add_subplot(2, 2, n_ax + 1)
        ax.set_title(title, fontsize=9)
        values = np.array(p.stages[name], dtype=np.float64)
        if not values.size:
            ax.text(0.5, 0.5, "empty (L or S is 0)", ha="center", va="center")
            ax.set_axis_off()
            continue
        is_output = name == "output"
        values[~np.isfinite(values)] = np.nan
        if name == "weights":
            top = float(np.nanmax(values, initial=0.0))
            cmap_name, vmin, vmax = "viridis", 0.0, top if top > 0 else 1.0
        else:
            top = float(np.nanmax(np.abs(values), initial=0.0)) or 1.0
            cmap_name, vmin, vmax = "RdBu_r", -top, top
        cmap = colormaps[cmap_name].with_extremes(bad="#bdbdbd")  # hidden: grey
        first, count = (0, values.shape[1]) if is_output else (p.keys.start, len(p.keys))
        # each cell spans its pooled positions: axes in the tensor's own indices
        extent = (
            first - 0.5,
            first + count - 0.5,
            p.rows.stop - 0.5,
            p.rows.start - 0.5,
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
        # Ticks on whole indices only, few enough to read: matplotlib's own fall on the
        # cells' edges (0.5), and 16 three-digit labels run together in 4 inches.
        ax.set_yticks(integer_ticks(p.rows.start, len(p.rows)))
        ax.set_xticks(integer_ticks(first, count))
        ax.tick_params(labelsize=8)
        fig.colorbar(image, ax=ax, shrink=0.8)

    def write(fh: BinaryIO) -> None:
        fig.savefig(fh, format="png", dpi=110)

    return write
