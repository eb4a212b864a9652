"""``sdpa report``: a manifest's runs, worked on. ``sdpa report merge`` joins the
reports of a manifest's shards (``sdpa check --manifest M --shard I/N --report FILE``)
into the unsharded run's report, JUnit XML and exit code; ``sdpa report model`` shows
every case of a manifest (every attention call of a model) as a layer × head grid of
attention statistics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from sdpa_cli.api.outputs import REPORTS
from sdpa_cli.cli.check import show_results, write_reports
from sdpa_cli.cli.completion import files
from sdpa_cli.cli.helps import SdpaCommand
from sdpa_cli.cli.options import (
    COLOR_OPTION,
    TOKENS_OPTION,
    Computing,
    computing_options,
    diagnostic_options,
    format_option,
    output_files,
    sample_path,
)
from sdpa_cli.cli.run import make_console, print_all, progress_bar, start_engine
from sdpa_cli.cli.streams import decided
from sdpa_cli.errors import ExitCode
from sdpa_cli.names import MODEL_METRICS

if TYPE_CHECKING:
    from sdpa_cli.api.outputs import Outputs

MERGE_EXIT_CODES_HELP = (
    "Exit codes: the merged run's: 0 every check passed · 1 a check failed · 2 a case could "
    "not be checked, or bad input (a file that is not a shard's report, shards of "
    "different runs, a shard missing or given twice, a report that contradicts itself or "
    "its manifest) · 3 internal error · 130 interrupted (143 SIGTERM, 129 SIGHUP)."
)


@click.group()
def report() -> None:
    """Work with a manifest's runs: merge sharded reports, see a model at a glance.

    \b
    Example:
      sdpa report merge shard-1.json shard-2.json --junit report.xml
      sdpa report model samples/model/manifest.yaml --metric all
    """


@report.command(epilog=MERGE_EXIT_CODES_HELP)
@click.argument("shards", nargs=-1, required=True, metavar="SHARD.json...", shell_complete=files)
@format_option("A summary for a person, or the merged JSON report on stdout.")
@output_files(*REPORTS, report="Also write the merged JSON report.")
@click.option(
    "--manifest",
    metavar="FILE",
    shell_complete=files,
    callback=sample_path,
    help="The manifest the shards ran (default: the path their reports name), against "
    "which each shard's cases are verified.",
)
@COLOR_OPTION
def merge(
    shards: tuple[str, ...], fmt: str, outputs: Outputs, manifest: str | None, color: bool | None
) -> int:
    """Merge the JSON reports of every shard of a manifest's run into one.

    Each SHARD.json is the --report of sdpa check --manifest M --shard I/N, for
    every I of the same N, the same manifest and the same settings. The merged
    report is the one the unsharded run writes (cases in manifest order), and so
    are the table, the JUnit XML and the exit code. Nothing is merged when a file
    is not a shard's report, when shards come from different runs, or when a shard
    is missing or given twice, when a shard's report contradicts itself (a case
    that says it passed over a failed check), or when its cases are not those of the
    manifest at its positions.

    \b
    Example:
      sdpa check --manifest sample:check/checks.yaml --shard 1/2 --report s1.json
      sdpa check --manifest sample:check/checks.yaml --shard 2/2 --report s2.json
      sdpa report merge s1.json s2.json --report all.json --junit all.xml
    """
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.merge import merge_reports

    outputs.check([*shards, manifest])
    run = merge_reports(shards, manifest)
    write_reports(run, outputs, color)
    code = decided(run.exit_code)  # kept when the reader goes away (| head)
    show_results(run, fmt, color)
    return code


MODEL_EXIT_CODES_HELP = (
    "Exit codes: 0 every case shown · 2 bad usage, a manifest that cannot be read, or a "
    "case that cannot be (the others are shown; a line on stderr names it) · 3 internal "
    "error · 130 interrupted (143 SIGTERM, 129 SIGHUP). Notable heads are findings, never a failure."
)


@report.command(epilog=MODEL_EXIT_CODES_HELP, cls=SdpaCommand)
@click.argument("manifest", metavar="MANIFEST", shell_complete=files, callback=sample_path)
@click.option(
    "--metric",
    type=click.Choice((*MODEL_METRICS, "all")),
    metavar="METRIC",
    default="entropy",
    show_default=True,
    help=f"The statistic the table shows ({', '.join(MODEL_METRICS)}), or all of them "
    "in turn: mean normalised "
    "entropy, mean max weight, shares of saturated, near-uniform and fully masked "
    "rows, the mean weight on key 0 (sink_mass), the output's relative RMS error "
    "(cases with an expect-output).",
)
@format_option("Heatmap tables for a person, or one JSON object on stdout.")
@output_files("page", what="the grid (choose a head to see its pattern)")
@TOKENS_OPTION
@computing_options()
@diagnostic_options
@COLOR_OPTION
def model(
    manifest: str,
    metric: str,
    fmt: str,
    outputs: Outputs,
    tokens: str | None,
    computing: Computing,
    thresholds: dict[str, str | None],
    color: bool | None,
) -> int:
    """A model at a glance: every case of MANIFEST as a row, each query head a column.

    Every case (an attention call: a layer) is computed as sdpa compute would, and
    each query head's rows, pooled over the batch, give its statistics: mean entropy
    (÷ log of the visible keys: 0 one-hot, 1 uniform), mean max weight, the shares of
    saturated, near-uniform and fully masked rows, the attention-sink mass (mean
    weight on key 0) and, for a case with an expect-output, the output's RMS error
    relative to the reference's RMS. Rows are labelled by the case's layer where
    sdpa capture's calls.yaml beside the manifest gives one to each case, else by
    its name. Below the grid: the attention sinks (sink
    mass > 0.5), dead heads (near-uniform on --head-fraction of their rows, or max
    weight ≈ 1/visible keys) and saturated heads (one-hot on --head-fraction of their
    rows), at most --max-findings of each kind (the JSON lists all). A case that
    cannot be read is named on stderr, its row left blank, and the exit code is 2.

    \b
    Examples:
      sdpa report model sample:model/manifest.yaml
      sdpa report model sample:model/manifest.yaml --metric sink_mass
      sdpa report model sample:model/manifest.yaml --html model.html
      sdpa report model sample:model/manifest.yaml --metric all --format json
    """
    outputs.check([manifest, tokens])
    threads = start_engine(computing)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.model import model_page_of, model_report
    from sdpa_cli.api.outputs import text_file, write_outputs
    from sdpa_cli.diagnosis.thresholds import thresholds as read_thresholds
    from sdpa_cli.render.model import render_model
    from sdpa_cli.report import document_head, to_json

    th = read_thresholds(thresholds)
    grid = model_report(
        manifest,
        th,
        errors=metric == "error",
        jobs=threads,
        watch=progress_bar,
        patterns="page" in outputs,
    )
    if "page" in outputs:  # written before anything is printed: a bad --tokens prints nothing
        write_outputs(outputs, {"page": text_file(model_page_of(grid, manifest, tokens))})
    for row in grid.rows:
        if row.error is not None:  # one line each, never wrapped
            click.echo(f"sdpa: error: {row.name}: {row.error}", err=True)
    if fmt == "json":
        document = {**document_head(), "manifest": manifest, **grid.to_dict()}
        click.echo(to_json(document))
    else:
        shown = [m for m in MODEL_METRICS if m in grid.metrics] if metric == "all" else [metric]
        console = make_console(color)
        view = render_model(grid, shown, manifest, console.width, th.max_findings)
        print_all(console, [view])
    unread = any(row.error is not None for row in grid.rows)
    return int(ExitCode.BAD_INPUT if unread else ExitCode.OK)
