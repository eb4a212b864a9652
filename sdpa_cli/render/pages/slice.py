"""``sdpa explain --html`` and ``sdpa compute --html``: one slice's stages as a page.

Scores (after the scale), masked scores (the hidden ones blank: the mask drawn),
weights and output, each a heat map over the window shown (the whole slice by
default, pooled past :data:`~sdpa_cli.diagnosis.pictures.PICTURE_SIDE`; ``--rows``
and ``--keys`` choose a window, at full resolution when it is small enough); the
slice's findings beside them with the rows they name; then what the terminal shows
(the walk, the scorecard of ``--query``) as text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sdpa_cli.diagnosis.findings import Finding
from sdpa_cli.diagnosis.pictures import SlicePictures
from sdpa_cli.engine.types import F64
from sdpa_cli.files.tokens import Tokens
from sdpa_cli.render.pages.html import esc, heatmap, number, page
from sdpa_cli.text import format_index

CAPTIONS = {
    "scores": ("scores, Q·Kᵀ × scale", "score"),
    "masked": ("masked scores (blank: hidden by the mask)", "score"),
    "weights": ("weights, softmax over the keys", "weight"),
    "output": ("output, weights · V", "value"),
}


def slice_page(
    pictures: SlicePictures,
    *,
    title: str,
    about: str,
    findings: Sequence[Finding],
    text: str,
    tokens: Tokens | None = None,
) -> str:
    """The page of one slice's ``pictures``, its ``findings`` and the terminal's
    ``text``; ``tokens`` label the positions."""
    p = pictures
    lead = "slice " + format_index(p.lead) if p.lead else "the slice"
    window = (
        f"{_span(p.rows, 'query', 'queries')} × {_span(p.keys, 'key', 'keys')}"
        if len(p.rows) and len(p.keys)
        else "no positions"
    )
    pooled = f"; each cell the largest of {p.pool} × {p.pool} positions" if p.pool > 1 else ""
    subtitle = f"{esc(about)} · {esc(lead)}: {esc(window)}{esc(pooled)}"
    q_names = k_names = None
    if tokens is not None:
        q_names = list(tokens.queries[p.rows.start : p.rows.stop])
        k_names = list(tokens.keys[p.keys.start : p.keys.stop])
    figures = []
    scale = _symmetric(p.stages["scores"])
    for name in ("scores", "masked", "weights", "output"):
        values = p.stages[name]
        caption, unit = CAPTIONS[name]
        if name == "weights":
            top = float(np.nanmax(values)) if np.isfinite(values).any() else 1.0
            lo, hi, cmap = 0.0, top if top > 0 else 1.0, "sequential"
        else:
            top = scale if name != "output" else _symmetric(values)
            lo, hi, cmap = -top, top, "diverging"
        output = name == "output"
        figures.append(
            heatmap(
                f"stage-{name}",
                values,
                lo=lo,
                hi=hi,
                cmap=cmap,
                caption=caption,
                unit=unit,
                x_label="feature" if output else "key",
                y_label="query",
                pooled=(p.pool, 1 if output else p.pool),
                shape=(len(p.rows), values.shape[1] if output else len(p.keys)),
                x_names=None if output else k_names,
                y_names=q_names,
                square=not output,
                alt=f"{caption} of {lead}, values from {number(lo)} to {number(hi)}",
            )
        )
    body = [
        '<section><h2>The stages</h2><div class="row">',
        *figures,
        "</div></section>",
        _findings(findings),
        f"<section><h2>As the terminal shows it</h2><pre>{esc(text)}</pre></section>",
    ]
    return page(title, subtitle, body)


def _findings(findings: Sequence[Finding]) -> str:
    """The slice's findings, each with the index it names."""
    if not findings:
        return "<section><h2>Findings</h2><p>Nothing worth a warning in this slice.</p></section>"
    items = []
    for f in findings:
        where = f" at {format_index(f.index)}" if f.index is not None else ""
        hint = f'<br><span class="note">hint: {esc(f.hint)}</span>' if f.hint else ""
        items.append(
            f"<li><strong>{esc(f.severity)}</strong> {esc(f.kind)}{esc(where)}: "
            f"{esc(f.message)}{hint}</li>"
        )
    return f"<section><h2>Findings</h2><ul>{''.join(items)}</ul></section>"


def _span(positions: range, one: str, many: str) -> str:
    """``query 0``, ``queries 0–15``."""
    if len(positions) == 1:
        return f"{one} {positions.start}"
    return f"{many} {positions.start}–{positions.stop - 1}"


def _symmetric(values: F64) -> float:
    """The largest finite magnitude (1 with none): a diverging map's half-range."""
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size else 1.0
    return top if top > 0 and math.isfinite(top) else 1.0
