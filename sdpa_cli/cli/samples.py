"""``sdpa samples``: the sample inputs shipped with sdpa, listed or copied out."""

from __future__ import annotations

import click

from sdpa_cli._version import __version__
from sdpa_cli.cli.options import format_option
from sdpa_cli.errors import EXIT_CODES_HELP, ExitCode, InputError

NAME_WIDTH = 21
"""The name column: ``batched_{q,k,v}.npy`` and two spaces."""

UNBROKEN = r"(?:\b\w+ )?\([^)]*\)|\[[^\]]*\]| = \S+"
"""``v (2, 2, 6, 4)``, lists and ``d_k = 2``: never split across lines."""


@click.command(epilog=EXIT_CODES_HELP)
@click.option(
    "--copy",
    "destination",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Copy every sample into DIR/samples (DIR is created if missing).",
)
@click.option("--force", is_flag=True, help="With --copy: overwrite the samples' files there.")
@click.option("--path", "show_path", is_flag=True, help="Print the samples' folder and exit.")
@format_option("A list for a person, or one JSON object on stdout.")
def samples(destination: str | None, force: bool, show_path: bool, fmt: str) -> int:
    """List the sample inputs shipped with sdpa, or copy them out.

    The examples in every --help name files under samples/: after
    `sdpa samples --copy .` they run from any folder. Copying refuses to
    overwrite a file already there unless --force is given.

    \b
    Examples:
      sdpa samples
      sdpa samples --copy .
      sdpa compute samples/scorecard.yaml
    """
    # imported here: keeps sdpa --help fast (numpy, yaml, and the standard library's
    # heavier modules)
    import json
    import shutil
    from pathlib import Path

    from sdpa_cli.files.samples import catalog, copy_samples, samples_dir
    from sdpa_cli.schemas import SCHEMA_VERSION

    if show_path:
        click.echo(str(samples_dir()))
        return int(ExitCode.OK)
    if destination is not None:
        if not destination:  # Path("") would be the current folder
            raise InputError("--copy", "the folder name is empty")
        target, written = copy_samples(Path(destination), force=force)
        click.echo(f"copied {len(written)} files to {target}")
        click.echo(f"try: sdpa compute {target / 'scorecard.yaml'}")
        return int(ExitCode.OK)
    entries = catalog()
    if fmt == "json":
        payload = {
            "schema_version": SCHEMA_VERSION,
            "sdpa_version": __version__,
            "folder": str(samples_dir()),
            "samples": [
                {"name": s.name, "files": list(s.files), "description": s.description}
                for s in entries
            ],
        }
        click.echo(json.dumps(payload, indent=2, ensure_ascii=False))
        return int(ExitCode.OK)
    width = min(shutil.get_terminal_size((80, 24)).columns, 100)
    click.echo(f"Samples shipped with sdpa, in {samples_dir()}:")
    click.echo()
    for s in entries:
        text = _wrap(s.description, max(width - NAME_WIDTH - 2, 30))
        click.echo(f"  {s.name:<{NAME_WIDTH}}{text[0]}")
        for line in text[1:]:
            click.echo(" " * (NAME_WIDTH + 2) + line)
    click.echo()
    click.echo("Copy them here with `sdpa samples --copy .`; the --help examples then run as")
    click.echo("written (sdpa compute samples/scorecard.yaml). Or name one wherever a file is")
    click.echo("taken: sdpa compute sample:scorecard, sdpa inspect sample:cross.npz.")
    return int(ExitCode.OK)


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of ``width``, never breaking a shape, a list or ``x = 1``."""
    import re  # imported here: keeps sdpa --help fast
    import textwrap

    kept = re.sub(UNBROKEN, lambda m: m.group().replace(" ", "\0"), text)
    lines = textwrap.wrap(kept, width, break_on_hyphens=False, break_long_words=False)
    return [line.replace("\0", " ") for line in lines] or [""]
