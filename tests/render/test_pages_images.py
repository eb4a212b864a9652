"""The pictures of the report pages: PNG heat maps, colour maps, max pooling, ticks.

A heat map's bytes are read back with Pillow (an independent PNG decoder) to show
the file is what a browser decodes: each cell one palette index, NaN the grey.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from sdpa_cli.render.pages.html import heatmap, page
from sdpa_cli.render.pages.images import (
    MISSING,
    css_gradient,
    palette,
    png,
    quantize,
    steps,
)

Image = pytest.importorskip("PIL.Image")


def test_a_heat_map_png_decodes_to_its_cells_on_the_colour_map() -> None:
    values = np.array([[0.0, 0.5, 1.0], [np.nan, 0.25, 2.0]])
    indices = quantize(values, 0.0, 1.0)
    assert indices.tolist() == [[0, 127, 254], [255, 64, 254]]  # NaN 255; 2.0 clipped to 1
    decoded = Image.open(io.BytesIO(png(indices, "sequential")))
    assert decoded.size == (3, 2)
    assert decoded.mode == "P"
    assert np.array(decoded).tolist() == indices.tolist()
    rgb = np.array(decoded.convert("RGB"))
    assert tuple(rgb[1, 0]) == MISSING  # no value: grey
    assert tuple(rgb[0, 0]) == tuple(palette("sequential")[0])  # viridis' dark purple
    assert tuple(rgb[0, 2]) == tuple(palette("sequential")[255])  # its yellow


def test_the_maps_run_dark_to_light_and_blue_white_red() -> None:
    viridis = palette("sequential").astype(int)
    assert viridis.shape == (256, 3)
    # perceptually ordered: lightness (the green channel, in viridis) rises throughout
    assert np.all(np.diff(viridis[:, 1]) >= 0)
    diverging = palette("diverging").astype(int)
    assert diverging[0, 2] > diverging[0, 0]  # blue at the bottom
    assert diverging[-1, 0] > diverging[-1, 2]  # red at the top
    assert diverging[128].min() > 230  # near white in the middle
    assert steps("mask")[[0, 85, 169, 254]].tolist() == [
        [255, 255, 255],
        [0x21, 0x66, 0xAC],
        [0xE6, 0x61, 0x01],
        [0xBD, 0xBD, 0xBD],
    ]
    assert css_gradient("sequential").startswith("linear-gradient(to right, #440154 0%")


def test_a_page_holds_everything_it_shows() -> None:
    """Nothing fetched: no src or href but data: URIs and in-page anchors, the script
    and the style inline, every cell's value in the figure (exact for small maps)."""
    figure = heatmap(
        "w", np.array([[0.25, 0.75]]), lo=0, hi=1, caption="weights", x_label="key", y_label="query"
    )
    text = page("t", "s", [figure], "console.log(SDPA_DATA.n);", {"n": 1, "x": None})
    assert "<script src" not in text
    assert "<link" not in text
    assert "http" not in text
    assert 'src="data:image/png;base64,' in text
    exact = base64.b64encode(np.array([0.25, 0.75], dtype="<f4").tobytes()).decode()
    assert f'data-exact="{exact}"' in text  # the cells' values in float32, for the read-out
    assert '{"n":1,"x":null}' in text
