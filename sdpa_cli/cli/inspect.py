"""``sdpa inspect``: what tensor files hold, and why one was refused or will overflow."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from sdpa_cli.cli.completion import files
from sdpa_cli.cli.options import COLOR_OPTION, format_option, output_files
from sdpa_cli.cli.run import make_console, pictures, print_all
from sdpa_cli.errors import EXIT_CODES_HELP, ExitCode

if TYPE_CHECKING:
    from rich.console import RenderableType

    from sdpa_cli.api.outputs import Outputs


@click.command(epilog=EXIT_CODES_HELP)
@click.argument("paths", nargs=-1, required=True, metavar="FILE...", shell_complete=files)
@format_option("Tables for a person, or one JSON object on stdout.")
@COLOR_OPTION
@output_files("svg", "html", what="the tables")
def inspect(paths: tuple[str, ...], fmt: str, color: bool | None, outputs: Outputs) -> int:
    """Show what tensor files hold: names, shapes, dtypes, min, max, mean, std, NaN
    and inf counts, and float16/bfloat16 headroom (overflow, flush to zero, subnormal).

    FILE is .npy, .npz (every array, or FILE.npz:name), .safetensors (every tensor,
    or FILE.safetensors:name), a PyTorch file (every tensor, or FILE.pt:name; read
    with torch.load(weights_only=True)), .json or .yaml (a nested list, or a case
    file's q, k, v, bias and mask). Files are read through the same checks as every other
    command, so a file sdpa refuses is refused here with the same message.
    Statistics are over the finite values, in float64, read block by block.

    Every file is read; what could be read is printed, then one `sdpa: error:` line
    per file or member that could not be, and the exit code is 2.

    \b
    Examples:
      sdpa inspect sample:cross.npz sample:scorecard
      sdpa inspect sample:long_q.npy --format json
    """
    # imported here (as below): keeps sdpa --help fast
    from sdpa_cli.api.outputs import PICTURES, write_outputs
    from sdpa_cli.diagnosis.inspect import FileReport, errors, inspect_files

    outputs.check(paths)
    results = inspect_files(paths)
    failed = errors(results)
    read = [r for r in results if isinstance(r, FileReport)]
    console = make_console(color)
    renderables: list[RenderableType] = []
    if fmt != "json" or outputs.wants(*PICTURES):
        from sdpa_cli.render.inspect import render_inspect

        renderables = render_inspect(read, console.width)
    if not failed:  # an input that cannot be read: no file written
        write_outputs(outputs, pictures(outputs, renderables, console.width, "sdpa inspect"))
    if fmt == "json":
        from sdpa_cli.report import inspect_payload, to_json

        click.echo(to_json(inspect_payload(results)))
    else:
        print_all(console, renderables)
    # One line each, never wrapped, after what could be read; the last goes through the
    # group, as every command's input error does.
    for exc in failed[:-1]:
        click.echo(f"sdpa: error: {exc}", err=True)
    if failed:
        raise failed[-1]
    return int(ExitCode.OK)
