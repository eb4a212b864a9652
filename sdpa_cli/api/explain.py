"""``sdpa explain`` as one call: one (batch, head) slice of a loaded computation walked
through every stage (and with ``backward`` the gradient back through them), over the
rows it shows (:func:`explain`), which :func:`shown_rows` picks."""

from __future__ import annotations

import dataclasses

from sdpa_cli.api.case import Watch, unwatched
from sdpa_cli.api.picks import check_slice, parse_rows
from sdpa_cli.diagnosis.explain import explain as build
from sdpa_cli.diagnosis.explain import slice_at
from sdpa_cli.diagnosis.explain_grad import explain_backward
from sdpa_cli.diagnosis.explained import Explanation
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.grad import backward_health
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.inputs import load_dout
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError


def shown_rows(
    spec: AttentionSpec,
    batch: int,
    head: int,
    rows: str | None = None,
    query: int | None = None,
    max_rows: int = 16,
) -> range:
    """The query rows to explain (``query``'s row, ``rows`` as ``I`` or
    ``START:STOP``, or the first ``max_rows``), once ``batch``, ``head`` and ``query``
    are checked against the inputs.

    Raises:
        SpecError: naming the option that picks what the inputs do not have, or
            ``--query`` beside ``--rows``.
    """
    check_slice(spec.lead, batch, head, zero_without_axis=True)
    if query is None:
        picked = parse_rows(rows, spec.L)
        return range(spec.L)[picked] if picked is not None else range(min(spec.L, max_rows))
    if rows is not None:
        raise SpecError("--query", "shows one row; drop --rows (or use --rows alone)")
    if not spec.L:
        raise SpecError("--query", "there are no query rows (L = 0)")
    if not 0 <= query < spec.L:
        raise SpecError("--query", f"{query} is outside the {spec.L} query rows (0..{spec.L - 1})")
    return range(query, query + 1)


def explain(
    spec: AttentionSpec,
    thresholds: Thresholds | None = None,
    at: tuple[int, int] = (0, 0),
    shown: range | None = None,
    *,
    query: int | None = None,
    compare_scales: bool = False,
    key_limit: int = 16,
    backward: bool = False,
    dout: str = "ones",
    jobs: int = 1,
    watch: Watch = unwatched,
) -> Explanation:
    """The slice ``at`` (batch, head) explained over the rows ``shown`` (default
    :func:`shown_rows`'), with the whole input's statistics and findings; ``query``:
    its scorecard; ``compare_scales``: the weights under each scale; ``backward``: the
    gradient of Σ O ⊙ ``dout`` back through every stage too (one pass gives the
    gradients and the forward statistics both). The slice's values come from the
    engine.

    Raises:
        SpecError: a ``dout`` that is neither a file nor a source, or not the
            output's shape.
    """
    thresholds = thresholds or Thresholds()
    if shown is None:
        shown = shown_rows(spec, *at, query=query, max_rows=key_limit)
    values, dout_label = None, ""  # with backward: dO and how it reads
    if backward:
        values, dout_label, _ = load_dout(spec, dout)
    run = None  # with backward: the gradients and their diagnosis
    lead = slice_at(spec, *at)  # the slice explained: the only gradients kept
    with watch(spec, "diagnosing") as progress:
        if values is not None and not spec.options.emulated:
            stats = Stats.empty(spec)
            run = backward_health(
                spec, values, thresholds, jobs=jobs, stats=stats, progress=progress, keep={lead}
            )
        else:
            stats = trace(spec, stages=(), jobs=jobs, progress=progress).stats
            if values is not None:  # the emulated forward pass's statistics, the float64 gradients
                run = backward_health(spec, values, thresholds, jobs=jobs, keep={lead})
    diagnosis = diagnose(stats, thresholds)
    ex = build(
        spec,
        stats,
        diagnosis,
        lead,
        shown,
        query=query,
        scales=compare_scales,
        key_limit=key_limit,
    )
    if run is None:
        return ex
    grads, health = run
    return dataclasses.replace(
        ex, backward=explain_backward(grads, health, ex.lead, shown, dout_label)
    )
