"""``sdpa diff``: two runs of a model (two captures, or two manifests) compared call
by call, and the first call where they part named: upstream of attention, or in the
kernel.

A command of its own rather than a ``report`` subcommand: ``report model`` and
``report merge`` show or join what one run holds and never judge it, while ``diff``
judges, with ``check``'s exit codes (1 when the runs part).
"""

from __future__ import annotations

import click

from sdpa_cli.cli.completion import files
from sdpa_cli.cli.options import (
    COLOR_OPTION,
    Computing,
    computing_options,
    format_option,
    sample_path,
)
from sdpa_cli.cli.run import make_console, print_all, progress_bar, start_engine
from sdpa_cli.cli.streams import decided

DIFF_EXIT_CODES_HELP = (
    "Exit codes: 0 the runs agree · 1 a call diverges · 2 bad usage, a run that cannot be "
    "read, no call that pairs, or a call that cannot be compared (a line on stderr names "
    "it) · 3 internal error · 130 interrupted (143 SIGTERM, 129 SIGHUP)."
)

BOUND_HELP = (
    "The largest relative RMS difference of Q, K or V that reads as rounding, in units "
    "of the narrower run's unit roundoff (bfloat16: 2^-8); default 64, 4× what a "
    "bfloat16 run of a 12-layer model reaches."
)


@click.command(epilog=DIFF_EXIT_CODES_HELP)
@click.argument("run_a", metavar="RUN_A", shell_complete=files, callback=sample_path)
@click.argument("run_b", metavar="RUN_B", shell_complete=files, callback=sample_path)
@click.option(
    "--bound",
    type=click.FloatRange(min=0, min_open=True),
    metavar="UNITS",
    help=BOUND_HELP,
)
@format_option("A table for a person, or one JSON object on stdout.")
@computing_options()
@COLOR_OPTION
def diff(
    run_a: str,
    run_b: str,
    bound: float | None,
    fmt: str,
    computing: Computing,
    color: bool | None,
) -> int:
    """Compare two runs of a model call by call, and name the first call that diverges.

    Each RUN is a capture's folder (sdpa capture --out DIR) or a manifest. Calls pair
    by name (module path and occurrence), else by layer, else in order; calls only
    in one run are listed. For each pair, Q, K and V of B are compared with A's: an
    input differs when its relative RMS difference, in units of the narrower run's
    unit roundoff, passes --bound and 4× any earlier call's. The mask is compared by
    the keys it hides. B's output is judged against attention from B's own inputs,
    as sdpa check judges it. The first call that diverges is named: upstream of
    attention (projections, rotary embedding) when its inputs differ, in the kernel
    when only its output does.

    \b
    Examples:
      sdpa diff sample:diff/float32 sample:diff/bfloat16
      sdpa diff sample:diff/float32 sample:diff/rotary_bug
      sdpa diff sample:diff/float32 sample:diff/kernel_bug --format json
    """
    threads = start_engine(computing)
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.diff import diff_runs
    from sdpa_cli.check.settings import Overrides
    from sdpa_cli.render.diff import render_diff
    from sdpa_cli.report import document_head, to_json

    result = diff_runs(
        run_a, run_b, Overrides.given(), bound=bound, jobs=threads, watch=progress_bar
    )
    code = decided(result.exit_code)  # kept when the reader goes away (| head)
    for call in result.calls:
        if call.error is not None:  # one line each, never wrapped
            click.echo(f"sdpa: error: {call.a}: {call.error}", err=True)
    if fmt == "json":
        click.echo(to_json({**document_head(), **result.to_dict()}))
    else:
        console = make_console(color)
        print_all(console, [render_diff(result, console.width)])
    return int(code)
