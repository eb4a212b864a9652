"""``sdpa grad``: the backward pass, dQ, dK, dV (and d(bias)), and gradient health."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from sdpa_cli.cli.completion import words
from sdpa_cli.cli.helps import SdpaCommand
from sdpa_cli.cli.options import (
    BATCH_OPTION,
    COLOR_OPTION,
    FORMAT_OPTION,
    HEAD_OPTION,
    KEYS_OPTION,
    MAX_ROWS_OPTION,
    MAX_SLICES_OPTION,
    PRECISION_OPTION,
    Computing,
    PositiveFinite,
    ViewFlags,
    case_options,
    computing_options,
    diagnostic_options,
    grouped,
    output_files,
    view_options,
)
from sdpa_cli.cli.run import make_console, pictures, print_all, progress_bar, start_engine
from sdpa_cli.cli.streams import decided
from sdpa_cli.errors import EXIT_CODES_HELP, ExitCode
from sdpa_cli.names import DOUT_SOURCES

if TYPE_CHECKING:
    from rich.console import RenderableType

    from sdpa_cli.api.case import Case
    from sdpa_cli.api.grad import GradRun
    from sdpa_cli.api.outputs import Outputs
    from sdpa_cli.render.common import View


@dataclass(frozen=True)
class NumericFlags:
    """``--check-numeric``: whether to check sampled entries of every gradient by central
    differences, how many per gradient, and the relative error accepted."""

    check_numeric: bool = False
    samples: int = 20
    tolerance: float = 1e-5


NUMERIC_OPTIONS = [
    click.option(
        "--check-numeric",
        is_flag=True,
        help="Check sampled entries of every gradient by central differences in float64; exit 1 when one is off by more than --tolerance.",
    ),
    click.option(
        "--samples",
        type=click.IntRange(min=1),
        default=NumericFlags.samples,
        show_default=True,
        metavar="N",
        help="Entries per gradient the numeric check samples (drawn with --seed).",
    ),
    click.option(
        "--tolerance",
        type=PositiveFinite(),
        default=NumericFlags.tolerance,
        show_default=True,
        metavar="R",
        help="Largest relative error the numeric check accepts, past the rounding of the differences.",
    ),
]
DOUT_OPTION = click.option(
    "--dout",
    metavar="FILE|ones|random",
    shell_complete=words(*DOUT_SOURCES, paths=True),
    default="ones",
    show_default=True,
    help="The output's gradient dO: a file shaped like the output, all ones, or standard normal from --seed.",
)
VIEW_OPTIONS = [
    BATCH_OPTION,
    HEAD_OPTION,
    click.option("--rows", metavar="I|START:STOP", help="Query rows of dQ to show."),
    KEYS_OPTION,
    MAX_ROWS_OPTION,
    MAX_SLICES_OPTION,
    PRECISION_OPTION,
]


@click.command(epilog=EXIT_CODES_HELP, cls=SdpaCommand)
@case_options()
@DOUT_OPTION
@grouped("numeric", NumericFlags, NUMERIC_OPTIONS)
@click.option(
    "--vanishing",
    metavar="G",
    help="Flag a row whose softmax passes back at most this fraction of its gradient, 1 − Σ w² (default 1e-3).",
)
@diagnostic_options
@view_options(*VIEW_OPTIONS)
@COLOR_OPTION
@FORMAT_OPTION
@output_files(
    "save",
    "svg",
    "html",
    what="the tables",
    save="Write dq, dk, dv (and dbias), each shaped as its input, and dout, atomically.",
)
@computing_options()
def grad(
    case: Case,
    dout: str,
    numeric: NumericFlags,
    vanishing: str | None,
    thresholds: dict[str, str | None],
    view: ViewFlags,
    color: bool | None,
    fmt: str,
    outputs: Outputs,
    computing: Computing,
) -> int:
    """Compute dQ, dK, dV (and d(bias)) of the loss Σ O ⊙ dO, and judge the gradients' health.

    The backward pass runs in float64 through every option (scale, softcap, bias,
    masks, dropout, grouped-query heads), block by block: rows whose softmax is
    saturated pass back almost nothing (vanishing_gradient), keys no query weighs get
    nothing. --dtype names the training format the gradients' range is judged against.

    \b
    Examples:
      sdpa grad sample:vanishing
      sdpa grad sample:causal --dout random --seed 1 --check-numeric
      sdpa grad sample:scorecard --save grads.npz --format json
      sdpa grad q.npy k.npy v.npy --dout dout.npy --causal
    """
    threads = start_engine(computing)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.grad import grad_writers, gradients
    from sdpa_cli.api.outputs import PICTURES, write_outputs
    from sdpa_cli.diagnosis.thresholds import thresholds as read_thresholds
    from sdpa_cli.render.common import layout

    limits = read_thresholds({**thresholds, "vanishing": vanishing})
    spec, description = case.load(outputs, also=[dout])
    console = make_console(color)
    shown = view.view(spec, console.width)
    # Tables alone show a few slices: the pass keeps those and judges every other as
    # it finishes it; documents, --save and the numeric check read every slice.
    document = fmt in ("json", "yaml")
    whole = document or "save" in outputs or numeric.check_numeric
    run = gradients(
        spec,
        dout,
        limits,
        samples=numeric.samples if numeric.check_numeric else None,
        tolerance=numeric.tolerance,
        keep=None if whole else layout(spec, shown).positions,
        jobs=threads,
        watch=progress_bar,
    )
    code = decided(ExitCode.CHECK_FAILED if run.failed else ExitCode.OK)  # kept if | head
    renderables = []
    if not document or outputs.wants(*PICTURES):
        renderables = _renderables(run, shown, description)
    files = pictures(outputs, renderables, console.width, "sdpa grad")
    write_outputs(outputs, {**files, **grad_writers(run, outputs)})
    if document:
        _write_document(run, fmt)
    else:
        print_all(console, renderables)
    return code


def _write_document(run: GradRun, fmt: str) -> None:
    """The run as one JSON or YAML document on stdout, the gradients' rows formatted a
    piece at a time."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.report import grad_arrays, grad_payload
    from sdpa_cli.stream import write_with_arrays

    data = grad_payload(
        run.grads,
        run.health,
        run.diagnosis,
        dout=run.dout_info,
        numeric=run.numeric,
        tolerance=run.tolerance,
        dtype=run.dtype,
        for_json=fmt == "json",
    )

    def echo(text: str) -> None:
        click.echo(text, nl=False)

    write_with_arrays(data, "gradients", grad_arrays(run.grads), echo, fmt=fmt)


def _renderables(run: GradRun, view: View, description: str | None) -> list[RenderableType]:
    """The case file's description (when it has one), then the gradients' view."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.render.common import case_description
    from sdpa_cli.render.grad import render_grad

    return [
        *case_description(description),
        render_grad(
            run.grads,
            run.health,
            run.diagnosis,
            view,
            run.dout_label,
            run.dtype,
            run.numeric,
            run.tolerance,
        ),
    ]
