"""``sdpa explain``: one (batch, head) slice, stage by stage, to learn from and debug with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

import click

from sdpa_cli.cli.grad import DOUT_OPTION
from sdpa_cli.cli.helps import SdpaCommand
from sdpa_cli.cli.options import (
    COLOR_OPTION,
    FORMAT_OPTION,
    KEYS_OPTION,
    MAX_ROWS_OPTION,
    PRECISION_OPTION,
    TOKENS_OPTION,
    Computing,
    ViewFlags,
    case_options,
    computing_options,
    diagnostic_options,
    grouped,
    output_files,
    view_options,
)
from sdpa_cli.cli.run import (
    make_console,
    pictures,
    print_all,
    progress_bar,
    slice_page,
    start_engine,
)
from sdpa_cli.errors import EXIT_CODES_HELP, SpecError

if TYPE_CHECKING:
    from rich.console import RenderableType

    from sdpa_cli.api.case import Case
    from sdpa_cli.api.outputs import Outputs
    from sdpa_cli.diagnosis.explained import Explanation
    from sdpa_cli.diagnosis.pictures import SlicePictures
    from sdpa_cli.files.writers import Writer
    from sdpa_cli.render.common import View

Write = Callable[[BinaryIO], None]
"""A file's writer, for an atomic write."""


@dataclass(frozen=True)
class Walk:
    """What ``explain`` shows of its slice besides the walk: one query's scorecard,
    the weights under each scale, or the backward stages (of ``dout``)."""

    query: int | None = None
    compare_scales: bool = False
    backward: bool = False
    dout: str = "ones"


WALK_OPTIONS = [
    click.option(
        "--query",
        type=int,
        metavar="I",
        help="The scorecard of query I: dot products term by term, weights, contributions.",
    ),
    click.option(
        "--compare-scales",
        is_flag=True,
        help="Weights, entropy and max weight under no scaling, 1/√d_k and 1/d_k, side by side.",
    ),
    click.option(
        "--backward",
        is_flag=True,
        help="Add the backward stages: dO, dA, dS (the softmax's Jacobian), dQ, dK, dV, each with a note.",
    ),
    DOUT_OPTION,
]
SLICE_OPTIONS = [
    click.option(
        "--batch",
        type=int,
        default=0,
        show_default=True,
        metavar="B",
        help="Batch item to explain.",
    ),
    click.option(
        "--head", type=int, default=0, show_default=True, metavar="H", help="Head to explain."
    ),
    click.option(
        "--rows",
        metavar="I|START:STOP",
        help="Query rows to show (default: the first --max-rows). Notes always cover every row.",
    ),
    KEYS_OPTION,
    MAX_ROWS_OPTION,
    PRECISION_OPTION,
]


@click.command(epilog=EXIT_CODES_HELP, cls=SdpaCommand)
@case_options()
@diagnostic_options
@view_options(*SLICE_OPTIONS)
@grouped("walk", Walk, WALK_OPTIONS)
@COLOR_OPTION
@FORMAT_OPTION
@output_files(
    "svg",
    "html",
    "page",
    "plot",
    what="the trace",
    page="Also write the slice as one self-contained HTML page: every stage a heat map "
    "(the whole slice, or the --rows and --keys window), the findings, the walk.",
    plot="Also write heatmaps of every stage (needs matplotlib: pip install matplotlib).",
)
@TOKENS_OPTION
@computing_options()
def explain(
    case: Case,
    thresholds: dict[str, str | None],
    view: ViewFlags,
    walk: Walk,
    color: bool | None,
    fmt: str,
    outputs: Outputs,
    tokens: str | None,
    computing: Computing,
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
      sdpa explain sample:causal
      sdpa explain sample:scorecard --query 0
      sdpa explain sample:scorecard --query 0 --html scorecard.html
      sdpa explain sample:scale_comparison --compare-scales
      sdpa explain sample:causal --backward --dout random
      sdpa explain q.npy k.npy v.npy --causal --head 3 --rows 100:116
    """
    threads = start_engine(computing)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.explain import explain as run_explain
    from sdpa_cli.api.explain import shown_rows
    from sdpa_cli.api.outputs import PICTURES, write_outputs
    from sdpa_cli.diagnosis.thresholds import thresholds as read_thresholds

    limits = read_thresholds(thresholds)
    spec, description = case.load(outputs, also=[walk.dout, tokens])
    at = (view.batch or 0, view.head or 0)  # explain's options default to 0
    shown = shown_rows(spec, *at, view.rows, walk.query, view.max_rows)
    console = make_console(color)
    # the tables' keys (--batch, --head and --rows picked the slice and rows, above)
    table = dataclasses.replace(view, batch=None, head=None, rows=None)
    shown_view = table.view(spec, console.width)
    plotter = _plotter(outputs.paths["plot"]) if "plot" in outputs else None
    walked = dataclasses.asdict(walk)  # query, compare_scales, backward, dout
    ex = run_explain(
        spec, limits, at, shown, **walked, key_limit=view.max_rows, jobs=threads, watch=progress_bar
    )
    # Everything is rendered before any file is written, and printed last.
    text = _document(ex, fmt)
    renderables: list[RenderableType] = []
    if fmt == "table" or outputs.wants(*PICTURES, "page"):
        on_walk = walk.query is None and not walk.compare_scales
        renderables = _renderables(ex, shown_view, description, walk=on_walk)
    files = pictures(outputs, renderables, console.width, "sdpa explain")
    files |= _drawn(ex, view, case, outputs, plotter, renderables, tokens, threads)
    write_outputs(outputs, files)
    if text is not None:
        click.echo(text, nl=False)
    else:
        print_all(console, renderables)


def _drawn(
    ex: Explanation,
    view: ViewFlags,
    case: Case,
    outputs: Outputs,
    plotter: Callable[[SlicePictures, str], Write] | None,
    renderables: list[RenderableType],
    tokens: str | None,
    threads: int,
) -> dict[str, Writer]:
    """``--html`` and ``--plot``: the slice's page and figure, of its window ``--rows`` ×
    ``--keys`` (default: the whole slice); nothing when neither is asked for."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.pages import window_pictures
    from sdpa_cli.render.common import slice_label

    files: dict[str, Writer] = {}
    if "page" in outputs:
        args = (ex.spec, ex.diagnosis, view, case.inputs, renderables, tokens, threads)
        files["page"] = slice_page("explain", *args)
    if plotter is not None:
        at = (view.batch or 0, view.head or 0)
        drawn = window_pictures(ex.spec, at, view.rows, view.keys, threads)
        files["plot"] = plotter(drawn, slice_label(ex.spec, ex.lead))
    return files


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


def _plotter(path: str) -> Callable[[SlicePictures, str], Write]:
    """The PNG writer for ``--plot``, or a clear error when matplotlib is missing."""
    if not path.lower().endswith(".png"):
        raise SpecError("--plot", f"writes PNG; name the file *.png, not {path!r}")
    try:
        # imported here: matplotlib is an optional extra, and slow to load; only
        # --plot needs it (render.plot imports it at its top)
        from sdpa_cli.render.plot import heatmaps
    except ImportError:
        raise SpecError(
            "--plot", "needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    return heatmaps
