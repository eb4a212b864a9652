"""``sdpa check``: exported attention tensors judged against a recomputed reference."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

from sdpa_cli.api.outputs import PICTURES, REPORTS
from sdpa_cli.cli.completion import files, finding_kinds, word_list, words
from sdpa_cli.cli.helps import SdpaCommand
from sdpa_cli.cli.options import (
    COLOR_OPTION,
    Computing,
    PositiveFinite,
    case_options,
    computing_options,
    diagnostic_options,
    format_option,
    grouped,
    output_files,
    sample_path,
)
from sdpa_cli.cli.run import make_console, pictures, print_all, progress_bar, start_engine
from sdpa_cli.cli.streams import decided
from sdpa_cli.errors import SpecError
from sdpa_cli.names import REFERENCE_FORMATS, SEVERITIES, TOLERANCE_RULES

if TYPE_CHECKING:
    from sdpa_cli.api.case import Case
    from sdpa_cli.api.check import CheckRun, ManifestRun
    from sdpa_cli.api.outputs import Outputs

CHECK_EXIT_CODES_HELP = (
    "Exit codes: 0 every check passed · 1 a check failed · 2 bad usage, or an input "
    "that cannot be read or is invalid, or an output that cannot be written (never 1) · "
    "3 internal error (please report) · 130 interrupted (Ctrl-C) · 143 SIGTERM · 129 SIGHUP; "
    "a reader of stdout that leaves early (| head) changes no code."
)

SETTINGS_OPTIONS = [
    click.option("--rtol", metavar="X", help="Fixed relative tolerance (with --atol)."),
    click.option("--atol", metavar="X", help="Fixed absolute tolerance (with --rtol)."),
    click.option(
        "--reference",
        metavar="FORMAT",
        shell_complete=words(*REFERENCE_FORMATS),
        help=f"Format of the reference: {' or '.join(REFERENCE_FORMATS)} (default: float32 for 16- and 8-bit exports, else float64).",
    ),
    click.option(
        "--tolerance",
        type=click.Choice(TOLERANCE_RULES),
        help="kernel (default): each element no worse than the plain computation in the "
        "export's dtype × --fudge, as kernel tests judge; dtype: PyTorch's fixed "
        "tolerances for the dtype; measured: PyTorch's get_tolerances.",
    ),
    click.option(
        "--fudge",
        metavar="F",
        help="How much worse than the plain computation an element may be (default 2; 4 for a float32 export).",
    ),
    click.option(
        "--max-error",
        metavar="STAT=X[,...]",
        help="Also fail when an error statistic passes X: abs_ or rel_ mean, median, p90, "
        "p99, max (at most X), cosine_min (at least X); e.g. abs_p99=1e-3,cosine_min=0.9999.",
    ),
    click.option(
        "--fail-on",
        metavar="KIND[,KIND...]",
        shell_complete=word_list(finding_kinds),
        help="Fail on these finding kinds, or none (default without --expect-*: "
        "nonfinite and overflow in the inputs' own dtype; with them: none).",
    ),
    click.option(
        "--fail-on-severity",
        type=click.Choice(SEVERITIES),
        help="Fail on any finding at this severity or worse.",
    ),
    click.option(
        "--equal-nan/--no-equal-nan",
        default=None,
        help="Count NaN in both export and reference as a match (default no).",
    ),
]
"""The settings of the judgement, as typed (a manifest's cases take the same keys)."""


def _manifest_run(manifest: str | None, **given: Any) -> ManifestRun | None:
    """``--manifest`` and how its cases run; the others belong to it."""
    if manifest is None:
        for name, value in given.items():
            if value is not None:
                flag = "--cluster-timeout" if name == "timeout" else f"--{name}"
                raise SpecError(flag, "runs the cases of a manifest; give --manifest FILE")
        return None
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.check import ManifestRun

    return ManifestRun(manifest, **given)


MANIFEST_OPTIONS = [
    click.option(
        "--manifest",
        metavar="FILE",
        shell_complete=files,
        callback=sample_path,
        help="Run the cases listed in FILE (YAML/JSON) in parallel, with one summary.",
    ),
    click.option(
        "--cluster",
        metavar="ADDRESS",
        help="Run the manifest's cases on the Dask cluster whose scheduler is at ADDRESS "
        "(tcp://HOST:PORT); files are read where the workers run (paths made absolute, or "
        "URLs). Needs the dask extra.",
    ),
    click.option(
        "--cluster-timeout",
        "timeout",
        type=PositiveFinite(),
        metavar="SECONDS",
        help="How long to wait for the --cluster scheduler to answer (default 5).",
    ),
    click.option(
        "--shard",
        metavar="I/N",
        help="Run shard I of N of the manifest (cases I, I+N, I+2N, ...), for a CI matrix; "
        "merge the shards' --report files with sdpa report merge.",
    ),
]
QUIET_OPTION = click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="Print nothing on stdout: the exit code is the answer (errors still on stderr, "
    "--report and --junit still written).",
)


@click.command(epilog=CHECK_EXIT_CODES_HELP, cls=SdpaCommand)
@case_options(judged=True, required=False)
@grouped("settings", dict, SETTINGS_OPTIONS)
@grouped("manifest", _manifest_run, MANIFEST_OPTIONS)
@computing_options(
    "Threads computing the blocks of a case, or cases run at once with --manifest "
    "(default: the number of cores)."
)
@format_option("A summary for a person, or one JSON object on stdout.")
@output_files(
    *REPORTS,
    *PICTURES,
    "page",
    what="the summary",
    page="Also write the verdict as one self-contained HTML page: for each failed "
    "comparison, where its error sits (heat maps, every value on hover).",
)
@QUIET_OPTION
@diagnostic_options
@COLOR_OPTION
def check(
    case: Case,
    settings: dict[str, Any],
    manifest: ManifestRun | None,
    computing: Computing,
    fmt: str,
    outputs: Outputs,
    quiet: bool,
    thresholds: dict[str, str | None],
    color: bool | None,
) -> int:
    """Validate exported attention tensors against a recomputed reference (for CI).

    Give Q K V (or a case file) with the options of compute, and the tensors to
    validate. With no --expect-* the inputs and the computation themselves are
    checked. Every export is also checked without a reference: finite, weights on
    the simplex, outputs inside V's range, LSE consistent with the weights.
    --dtype names the format the export was computed in (a bfloat16 export saved
    as float32 needs it); otherwise it is read from the files.

    \b
    Examples:
      sdpa check --manifest sample:check/checks.yaml
      sdpa check --manifest sample:check/checks.yaml --html checks.html
      sdpa check sample:fp16_overflow --fail-on overflow
      sdpa check q.npy k.npy v.npy --causal --expect-output out.npy
      sdpa check q.npy k.npy v.npy --expect-weights w.npy --rtol 1e-4 --atol 1e-5
      sdpa check q.npy k.npy v.npy --expect-partials partials.yaml
      sdpa check q.npy k.npy v.npy --fail-on overflow,nonfinite --format json
      sdpa check --manifest checks.yaml --cluster tcp://10.0.0.5:8786
      sdpa check --manifest checks.yaml --shard 2/4 --report shard-2.json
    """
    start_engine(computing)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.check import run_check
    from sdpa_cli.check.settings import Overrides

    over = Overrides.given(thresholds, settings, case.options)
    run = run_check(
        case, over, manifest=manifest, outputs=outputs, jobs=computing.jobs, watch=progress_bar
    )
    write_reports(run, outputs, color)
    code = decided(run.exit_code)  # the verdict is kept when the reader leaves early (| head)
    show_results(run, fmt, color, quiet=quiet)
    return code


def write_reports(run: CheckRun, outputs: Outputs, color: bool | None) -> None:
    """The report files ``outputs`` asks for, all or none: the JSON report, the JUnit
    XML, and the summary's pictures."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.outputs import text_file, write_outputs
    from sdpa_cli.render.check import render_results

    shown = []
    if outputs.wants(*PICTURES):
        shown = [render_results(run.results, run.manifest, run.title)]
    width = make_console(color).width
    files = {**run.writers(), **pictures(outputs, shown, width, "sdpa check")}
    if "page" in outputs:
        files["page"] = text_file(run.page())
    write_outputs(outputs, files)


def show_results(run: CheckRun, fmt: str, color: bool | None, *, quiet: bool = False) -> None:
    """GitHub annotations (under GitHub Actions), a line per case that could not be
    checked (stderr), then the JSON report or the table (of a manifest: titled by the
    run's title, or the manifest); with ``quiet``, the stderr lines alone."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.render.check import render_results
    from sdpa_cli.report import github_annotations

    if os.environ.get("GITHUB_ACTIONS") == "true":
        for line in github_annotations(run.results, manifest=run.manifest):
            # On stdout, where the runner reads them; on stderr beside JSON, or --quiet.
            click.echo(line, err=fmt == "json" or quiet)
    for r in run.results:
        if r.error is not None:  # one line each, never wrapped
            click.echo(f"sdpa: error: {r.name}: {r.error}", err=True)
    if quiet:
        return
    if fmt == "json":
        click.echo(run.json_text, nl=False)
    else:
        print_all(make_console(color), [render_results(run.results, run.manifest, run.title)])
