"""``sdpa compute``: every stage as tables, JSON, YAML or .npz."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

import click

from sdpa_cli.cli.completion import files
from sdpa_cli.cli.options import (
    EXIT_CODES_HELP,
    JOBS_OPTION,
    attention_options,
    check_index,
    diagnostic_options,
    display_options,
    export_options,
    export_outputs,
    exports,
    make_console,
    output_options,
    parse_rows,
    parse_stages,
    print_all,
    progress_bar,
    start_engine,
)

if TYPE_CHECKING:
    from rich.console import RenderableType

    from sdpa_cli.diagnosis.findings import Diagnosis
    from sdpa_cli.engine.spec import AttentionSpec
    from sdpa_cli.engine.trace import Trace
    from sdpa_cli.render.common import View


@click.command(epilog=EXIT_CODES_HELP)
@click.argument("inputs", nargs=-1, required=True, metavar="Q K V | CASE", shell_complete=files)
@attention_options
@diagnostic_options
@display_options
@output_options
@export_options("the tables")
@click.option(
    "--frameworks",
    is_flag=True,
    help="Instead of the stages: what each framework (torch, flash, jax, onnx, hf) would "
    "output for this case under its own conventions, and where they disagree.",
)
@JOBS_OPTION
def compute(
    inputs: tuple[str, ...],
    bias_path: str | None,
    mask_path: str | None,
    stages: str | None,
    batch: int | None,
    head: int | None,
    rows: str | None,
    keys: str | None,
    max_rows: int,
    max_slices: int,
    precision: int,
    color: bool | None,
    fmt: str,
    save: str | None,
    export_svg: str | None,
    export_html: str | None,
    given_thresholds: dict[str, str | None],
    jobs: int | None,
    frameworks: bool,
    **flags: Any,
) -> None:
    """Compute attention and show every stage: raw, scaled and masked scores, weights, output.

    Inputs are three files Q K V (.npy, .npz[:name], .safetensors[:name],
    .pt[:name] (torch.save, read with weights_only), .json, .yaml) or one case file
    holding q, k, v and options. Flags override the case file.

    \b
    Examples:
      sdpa compute samples/scorecard.yaml
      sdpa compute samples/causal.yaml --stages masked,weights --format json
      sdpa compute q.npy k.npy v.npy --causal --causal-align lower-right
      sdpa compute q.npy k.npy v.npy --causal --save trace.npz
      sdpa compute q.npy k.npy v.npy --dtype float16
      sdpa compute samples/cross.yaml --causal --window 2,0 --frameworks
    """
    threads = start_engine(jobs)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.diagnosis.rules import diagnose
    from sdpa_cli.diagnosis.thresholds import thresholds
    from sdpa_cli.engine.block import applicable_stages
    from sdpa_cli.engine.inputs import load_spec
    from sdpa_cli.engine.trace import trace
    from sdpa_cli.files.outputs import check_outputs, inputs_of
    from sdpa_cli.files.writers import write_all_atomic
    from sdpa_cli.render.common import View
    from sdpa_cli.stream import check_document_room, trace_stages, write_document
    from sdpa_cli.stream_save import check_room, save_npz

    limits = thresholds(given_thresholds)
    outputs = [("--save", save), *export_outputs(export_svg, export_html)]
    check_outputs(inputs_of([*inputs, bias_path, mask_path], flags), outputs)
    spec, description = load_spec(inputs, bias_path, mask_path, flags)
    if frameworks:
        _frameworks(spec, description, fmt, save, color, threads, (export_svg, export_html))
        return
    chosen = parse_stages(stages, applicable_stages(spec))
    check_index("--head", head, spec.lead[-1] if spec.lead else None, "head")
    check_index("--batch", batch, spec.lead[-2] if len(spec.lead) >= 2 else None, "batch item")
    row_slice = parse_rows(rows, spec.L)
    key_slice = parse_rows(keys, spec.S, "--keys", "keys")

    if save is not None:
        check_room(spec, save)
    if fmt != "table":
        check_document_room(spec, chosen, fmt, _stdout_fd())
    # The statistics, and nothing score-sized: JSON, YAML and --save compute each stage
    # again, block by block, as they write it; tables compute the rows they show.
    keep = trace_stages(spec, chosen) if fmt != "table" else ()
    with progress_bar(spec, "computing") as progress:
        result = trace(spec, stages=keep, summarize=chosen, jobs=threads, progress=progress)
    diagnosis = diagnose(result, limits)
    # The tables are rendered, then the --save file written, before anything is
    # printed: a failure in either prints nothing. JSON and YAML stream to stdout last.
    console = make_console(color)
    renderables: list[RenderableType] = []
    if fmt == "table" or export_svg or export_html:
        view = View(
            stages=chosen,
            batch=batch,
            head=head,
            rows=row_slice,
            keys=key_slice,
            max_rows=max_rows,
            max_slices=max_slices,
            precision=precision,
            width=console.width,
            explicit_stages=stages is not None,
        )
        renderables = _renderables(result, diagnosis, view, description)
        write_all_atomic(
            exports(renderables, console.width, export_svg, export_html, "sdpa compute")
        )
    if save is not None:
        with progress_bar(spec, "saving") as progress:
            save_npz(spec, save, jobs=threads, progress=progress)
    if fmt in ("json", "yaml"):

        def echo(text: str) -> None:
            click.echo(text, nl=False)

        # No bar on the terminal the document is printed on: it would be drawn across it.
        on_terminal = sys.stdout.isatty()
        bar = contextlib.nullcontext(None) if on_terminal else progress_bar(spec, "writing")
        try:
            with bar as progress:
                write_document(
                    result, chosen, diagnosis, echo, fmt=fmt, jobs=threads, progress=progress
                )
        except BrokenPipeError:  # the reader went away (| head): not an error
            _silence_stdout()
        return
    print_all(console, renderables)


def _frameworks(
    spec: AttentionSpec,
    description: str | None,
    fmt: str,
    save: str | None,
    color: bool | None,
    threads: int,
    exported: tuple[str | None, str | None] = (None, None),
) -> None:
    """``--frameworks``: the comparison as tables, or the setup and a ``frameworks`` key;
    ``exported``: the tables' ``--export-svg`` and ``--export-html``."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.diagnosis.frameworks import compare_frameworks, frameworks_payload
    from sdpa_cli.files.writers import write_all_atomic
    from sdpa_cli.render.common import case_description
    from sdpa_cli.render.frameworks import render_frameworks
    from sdpa_cli.report import setup_payload, to_json, to_yaml

    if save is not None:
        raise click.UsageError("--frameworks shows no stages to save; leave out --save")
    comparison = compare_frameworks(spec, jobs=threads)
    console = make_console(color)
    renderables = [
        *case_description(description),
        render_frameworks(spec, comparison, console.width),
    ]
    write_all_atomic(exports(renderables, console.width, *exported, "sdpa compute --frameworks"))
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


def _renderables(
    result: Trace, diagnosis: Diagnosis, view: View, description: str | None
) -> list[RenderableType]:
    """The case file's description (when it has one), then the tables: the blocks of
    the slices and rows the view shows are computed here, the rest comes from ``result``."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.engine.trace import shown_blocks
    from sdpa_cli.render.common import case_description, layout
    from sdpa_cli.render.compute import render_compute

    laid_out = layout(result.spec, view)
    shown = shown_blocks(result.spec, laid_out.positions, laid_out.rows)
    return [
        *case_description(description),
        render_compute(result, view, shown, diagnosis, laid_out=laid_out),
    ]
