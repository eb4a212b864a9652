"""The files a run writes (:mod:`sdpa_cli.api.outputs`): one table of their kinds, one
record of those asked for, one function writing them all or none; every command's
options for them read off the table."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import click
import pytest

from sdpa_cli.api.outputs import OUTPUT_FILES, Outputs, write_outputs
from sdpa_cli.cli import COMMANDS, cli
from sdpa_cli.errors import InputError


def test_the_record_holds_the_kinds_asked_for_in_the_tables_order() -> None:
    outputs = Outputs.given(svg="t.svg", report="r.json", junit=None, save="s.npz")
    assert "junit" not in outputs
    assert "report" in outputs
    assert outputs.wants("junit", "svg")
    assert not outputs.wants("html", "plot")
    assert outputs.flagged() == [
        ("--report", "r.json"),
        ("--save", "s.npz"),
        ("--export-svg", "t.svg"),
    ]
    with pytest.raises(ValueError, match="no output file 'sarif'; the kinds are junit, report"):
        Outputs.given(sarif="x.sarif")


def test_an_output_that_is_an_input_is_refused_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "q.npy").write_bytes(b"x")
    outputs = Outputs.given(report=str(tmp_path / "q.npy"))
    with pytest.raises(InputError, match="is the same file as the input"):
        outputs.check([str(tmp_path / "q.npy")])


def test_every_file_is_written_or_none(tmp_path: Path) -> None:
    def good(fh: BinaryIO) -> None:
        fh.write(b"{}")

    def broken(fh: BinaryIO) -> None:
        raise InputError(str(tmp_path / "r.xml"), "cannot be written")

    outputs = Outputs.given(report=str(tmp_path / "r.json"), junit=str(tmp_path / "r.xml"))
    with pytest.raises(InputError):
        write_outputs(outputs, {"report": good, "junit": broken})
    assert list(tmp_path.iterdir()) == []
    write_outputs(outputs, {"report": good, "junit": good, "save": broken})  # save: not asked for
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.xml"]
    with pytest.raises(KeyError):  # a kind asked for and no writer: a bug, not a quiet skip
        write_outputs(Outputs.given(svg=str(tmp_path / "t.svg")), {})


def _commands() -> list[tuple[str, click.Command]]:
    found = []
    for name in COMMANDS:
        command = cli.commands[name]
        if isinstance(command, click.Group):
            found += [(f"{name} {n}", c) for n, c in command.commands.items()]
        else:
            found.append((name, command))
    return found


@pytest.mark.parametrize(("name", "command"), _commands(), ids=lambda x: str(x).split()[0])
def test_every_commands_file_options_are_the_tables(name: str, command: click.Command) -> None:
    for param in command.params:
        if isinstance(param, click.Option) and param.name in OUTPUT_FILES:
            kind = OUTPUT_FILES[param.name]
            assert param.opts == [kind.flag], name
            assert param.metavar == kind.metavar, name


def test_a_check_run_writes_every_report_it_offers() -> None:
    """A new report format is its entry in OUTPUT_FILES and REPORTS and its writer:
    ``sdpa check`` and ``sdpa report merge`` offer it with no change of theirs."""
    from sdpa_cli.api.check import CheckRun
    from sdpa_cli.api.outputs import REPORTS

    assert set(CheckRun([]).writers()) == set(REPORTS)
    offered = {
        p.name
        for name in ("check", "report")
        for command in [cli.commands[name]]
        for c in ([command] if not isinstance(command, click.Group) else command.commands.values())
        for p in c.params
    }
    assert set(REPORTS) <= offered
