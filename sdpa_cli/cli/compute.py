"""``sdpa compute``: every stage as tables, JSON, YAML or .npz."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

import click

from sdpa_cli.cli.helps import SdpaCommand
from sdpa_cli.cli.options import (
    COLOR_OPTION,
    DISPLAY_OPTIONS,
    FORMAT_OPTION,
    TOKENS_OPTION,
    Computing,
    ViewFlags,
    case_options,
    computing_options,
    diagnostic_options,
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
from sdpa_cli.errors import EXIT_CODES_HELP

if TYPE_CHECKING:
    from rich.console import RenderableType

    from sdpa_cli.api.case import Case
    from sdpa_cli.api.compute import Computed
    from sdpa_cli.api.outputs import Outputs
    from sdpa_cli.engine.spec import AttentionSpec
    from sdpa_cli.files.writers import Writer
    from sdpa_cli.render.common import View


@click.command(epilog=EXIT_CODES_HELP, cls=SdpaCommand)
@case_options()
@diagnostic_options
@view_options(*DISPLAY_OPTIONS)
@COLOR_OPTION
@FORMAT_OPTION
@output_files(
    "save",
    "svg",
    "html",
    "page",
    what="the tables",
    save="Write every stage (full shape) to FILE.npz, atomically.",
    page="Also write a slice (--batch, --head; default the first) as one self-contained "
    "HTML page: every stage a heat map (the whole slice, or the --rows and --keys "
    "window), the findings, the tables.",
)
@TOKENS_OPTION
@click.option(
    "--frameworks",
    is_flag=True,
    help="Instead of the stages: what each framework (torch, flash, jax, onnx, hf) would "
    "output for this case under its own conventions, and where they disagree.",
)
@computing_options()
def compute(
    case: Case,
    thresholds: dict[str, str | None],
    view: ViewFlags,
    color: bool | None,
    outputs: Outputs,
    fmt: str,
    frameworks: bool,
    tokens: str | None,
    computing: Computing,
) -> None:
    """Compute attention and show every stage: raw, scaled and masked scores, weights, output.

    Inputs are three files Q K V (.npy, .npz[:name], .safetensors[:name],
    .pt[:name] (torch.save, read with weights_only), .json, .yaml) or one case file
    holding q, k, v and options. Flags override the case file.

    \b
    Examples:
      sdpa compute sample:scorecard
      sdpa compute sample:causal --stages masked,weights --format json
      sdpa compute sample:cross --causal --window 2,0 --frameworks
      sdpa compute sample:fp16_overflow --dtype float16
      sdpa compute sample:cross --causal --causal-align lower-right --save trace.npz
      sdpa compute q.npy k.npy v.npy --causal --html page.html
    """
    threads = start_engine(computing)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.compute import compute as run_compute
    from sdpa_cli.api.compute import compute_writers
    from sdpa_cli.api.outputs import PICTURES, write_outputs
    from sdpa_cli.diagnosis.thresholds import thresholds as read_thresholds
    from sdpa_cli.engine.block import applicable_stages

    limits = read_thresholds(thresholds)
    spec, description = case.load(outputs, also=[tokens])
    if frameworks:
        _frameworks(spec, description, fmt, outputs, color, threads)
        return
    console = make_console(color)
    shown = view.view(spec, console.width, applicable_stages(spec))
    document = None if fmt == "table" else fmt
    run = run_compute(
        spec,
        limits,
        stages=shown.stages,
        document=document,
        jobs=threads,
        watch=progress_bar,
        outputs=outputs,
        stdout=_stdout_fd(),
    )
    # The tables are rendered, then the files written, before anything is printed: a
    # failure in either prints nothing. JSON and YAML stream to stdout last.
    wanted = document is None or outputs.wants(*PICTURES, "page")
    renderables = _renderables(run, shown, description) if wanted else []
    files = compute_writers(spec, outputs, jobs=threads, watch=progress_bar)
    files |= _page(run, view, case, outputs, renderables, tokens, threads)
    write_outputs(
        outputs, {**pictures(outputs, renderables, console.width, "sdpa compute"), **files}
    )
    if document is None:
        print_all(console, renderables)
    else:
        _write_document(run, document, threads)


def _page(
    run: Computed,
    view: ViewFlags,
    case: Case,
    outputs: Outputs,
    renderables: list[RenderableType],
    tokens: str | None,
    threads: int,
) -> dict[str, Writer]:
    """``--html``: the slice ``--batch``, ``--head`` (default the first), its window
    ``--rows`` × ``--keys`` (default: all); nothing when not asked for."""
    if "page" not in outputs:
        return {}
    args = (run.spec, run.diagnosis, view, case.inputs, renderables, tokens, threads)
    return {"page": slice_page("compute", *args)}


def _write_document(run: Computed, fmt: str, threads: int) -> None:
    """The run as one JSON or YAML document on stdout, stage by stage, block by block."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.stream import write_document

    def echo(text: str) -> None:
        click.echo(text, nl=False)

    # No bar on the terminal the document is printed on: it would be drawn across it.
    on_terminal = sys.stdout.isatty()
    bar = contextlib.nullcontext(None) if on_terminal else progress_bar(run.spec, "writing")
    try:
        with bar as progress:
            write_document(
                run.trace, run.stages, run.diagnosis, echo, fmt=fmt, jobs=threads, progress=progress
            )
    except BrokenPipeError:  # the reader went away (| head): not an error
        _silence_stdout()


def _frameworks(
    spec: AttentionSpec,
    description: str | None,
    fmt: str,
    outputs: Outputs,
    color: bool | None,
    threads: int,
) -> None:
    """``--frameworks``: the comparison as tables (and their pictures), or the setup
    and a ``frameworks`` key."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.compute import frameworks
    from sdpa_cli.api.outputs import write_outputs
    from sdpa_cli.diagnosis.frameworks import frameworks_payload
    from sdpa_cli.render.common import case_description
    from sdpa_cli.render.frameworks import render_frameworks
    from sdpa_cli.report import setup_payload, to_json, to_yaml

    comparison = frameworks(spec, outputs, jobs=threads)
    console = make_console(color)
    renderables = [
        *case_description(description),
        render_frameworks(spec, comparison, console.width),
    ]
    title = "sdpa compute --frameworks"
    write_outputs(outputs, pictures(outputs, renderables, console.width, title))
    if fmt != "table":
        document = {
            **setup_payload(spec, for_json=fmt == "json"),
            "frameworks": frameworks_payload(comparison),
        }
        click.echo(to_json(document) if fmt == "json" else to_yaml(document), nl=fmt == "json")
        return
    print_all(console, renderables)


def _stdout_fd() -> int:
    """stdout's file descriptor (-1 when it has none, as under a test runner)."""
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return -1


def _silence_stdout() -> None:
    """Send what is left in stdout's buffer to /dev/null (Python's advice for a broken
    pipe), so that the exit is quiet: click would exit 1, a flush at exit complain."""
    # No descriptor (a test runner's stdout): nothing to silence.
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _renderables(run: Computed, view: View, description: str | None) -> list[RenderableType]:
    """The case file's description (when it has one), then the tables: the blocks of
    the slices and rows the view shows are computed here, the rest comes from the run."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.engine.trace import shown_blocks
    from sdpa_cli.render.common import case_description, layout
    from sdpa_cli.render.compute import render_compute

    laid_out = layout(run.spec, view)
    shown = shown_blocks(run.spec, laid_out.positions, laid_out.rows)
    return [
        *case_description(description),
        render_compute(run.trace, view, shown, run.diagnosis, laid_out=laid_out),
    ]
