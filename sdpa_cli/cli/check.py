"""``sdpa check``: exported attention tensors judged against a recomputed reference."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import click

from sdpa_cli.cli.completion import files, finding_kinds, word_list
from sdpa_cli.cli.options import (
    COLOR_OPTION,
    JUNIT_OPTION,
    attention_options,
    diagnostic_options,
    export_options,
    export_outputs,
    exports,
    format_option,
    make_console,
    print_all,
    progress_bar,
    start_engine,
)
from sdpa_cli.cli.streams import decided
from sdpa_cli.errors import SpecError
from sdpa_cli.names import REFERENCE_FORMATS, SEVERITIES, TOLERANCE_RULES

if TYPE_CHECKING:
    from sdpa_cli.check.records import CaseResult
    from sdpa_cli.check.settings import Overrides

CHECK_EXIT_CODES_HELP = (
    "Exit codes: 0 every check passed · 1 a check failed · 2 bad usage, or an input "
    "that cannot be read or is invalid, or an output that cannot be written (never 1) · "
    "3 internal error (please report) · 130 interrupted (Ctrl-C) · 143 SIGTERM · 129 SIGHUP; "
    "a reader of stdout that leaves early (| head) changes no code."
)


@click.command(epilog=CHECK_EXIT_CODES_HELP)
@click.argument("inputs", nargs=-1, metavar="Q K V | CASE", shell_complete=files)
@click.option(
    "--expect-output",
    metavar="FILE",
    shell_complete=files,
    help="The exported output, (..., L, Ev).",
)
@click.option(
    "--expect-weights",
    metavar="FILE",
    shell_complete=files,
    help="The exported attention weights, (..., L, S).",
)
@click.option(
    "--expect-lse",
    metavar="FILE",
    shell_complete=files,
    help="The exported logsumexp per row, (..., L), as FlashAttention returns it.",
)
@click.option(
    "--expect-partials",
    metavar="FILE",
    shell_complete=files,
    help="Split-KV partials: a YAML/JSON list of {keys: START:STOP, output: FILE, lse: FILE}; "
    "each checked over its keys, their merge against the whole attention.",
)
@click.option(
    "--decode",
    is_flag=True,
    help="Also compare this causal prefill with the same tokens decoded one query at a "
    "time against the growing cache (query i after the S − L cached keys, or at "
    "--query-offset + i): equal to rounding in float64, within the format's tolerance "
    "under --dtype. An --expect-output beside it (a decode run's steps, stacked) is "
    "judged against the prefill.",
)
@click.option("--rtol", metavar="X", help="Fixed relative tolerance (with --atol).")
@click.option("--atol", metavar="X", help="Fixed absolute tolerance (with --rtol).")
@click.option(
    "--reference",
    type=click.Choice(REFERENCE_FORMATS),
    help="Format of the reference (default: float32 for 16- and 8-bit exports, else float64).",
)
@click.option(
    "--tolerance",
    type=click.Choice(TOLERANCE_RULES),
    help="kernel (default): each element no worse than the plain computation in the "
    "export's dtype × --fudge, as kernel tests judge; dtype: PyTorch's fixed "
    "tolerances for the dtype; measured: PyTorch's get_tolerances.",
)
@click.option(
    "--fudge",
    metavar="F",
    help="How much worse than the plain computation an element may be (default 2; 4 for a float32 export).",
)
@click.option(
    "--max-error",
    metavar="STAT=X[,...]",
    help="Also fail when an error statistic passes X: abs_ or rel_ mean, median, p90, "
    "p99, max (at most X), cosine_min (at least X); e.g. abs_p99=1e-3,cosine_min=0.9999.",
)
@click.option(
    "--fail-on",
    metavar="KIND[,KIND...]",
    shell_complete=word_list(finding_kinds),
    help="Fail on these finding kinds, or none (default without --expect-*: "
    "nonfinite and overflow in the inputs' own dtype; with them: none).",
)
@click.option(
    "--fail-on-severity",
    type=click.Choice(SEVERITIES),
    help="Fail on any finding at this severity or worse.",
)
@click.option(
    "--equal-nan/--no-equal-nan",
    default=None,
    help="Count NaN in both export and reference as a match (default no).",
)
@click.option(
    "--manifest",
    metavar="FILE",
    shell_complete=files,
    help="Run the cases listed in FILE (YAML/JSON) in parallel, with one summary.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    metavar="N",
    help="Threads computing the blocks of a case, or cases run at once with --manifest "
    "(default: the number of cores).",
)
@click.option(
    "--cluster",
    metavar="ADDRESS",
    help="Run the manifest's cases on the Dask cluster whose scheduler is at ADDRESS "
    "(tcp://HOST:PORT); files are read where the workers run (paths made absolute, or "
    "URLs). Needs the dask extra.",
)
@click.option(
    "--cluster-timeout",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="How long to wait for the --cluster scheduler to answer (default 5).",
)
@click.option(
    "--shard",
    metavar="I/N",
    help="Run shard I of N of the manifest (cases I, I+N, I+2N, ...), for a CI matrix; "
    "merge the shards' --report files with sdpa report merge.",
)
@format_option("A summary for a person, or one JSON object on stdout.")
@JUNIT_OPTION
@click.option(
    "--report",
    metavar="FILE.json",
    shell_complete=files,
    help="Also write the JSON report, atomically.",
)
@click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="Print nothing on stdout: the exit code is the answer (errors still on stderr, "
    "--report and --junit still written).",
)
@export_options("the summary")
@attention_options
@diagnostic_options
@COLOR_OPTION
def check(
    inputs: tuple[str, ...],
    expect_output: str | None,
    expect_weights: str | None,
    expect_lse: str | None,
    expect_partials: str | None,
    decode: bool,
    rtol: str | None,
    atol: str | None,
    reference: str | None,
    tolerance: str | None,
    fudge: str | None,
    max_error: str | None,
    fail_on: str | None,
    fail_on_severity: str | None,
    equal_nan: bool | None,
    manifest: str | None,
    jobs: int | None,
    cluster: str | None,
    cluster_timeout: float | None,
    shard: str | None,
    fmt: str,
    junit: str | None,
    report: str | None,
    quiet: bool,
    export_svg: str | None,
    export_html: str | None,
    bias_path: str | None,
    mask_path: str | None,
    given_thresholds: dict[str, str | None],
    color: bool | None,
    **flags: Any,
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
      sdpa check q.npy k.npy v.npy --causal --expect-output out.npy
      sdpa check q.npy k.npy v.npy --expect-weights w.npy --rtol 1e-4 --atol 1e-5
      sdpa check q.npy k.npy v.npy --expect-partials partials.yaml
      sdpa check q.npy k.npy v.npy --fail-on overflow,nonfinite --format json
      sdpa check --manifest checks.yaml --junit report.xml
      sdpa check --manifest checks.yaml --cluster tcp://10.0.0.5:8786
      sdpa check --manifest checks.yaml --shard 2/4 --report shard-2.json
    """
    threads = start_engine(jobs)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.files.outputs import check_outputs, inputs_of
    from sdpa_cli.report import check_exit_code

    outputs = [("--junit", junit), ("--report", report), *export_outputs(export_svg, export_html)]
    given_files = [*inputs, bias_path, mask_path, manifest, expect_partials]
    given_files += [expect_output, expect_weights, expect_lse]
    check_outputs(inputs_of(given_files, flags), outputs)
    over = _overrides(
        given_thresholds,
        {
            "rtol": rtol,
            "atol": atol,
            "reference": reference,
            "tolerance": tolerance,
            "fudge": fudge,
            "max_error": max_error,
            "fail_on": fail_on,
            "fail_on_severity": fail_on_severity,
            "equal_nan": equal_nan,
        },
        flags,
    )
    expect = {"output": expect_output, "weights": expect_weights, "lse": expect_lse}
    title = None
    sharding: dict[str, Any] | None = None
    if manifest is not None:
        tensor_flags = (
            "sinks_path",
            "segment_ids_path",
            "segment_ids_kv_path",
            "dropout_mask_path",
        )
        given = any(flags.get(n) for n in tensor_flags)
        if decode:
            raise SpecError("--decode", "checks the one case given; not with --manifest")
        if inputs or bias_path or mask_path or given or any(expect.values()) or expect_partials:
            raise SpecError(
                "--manifest",
                "the manifest lists inputs and expectations; give no Q K V, --bias, --mask, --sinks, "
                "--segment-ids, --dropout-mask or --expect-* beside it",
            )
        if cluster is not None and jobs is not None:
            raise SpecError(
                "--jobs", "the cluster's workers run the cases; give --jobs or --cluster"
            )
        results, sharding = _run_manifest(
            manifest,
            over,
            threads,
            cluster=cluster,
            timeout=cluster_timeout,
            shard=shard,
            outputs=outputs,
        )
        if sharding is not None:
            title = f"{manifest} · shard {sharding['shard']}"
    else:
        for name, value in (("--cluster", cluster), ("--shard", shard)):
            if value is not None:
                raise SpecError(name, "runs the cases of a manifest; give --manifest FILE")
        title, results = _run_case(
            inputs, bias_path, mask_path, expect, over, threads, expect_partials, decode
        )
    exported: list[tuple[str, Callable[[BinaryIO], object]]] = []
    if export_svg or export_html:
        # imported here: keeps sdpa --help fast
        from sdpa_cli.render.check import render_results

        table = render_results(results, manifest, title)
        width = make_console(color).width
        exported += exports([table], width, export_svg, export_html, "sdpa check")
    json_text = _write_reports(results, manifest, junit, report, sharding, exported)
    # The verdict is kept when the reader of stdout goes away early (| head).
    code = decided(check_exit_code(results))
    show_results(results, manifest, title, fmt, json_text, color, quiet=quiet)
    return code


def _overrides(
    given_thresholds: Mapping[str, str | None],
    check_flags: Mapping[str, Any],
    option_flags: Mapping[str, Any],
) -> Overrides:
    """What the command line gives every case: the thresholds, the config file's check
    settings, the check flags (parsed) and the options given; the config file is read
    once, for the thresholds and the check settings."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.check.settings import Overrides, check_config, check_values
    from sdpa_cli.diagnosis.thresholds import thresholds
    from sdpa_cli.files.config import read_config
    from sdpa_cli.files.confine import outside_allowed

    config_file = read_config()
    limits = thresholds(given_thresholds, config=config_file)
    return Overrides(
        config=check_config(config=config_file),
        check_flags=check_values(check_flags),
        option_flags={k: v for k, v in option_flags.items() if v is not None},
        thresholds=limits,
        allow_outside=outside_allowed(),
    )


def _run_manifest(
    manifest: str,
    over: Overrides,
    threads: int,
    *,
    cluster: str | None,
    timeout: float | None,
    shard: str | None,
    outputs: Sequence[tuple[str, str | None]] = (),
) -> tuple[list[CaseResult], dict[str, Any] | None]:
    """The cases of the manifest (those of ``shard`` when given), ``threads`` at a time
    in local processes or as tasks on ``cluster``; and for a shard, what its report
    says of it (:func:`~sdpa_cli.report_merge.shard_document`'s keywords). Settings
    that do not fit together, in any case of the manifest, stop the run (exit 2)
    before any case runs, as does an output that is one of the cases' files."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.check.manifest import Shard, fingerprint, load_manifest, run_cases
    from sdpa_cli.files.outputs import check_outputs, inputs_of

    picked = None if shard is None else Shard.parse(shard)
    cases = load_manifest(manifest)
    read = [
        (*c.inputs, c.bias, c.mask, c.sinks, *c.tensors.values(), *c.expect.values()) for c in cases
    ]
    check_outputs(inputs_of(p for paths in read for p in paths), outputs)
    for case in cases:
        try:
            over.settings(case.check)
        except SpecError as exc:
            raise SpecError(f"{manifest}: case {case.name}", str(exc)) from None
    sharding = None
    if picked is not None:
        sharding = {"shard": picked, "total": len(cases), "fingerprint": fingerprint(cases, over)}
        cases = [cases[p - 1] for p in picked.positions(len(cases))]
    if cluster is None:
        return run_cases(cases, over, threads), sharding
    # imported here: keeps sdpa --help fast
    from sdpa_cli.check.cluster import CONNECT_TIMEOUT, run_cases_on_cluster

    results = run_cases_on_cluster(cases, over, cluster, timeout=timeout or CONNECT_TIMEOUT)
    return results, sharding


def _run_case(
    inputs: tuple[str, ...],
    bias_path: str | None,
    mask_path: str | None,
    expect: Mapping[str, str | None],
    over: Overrides,
    threads: int,
    partials_path: str | None = None,
    decode: bool = False,
) -> tuple[str, list[CaseResult]]:
    """The one case given on the command line, and its title (the case file's
    description, or the inputs); with ``partials_path``, the partials' checks after
    the exports'."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.check.exports import load_expected
    from sdpa_cli.check.records import CaseResult
    from sdpa_cli.check.run import run_checks
    from sdpa_cli.engine.inputs import load_spec

    if not inputs:
        raise SpecError("", "give Q K V (or one case file), or --manifest FILE")
    settings = over.settings()
    spec, description = load_spec(inputs, bias_path, mask_path, over.option_flags)
    expected = load_expected(expect)
    title = (description or "").strip() or " ".join(inputs)
    partial_checks: list[Any] = []
    if partials_path is not None:
        # imported here: keeps sdpa --help fast
        from sdpa_cli.check.partials import load_partials
        from sdpa_cli.check.partials import partial_checks as judge_partials

        partial_checks = judge_partials(spec, load_partials(partials_path), settings)
    if decode:
        # imported here: keeps sdpa --help fast
        from sdpa_cli.check.decode import decode_checks

        partial_checks += decode_checks(spec, settings)
    with progress_bar(spec, "checking") as progress:
        report = run_checks(
            spec, expected, settings, over.thresholds, jobs=threads, progress=progress
        )
    if partial_checks:
        report = dataclasses.replace(report, checks=(*partial_checks, *report.checks))
    return title, [CaseResult(title, report)]


def _write_reports(
    results: list[CaseResult],
    manifest: str | None,
    junit: str | None,
    report: str | None,
    sharding: dict[str, Any] | None,
    exported: Sequence[tuple[str, Callable[[BinaryIO], object]]] = (),
) -> str:
    """Write the JUnit and JSON report files asked for, and the ``exported`` files
    (atomically, all or none); returns the JSON report's text (a shard's says which
    shard it is)."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.report import check_document, to_json
    from sdpa_cli.report_merge import shard_document

    document = check_document(results, manifest=manifest)
    if sharding is not None:
        document = shard_document(document, **sharding)
    json_text = to_json(document) + "\n"
    write_report_files(results, json_text, junit, report, exported)
    return json_text


def write_report_files(
    results: list[CaseResult],
    json_text: str,
    junit: str | None,
    report: str | None,
    exported: Sequence[tuple[str, Callable[[BinaryIO], object]]] = (),
) -> None:
    """Write the JUnit and JSON report files asked for and the ``exported`` files,
    atomically, all or none (before what a person or a script reads is shown)."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.files.writers import write_all_atomic
    from sdpa_cli.report import junit_xml

    reports = [] if junit is None else [(junit, junit_xml(results))]
    reports += [] if report is None else [(report, json_text.encode())]
    write_all_atomic([*((path, _writes(data)) for path, data in reports), *exported])


def show_results(
    results: list[CaseResult],
    manifest: str | None,
    title: str | None,
    fmt: str,
    json_text: str,
    color: bool | None,
    *,
    quiet: bool = False,
) -> None:
    """GitHub annotations (under GitHub Actions), a line per case that could not be
    checked (stderr), then the JSON report or the table (of a manifest: titled
    ``title``, or the manifest); with ``quiet``, the stderr lines alone."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.render.check import render_results
    from sdpa_cli.report import github_annotations

    console = make_console(color)
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for line in github_annotations(results, manifest=manifest):
            # On stdout, where the runner reads them; on stderr beside JSON, or --quiet.
            click.echo(line, err=fmt == "json" or quiet)
    for r in results:
        if r.error is not None:  # one line each, never wrapped
            click.echo(f"sdpa: error: {r.name}: {r.error}", err=True)
    if quiet:
        return
    if fmt == "json":
        click.echo(json_text, nl=False)
    else:
        print_all(console, [render_results(results, manifest, title)])


def _writes(data: bytes) -> Callable[[BinaryIO], object]:
    """A writer of ``data``, for :func:`~sdpa_cli.files.writers.write_all_atomic`."""
    return lambda fh: fh.write(data)
