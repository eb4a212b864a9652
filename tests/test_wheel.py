"""The wheel: what tests/wheel_smoke.py (make test-wheel) reads from the help, and what
a wheel built from the sources holds. The smoke test itself installs the wheel into a
clean venv and runs every --help example; too slow for make test."""

from __future__ import annotations

import email
import shlex
import shutil
import time
import zipfile
from pathlib import Path

import click
import pytest
from clirunner import invoke
from wheel_smoke import (
    ROOT,
    SmokeError,
    build,
    example_lines,
    needed_files,
    subcommands,
    wheel_problems,
    why_skipped,
)

from sdpa_cli.cli import cli

HELP = """Usage: sdpa thing [OPTIONS]

  Do a thing.

  Example:
    sdpa compute samples/scorecard.yaml
    sdpa explain q.npy k.npy v.npy --rows 100:116

  Some prose that mentions sdpa compute x.npy but is no example.

  Examples:
    sdpa check --manifest m.yaml --junit report.xml
    python -c 'not sdpa'

Options:
  --help  Show this message and exit.
"""


def test_examples_are_the_sdpa_lines_of_the_example_blocks() -> None:
    assert example_lines(HELP) == [
        "sdpa compute samples/scorecard.yaml",
        "sdpa explain q.npy k.npy v.npy --rows 100:116",
        "sdpa check --manifest m.yaml --junit report.xml",
    ]


def test_subcommands_are_read_from_the_groups_help() -> None:
    assert subcommands(invoke("--help", env={"COLUMNS": "80"}).stdout) == sorted(cli.commands)
    assert subcommands(invoke("report", "--help").stdout) == ["merge", "model"]
    assert subcommands(invoke("compute", "--help").stdout) == []


def test_inputs_are_files_read_not_written_nor_option_values() -> None:
    argv = shlex.split(
        "sdpa check q.npy k.npy v.npy --expect-output out.npy --junit report.xml "
        "--report r.json --shard 2/4 --rows 100:116 --cluster tcp://10.0.0.5:8786"
    )
    assert needed_files(argv) == ["q.npy", "k.npy", "v.npy", "out.npy"]
    member = shlex.split("sdpa inspect model.safetensors:layers.0.attn.q samples/cross.npz:q")
    assert needed_files(member) == ["model.safetensors", "samples/cross.npz"]


def test_an_example_is_skipped_for_a_missing_input_or_what_a_clean_install_lacks(
    tmp_path: Path,
) -> None:
    (tmp_path / "q.npy").write_bytes(b"")
    assert why_skipped(shlex.split("sdpa compute q.npy q.npy q.npy"), tmp_path) is None
    assert why_skipped(shlex.split("sdpa compute q.npy k.npy v.npy"), tmp_path) == "no k.npy, v.npy"
    assert why_skipped(shlex.split("sdpa samples --copy ."), tmp_path) is None
    assert why_skipped(
        shlex.split("sdpa check --manifest q.npy --cluster tcp://h:1"), tmp_path
    ) == ("needs a running Dask scheduler")
    assert why_skipped(shlex.split("sdpa capture --out r -- -m pkg"), tmp_path) == (
        "runs a model script under PyTorch"
    )


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, command in group.commands.items():
        found.append((*path, name))
        if isinstance(command, click.Group):
            found += _commands(command, (*path, name))
    return found


def test_every_help_example_calls_a_command_sdpa_has() -> None:
    """The smoke test runs these lines as written: each must name a real command."""
    lines = example_lines(invoke("--help").stdout)
    for words in _commands(cli):
        lines += example_lines(invoke(*words, "--help").stdout)
        lines += example_lines(invoke(*words, "--help-all").stdout)
    assert len(lines) > 20
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "sdpa", line
        assert argv[1] in cli.commands, line


@pytest.mark.e2e
def test_a_wheel_built_from_the_sources_holds_samples_py_typed_and_license(
    tmp_path: Path,
) -> None:
    """sdist, then the wheel from it, as pip and make test-wheel build them (with this
    venv's setuptools: nothing downloaded), in a copy of the sources so nothing is
    written into the repository. build() raises on any setuptools warning."""
    pytest.importorskip("build", reason="the dev extra installs build")
    source = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("sdpa_cli", "samples"):
        shutil.copytree(ROOT / folder, source / folder, ignore=skip)
    for name in (
        "pyproject.toml",
        "setup.py",
        "MANIFEST.in",
        "LICENSE",
        "README.md",
        "CHANGELOG.md",
    ):
        shutil.copy(ROOT / name, source / name)
    started = time.monotonic()
    try:
        wheel = build(tmp_path / "dist", source, isolated=False)
    except SmokeError as exc:
        pytest.fail(str(exc))
    assert time.monotonic() - started < 60
    assert wheel_problems(wheel) == []
    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = (n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(metadata))
        license_text = zf.read(metadata.replace("METADATA", "licenses/LICENSE")).decode()
    assert meta["License-Expression"] == "MIT"
    assert license_text == (ROOT / "LICENSE").read_text(encoding="utf-8")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert sorted(urls) == ["Changelog", "Documentation", "Homepage", "Issues", "Repository"]
    assert "docs" in (meta.get_all("Provides-Extra") or [])
