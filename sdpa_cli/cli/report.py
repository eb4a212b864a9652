"""``sdpa report``: the JSON reports ``sdpa check`` writes, worked on; ``sdpa report
merge`` joins the reports of a manifest's shards (``sdpa check --manifest M --shard
I/N --report FILE``) into the unsharded run's report, JUnit XML and exit code."""

from __future__ import annotations

import click

from sdpa_cli.cli.check import show_results, write_report_files
from sdpa_cli.cli.options import COLOR_OPTION, JUNIT_OPTION, format_option

MERGE_EXIT_CODES_HELP = (
    "Exit codes: the merged run's: 0 every check passed · 1 a check failed · 2 a case could "
    "not be checked, or bad input (a file that is not a shard's report, shards of "
    "different runs, a shard missing or given twice) · 3 internal error · 130 interrupted."
)


@click.group()
def report() -> None:
    """Work with the JSON reports of sdpa check.

    \b
    Example:
      sdpa report merge shard-1.json shard-2.json --junit report.xml
    """


@report.command(epilog=MERGE_EXIT_CODES_HELP)
@click.argument("shards", nargs=-1, required=True, metavar="SHARD.json...")
@format_option("A summary for a person, or the merged JSON report on stdout.")
@JUNIT_OPTION
@click.option(
    "--report", "report_path", metavar="FILE.json", help="Also write the merged JSON report."
)
@COLOR_OPTION
def merge(
    shards: tuple[str, ...],
    fmt: str,
    junit: str | None,
    report_path: str | None,
    color: bool | None,
) -> int:
    """Merge the JSON reports of every shard of a manifest's run into one.

    Each SHARD.json is the --report of sdpa check --manifest M --shard I/N, for
    every I of the same N, the same manifest and the same settings. The merged
    report is the one the unsharded run writes (cases in manifest order), and so
    are the table, the JUnit XML and the exit code. Nothing is merged when a file
    is not a shard's report, when shards come from different runs, or when a shard
    is missing or given twice.

    \b
    Example:
      sdpa check --manifest m.yaml --shard 1/2 --report s1.json
      sdpa check --manifest m.yaml --shard 2/2 --report s2.json
      sdpa report merge s1.json s2.json --report all.json --junit all.xml
    """
    # imported here: keeps sdpa --help fast
    from sdpa_cli.report import to_json
    from sdpa_cli.report_merge import merge_shard_reports, read_shard_report

    document, results = merge_shard_reports([read_shard_report(path) for path in shards])
    json_text = to_json(document) + "\n"
    write_report_files(results, json_text, junit, report_path)
    show_results(results, document["manifest"], None, fmt, json_text, color)
    return int(document["exit_code"])
