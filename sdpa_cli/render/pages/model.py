"""``sdpa report model --html``: a model's layer × head grid as one page.

The grid is a table of cells (a row per attention call, a column per query head),
coloured by the measure chosen above it; notable heads carry their mark (◆ sink,
✕ dead, ● saturated). Choosing a cell shows that head's attention pattern (pooled
by max, so a sink's column and a diagonal stay visible at any length), its
statistics and what made it notable. Every cell's figures are also its ``title``
and the notable heads are listed in words below, for a screen reader or ``grep``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from sdpa_cli.check.records import CaseResult
from sdpa_cli.diagnosis.model import ModelGrid
from sdpa_cli.engine.types import F64
from sdpa_cli.files.tokens import Tokens
from sdpa_cli.names import NOTABLE_HEADS
from sdpa_cli.render.grid_words import kind_titles, metric_description, row_labels
from sdpa_cli.render.pages.check import case_sections
from sdpa_cli.render.pages.html import esc, heatmap, number, page
from sdpa_cli.render.pages.images import css_gradient, palette

MARKS = {"sink": "◆", "dead": "✕", "saturated": "●"}
"""The mark of each notable kind (:data:`~sdpa_cli.names.NOTABLE_HEADS`) in a cell."""

ONE = {"sink": "An attention sink", "dead": "A dead head", "saturated": "A saturated head"}
"""What one head of each notable kind is, as the pattern panel says it."""

SCRIPT = """
const D = SDPA_DATA, grid = document.getElementById('grid'), pick = document.getElementById('measure');
function colour(m, v) {
  const s = D.measures[m]; if (v === null) return '#e0e0e0';
  const t = Math.max(0, Math.min(1, (v - s.lo) / ((s.hi - s.lo) || 1)));
  const c = D.palette[Math.round(t * 255)]; return 'rgb(' + c.join(',') + ')';
}
function ink(m, v) { if (v === null) return '#1d1d1f';
  const s = D.measures[m], t = (v - s.lo) / ((s.hi - s.lo) || 1); return t > 0.6 ? '#1d1d1f' : '#ffffff'; }
function paint() {
  const m = pick.value, s = D.measures[m];
  grid.querySelectorAll('td.cell').forEach(td => {
    const v = s.values[+td.dataset.case][+td.dataset.head];
    td.style.background = colour(m, v); td.style.color = ink(m, v);
    const x = v !== null && s.log2 ? Math.pow(2, v) : v;
    td.querySelector('.v').textContent = x === null ? '' : (s.log2 ? (+x.toPrecision(2)) : (+x.toFixed(2))).toString();
  });
  document.getElementById('measure-about').textContent = s.about;
  document.getElementById('legend-lo').textContent = s.lo_text;
  document.getElementById('legend-hi').textContent = s.hi_text;
}
function show(c, h) {
  grid.querySelectorAll('td.cell.chosen').forEach(td => td.classList.remove('chosen'));
  const td = grid.querySelector('td.cell[data-case="' + c + '"][data-head="' + h + '"]');
  if (td) td.classList.add('chosen');
  const panel = document.getElementById('pattern'), key = c + ',' + h, pat = D.patterns[key];
  panel.querySelector('h3').textContent = D.rows[c] + ', head ' + h;
  const facts = Object.keys(D.measures).map(m => {
    const s = D.measures[m], v = s.values[c][h], x = v !== null && s.log2 ? Math.pow(2, v) : v;
    return s.label + ': ' + (x === null ? 'no value' : fmt(x)); });
  panel.querySelector('.facts').textContent = facts.join(' · ');
  const notes = D.notable.filter(n => n.case === c && n.head === h).map(n =>
    D.marks[n.kind] + ' ' + D.one[n.kind] + ' (' + fmt(n.value) + '). The rule: ' + D.kinds[n.kind] + '.');
  panel.querySelector('.found').textContent = notes.length ? notes.join('; ') : 'Nothing notable.';
  const holder = panel.querySelector('.picture');
  holder.innerHTML = pat ? pat : '<p class="note">No pattern: this case was not read.</p>';
  wireHeats(holder);
}
pick.addEventListener('change', paint);
grid.addEventListener('click', ev => { const td = ev.target.closest('td.cell');
  if (td) show(+td.dataset.case, +td.dataset.head); });
grid.addEventListener('keydown', ev => { const td = ev.target.closest('td.cell');
  if (td && (ev.key === 'Enter' || ev.key === ' ')) { ev.preventDefault(); show(+td.dataset.case, +td.dataset.head); } });
document.querySelectorAll('a.head').forEach(a => a.addEventListener('click', ev => {
  ev.preventDefault(); show(+a.dataset.case, +a.dataset.head); }));
paint();
if (D.first) show(D.first[0], D.first[1]);
"""

STYLE = """
<style>
table.grid { border-collapse: separate; border-spacing: 2px; font-size: 0.78rem; }
table.grid th { font-weight: 500; color: var(--mute); padding: 0 4px; text-align: right; }
table.grid thead th { text-align: center; }
td.cell { width: 34px; height: 24px; text-align: center; cursor: pointer; position: relative;
  font-variant-numeric: tabular-nums; border: 2px solid transparent; }
td.cell.notable { border-color: #1d1d1f; }
td.cell.chosen { outline: 3px solid #e66101; outline-offset: 1px; }
td.cell .mark { position: absolute; top: -4px; right: 0; font-size: 0.6rem; }
th.corner { font-size: 0.7rem; white-space: nowrap; }
#pattern { min-width: 420px; }
.controls { margin: 8px 0; }
</style>
"""


def model_page(
    grid: ModelGrid,
    manifest: str,
    tokens: Mapping[str, Tokens] | None = None,
    *,
    checks: Sequence[CaseResult] | None = None,
    title: str | None = None,
) -> str:
    """The page of ``grid`` (from ``manifest``), with each case's token labels where
    ``tokens`` names them (case name → its queries' and keys' labels); with ``checks`` (a
    manifest's check, case by case in the grid's order), each case's verdict as a
    measure too, and its checks below the grid."""
    th = grid.thresholds
    labels, label_kind, _ = row_labels(grid, 10_000)
    short = [f"{label_kind} {x}" if label_kind == "layer" else x for x in labels]
    rows = [r.name for r in grid.rows]
    measures = {}
    for m in grid.metrics:
        values, present = grid.values(m), grid.present(m)
        finite = values[present & np.isfinite(values)]
        lo, hi = (0.0, 1.0) if m != "error" else (0.0, float(finite.max()) if finite.size else 1.0)
        hi = hi if hi > lo else lo + 1.0  # every error 0: the scale, and its legend, 0 … 1
        measures[m] = {
            "label": m.replace("_", " "),
            "about": metric_description(m, th),
            "lo": lo,
            "hi": hi,
            "lo_text": number(lo),
            "hi_text": number(hi),
            "values": [
                [float(x) if p and math.isfinite(x) else None for x, p in zip(vs, ps, strict=True)]
                for vs, ps in zip(values, present, strict=True)
            ],
        }
    if checks is not None:
        checked = {"verdict": _verdicts(grid, checks)}
        over = _over_allowance(grid)
        if over is not None:
            checked["over_allowance"] = over
        measures = {**checked, **measures}
    marks: dict[tuple[int, int], list[str]] = {}
    index = {r.name: i for i, r in enumerate(grid.rows)}
    for n in grid.notable:
        marks.setdefault((index[n.case], n.head), []).append(n.kind)
    patterns = {}
    for c, row in enumerate(grid.rows):
        heads = row.heads
        if heads is None or heads.patterns is None:
            continue
        names = (tokens or {}).get(row.name)
        for h in range(heads.heads):
            patterns[f"{c},{h}"] = _pattern(
                rows[c], h, heads.patterns[h], heads.pool, heads.lengths, names
            )
    first = next(iter(sorted(marks)), (0, 0) if grid.rows and grid.heads else None)
    data = {
        "measures": measures,
        "palette": palette("sequential").tolist(),
        "rows": rows,
        "patterns": patterns,
        "notable": [
            {"case": index[n.case], "head": n.head, "kind": n.kind, "value": n.value}
            for n in grid.notable
        ],
        "kinds": kind_titles(th),
        "one": ONE,
        "marks": MARKS,
        "first": None if first is None else list(first),
    }
    chosen = next((m for m in ("verdict", "entropy") if m in measures), next(iter(measures), ""))
    options = "".join(
        f'<option value="{esc(m)}"{" selected" if m == chosen else ""}>'
        f"{esc(m.replace('_', ' '))}</option>"
        for m in measures
    )
    body = [
        STYLE,
        '<section><div class="controls"><label for="measure"><strong>Colour by</strong> '
        f'</label><select id="measure">{options}</select> '
        '<span class="note" id="measure-about"></span></div>',
        '<div class="legend"><span id="legend-lo"></span><span class="bar" '
        f'style="background:{css_gradient("sequential")}"></span><span id="legend-hi"></span>'
        f'<span class="unit">{_marks_legend()}; choose a cell to see its head</span></div>',
        '<div class="row">',
        _grid_table(grid, label_kind, short, rows, measures.get(chosen), marks),
        '<div id="pattern" aria-live="polite"><h3>Choose a cell</h3>'
        '<p class="note facts"></p><p class="found"></p><div class="picture"></div></div>',
        "</div></section>",
        _notable_section(grid, rows, index),
    ]
    n_cases, n_heads = len(grid.rows), grid.heads
    subtitle = (
        f"{n_cases} attention call{'s' if n_cases != 1 else ''} × "
        f"{n_heads} quer{'ies' if n_heads == 1 else 'y heads'}; each head's rows pooled "
        "over the batch"
    )
    if checks is None:
        return page(f"sdpa report model: {manifest}", subtitle, body, SCRIPT, data)
    passed = sum(r.passed for r in checks)
    subtitle = f"{passed} of {len(checks)} cases passed · {subtitle}"
    body.append("<section><h2>The checks, case by case</h2>")
    for r in checks:
        line, parts = case_sections(r, 4)
        body.append(f"<h3>{esc(r.name)}</h3><p>{line}</p>{''.join(parts)}")
    body.append("</section>")
    return page(f"sdpa check: {title or manifest}", subtitle, body, SCRIPT, data)


def _over_allowance(grid: ModelGrid) -> dict[str, object] | None:
    """The ``over_allowance`` measure: each head's largest output error ÷ the allowance
    the verdict used (above 1 fails; log scale, 1/16 to 16, as the check page draws it);
    None when no case exported an output under the kernel-relative rule."""
    values: list[list[float | None]] = []
    found = False
    for row in grid.rows:
        over = None if row.heads is None else row.heads.over_allowance
        line: list[float | None] = [None] * grid.heads
        if over is not None:
            found = True
            for h, x in enumerate(over.tolist()):
                # log2 for the colour (clamped to 1/16..16 there); 0 → 1/16, inf → 2^30
                line[h] = math.log2(x) if x > 0 and math.isfinite(x) else (-4.0 if x == 0 else 30.0)
        values.append(line)
    if not found:
        return None
    return {
        "label": "over allowance",
        "about": "each head's largest output error ÷ the allowance sdpa check used: "
        "above 1 fails (log scale: 1/16 dark, 16 light)",
        "lo": -4.0,
        "hi": 4.0,
        "lo_text": "1/16",
        "hi_text": "16×",
        "log2": True,
        "values": values,
    }


def _verdicts(grid: ModelGrid, checks: Sequence[CaseResult]) -> dict[str, object]:
    """The ``verdict`` measure: 1 where a check of the case failed, 0 where every check
    passed, no value where the case was not checked; every head of a case alike."""
    by_name = {r.name: r for r in checks}
    values: list[list[float | None]] = []
    for row in grid.rows:
        r = by_name.get(row.name)
        v = None if r is None or r.report is None else float(not r.report.passed)
        values.append([v] * grid.heads)
    return {
        "label": "verdict",
        "about": "the case's verdict: 1 (yellow) a check failed, 0 (dark) every check passed",
        "lo": 0.0,
        "hi": 1.0,
        "lo_text": "passed",
        "hi_text": "failed",
        "values": values,
    }


def _pattern(
    row: str,
    head: int,
    pattern: F64,
    pool: int,
    lengths: tuple[int, int],
    names: Tokens | None,
) -> str:
    """A head's pattern as a heat map of weights, 0 to its largest."""
    hi = float(np.nanmax(pattern)) if pattern.size else 1.0
    return heatmap(
        f"pattern-{row}-{head}".replace(" ", "-"),
        pattern.astype(np.float64),
        lo=0.0,
        hi=hi if hi > 0 else 1.0,
        caption=f"Attention weights of {row}, head {head}",
        unit="weight",
        x_label="key",
        y_label="query",
        pooled=(pool, pool),
        shape=lengths,
        x_names=None if names is None else names.keys,
        y_names=None if names is None else names.queries,
        alt=f"the attention pattern of {row}, head {head}: weights up to {number(hi)}",
        exact=False,  # a thousand heads' values would be most of the page: read from the picture
    )


def _grid_table(
    grid: ModelGrid,
    kind: str,
    short: Sequence[str],
    rows: Sequence[str],
    measure: Mapping[str, object] | None,
    marks: Mapping[tuple[int, int], Sequence[str]],
) -> str:
    """The grid as a table of cells: each cell's figures in its title (every measure),
    the chosen measure's value in it, coloured by the script (and here, for a page
    read without it)."""
    head = "".join(f'<th scope="col">{h}</th>' for h in range(grid.heads))
    corner = f'<th class="corner">{esc(kind)} ╲ head</th>'
    lines = [f'<table class="grid" id="grid"><thead><tr>{corner}{head}</tr></thead><tbody>']
    colours = palette("sequential")
    figures = {m: (grid.values(m), grid.present(m)) for m in grid.metrics}  # once, not a cell
    for c, label in enumerate(rows):
        cells = [f'<th scope="row" title="{esc(label)}">{esc(short[c])}</th>']
        for h in range(grid.heads):
            kinds = marks.get((c, h), ())
            facts = [
                f"{m.replace('_', ' ')} {number(float(values[c, h]))}"
                for m, (values, present) in figures.items()
                if present[c, h]
            ]
            title = f"{label}, head {h}: " + (", ".join(facts) or "no value")
            if kinds:
                title += "; " + ", ".join(kinds)
            value = None
            if measure is not None:
                value = measure["values"][c][h]  # type: ignore[index]
            style = ""
            if isinstance(value, float) and measure is not None:  # as the script paints it
                lo, hi = float(measure["lo"]), float(measure["hi"])  # type: ignore[arg-type]
                t = min(1.0, max(0.0, (value - lo) / ((hi - lo) or 1.0)))
                r, g, b = colours[round(t * 255)]
                style = f' style="background:rgb({r},{g},{b})"'
            mark = "".join(MARKS[k] for k in kinds)
            cells.append(
                f'<td class="cell{" notable" if kinds else ""}" tabindex="0" role="button" '
                f'data-case="{c}" data-head="{h}" title="{esc(title)}" aria-label="{esc(title)}"{style}>'
                f'<span class="v"></span>{f"<span class=mark>{mark}</span>" if mark else ""}</td>'
            )
        lines.append(f"<tr>{''.join(cells)}</tr>")
    lines.append("</tbody></table>")
    return "".join(lines)


def _notable_section(grid: ModelGrid, rows: Sequence[str], index: Mapping[str, int]) -> str:
    """The notable heads in words, by kind; each a link that chooses its cell."""
    titles = kind_titles(grid.thresholds)
    parts = ["<section><h2>Notable heads</h2>"]
    if not grid.notable:
        parts.append("<p>None: no attention sink, dead or saturated head.</p>")
    for kind in NOTABLE_HEADS:
        found = [n for n in grid.notable if n.kind == kind]
        if not found:
            continue
        links = ", ".join(
            f'<a href="#" class="head" data-case="{index[n.case]}" data-head="{n.head}">'
            f"{esc(rows[index[n.case]])} head {n.head} ({number(n.value)})</a>"
            for n in found
        )
        parts.append(f"<h3>{MARKS[kind]} {esc(titles[kind])}</h3><p>{links}</p>")
    parts.append("</section>")
    return "".join(parts)


def _marks_legend() -> str:
    return ", ".join(f"{mark} {kind}" for kind, mark in MARKS.items())
