"""``sdpa grad``: the backward pass, dQ, dK, dV (and d(bias)), and gradient health."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from sdpa_cli.cli.completion import files, words
from sdpa_cli.cli.options import (
    BATCH_OPTION,
    COLOR_OPTION,
    EXIT_CODES_HELP,
    FORMAT_OPTION,
    HEAD_OPTION,
    JOBS_OPTION,
    KEYS_OPTION,
    MAX_ROWS_OPTION,
    MAX_SLICES_OPTION,
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
from sdpa_cli.cli.streams import decided
from sdpa_cli.errors import ExitCode
from sdpa_cli.names import DOUT_SOURCES

if TYPE_CHECKING:
    from collections.abc import Collection

    from rich.console import RenderableType

    from sdpa_cli.diagnosis.findings import Diagnosis, Thresholds
    from sdpa_cli.diagnosis.grad import GradDiagnosis
    from sdpa_cli.engine.grad import Gradients
    from sdpa_cli.engine.numeric import NumericCheck
    from sdpa_cli.engine.spec import AttentionSpec
    from sdpa_cli.engine.types import Index
    from sdpa_cli.render.common import View


@click.command(epilog=EXIT_CODES_HELP)
@click.argument("inputs", nargs=-1, required=True, metavar="Q K V | CASE", shell_complete=files)
@attention_options
@click.option(
    "--dout",
    metavar="FILE|ones|random",
    shell_complete=words(*DOUT_SOURCES, paths=True),
    default="ones",
    show_default=True,
    help="The output's gradient dO: a file shaped like the output, all ones, or standard normal from --seed.",
)
@click.option(
    "--check-numeric",
    is_flag=True,
    help="Check sampled entries of every gradient by central differences in float64; exit 1 when one is off by more than --tolerance.",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    metavar="N",
    help="Entries per gradient the numeric check samples (drawn with --seed).",
)
@click.option(
    "--tolerance",
    type=click.FloatRange(min=0, min_open=True),
    default=1e-5,
    show_default=True,
    metavar="R",
    help="Largest relative error the numeric check accepts.",
)
@click.option(
    "--vanishing",
    metavar="G",
    help="Flag a row whose softmax passes back at most this fraction of its gradient, 1 − Σ w² (default 1e-3).",
)
@diagnostic_options
@BATCH_OPTION
@HEAD_OPTION
@click.option("--rows", metavar="I|START:STOP", help="Query rows of dQ to show.")
@KEYS_OPTION
@MAX_ROWS_OPTION
@MAX_SLICES_OPTION
@PRECISION_OPTION
@COLOR_OPTION
@FORMAT_OPTION
@click.option(
    "--save",
    metavar="FILE.npz",
    shell_complete=files,
    help="Write dq, dk, dv (and dbias), each shaped as its input, and dout, atomically.",
)
@export_options("the tables")
@JOBS_OPTION
def grad(
    inputs: tuple[str, ...],
    bias_path: str | None,
    mask_path: str | None,
    dout: str,
    check_numeric: bool,
    samples: int,
    tolerance: float,
    vanishing: str | None,
    given_thresholds: dict[str, str | None],
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
    jobs: int | None,
    **flags: Any,
) -> int:
    """Compute dQ, dK, dV (and d(bias)) of the loss Σ O ⊙ dO, and judge the gradients' health.

    The backward pass runs in float64 through every option (scale, softcap, bias,
    masks, dropout, grouped-query heads), block by block: rows whose softmax is
    saturated pass back almost nothing (vanishing_gradient), keys no query weighs get
    nothing. --dtype names the training format the gradients' range is judged against.

    \b
    Examples:
      sdpa grad samples/scorecard.yaml
      sdpa grad q.npy k.npy v.npy --causal --dout random --seed 1 --check-numeric
      sdpa grad q.npy k.npy v.npy --dout dout.npy --save grads.npz --format json
    """
    threads = start_engine(jobs)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.diagnosis.thresholds import thresholds
    from sdpa_cli.engine.inputs import load_spec
    from sdpa_cli.files.outputs import check_outputs, inputs_of
    from sdpa_cli.files.writers import write_all_atomic
    from sdpa_cli.render.common import View, layout
    from sdpa_cli.stream_save import save_grad_npz

    limits = thresholds({**given_thresholds, "vanishing": vanishing})
    outputs = [("--save", save), *export_outputs(export_svg, export_html)]
    check_outputs(inputs_of([*inputs, bias_path, mask_path, dout], flags), outputs)
    spec, description = load_spec(inputs, bias_path, mask_path, flags)
    check_index("--head", head, spec.lead[-1] if spec.lead else None, "head")
    check_index("--batch", batch, spec.lead[-2] if len(spec.lead) >= 2 else None, "batch item")
    row_slice = parse_rows(rows, spec.L)
    key_slice = parse_rows(keys, spec.S, "--keys", "keys")
    console = make_console(color)
    view = View(
        stages=(),
        batch=batch,
        head=head,
        rows=row_slice,
        keys=key_slice,
        max_rows=max_rows,
        max_slices=max_slices,
        precision=precision,
        width=console.width,
    )
    # tables alone show a few slices: the pass keeps those and judges every other
    # as it finishes it; documents, --save and the numeric check read every slice
    document = fmt in ("json", "yaml")
    whole = document or save is not None or check_numeric
    keep = None if whole else layout(spec, view).positions
    run = _run(spec, dout, limits, samples if check_numeric else None, jobs=threads, keep=keep)
    failed = run.numeric is not None and not all(c.passed(tolerance) for c in run.numeric)
    decided(ExitCode.CHECK_FAILED if failed else ExitCode.OK)  # kept if the reader leaves (| head)

    renderables: list[RenderableType] = []
    if not document or export_svg or export_html:
        renderables = _renderables(run, view, description, spec.options.dtype, tolerance)
    write_all_atomic(exports(renderables, console.width, export_svg, export_html, "sdpa grad"))
    if save is not None:
        save_grad_npz(run.grads, save)
    if document:
        _write_document(run, spec.options.dtype, tolerance, fmt)
    else:
        print_all(console, renderables)
    return ExitCode.CHECK_FAILED if failed else ExitCode.OK


@dataclass(frozen=True)
class _Run:
    """What ``sdpa grad`` computed: the gradients, their health, every finding
    (forward and gradient), how dO reads (a label, a JSON record), the numeric check."""

    grads: Gradients
    health: GradDiagnosis
    diagnosis: Diagnosis
    dout_label: str
    dout_info: dict[str, Any]
    numeric: list[NumericCheck] | None


def _run(
    spec: AttentionSpec,
    dout: str,
    limits: Thresholds,
    samples: int | None,
    *,
    jobs: int,
    keep: Collection[Index] | None,
) -> _Run:
    """The backward pass (which gathers the forward statistics too), the findings of
    both, and with ``samples`` the numeric check of that many entries per gradient;
    ``keep``: the query slices whose gradients are kept (None: all)."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.diagnosis.grad import backward_health, combined
    from sdpa_cli.diagnosis.rules import diagnose
    from sdpa_cli.engine.inputs import load_dout
    from sdpa_cli.engine.numeric import numeric_check
    from sdpa_cli.engine.stats import Stats

    values, dout_label, dout_info = load_dout(spec, dout)
    stats = Stats.empty(spec.in_float64())
    with progress_bar(spec, "gradients") as progress:
        grads, health = backward_health(
            spec, values, limits, jobs=jobs, stats=stats, progress=progress, keep=keep
        )
    diagnosis = combined(diagnose(stats, limits), health)
    numeric = numeric_check(grads, samples, spec.options.seed) if samples is not None else None
    return _Run(grads, health, diagnosis, dout_label, dout_info, numeric)


def _write_document(run: _Run, dtype: str, tolerance: float, fmt: str) -> None:
    """The run as one JSON or YAML document on stdout, the gradients' rows formatted a
    piece at a time; ``dtype`` the format their range is judged in."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.report import grad_arrays, grad_payload
    from sdpa_cli.stream import write_with_arrays

    data = grad_payload(
        run.grads,
        run.health,
        run.diagnosis,
        dout=run.dout_info,
        numeric=run.numeric,
        tolerance=tolerance,
        dtype=dtype,
        for_json=fmt == "json",
    )

    def echo(text: str) -> None:
        click.echo(text, nl=False)

    write_with_arrays(data, "gradients", grad_arrays(run.grads), echo, fmt=fmt)


def _renderables(
    run: _Run, view: View, description: str | None, dtype: str, tolerance: float
) -> list[RenderableType]:
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
            dtype,
            run.numeric,
            tolerance,
        ),
    ]
