"""``sdpa compute``: every stage as tables, JSON, YAML or .npz."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from sdpa_cli.cli.options import (
    EXIT_CODES_HELP,
    JOBS_OPTION,
    attention_options,
    check_index,
    diagnostic_options,
    display_options,
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
    from sdpa_cli.engine.trace import Trace
    from sdpa_cli.render.common import View


@click.command(epilog=EXIT_CODES_HELP)
@click.argument("inputs", nargs=-1, required=True, metavar="Q K V | CASE")
@attention_options
@diagnostic_options
@display_options
@output_options
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
    given_thresholds: dict[str, str | None],
    jobs: int | None,
    **flags: Any,
) -> None:
    """Compute attention and show every stage: raw, scaled and masked scores, weights, output.

    Inputs are three files Q K V (.npy, .npz[:name], .safetensors[:name], .json,
    .yaml) or one case file holding q, k, v and options. Flags override the case file.

    \b
    Examples:
      sdpa compute samples/scorecard.yaml
      sdpa compute samples/causal.yaml --stages masked,weights --format json
      sdpa compute q.npy k.npy v.npy --causal --causal-align lower-right --save trace.npz
      sdpa compute q.npy k.npy v.npy --dtype float16
    """
    threads = start_engine(jobs)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.diagnosis.rules import diagnose
    from sdpa_cli.diagnosis.thresholds import thresholds
    from sdpa_cli.engine.block import applicable_stages
    from sdpa_cli.engine.inputs import load_spec
    from sdpa_cli.engine.trace import trace
    from sdpa_cli.render.common import View
    from sdpa_cli.report import DOCUMENT_VALUE_BYTES, payload, save_npz, to_json, to_yaml

    limits = thresholds(given_thresholds)
    spec, description = load_spec(inputs, bias_path, mask_path, flags)
    chosen = parse_stages(stages, applicable_stages(spec))
    check_index("--head", head, spec.lead[-1] if spec.lead else None, "head")
    check_index("--batch", batch, spec.lead[-2] if len(spec.lead) >= 2 else None, "batch item")
    row_slice = parse_rows(rows, spec.L)
    key_slice = parse_rows(keys, spec.S, "--keys", "keys")

    # Whole stages only for what writes them: JSON and YAML the chosen ones, --save
    # every one. Tables compute the rows they show, and the whole-tensor ranges.
    keep: tuple[str, ...] | None = chosen if fmt != "table" else ()
    if save is not None:
        keep = None
    value_bytes = (8, "in float64")
    if fmt in DOCUMENT_VALUE_BYTES:
        value_bytes = (DOCUMENT_VALUE_BYTES[fmt], f"as a {fmt.upper()} document")
    with progress_bar(spec, "computing") as progress:
        result = trace(
            spec,
            stages=keep,
            summarize=chosen,
            jobs=threads,
            progress=progress,
            value_bytes=value_bytes,
        )
    diagnosis = diagnose(result, limits)
    # Everything is rendered before the --save file is written, so a failure while
    # rendering cannot leave a new file behind; the output is printed last.
    console = make_console(color)
    text: str | None = None
    renderables: list[RenderableType] = []
    if fmt == "json":
        text = to_json(payload(result, chosen, diagnosis, for_json=True)) + "\n"
    elif fmt == "yaml":
        text = to_yaml(payload(result, chosen, diagnosis, for_json=False))
    else:
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
    if save is not None:
        save_npz(result, save)
    if text is not None:
        click.echo(text, nl=False)
    print_all(console, renderables)


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
