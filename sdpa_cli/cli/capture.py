"""``sdpa capture``: a Python program run under a capture of its attention calls."""

from __future__ import annotations

import click

from sdpa_cli.cli.completion import directories, files

CAPTURE_EXIT_CODES_HELP = (
    "Exit codes: the program's own · 2 bad usage, PyTorch not installed, or the capture "
    "cannot be written · 3 internal error (please report) · 130 interrupted."
)


@click.command(
    epilog=CAPTURE_EXIT_CODES_HELP,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--out",
    required=True,
    metavar="DIR",
    shell_complete=directories,
    help="Write the calls here: tensors/*.safetensors, manifest.yaml, calls.yaml.",
)
@click.option(
    "--max-calls", type=click.IntRange(min=1), metavar="N", help="Record at most N calls."
)
@click.option(
    "--match",
    metavar="PATTERN",
    help="Record only calls whose name (model.layers.3.self_attn, call-7) matches this "
    "glob or contains this text.",
)
@click.option(
    "--every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Record every Nth call (of those --match selects).",
)
@click.option(
    "--max-bytes",
    metavar="SIZE",
    help="Stop recording before the files pass SIZE (500MB, 2GiB; kB/MB/GB are powers "
    "of 1000, K/M/G and KiB/MiB/GiB of 1024).",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Replace a capture already in DIR (its manifest.yaml, calls.yaml and tensors/; "
    "anything else there refuses it).",
)
@click.option(
    "--backward",
    is_flag=True,
    help="Also record each call's gradients when the program runs a backward pass: dO "
    "and the dQ, dK, dV autograd computed, listed as dout and expect-dq/dk/dv for sdpa "
    "check to judge the backward kernel.",
)
@click.argument(
    "command",
    nargs=-1,
    type=click.UNPROCESSED,
    metavar="-- [python] SCRIPT|-m MODULE [ARGS]...",
    shell_complete=files,
)
def capture(
    out: str,
    max_calls: int | None,
    match: str | None,
    every: int,
    max_bytes: str | None,
    replace: bool,
    backward: bool,
    command: tuple[str, ...],
) -> int:
    """Run a Python program and record every attention call it makes, for sdpa check.

    The program runs in this process, as python would run it (sys.argv, __main__).
    Every call of torch.nn.functional.scaled_dot_product_attention and of Hugging
    Face transformers' eager attention becomes DIR/tensors/NNNNN-NAME.safetensors
    (q, k, v, mask, output, weights), a case of DIR/manifest.yaml named by the
    module it came from (model.layers.3.self_attn), and a case file beside its
    tensors (DIR/tensors/NNNNN-NAME.yaml) that sdpa compute, explain and grad take
    alone. Then check them all with sdpa check --manifest DIR/manifest.yaml. The program's outputs are unchanged, and its
    exit code is sdpa's. Needs PyTorch: pip install torch.

    \b
    Examples:
      sdpa capture --out runs/llama -- python generate.py --prompt hi
      sdpa capture --out runs/bert --match 'encoder.layer.1*' -- -m my_pkg.eval
      sdpa capture --out runs/big --every 8 --max-bytes 2GiB -- train_step.py
      sdpa capture --out runs/train --backward -- train_step.py
      sdpa check --manifest runs/llama/manifest.yaml
    """
    # imported here: keeps sdpa --help fast
    from sdpa_cli.capture import capture as start_capture
    from sdpa_cli.capture.script import Program, run_program
    from sdpa_cli.capture.writer import parse_size
    from sdpa_cli.files.writers import immediate

    limit = None if max_bytes is None else parse_size(max_bytes)
    program = Program.parse(command)
    session = start_capture(
        out,
        max_calls=max_calls,
        match=match,
        every=every,
        max_bytes=limit,
        notify=lambda line: click.echo(f"sdpa capture: {line}", err=True),
        replace=replace,
        backward=backward,
    )
    # Its files are written as the calls come, not held back until stdout is delivered.
    with immediate(), session:
        code = run_program(program)
    assert session.summary is not None
    click.echo(f"sdpa capture: {session.summary.line()}", err=True)
    return code
