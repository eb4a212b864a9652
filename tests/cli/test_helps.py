"""Help that fits a screen: every command's default ``--help`` is at most 60 lines at
80 columns, its lines fit them, its first options come in named groups, and every
example it shows runs as typed in an empty folder (``sample:NAME`` names the shipped
samples from anywhere). ``--help-all`` shows everything."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import click
import pytest
from clirunner import clean_environ, invoke, sdpa_executable

from sdpa_cli.cli import cli
from sdpa_cli.cli.helps import COMMON, MOST_LINES, short_help_text

COMMANDS = [
    *(name for name in cli.commands if name != "report"),
    "report merge",
    "report model",
]

TEMPLATES = {
    "capture": "its examples run a program of the user's (python generate.py ...)",
    "completion": "its example writes into the user's shell configuration",
}
"""Commands whose examples are templates to fill in, not runs."""


def examples(text: str) -> list[str]:
    """The example command lines a default help shows, from its command's docstring."""
    shown = short_help_text(text)
    return [line.strip() for line in shown.splitlines() if line.strip().startswith("sdpa ")]


def command(path: str) -> click.Command:
    found: click.Command = cli
    for part in path.split():
        assert isinstance(found, click.Group)
        found = found.commands[part]
    return found


def help_text(path: str, *extra: str) -> str:
    result = invoke(*path.split(), "--help", *extra, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("path", COMMANDS)
def test_the_default_help_fits_a_screen(path: str) -> None:
    lines = help_text(path).splitlines()
    assert len(lines) <= MOST_LINES, (path, len(lines))
    assert [line for line in lines if len(line) > 80] == []


@pytest.mark.parametrize("path", [p for p in COMMANDS if p.split()[-1] in COMMON])
def test_the_first_options_come_in_named_groups_and_the_rest_behind_help_all(
    path: str,
) -> None:
    short = help_text(path)
    for title, _ in COMMON[path.split()[-1]]:
        assert f"\n{title}:\n" in short, title
    assert f"more options: sdpa {path} --help-all" in short
    everything = invoke(*path.split(), "--help-all", env={"COLUMNS": "80"})
    assert everything.exit_code == 0
    assert "Every other option:" in everything.stdout
    assert len(everything.stdout.splitlines()) > len(short.splitlines())
    for param in command(path).params:  # every option is in one of the two
        for flag in getattr(param, "opts", []):
            if flag.startswith("--"):
                assert flag in everything.stdout, flag


@pytest.mark.e2e
@pytest.mark.parametrize("path", [p for p in COMMANDS if p not in TEMPLATES])
def test_every_example_the_help_shows_runs_in_an_empty_folder(path: str, tmp_path: Path) -> None:
    shown = examples(command(path).help or "")
    assert shown, f"sdpa {path} --help shows no example"
    for line in shown:  # in order: an example may read what an earlier one wrote
        proc = subprocess.run(
            [sdpa_executable(), *shlex.split(line)[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=clean_environ(COLUMNS="80"),
            timeout=300,
        )
        # 1: a check that fails by design (a sample's planted bug) is a run, not a stumble
        assert proc.returncode in (0, 1), (line, proc.returncode, proc.stderr)
