"""``sdpa explain``: one (batch, head) slice, stage by stage, to learn from and debug with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

import click

from sdpa_cli.cli.completion import files, words
from sdpa_cli.cli.options import (
    COLOR_OPTION,
    EXIT_CODES_HELP,
    FORMAT_OPTION,
    JOBS_OPTION,
    KEYS_OPTION,
    MAX_ROWS_OPTION,
    PRECISION_OPTION,
    attention_options,
    check_index,
    diagnostic_options,
    export_options,
    export_outputs,
    exports,
    make_console,
    parse_rows,
    print_all,
    progress_bar,
    start_engine,
)
from sdpa_cli.errors import SpecError
from sdpa_cli.names import DOUT_SOURCES

if TYPE_CHECKING:
    from rich.console import RenderableType

    from sdpa_cli.diagnosis.explained import Explanation
    from sdpa_cli.diagnosis.findings import Thresholds
    from sdpa_cli.engine.spec import AttentionSpec
    from sdpa_cli.render.common import View

Write = Callable[[BinaryIO], None]
"""A file's writer, for an atomic write."""


@click.command(epilog=EXIT_CODES_HELP)
@click.argument("inputs", nargs=-1, required=True, metavar="Q K V | CASE", shell_complete=files)
@attention_options
@diagnostic_options
@click.option(
    "--batch", type=int, default=0, show_default=True, metavar="B", help="Batch item to explain."
)
@click.option(
    "--head", type=int, default=0, show_default=True, metavar="H", help="Head to explain."
)
@click.option(
    "--rows",
    metavar="I|START:STOP",
    help="Query rows to show (default: the first --max-rows). Notes always cover every row.",
)
@KEYS_OPTION
@click.option(
    "--query",
    type=int,
    metavar="I",
    help="The scorecard of query I: dot products term by term, weights, contributions.",
)
@click.option(
    "--compare-scales",
    is_flag=True,
    help="Weights, entropy and max weight under no scaling, 1/√d_k and 1/d_k, side by side.",
)
@click.option(
    "--backward",
    is_flag=True,
    help="Add the backward stages: dO, dA, dS (the softmax's Jacobian), dQ, dK, dV, each with a note.",
)
@click.option(
    "--dout",
    metavar="FILE|ones|random",
    shell_complete=words(*DOUT_SOURCES, paths=True),
    default="ones",
    show_default=True,
    help="With --backward: the output's gradient dO (as sdpa grad's).",
)
@MAX_ROWS_OPTION
@PRECISION_OPTION
@COLOR_OPTION
@FORMAT_OPTION
@export_options("the trace")
@click.option(
    "--plot",
    metavar="FILE.png",
    shell_complete=files,
    help="Also write heatmaps of every stage (needs matplotlib: pip install 'sdpa-cli[plot]').",
)
@JOBS_OPTION
def explain(
    inputs: tuple[str, ...],
    bias_path: str | None,
    mask_path: str | None,
    batch: int,
    head: int,
    rows: str | None,
    keys: str | None,
    query: int | None,
    compare_scales: bool,
    backward: bool,
    dout: str,
    max_rows: int,
    precision: int,
    color: bool | None,
    fmt: str,
    export_svg: str | None,
    export_html: str | None,
    plot: str | None,
    given_thresholds: dict[str, str | None],
    jobs: int | None,
    **flags: Any,
) -> None:
    """Walk one (batch, head) slice through every stage, saying what each did.

    raw scores → scaled (and why 1/√d_k) → capped → biased → masked (what the mask
    hid) → weights (row sums, entropy, max weight) → dropout → output, each with its
    table, a note on what changed, and the findings that arose there. --query shows
    one query's scorecard, --compare-scales the weights under each scale; both
    replace the walk in the table view. --backward follows the gradient back: dO →
    dA → dS (where a saturated softmax stops it) → dQ, dK, dV.

    \b
    Examples:
      sdpa explain samples/causal.yaml
      sdpa explain samples/scorecard.yaml --query 0
      sdpa explain samples/scale_comparison.yaml --compare-scales
      sdpa explain samples/causal.yaml --backward --dout random
      sdpa explain q.npy k.npy v.npy --causal --head 3 --rows 100:116
    """
    threads = start_engine(jobs)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.diagnosis.thresholds import thresholds
    from sdpa_cli.engine.inputs import load_spec
    from sdpa_cli.files.outputs import check_outputs, inputs_of
    from sdpa_cli.files.writers import write_all_atomic
    from sdpa_cli.render.common import View

    limits = thresholds(given_thresholds)
    check_outputs(
        inputs_of([*inputs, bias_path, mask_path, dout], flags),
        [*export_outputs(export_svg, export_html), ("--plot", plot)],
    )
    spec, description = load_spec(inputs, bias_path, mask_path, flags)
    shown = _shown_rows(spec, batch, head, rows, query, max_rows)
    key_slice = parse_rows(keys, spec.S, "--keys", "keys")
    plotter = _plotter(plot) if plot is not None else None
    ex = _explain_slice(
        spec,
        limits,
        (batch, head),
        shown,
        query=query,
        compare_scales=compare_scales,
        key_limit=max_rows,
        backward=backward,
        dout=dout,
        threads=threads,
    )

    # Everything is rendered before any file is written, and printed last.
    console = make_console(color)
    text = _document(ex, fmt)
    renderables: list[RenderableType] = []
    written: list[tuple[str, Write]] = []
    if fmt == "table" or export_svg or export_html:
        view = View(
            stages=(), keys=key_slice, max_rows=max_rows, precision=precision, width=console.width
        )
        walk = query is None and not compare_scales
        renderables = _renderables(ex, view, description, walk=walk)
        written = exports(renderables, console.width, export_svg, export_html, "sdpa explain")
    if plotter is not None and plot is not None:
        written.append((plot, plotter(ex, key_slice)))
    if written:
        write_all_atomic(written)
    if text is not None:
        click.echo(text, nl=False)
    elif fmt == "table":
        print_all(console, renderables)


def _shown_rows(
    spec: AttentionSpec,
    batch: int,
    head: int,
    rows: str | None,
    query: int | None,
    max_rows: int,
) -> range:
    """The query rows to explain (``--query``'s row, ``--rows``, or the first
    ``--max-rows``), once ``--batch``, ``--head`` and ``--query`` are checked against
    the inputs."""
    if spec.lead:
        check_index("--head", head, spec.lead[-1], "head")
    elif head:
        check_index("--head", head, None, "head")
    if len(spec.lead) >= 2:
        check_index("--batch", batch, spec.lead[-2], "batch item")
    elif batch:
        check_index("--batch", batch, None, "batch item")
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


def _explain_slice(
    spec: AttentionSpec,
    limits: Thresholds,
    at: tuple[int, int],
    shown: range,
    *,
    query: int | None,
    compare_scales: bool,
    key_limit: int,
    backward: bool,
    dout: str,
    threads: int,
) -> Explanation:
    """The run: the whole input's statistics and findings (with ``--backward`` its
    gradients too), then the slice ``at`` (batch, head) explained over the rows
    ``shown``; the slice's values come from the engine."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.diagnosis.explain import explain as build
    from sdpa_cli.diagnosis.explain import slice_at
    from sdpa_cli.diagnosis.explain_grad import explain_backward
    from sdpa_cli.diagnosis.grad import backward_health
    from sdpa_cli.diagnosis.rules import diagnose
    from sdpa_cli.engine.inputs import load_dout
    from sdpa_cli.engine.stats import Stats
    from sdpa_cli.engine.trace import trace

    values, dout_label = None, ""  # with --backward: dO and how it reads
    if backward:
        values, dout_label, _ = load_dout(spec, dout)
    run = None  # with --backward: the gradients and their diagnosis
    lead = slice_at(spec, *at)  # the slice explained: the only gradients kept
    with progress_bar(spec, "diagnosing") as progress:
        if values is not None and not spec.options.emulated:
            # One pass gives the gradients and the forward statistics both.
            stats = Stats.empty(spec)
            run = backward_health(
                spec, values, limits, jobs=threads, stats=stats, progress=progress, keep={lead}
            )
        else:
            stats = trace(spec, stages=(), jobs=threads, progress=progress).stats
            if values is not None:  # the emulated forward pass's statistics, the float64 gradients
                run = backward_health(spec, values, limits, jobs=threads, keep={lead})
    diagnosis = diagnose(stats, limits)
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


def _document(ex: Explanation, fmt: str) -> str | None:
    """The explanation as one JSON or YAML document; None for tables."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.report import explain_payload, to_json, to_yaml

    if fmt == "json":
        return to_json(explain_payload(ex, for_json=True)) + "\n"
    if fmt == "yaml":
        return to_yaml(explain_payload(ex, for_json=False))
    return None


def _renderables(
    ex: Explanation, view: View, description: str | None, *, walk: bool
) -> list[RenderableType]:
    """The case file's description (when it has one), then the explanation: the walk,
    or (``walk`` False) the scorecard and the scale comparison."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.render.common import case_description
    from sdpa_cli.render.explain import render_explain

    return [*case_description(description), render_explain(ex, view, walk=walk)]


def _plotter(path: str) -> Callable[[Explanation, slice | None], Write]:
    """The PNG writer for ``--plot``, or a clear error when matplotlib is missing."""
    if not path.lower().endswith(".png"):
        raise SpecError("--plot", f"writes PNG; name the file *.png, not {path!r}")
    try:
        # imported here: matplotlib is an optional extra, and slow to load; only
        # --plot needs it (render.plot imports it at its top)
        from sdpa_cli.render.plot import heatmaps
    except ImportError:
        raise SpecError(
            "--plot", "needs matplotlib, which is not installed: pip install 'sdpa-cli[plot]'"
        ) from None
    return heatmaps
