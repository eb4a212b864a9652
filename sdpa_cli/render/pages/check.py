"""``sdpa check --html``: a check's verdict as one page, and for each failed
comparison, where its error sits.

A failed export gets, from the report's :class:`~sdpa_cli.check.records.Evidence`:

- the error ÷ its allowance over (batch, head) slices × query rows, the largest of
  each row (above 1 fails; a diverging map, white at the allowance);
- the worst slice zoomed: every element of its rows (features, or keys for weights);
- where a hint found the computation the export matches and its mask differs from
  the one asked for, both masks over (query, key) of that slice: the keys one sees
  and the other does not (a flipped causal mask is a triangle);
- the distribution of the export's errors beside the plain computation's;
- the report's own lines: the mismatch, the hint.

A passing run is its table of checks, one line each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sdpa_cli.check.compare import tolerance_ratio
from sdpa_cli.check.records import CaseResult, Check, CheckReport, Evidence, failure_lines
from sdpa_cli.check.relative import error_ratio
from sdpa_cli.diagnosis.pictures import largest, pooled_to
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64
from sdpa_cli.engine.visible import visibility
from sdpa_cli.render.pages.html import esc, heatmap, number, page

SPAN = 4.0
"""The ratio maps run from 1/2^SPAN to 2^SPAN of the allowance (log scale)."""

ROWS_SHOWN = 512
"""Query rows (and features, keys) a map shows before pooling them by max."""

MASK_ROWS = 256
"""Query rows of both masks made at once: (256, S) arrays, never (L, S)."""


MASK_LABELS = (
    "neither sees it",
    "only the computation asked for sees it",
    "only the computation the export matches sees it",
    "both see it",
)


def check_page(results: Sequence[CaseResult], title: str) -> str:
    """The page of a check's run: one case's verdict, its checks and the pictures of
    each failed comparison its report kept evidence for; a manifest's cases, a
    section each."""
    if len(results) == 1:
        subtitle, body = case_sections(results[0], 2)
        return page(f"sdpa check: {title}", subtitle, body)
    passed = sum(r.passed for r in results)
    subtitle = f"{passed} of {len(results)} cases passed"
    body = []
    for r in results:
        line, parts = case_sections(r, 3)
        body.append(f"<section><h2>{esc(r.name)}</h2><p>{line}</p>{''.join(parts)}</section>")
    return page(f"sdpa check: {title}", subtitle, body)


def case_sections(result: CaseResult, level: int) -> tuple[str, list[str]]:
    """A case's verdict line and its sections (headings at ``level``)."""
    report = result.report
    if report is None:
        return '<span class="fail">not checked</span>', [
            f'<p class="fail">Not checked: {esc(result.error)}</p>'
        ]
    line = (
        f'<span class="{"pass" if report.passed else "fail"}">{esc(_verdict(report))}</span> · '
        f"export {esc(report.export_dtype)}, reference {esc(report.reference)} on "
        f"{esc(report.backend)} ({esc(report.device)})"
    )
    body = [_checks_table(report, level)]
    evidence = report.evidence
    if evidence is not None:
        for c in report.failed:
            name = c.name.removesuffix(".close")
            if c.name.endswith(".close") and name in evidence.exports:
                body.append(_failed_export(c, name, evidence, level))
    return line, body


def _verdict(report: CheckReport) -> str:
    n = len(report.checks)
    if report.passed:
        return f"all {n} checks passed" if n != 1 else "the check passed"
    failed = [c.name for c in report.failed]
    return f"{len(failed)} of {n} checks failed: {', '.join(failed)}"


def _checks_table(report: CheckReport, level: int) -> str:
    rows = "".join(
        f'<tr><td class="{"pass" if c.passed else "fail"}">{esc(c.status.upper())}</td>'
        f"<td>{esc(c.name)}</td><td>{esc(c.summary)}</td></tr>"
        for c in report.checks
    )
    return f'<section><h{level}>Checks</h{level}><table class="lines">{rows}</table></section>'


def _failed_export(check: Check, name: str, ev: Evidence, level: int) -> str:
    """The pictures of one failed comparison (see the module's docstring)."""
    spec = ev.spec
    lead = spec.lead
    n = math.prod(lead)
    a = np.asarray(ev.exports[name], dtype=np.float64)
    r = np.asarray(ev.reference[name], dtype=np.float64)
    p = ev.plain.get(name)
    rows_axis = name != "lse"
    shape = (n, spec.L, -1) if rows_axis else (n, spec.L)
    a, r = a.reshape(shape), r.reshape(shape)
    plain = None if p is None else np.asarray(p, dtype=np.float64).reshape(shape)
    if (judged := ev.judgement) is not None:  # the rule the verdict used, whole
        ratio = error_ratio(a, r, plain, judged, rows=rows_axis)
        allowance = (
            f"the kernel-relative allowance ({number(judged.factor)}× the plain "
            f"{judged.export} computation's largest error in the slice, at least "
            f"{number(judged.floor_ulps)} ulp of {judged.floor_of})"
        )
    else:
        tol = check.tolerance
        rtol, atol = (tol.rtol, tol.atol) if tol is not None else (0.0, 0.0)
        ratio = tolerance_ratio(a, r, rtol, atol)
        allowance = f"atol + rtol·|reference| (rtol {number(rtol)}, atol {number(atol)})"
    with np.errstate(invalid="ignore"):
        per_row = ratio if not rows_axis else _nanmax(ratio, axis=-1)
    slices = [_slice_name(spec.lead, k) for k in range(n)]
    parts = [f"<section><h{level}>{esc(check.name)}: where the error sits</h{level}>"]
    parts.append(f'<p class="note">Each cell: the error ÷ {esc(allowance)}; above 1 fails.</p>')
    parts.append('<div class="row">')
    parts.append(
        _ratio_map(
            f"{name}-rows",
            per_row,
            f"{name}: error ÷ allowance, the largest of each row",
            ("query row", "slice"),
            y_names=slices,
            alt=_where_text(per_row, slices),
        )
    )
    by_slice = _nanmax(per_row.reshape(n, -1), axis=1)
    worst = int(np.argmax(np.where(np.isnan(by_slice), -np.inf, by_slice))) if n else 0
    if rows_axis:
        across = "key" if name == "weights" else "feature"
        parts.append(
            _ratio_map(
                f"{name}-worst",
                ratio[worst],
                f"the worst slice, {slices[worst]}: every element",
                (across, "query row"),
            )
        )
    matched = ev.matched.get(name)
    if matched is not None:
        parts.append(_mask_panel(ev, matched, name, worst, slices[worst]))
    parts.append("</div>")
    parts.append(_distribution(a, r, plain, "" if judged is None else judged.export))
    lines = "\n".join(failure_lines(check))
    parts.append(f"<h3>The report</h3><pre>{esc(lines)}</pre></section>")
    return "".join(parts)


def _ratio_map(
    ident: str,
    ratio: F64,
    caption: str,
    labels: tuple[str, str],
    y_names: Sequence[str] | None = None,
    alt: str = "",
) -> str:
    """A map of error ÷ allowance (2-D), pooled past :data:`ROWS_SHOWN` a side, on the
    diverging log scale from 1/2^SPAN to 2^SPAN (white at the allowance)."""
    shown, fr, fc = pooled_to(ratio, ROWS_SHOWN, ROWS_SHOWN)
    return heatmap(
        ident,
        _log2(shown),
        lo=-SPAN,
        hi=SPAN,
        cmap="diverging",
        scale="log2",
        caption=caption,
        unit="× allowance",
        x_label=labels[0],
        y_label=labels[1],
        pooled=(fr, fc),
        shape=ratio.shape,
        y_names=y_names if fr == 1 else None,
        alt=alt or caption,
        square=False,
    )


def _mask_panel(ev: Evidence, matched: AttentionSpec, name: str, k: int, label: str) -> str:
    """Both computations' masks over one slice, where they differ: what each lets
    each query row see."""
    spec = ev.spec
    lead = tuple(int(i) for i in np.unravel_index(k, spec.lead)) if spec.lead else ()
    fr = max(1, math.ceil(spec.L / ROWS_SHOWN))
    fc = max(1, math.ceil(spec.S / ROWS_SHOWN))
    step = fr * max(1, MASK_ROWS // fr)  # whole pooled rows a block: no (L, S) array
    pooled, differ = [], 0
    for r0 in range(0, spec.L, step):
        rows = slice(r0, min(r0 + step, spec.L))
        asked, other = (
            np.broadcast_to(True if v is None else np.asarray(v), (rows.stop - r0, spec.S))
            for v in (visibility(spec, lead, rows), visibility(matched, lead, rows))
        )
        differ += int(np.count_nonzero(asked != other))
        code = asked.astype(np.float64) + 2.0 * other  # 0..3, MASK_LABELS
        pooled.append(largest(code, fr, fc))
    if not differ:
        return ""
    shown = np.concatenate(pooled) if pooled else np.zeros((0, 0))
    figure = heatmap(
        f"{name}-mask",
        shown,
        lo=0.0,
        hi=3.0,
        cmap="mask",
        caption=f"the masks over {label}: {differ:,} (query, key) pairs differ",
        x_label="key",
        y_label="query row",
        pooled=(fr, fc),
        shape=(spec.L, spec.S),
        alt=f"{differ} query-key pairs one computation sees and the other does not",
        categories=MASK_LABELS,
        exact=False,  # four categories, told apart by their colours
    )
    return f"<div>{figure}</div>"


def _distribution(a: F64, r: F64, plain: F64 | None, export: str) -> str:
    """Histograms of |export − reference| and |plain − reference| (where computed), on
    log-spaced bins, as an SVG of two series of bars."""
    with np.errstate(invalid="ignore"):
        errs = np.abs(a - r)
        errs = errs[np.isfinite(errs) & (errs > 0)]
        theirs = None
        if plain is not None:
            pe = np.abs(plain - r)
            theirs = pe[np.isfinite(pe) & (pe > 0)]
    if not errs.size:
        return ""
    both = errs if theirs is None or not theirs.size else np.concatenate([errs, theirs])
    lo, hi = math.floor(math.log10(both.min())), math.ceil(math.log10(both.max()))
    hi = max(hi, lo + 1)
    edges = np.logspace(lo, hi, 4 * (hi - lo) + 1)
    series = [("the export's errors", errs, "#b2182b")]
    if theirs is not None and theirs.size:
        series.append((f"the plain {export} computation's", theirs, "#2166ac"))
    counts = [np.histogram(x, edges)[0] / max(len(x), 1) for _, x, _ in series]
    top = max(float(c.max()) for c in counts) or 1.0
    width, height, bars = 520, 140, len(edges) - 1
    step = width / bars
    shapes = []
    for s, ((_, _, colour), c) in enumerate(zip(series, counts, strict=True)):
        w = step / len(series)
        for i, v in enumerate(c):
            h = height * float(v) / top
            x = i * step + s * w
            shapes.append(
                f'<rect x="{x:.1f}" y="{height - h:.1f}" width="{w:.1f}" height="{h:.1f}" '
                f'fill="{colour}"><title>{esc(number(edges[i]))} to {esc(number(edges[i + 1]))}: '
                f"{100 * float(v):.1f}%</title></rect>"
            )
    labels = "".join(
        f'<text x="{(i * 4) * step:.1f}" y="{height + 14}" font-size="11" fill="#5f6368">'
        f"1e{lo + i}</text>"
        for i in range(hi - lo + 1)
    )
    legend = " ".join(
        f'<span class="swatch" style="background:{colour}"></span>{esc(label)}'
        for label, _, colour in series
    )
    svg = (
        f'<svg role="img" aria-label="histograms of the errors" width="{width + 30}" '
        f'height="{height + 20}" viewBox="0 0 {width + 30} {height + 20}">'
        f"{''.join(shapes)}{labels}</svg>"
    )
    return (
        "<h3>The errors' distribution</h3>"
        f'<p class="note">|value − reference| of every element, share per bin (log scale). '
        f"{legend}</p>{svg}"
    )


def _slice_name(lead: Sequence[int], k: int) -> str:
    if not lead:
        return "the slice"
    index = np.unravel_index(k, tuple(lead))
    names = ("b", "h") if len(lead) == 2 else tuple(f"d{i}" for i in range(len(lead)))
    return " ".join(f"{n}{int(i)}" for n, i in zip(names[-len(lead) :], index, strict=True))


def _where_text(per_row: F64, slices: Sequence[str]) -> str:
    """The map in words: the rows that fail, per slice, for a screen reader."""
    failing = []
    for k, name in enumerate(slices):
        bad = np.flatnonzero(per_row.reshape(len(slices), -1)[k] > 1.0)
        if bad.size:
            failing.append(f"{name}: {bad.size} rows fail, from row {int(bad[0])}")
    return "; ".join(failing) or "no row fails"


def _nanmax(x: F64, axis: int) -> F64:
    with np.errstate(invalid="ignore"):
        filled = np.where(np.isnan(x), -np.inf, x)
        top = filled.max(axis=axis, initial=-np.inf)
    return np.where(np.isneginf(top), np.nan, top)


def _log2(x: F64) -> F64:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.clip(np.log2(x), -SPAN, SPAN)
