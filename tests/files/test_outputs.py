"""Tests of the outputs' check: an output that is one of the inputs (however named) or
another output is refused before anything is computed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sdpa_cli.api.case import Case
from sdpa_cli.api.outputs import Outputs
from sdpa_cli.errors import InputError
from sdpa_cli.files.outputs import check_outputs


@pytest.fixture
def q(workdir: Path) -> Path:
    path = workdir / "q.npy"
    path.write_bytes(b"Q")
    return path


def test_same_string(q: Path) -> None:
    with pytest.raises(InputError) as exc:
        check_outputs([("input", "q.npy")], [("--save", "q.npy")])
    assert str(exc.value) == (
        "--save q.npy: is the same file as the input q.npy; writing it would destroy it"
    )


@pytest.mark.parametrize("alias", ["./q.npy", "sub/../q.npy", "link.npy", "hard.npy"])
def test_other_names_of_the_same_file(q: Path, alias: str) -> None:
    (q.parent / "sub").mkdir()
    (q.parent / "link.npy").symlink_to("q.npy")
    os.link(q, q.parent / "hard.npy")
    with pytest.raises(InputError, match=r"same file as the input q\.npy"):
        check_outputs([("input", "q.npy")], [("--save", alias)])


def test_named_array_inside_a_file(workdir: Path) -> None:
    (workdir / "x.npz").write_bytes(b"PK")
    with pytest.raises(InputError, match=r"the input x\.npz:q"):
        check_outputs([("input", "x.npz:q")], [("--save", "x.npz")])


def test_two_outputs_that_do_not_exist_yet(workdir: Path) -> None:
    with pytest.raises(InputError) as exc:
        check_outputs([], [("--junit", "r"), ("--report", "./r")])
    assert str(exc.value) == "--report ./r: is the same file as --junit r; one report would be lost"


def test_flags_naming_files_are_inputs(q: Path) -> None:
    case = Case(("a.npy", "k.npy", "v.npy"), tensors={"sinks": "q.npy"}, options={"causal": True})
    with pytest.raises(InputError, match=r"--save q\.npy"):
        Outputs.given(save="q.npy").check(case.files())


def test_distinct_files_devices_urls_and_missing_inputs_pass(q: Path) -> None:
    check_outputs(
        [("input", p) for p in ("q.npy", "missing.npy", "s3://bucket/q.npy", None)],
        [("--save", "out.npz"), ("--report", os.devnull), ("--junit", os.devnull), ("--x", None)],
    )


def test_empty_output_name(q: Path) -> None:
    with pytest.raises(InputError) as exc:
        check_outputs([], [("--save", "")])
    assert str(exc.value) == "--save: the file name is empty"


def test_directory_is_refused_before_the_work(workdir: Path) -> None:
    with pytest.raises(InputError) as exc:
        check_outputs([], [("--save", str(workdir))])
    assert str(exc.value) == f"{workdir}: is a directory; expected a file name"
