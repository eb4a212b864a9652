"""The page every report page is built on: one HTML file with its style, its script,
its pictures and its numbers inside (no network, no CDN: it opens offline, from a CI
artifact or an e-mail), and the heat map, the one picture the pages draw.

Hand-written HTML, CSS and about a hundred lines of script, with PNG heat maps
(:mod:`~sdpa_cli.render.pages.images`): no plotting library to vendor or to load, a
page that opens as fast as an image, and every figure also written as text (the
``alt`` of each picture, the ``title`` of each cell, the tables beside them) for a
screen reader, a text browser or ``grep``.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from sdpa_cli._version import __version__
from sdpa_cli.engine.types import F64
from sdpa_cli.render.pages.images import (
    CATEGORIES,
    MAPS,
    css_gradient,
    palette,
    png,
    quantize,
    steps,
)
from sdpa_cli.text import compact, integer_ticks, prose

EXACT_CELLS = 1 << 16
"""A heat map of at most this many cells carries its values in float32 for the hover
read-out; a larger one (a pooled pattern) is read back from its picture's bytes, to
1/254 of its scale."""

PLOT_PX = 480
"""The longer side of a heat map on the page, in CSS pixels (cells are whole pixels
each, at most :data:`CELL_PX`)."""

CELL_PX = 28

STYLE = """
:root { --ink: #1d1d1f; --mute: #5f6368; --line: #d0d4d9; --fail: #b2182b; --pass: #1b7837;
  --bg: #ffffff; --panel: #f6f7f9; font-family: system-ui, -apple-system, "Segoe UI", sans-serif; }
body { margin: 0 auto; max-width: 1200px; padding: 16px 24px 48px; color: var(--ink);
  background: var(--bg); line-height: 1.4; }
h1 { font-size: 1.35rem; margin: 0.2em 0; } h2 { font-size: 1.1rem; margin: 1.4em 0 0.4em; }
h3 { font-size: 1rem; margin: 1em 0 0.3em; }
.sub, .note, figcaption .unit, .readout { color: var(--mute); font-size: 0.9rem; }
.fail { color: var(--fail); font-weight: 600; } .pass { color: var(--pass); font-weight: 600; }
section { border-top: 1px solid var(--line); margin-top: 1.2em; }
pre { background: var(--panel); padding: 8px 10px; overflow-x: auto; font-size: 0.85rem;
  white-space: pre-wrap; }
footer { margin-top: 2em; }
table.lines { border-collapse: collapse; font-size: 0.92rem; }
table.lines td, table.lines th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
.row { display: flex; flex-wrap: wrap; gap: 28px; align-items: flex-start; }
figure.heat { margin: 8px 0; }
figure.heat figcaption { font-weight: 600; margin-bottom: 4px; }
.plot { display: inline-grid; grid-template-columns: 1.4em auto; grid-template-rows: auto auto;
  padding-top: 8px; }
.plot .ylab { writing-mode: vertical-rl; transform: rotate(180deg); text-align: center;
  color: var(--mute); font-size: 0.85rem; }
.plot .frame { position: relative; margin-left: 3.2em; }
.plot img { image-rendering: pixelated; display: block; border: 1px solid var(--line); cursor: crosshair; }
.plot .xlab { grid-column: 2; text-align: center; color: var(--mute); font-size: 0.85rem;
  padding-left: 3.2em; }
.tick { position: absolute; font-size: 0.72rem; color: var(--mute); white-space: nowrap; }
.tick.x { top: 100%; transform: translateX(-50%); padding-top: 2px; }
.tick.x.name { writing-mode: vertical-rl; transform: translateX(-50%) rotate(180deg);
  transform-origin: center; padding-top: 0; padding-bottom: 3px; }
.tick.y { right: 100%; transform: translateY(-50%); padding-right: 3px; }
.legend { display: flex; align-items: center; gap: 6px; font-size: 0.8rem; color: var(--mute); margin-top: 4px; }
.legend .bar { display: inline-block; width: 180px; height: 10px; border: 1px solid var(--line); }
.readout { min-height: 1.3em; display: block; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: 12px; height: 12px; border: 1px solid var(--line);
  vertical-align: middle; margin: 0 3px 0 8px; }
"""

HEAT_SCRIPT = """
function b64bytes(s) { const b = atob(s); const a = new Uint8Array(b.length);
  for (let i = 0; i < b.length; i++) a[i] = b.charCodeAt(i); return a; }
function heatValue(fig, r, c) {
  const d = fig.dataset, cols = +d.cols;
  if (!fig._exact && d.exact) fig._exact = new Float32Array(b64bytes(d.exact).buffer);
  if (fig._exact) return fig._exact[r * cols + c];
  if (!fig._pixels) {
    const img = fig.querySelector('img'), cv = document.createElement('canvas');
    cv.width = img.naturalWidth; cv.height = img.naturalHeight;
    const cx = cv.getContext('2d'); cx.drawImage(img, 0, 0);
    fig._pixels = cx.getImageData(0, 0, cv.width, cv.height).data;
  }
  const p = (r * cols + c) * 4, key = (fig._pixels[p] << 16) | (fig._pixels[p + 1] << 8) | fig._pixels[p + 2];
  const idx = SDPA_STEPS[d.map].get(key);
  if (idx === undefined || idx === 255) return NaN;
  const lo = +d.lo, hi = +d.hi; let v = lo + (hi - lo) * idx / 254;
  return d.scale === 'log2' ? Math.pow(2, v) : v;
}
function fmt(v) { if (Number.isNaN(v)) return 'no value'; if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v); return (a !== 0 && (a < 1e-3 || a >= 1e5)) ? v.toExponential(3) : (+v.toPrecision(4)).toString(); }
function names(fig, axis) { const n = fig.dataset[axis + 'names']; return n ? JSON.parse(n) : null; }
function span(i, f, n, list) { const a = i * f, b = Math.min(n, a + f) - 1;
  const nm = k => list && list[k] !== undefined ? k + ' ' + JSON.stringify(list[k]) : String(k);
  return a === b ? nm(a) : nm(a) + '–' + nm(b); }
function onHeat(ev) {
  const img = ev.currentTarget, fig = img.closest('figure.heat'), d = fig.dataset;
  const rows = +d.rows, cols = +d.cols;  // offsetX: from the picture's edge, inside its border
  const c = Math.min(cols - 1, Math.floor(ev.offsetX / img.clientWidth * cols));
  const r = Math.min(rows - 1, Math.floor(ev.offsetY / img.clientHeight * rows));
  if (r < 0 || c < 0) return;
  const v = heatValue(fig, r, c), approx = d.exact ? '' : '≈ ';
  const cats = d.categories ? JSON.parse(d.categories) : null;
  const where = d.ylabel + ' ' + span(r, +d.fr, +d.nrows, names(fig, 'y')) + ', ' +
    d.xlabel + ' ' + span(c, +d.fc, +d.ncols, names(fig, 'x'));
  const said = cats ? (cats[Math.round(v)] || 'no value') : approx + fmt(v) + (d.unit ? ' ' + d.unit : '');
  fig.querySelector('.readout').textContent = where + ': ' + said;
}
const SDPA_STEPS = {};
for (const [name, hex] of Object.entries(JSON.parse(document.getElementById('sdpa-steps').textContent))) {
  const m = new Map();
  for (let i = 0; i < 256; i++) { const key = parseInt(hex.substr(i * 6, 6), 16); if (!m.has(key)) m.set(key, i); }
  SDPA_STEPS[name] = m;
}
function wireHeats(root) { root.querySelectorAll('figure.heat img').forEach(img => {
  if (!img._wired) { img._wired = true; img.addEventListener('mousemove', onHeat); } }); }
wireHeats(document);
"""


def esc(text: object) -> str:
    """``text`` escaped for HTML (quotes too: it goes into attributes)."""
    return html.escape(str(text), quote=True)


def number(x: float) -> str:
    """A figure as the pages print it: four significant digits with a short exponent, as
    the tables (:func:`~sdpa_cli.text.compact`); NaN as ``no value``, ∞ as itself."""
    if math.isnan(x):
        return "no value"
    return prose(x) if math.isinf(x) else compact(x)


def heatmap(
    ident: str,
    values: F64,
    *,
    lo: float,
    hi: float,
    cmap: str = "sequential",
    caption: str,
    unit: str = "",
    x_label: str,
    y_label: str,
    pooled: tuple[int, int] = (1, 1),
    shape: tuple[int, int] | None = None,
    x_names: Sequence[str] | None = None,
    y_names: Sequence[str] | None = None,
    scale: str = "linear",
    alt: str = "",
    square: bool = True,
    categories: Sequence[str] | None = None,
    exact: bool = True,
) -> str:
    """One heat map as a ``<figure>``: the picture (one byte a cell on ``cmap``, from
    ``lo`` to ``hi``; NaN grey), its axes, a legend with ``unit``, and the hover
    read-out of each cell's value (exact for small maps, see :data:`EXACT_CELLS`).

    Args:
        values: the cells (rows, cols), already pooled ``pooled`` = (row factor,
            column factor) from an array of ``shape`` (its rows, its columns).
        scale: ``log2`` when ``values``, ``lo`` and ``hi`` are log2 of the figure
            (the legend and the read-out show the figure itself).
        x_names, y_names: a label per position (tokens), for ticks and the read-out.
        alt: the picture's facts in words, for a screen reader.
        square: cells as wide as high (a pattern: queries against keys); else each
            axis fills the plot on its own (a few slices against many rows).
        categories: the name of each value 0, 1, ... (a map of categories), which
            the read-out shows.
        exact: carry the values for the read-out (up to :data:`EXACT_CELLS`); a page
            of many maps (a model's patterns) reads them back from the pictures.
    """
    a = np.asarray(values, dtype=np.float64)
    rows, cols = a.shape
    n_rows, n_cols = shape if shape is not None else (rows, cols)
    fr, fc = pooled
    cell_w = max(1, min(CELL_PX, PLOT_PX // max(cols, 1)))
    cell_h = max(1, min(CELL_PX, PLOT_PX // max(rows, 1)))
    if square:
        cell_w = cell_h = min(cell_w, cell_h)
    width, height = cols * cell_w, rows * cell_h
    image = base64.b64encode(png(quantize(a, lo, hi), cmap)).decode("ascii")
    attrs: dict[str, str] = {
        "rows": str(rows),
        "cols": str(cols),
        "nrows": str(n_rows),
        "ncols": str(n_cols),
        "fr": str(fr),
        "fc": str(fc),
        "lo": repr(lo),
        "hi": repr(hi),
        "map": cmap,
        "scale": scale,
        "unit": unit,
        "xlabel": x_label,
        "ylabel": y_label,
    }
    if exact and a.size <= EXACT_CELLS:
        shown = np.exp2(a) if scale == "log2" else a
        attrs["exact"] = base64.b64encode(shown.astype("<f4").tobytes()).decode("ascii")
    if x_names is not None:
        attrs["xnames"] = json.dumps(list(x_names))
    if y_names is not None:
        attrs["ynames"] = json.dumps(list(y_names))
    if categories is not None:
        attrs["categories"] = json.dumps(list(categories))
    data = " ".join(f'data-{k}="{esc(v)}"' for k, v in attrs.items())
    tick_html = []
    named = x_names is not None and len(x_names) <= 32  # every position labelled
    x_room = 16
    for pos in integer_ticks(0, n_cols):
        at = pos // fc
        label = x_names[pos] if named and x_names is not None else str(pos)
        kind = "tick x name" if named else "tick x"
        x_room = max(x_room, 8 + 7 * min(len(label), 12) if named else 16)
        tick_html.append(
            f'<span class="{kind}" style="left:{(at + 0.5) * cell_w}px">{esc(label[:12])}</span>'
        )
    for pos in integer_ticks(0, n_rows):
        at = pos // fr
        label = y_names[pos] if y_names is not None and len(y_names) <= 32 else str(pos)
        tick_html.append(
            f'<span class="tick y" style="top:{(at + 0.5) * cell_h}px">{esc(label)}</span>'
        )
    ends = (2.0**lo, 2.0**hi) if scale == "log2" else (lo, hi)
    legend = (
        f'<div class="legend"><span>{esc(number(ends[0]))}</span>'
        f'<span class="bar" style="background:{css_gradient(cmap)}"></span>'
        f"<span>{esc(number(ends[1]))}</span>"
        f'<span class="unit">{esc(unit)}{" (log scale)" if scale == "log2" else ""}'
        f"{'; grey: no value' if np.isnan(a).any() else ''}</span></div>"
    )
    if categories is not None:  # a swatch each, not a ramp
        colours = palette(cmap)[np.rint(np.linspace(0, 255, len(categories))).astype(int)]
        swatches = "".join(
            f'<span class="swatch" style="background:rgb({r},{g},{b})"></span>{esc(name)}'
            for (r, g, b), name in zip(colours.tolist(), categories, strict=True)
        )
        legend = f'<div class="legend">{swatches}</div>'
    pool_note = f" (each cell the largest of {fr} × {fc} positions)" if fr > 1 or fc > 1 else ""
    return (
        f'<figure class="heat" id="{esc(ident)}" {data}>'
        f"<figcaption>{esc(caption)}"
        f'<span class="unit">{esc(pool_note)}</span></figcaption>'
        f'<div class="plot"><div class="ylab">{esc(y_label)}</div>'
        f'<div class="frame"><img alt="{esc(alt or caption)}" width="{width}" '
        f'height="{height}" style="width:{width}px;height:{height}px" '
        f'src="data:image/png;base64,{image}">{"".join(tick_html)}</div>'
        f'<div class="xlab" style="padding-top:{x_room}px">{esc(x_label)}</div></div>'
        f'{legend}<output class="readout">Point at a cell to read its value.</output></figure>'
    )


def page(title: str, subtitle: str, body: Sequence[str], script: str = "", data: Any = None) -> str:
    """The whole page: ``body`` (HTML fragments) under a title, the heat maps' script,
    and the page's own ``script`` reading ``data`` (JSON, as ``SDPA_DATA``)."""
    table = {name: steps(name).tobytes().hex() for name in (*MAPS, *CATEGORIES)}
    blobs = [
        f'<script type="application/json" id="sdpa-steps">{_json(table)}</script>',
        f'<script type="application/json" id="sdpa-data">{_json(data)}</script>',
        f"<script>{HEAT_SCRIPT}</script>",
    ]
    if script:
        blobs.append(
            "<script>const SDPA_DATA = JSON.parse("
            f"document.getElementById('sdpa-data').textContent);\n{script}</script>"
        )
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>",
            f'<header><h1>{esc(title)}</h1><p class="sub">{subtitle}</p></header><main>',
            *body,
            f'</main><footer class="note">Made by sdpa {esc(__version__)}: one file, '
            "nothing fetched; every picture's numbers are under the pointer and in the "
            "text beside it.</footer>",
            *blobs,
            "</body></html>",
        ]
    )


def _json(data: Any) -> str:
    """JSON safe inside a ``<script>`` element (no ``</``), NaN as null."""
    text = json.dumps(data, allow_nan=False, separators=(",", ":"), default=_plain)
    return text.replace("</", "<\\/")


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON: {type(x).__name__}")
