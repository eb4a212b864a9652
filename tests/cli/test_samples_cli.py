"""sdpa samples: the shipped samples listed, located and copied; sample:NAME as a file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from clirunner import CLEAN_ENV, assert_one_error_line, invoke

from sdpa_cli.cli import SdpaGroup, cli
from sdpa_cli.cli.samples import samples
from sdpa_cli.files.samples import catalog, sample_files

REPO_SAMPLES = Path(__file__).resolve().parents[2] / "samples"
# The command in a group of its own, so that these tests do not depend on where the
# sdpa group registers it; errors reach the exit code through the same SdpaGroup.
GROUP = SdpaGroup(name="sdpa", commands={"samples": samples})


def run(*args: str, columns: int = 100) -> Result:
    runner = CliRunner(env={**CLEAN_ENV, "COLUMNS": str(columns)})
    return runner.invoke(GROUP, ["samples", *args], catch_exceptions=False)


def test_sdpa_has_the_samples_command() -> None:
    assert cli.commands.get("samples") is samples


def test_the_list_names_and_describes_every_sample_within_80_columns() -> None:
    result = run(columns=80)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"Samples shipped with sdpa, in {REPO_SAMPLES}:"
    assert max(len(line) for line in lines[1:]) <= 80
    entries: dict[str, str] = {}
    for line in lines[2:]:
        if line.startswith("  ") and line[2] != " ":
            name, described = line.split(maxsplit=1)
            entries[name] = described
        elif line.startswith(" " * 23):
            entries[name] += " " + line.strip()
        else:
            break
    assert entries == {s.name: s.description for s in catalog()}
    assert entries["batched_{q,k,v}.npy"] == (
        "float64 tensors: q (2, 4, 6, 8), k (2, 2, 6, 8), v (2, 2, 6, 4)"
    )
    assert "sdpa samples --copy ." in result.stdout
    assert result.stderr == ""


def test_the_list_as_json() -> None:
    result = run("--format", "json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["folder"] == str(REPO_SAMPLES)
    assert [s["name"] for s in doc["samples"]] == [s.name for s in catalog()]
    scorecard = next(s for s in doc["samples"] if s["name"] == "scorecard")
    assert scorecard["files"] == ["scorecard.yaml"]


def test_path_prints_the_folder_alone() -> None:
    result = run("--path")
    assert (result.exit_code, result.stdout) == (0, f"{REPO_SAMPLES}\n")


def test_copy_then_the_help_examples_run_from_that_folder(workdir: Path) -> None:
    result = run("--copy", ".")
    assert result.exit_code == 0, result.output
    n = len(sample_files())
    assert result.stdout == (
        f"copied {n} files to samples\ntry: sdpa compute {Path('samples', 'scorecard.yaml')}\n"
    )
    assert (
        sorted(
            p.relative_to(workdir / "samples").as_posix()
            for p in (workdir / "samples").rglob("*")
            if p.is_file()
        )
        == sample_files()
    )
    computed = invoke("compute", "samples/scorecard.yaml", "--format", "json")
    assert computed.exit_code == 0, computed.output
    assert json.loads(computed.stdout)["output"] == [pytest.approx([8.829123, 0.858154])]
    assert invoke("inspect", "samples/cross.npz").exit_code == 0


def test_copy_refuses_to_overwrite_without_force(workdir: Path) -> None:
    assert run("--copy", "out").exit_code == 0
    (workdir / "out" / "samples" / "scorecard.yaml").write_text("mine", encoding="utf-8")
    line = assert_one_error_line(run("--copy", "out"))
    assert line.startswith(f"sdpa: error: {Path('out', 'samples')}: already holds ")
    assert line.endswith(" more; --force overwrites the samples' files")
    assert (workdir / "out" / "samples" / "scorecard.yaml").read_text(encoding="utf-8") == "mine"
    assert run("--copy", "out", "--force").exit_code == 0
    copied = (workdir / "out" / "samples" / "scorecard.yaml").read_bytes()
    assert copied == (REPO_SAMPLES / "scorecard.yaml").read_bytes()


def test_copy_into_a_file_is_bad_usage(workdir: Path) -> None:
    (workdir / "f").write_text("x", encoding="utf-8")
    line = assert_one_error_line(run("--copy", "f"))
    assert line == "sdpa: error: Invalid value for '--copy': Directory 'f' is a file."


def test_a_sample_name_is_taken_wherever_a_file_is(workdir: Path) -> None:
    """Needs files/loaders.py (Source.parse) and files/cases.py (is_case_file) to pass
    their text through sdpa_cli.files.samples.expand."""
    by_name = invoke("compute", "sample:scorecard", "--format", "json", "--stages", "output")
    assert by_name.exit_code == 0, by_name.output
    assert json.loads(by_name.stdout)["output"] == [pytest.approx([8.829123, 0.858154])]
    member = invoke("inspect", "sample:cross.npz:q", "--format", "json")
    assert member.exit_code == 0, member.output
    unknown = assert_one_error_line(invoke("compute", "sample:nope"))
    assert unknown.startswith("sdpa: error: sample:nope: no such sample; known: causal, ")


def test_copy_into_an_empty_name_is_refused(workdir: Path) -> None:
    """Path('') is '.': the copy used to land in the current folder."""
    line = assert_one_error_line(run("--copy", ""))
    assert line == "sdpa: error: --copy: the folder name is empty"
    assert list(workdir.iterdir()) == []


def test_copy_never_writes_through_links_planted_in_the_folder(workdir: Path) -> None:
    victim = workdir / "victim.txt"
    victim.write_text("VICTIM", encoding="utf-8")
    (workdir / "victimdir").mkdir()
    (workdir / "victimdir" / "q.npy").write_text("V2", encoding="utf-8")
    (workdir / "cp1" / "samples").mkdir(parents=True)
    (workdir / "cp1" / "samples" / "causal.yaml").symlink_to(victim)
    (workdir / "cp1" / "samples" / "check").symlink_to(workdir / "victimdir")
    line = assert_one_error_line(run("--copy", "cp1", "--force"))
    assert line == (
        f"sdpa: error: {Path('cp1', 'samples', 'check')}: is a symbolic link; "
        "the samples are copied only into real folders"
    )
    assert [p.name for p in (workdir / "victimdir").iterdir()] == ["q.npy"]
    assert (workdir / "victimdir" / "q.npy").read_text(encoding="utf-8") == "V2"
    assert victim.read_text(encoding="utf-8") == "VICTIM"
    (workdir / "cp1" / "samples" / "check").unlink()
    assert run("--copy", "cp1", "--force").exit_code == 0
    copied = workdir / "cp1" / "samples" / "causal.yaml"
    assert not copied.is_symlink()
    assert copied.read_bytes() == (REPO_SAMPLES / "causal.yaml").read_bytes()
    assert victim.read_text(encoding="utf-8") == "VICTIM"
