"""Files named inside other files stay in their folder tree (a manifest from a pull
request reads only its own tree), unless ``--allow-outside``; and what such files hold
is not echoed into messages and reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from clirunner import assert_one_error_line, invoke, strict_json

from sdpa_cli.errors import InputError
from sdpa_cli.files.confine import allow_outside, confine, outside_allowed
from sdpa_cli.text import shown, unechoed

SECRET = "hunter2-api-token"


@pytest.fixture(autouse=True)
def _confined() -> None:
    allow_outside(False)


def _tensors(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in (("q", [[1.0, 0.0]]), ("k", [[1.0, 0.0], [2.0, 0.0]])):
        np.save(folder / f"{name}.npy", np.array(value))
    np.save(folder / "v.npy", np.array([[1.0, 0.0], [0.0, 1.0]]))


def _case(folder: Path, q: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    case = folder / "case.yaml"
    case.write_text(f"q: {json.dumps(q)}\nk: k.npy\nv: v.npy\n")
    _tensors(folder)
    return case


@pytest.mark.parametrize("named", ["../outside/q.npy", "ABSOLUTE"])
def test_a_case_file_may_not_name_a_file_outside_its_folder(tmp_path: Path, named: str) -> None:
    _tensors(tmp_path / "outside")
    if named == "ABSOLUTE":
        named = str(tmp_path / "outside" / "q.npy")
    case = _case(tmp_path / "pr", named)
    line = assert_one_error_line(invoke("compute", str(case)))
    assert line.startswith(f"sdpa: error: {case}: q: ")
    assert "is outside the folder" in line
    assert "--allow-outside" in line
    result = invoke("compute", str(case), "--allow-outside", "--format", "json")
    assert result.exit_code == 0, result.output
    assert strict_json(result.stdout)["output"][0] == pytest.approx(
        [0.330_238, 0.669_762], abs=1e-6
    )


def test_a_symlink_leading_out_of_the_folder_is_outside(tmp_path: Path) -> None:
    _tensors(tmp_path / "outside")
    case = _case(tmp_path / "pr", "q.npy")
    (tmp_path / "pr" / "q.npy").unlink()
    (tmp_path / "pr" / "q.npy").symlink_to(tmp_path / "outside" / "q.npy")
    assert "is outside the folder" in assert_one_error_line(invoke("compute", str(case)))


def test_subfolders_and_members_stay_inside(tmp_path: Path) -> None:
    _tensors(tmp_path / "pr" / "deep")
    np.savez(tmp_path / "pr" / "deep" / "all.npz", q=np.array([[1.0, 0.0]]))
    case = _case(tmp_path / "pr", "deep/all.npz:q")
    result = invoke("compute", str(case), "--format", "json")
    assert result.exit_code == 0, result.output


def test_a_manifest_may_not_reach_out_or_name_urls(tmp_path: Path) -> None:
    _tensors(tmp_path / "outside")
    (tmp_path / "pr").mkdir()
    _tensors(tmp_path / "pr")
    manifest = tmp_path / "pr" / "m.yaml"
    manifest.write_text("cases:\n  - {name: a, q: ../outside/q.npy, k: k.npy, v: v.npy}\n")
    line = assert_one_error_line(invoke("check", "--manifest", str(manifest)))
    assert f"{manifest}: cases[1]: q: '../outside/q.npy' is outside the folder" in line
    assert invoke("check", "--manifest", str(manifest), "--allow-outside").exit_code == 0
    manifest.write_text("cases:\n  - {name: a, q: 'http://10.0.0.1/q.npy', k: k.npy, v: v.npy}\n")
    line = assert_one_error_line(invoke("check", "--manifest", str(manifest)))
    assert "q: names a URL" in line


def test_a_partials_list_may_not_reach_out(tmp_path: Path) -> None:
    _tensors(tmp_path / "pr")
    np.save(tmp_path / "out.npy", np.zeros((1, 2)))
    listing = tmp_path / "pr" / "partials.yaml"
    listing.write_text("- {keys: '0:2', output: ../out.npy, lse: lse.npy}\n")
    pr = tmp_path / "pr"
    result = invoke(
        "check",
        str(pr / "q.npy"),
        str(pr / "k.npy"),
        str(pr / "v.npy"),
        "--expect-partials",
        str(listing),
    )
    assert "partial 0: output: '../out.npy' is outside the folder" in assert_one_error_line(result)


def test_what_a_manifests_files_hold_is_not_echoed(tmp_path: Path) -> None:
    """A tensor file holding a string: the error row says what kind of value, not the
    value, so a manifest cannot copy a file's content into a public CI log."""
    _tensors(tmp_path)
    (tmp_path / "q.json").write_text(json.dumps([[SECRET, 0.0]]))
    manifest = tmp_path / "m.yaml"
    manifest.write_text("cases:\n  - {name: a, q: q.json, k: k.npy, v: v.npy}\n")
    result = invoke("check", "--manifest", str(manifest), "--format", "json")
    assert result.exit_code == 2
    error = strict_json(result.stdout)["cases"][0]["error"]
    assert "expected a number" in error
    assert "content not shown" in error
    assert SECRET not in result.output
    # named on the command line, the same file's value is shown: the user named it
    direct = invoke(
        "compute", str(tmp_path / "q.json"), str(tmp_path / "k.npy"), str(tmp_path / "v.npy")
    )
    assert SECRET in assert_one_error_line(direct)


def test_shown_says_only_the_kind_when_unechoed() -> None:
    assert shown(SECRET) == repr(SECRET)
    with unechoed():
        assert shown(SECRET) == "a str of length 17 (content not shown)"
        assert shown(3.5) == "a float (content not shown)"
    assert shown([1, 2]) == "[1, 2]"


def test_confine_is_lifted_for_the_run_only_when_allowed(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    with pytest.raises(InputError, match="outside the folder"):
        confine("../b.npy", tmp_path / "a" / ".." / "b.npy", tmp_path / "a", "x.yaml: q")
    allow_outside(True)
    assert outside_allowed()
    confine("../b.npy", tmp_path / "b.npy", tmp_path / "a", "x.yaml: q")  # no error


def test_a_manifests_case_files_share_the_manifests_tree(tmp_path: Path) -> None:
    """A case file in a subfolder may read tensors elsewhere under the manifest's folder,
    and nothing above it."""
    _tensors(tmp_path / "pr" / "shared")
    _tensors(tmp_path / "outside")
    (tmp_path / "pr" / "cases").mkdir()
    case = tmp_path / "pr" / "cases" / "c.yaml"
    case.write_text("q: ../shared/q.npy\nk: ../shared/k.npy\nv: ../shared/v.npy\n")
    manifest = tmp_path / "pr" / "m.yaml"
    manifest.write_text("cases:\n  - {name: a, case: cases/c.yaml}\n")
    assert invoke("check", "--manifest", str(manifest)).exit_code == 0
    case.write_text("q: ../../outside/q.npy\nk: ../shared/k.npy\nv: ../shared/v.npy\n")
    result = invoke("check", "--manifest", str(manifest), "--format", "json")
    error = strict_json(result.stdout)["cases"][0]["error"]
    # the path is the case file's content, which the user did not name: not echoed
    assert "c.yaml: q: a str of length 19 (content not shown) is outside the folder" in error
    assert error.endswith("of the manifest; give --allow-outside to read files outside it")


def test_a_path_in_a_case_file_a_manifest_names_is_not_echoed(tmp_path: Path) -> None:
    """A string that names no file: the entry is named, not the string."""
    _tensors(tmp_path)
    (tmp_path / "leak.json").write_text(json.dumps({"q": SECRET, "k": "k.npy", "v": "v.npy"}))
    (tmp_path / "m.yaml").write_text("cases:\n  - {name: c1, case: leak.json}\n")
    result = invoke("check", "--manifest", str(tmp_path / "m.yaml"), "--format", "json")
    error = strict_json(result.stdout)["cases"][0]["error"]
    assert error == f"{tmp_path / 'leak.json'}: q: no such file"
    assert SECRET not in result.output
