"""``sdpa inspect``: what tensor files hold, and why one was refused or will overflow."""

from __future__ import annotations

import click

from sdpa_cli.cli.options import (
    COLOR_OPTION,
    EXIT_CODES_HELP,
    format_option,
    make_console,
    print_all,
)
from sdpa_cli.errors import ExitCode


@click.command(epilog=EXIT_CODES_HELP)
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@format_option("Tables for a person, or one JSON object on stdout.")
@COLOR_OPTION
def inspect(files: tuple[str, ...], fmt: str, color: bool | None) -> int:
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
      sdpa inspect samples/cross.npz samples/scorecard.yaml
      sdpa inspect model.safetensors:layers.0.attn.q --format json
    """
    # imported here (as below): keeps sdpa --help fast
    from sdpa_cli.diagnosis.inspect import FileReport, errors, inspect_files

    results = inspect_files(files)
    failed = errors(results)
    if fmt == "json":
        from sdpa_cli.report import inspect_payload, to_json

        click.echo(to_json(inspect_payload(results)))
    else:
        from sdpa_cli.render.inspect import render_inspect

        console = make_console(color)
        read = [r for r in results if isinstance(r, FileReport)]
        print_all(console, render_inspect(read, console.width))
    # One line each, never wrapped, after what could be read; the last goes through the
    # group, as every command's input error does.
    for exc in failed[:-1]:
        click.echo(f"sdpa: error: {exc}", err=True)
    if failed:
        raise failed[-1]
    return int(ExitCode.OK)
