"""Thresholds from flags, ``sdpa.yaml`` and ``[tool.sdpa]`` in pyproject.toml.

Order: a flag wins over the config file, which wins over the defaults. The first
config file found is the one read: ``sdpa.yaml``, else pyproject.toml's ``[tool.sdpa]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sdpa_cli.check.settings import check_config, check_values
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.thresholds import thresholds
from sdpa_cli.errors import InputError, SpecError
from sdpa_cli.files.config import read_config

DEFAULTS = Thresholds(saturation=0.99, uniform=0.98, head_fraction=0.9, max_findings=50)
NO_FLAGS: dict[str, Any] = {}


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def test_no_config_file_gives_the_defaults(tmp_path: Path) -> None:
    assert read_config(str(tmp_path)) == (None, {})
    assert thresholds(NO_FLAGS, str(tmp_path)) == DEFAULTS


def test_sdpa_yaml_values_are_used(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "sdpa.yaml",
        "saturation: 0.95\nuniform: 0.9\nhead_fraction: 0.8\nmax_findings: 7\n",
    )
    assert read_config(str(tmp_path))[0] == str(path)
    assert thresholds(NO_FLAGS, str(tmp_path)) == Thresholds(0.95, 0.9, 0.8, 7)


def test_pyproject_tool_sdpa_is_used_without_sdpa_yaml(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "pyproject.toml",
        '[project]\nname = "x"\n\n[tool.sdpa]\nsaturation = 0.97\nmax_findings = 3\n',
    )
    source, _ = read_config(str(tmp_path))
    assert source == f"{path} [tool.sdpa]"
    assert thresholds(NO_FLAGS, str(tmp_path)) == Thresholds(0.97, 0.98, 0.9, 3)


def test_pyproject_without_a_tool_sdpa_table_gives_the_defaults(tmp_path: Path) -> None:
    write(tmp_path, "pyproject.toml", '[project]\nname = "x"\n\n[tool.ruff]\nline-length = 100\n')
    assert read_config(str(tmp_path)) == (None, {})
    assert thresholds(NO_FLAGS, str(tmp_path)) == DEFAULTS


def test_sdpa_yaml_wins_over_pyproject_as_a_whole(tmp_path: Path) -> None:
    """The first file found is the config: pyproject's settings are not merged in."""
    write(tmp_path, "sdpa.yaml", "saturation: 0.95\n")
    write(tmp_path, "pyproject.toml", "[tool.sdpa]\nsaturation = 0.97\nuniform = 0.9\n")
    assert thresholds(NO_FLAGS, str(tmp_path)) == Thresholds(0.95, 0.98, 0.9, 50)


def test_flags_win_over_the_config_file_and_none_keeps_it(tmp_path: Path) -> None:
    write(tmp_path, "sdpa.yaml", "saturation: 0.95\nuniform: 0.9\n")
    write(tmp_path, "pyproject.toml", "[tool.sdpa]\nhead-fraction = 0.7\n")
    flags = {"saturation": "0.999", "uniform": None, "head_fraction": None, "max_findings": "4"}
    assert thresholds(flags, str(tmp_path)) == Thresholds(0.999, 0.9, 0.9, 4)


def test_flags_win_over_pyproject(tmp_path: Path) -> None:
    write(tmp_path, "pyproject.toml", "[tool.sdpa]\nsaturation = 0.97\nuniform = 0.9\n")
    assert thresholds({"uniform": 0.95}, str(tmp_path)) == Thresholds(0.97, 0.95, 0.9, 50)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("sdpa.yaml", "head-fraction: 0.6\nmax-findings: 2\n"),
        ("pyproject.toml", "[tool.sdpa]\nhead-fraction = 0.6\nmax-findings = 2\n"),
    ],
)
def test_dash_spelling_is_accepted(tmp_path: Path, name: str, text: str) -> None:
    write(tmp_path, name, text)
    assert thresholds(NO_FLAGS, str(tmp_path)) == Thresholds(0.99, 0.98, 0.6, 2)


def test_quoted_numbers_are_read_as_numbers(tmp_path: Path) -> None:
    write(tmp_path, "sdpa.yaml", "saturation: '0.95'\nmax_findings: '12'\n")
    assert thresholds(NO_FLAGS, str(tmp_path)) == Thresholds(0.95, 0.98, 0.9, 12)


def test_boundaries_one_and_zero_findings_are_accepted(tmp_path: Path) -> None:
    write(tmp_path, "sdpa.yaml", "saturation: 1\nuniform: 1.0\nhead_fraction: 1\nmax_findings: 0\n")
    assert thresholds(NO_FLAGS, str(tmp_path)) == Thresholds(1.0, 1.0, 1.0, 0)


@pytest.mark.parametrize("name", ["sdpa.yaml", "pyproject.toml"])
def test_unknown_key_names_the_file_and_the_key(tmp_path: Path, name: str) -> None:
    text = "saturaton: 0.95\n" if name == "sdpa.yaml" else "[tool.sdpa]\nsaturaton = 0.95\n"
    path = write(tmp_path, name, text)
    with pytest.raises(SpecError) as info:
        thresholds(NO_FLAGS, str(tmp_path))
    message = str(info.value)
    assert str(path) in message
    assert "saturaton" in message
    assert "head-fraction" in message  # the known names are listed


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("saturation: 1.5", "saturation"),
        ("saturation: 0.5", "saturation"),  # one-hot needs more than half the weight
        ("saturation: .nan", "saturation"),
        ("saturation: yes", "saturation"),
        ("saturation: high", "saturation"),
        ("uniform: 0", "uniform"),
        ("uniform: -0.1", "uniform"),
        ("head_fraction: 0", "head_fraction"),
        ("head-fraction: 1.01", "head-fraction"),
        ("max_findings: -1", "max_findings"),
        ("max_findings: 2.5", "max_findings"),
        ("max_findings: true", "max_findings"),
        ("max_findings: many", "max_findings"),
    ],
)
def test_out_of_range_or_mistyped_values_are_refused(tmp_path: Path, line: str, key: str) -> None:
    path = write(tmp_path, "sdpa.yaml", line + "\n")
    with pytest.raises(SpecError) as info:
        thresholds(NO_FLAGS, str(tmp_path))
    assert info.value.where == f"{path}: {key}"


@pytest.mark.parametrize(
    ("flags", "where"),
    [
        ({"saturation": "1.5"}, "--saturation"),
        ({"uniform": "0"}, "--uniform"),
        ({"head_fraction": "x"}, "--head-fraction"),
        ({"max_findings": "-3"}, "--max-findings"),
    ],
)
def test_bad_flag_values_name_the_flag(tmp_path: Path, flags: dict[str, Any], where: str) -> None:
    with pytest.raises(SpecError) as info:
        thresholds(flags, str(tmp_path))
    assert info.value.where == where


@pytest.mark.parametrize(
    "text",
    [
        "saturation: [0.9\n",  # invalid YAML
        "- 0.95\n- 0.9\n",  # a list, not a mapping
        "just text\n",  # a scalar
    ],
)
def test_invalid_or_non_mapping_yaml_is_an_input_error(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, "sdpa.yaml", text)
    with pytest.raises(InputError) as info:
        thresholds(NO_FLAGS, str(tmp_path))
    assert info.value.where == str(path)


@pytest.mark.parametrize(
    "text",
    [
        "[tool.sdpa\nsaturation = 0.9\n",  # invalid TOML
        "[tool]\nsdpa = 3\n",  # not a table
    ],
)
def test_invalid_pyproject_is_an_input_error(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, "pyproject.toml", text)
    with pytest.raises(InputError) as info:
        thresholds(NO_FLAGS, str(tmp_path))
    assert info.value.where == str(path)


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_sdpa_yaml_gives_the_defaults(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, "sdpa.yaml", text)
    assert read_config(str(tmp_path)) == (str(path), {})
    assert thresholds(NO_FLAGS, str(tmp_path)) == DEFAULTS


# --- sdpa check's section: `check:` in sdpa.yaml, [tool.sdpa.check] in pyproject.toml ---


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "sdpa.yaml",
            "saturation: 0.95\ncheck:\n  rtol: 1e-4\n  atol: 2e-5\n  fail-on: [nonfinite, fully_masked]\n",
        ),
        (
            "pyproject.toml",
            '[tool.sdpa]\nsaturation = 0.95\n\n[tool.sdpa.check]\nrtol = 1e-4\natol = 2e-5\nfail-on = "nonfinite,fully_masked"\n',
        ),
    ],
)
def test_the_check_section_sits_beside_the_thresholds(tmp_path: Path, name: str, text: str) -> None:
    """The thresholds ignore the check section; check_config reads only it."""
    write(tmp_path, name, text)
    assert thresholds(NO_FLAGS, str(tmp_path)) == Thresholds(0.95, 0.98, 0.9, 50)
    assert check_config(str(tmp_path)) == {
        "rtol": 1e-4,
        "atol": 2e-5,
        "fail_on": ("nonfinite", "fully_masked"),
    }


def test_no_check_section_gives_no_check_settings(tmp_path: Path) -> None:
    write(tmp_path, "sdpa.yaml", "saturation: 0.95\n")
    assert check_config(str(tmp_path)) == {}


def test_every_check_setting_is_parsed() -> None:
    raw = {
        "rtol": "1e-3",
        "atol": 0,
        "reference": "float64",
        "tolerance": "measured",
        "fudge": 3,
        "fail-on": "none",
        "fail_on_severity": "warning",
        "equal-nan": True,
    }
    assert check_values(raw, "sdpa.yaml: check") == {
        "rtol": 1e-3,
        "atol": 0.0,
        "reference": "float64",
        "tolerance": "measured",
        "fudge": 3.0,
        "fail_on": (),
        "fail_on_severity": "warning",
        "equal_nan": True,
    }


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ({"rtoll": 1e-3}, "sdpa.yaml: check: rtoll"),
        ({"rtol": "tight"}, "sdpa.yaml: check: rtol"),
        ({"equal-nan": "yes"}, "sdpa.yaml: check: equal-nan"),
        ({"fail-on": 3}, "sdpa.yaml: check: fail-on"),
    ],
)
def test_bad_check_settings_name_the_file_and_key(raw: dict[str, Any], where: str) -> None:
    with pytest.raises(SpecError) as info:
        check_values(raw, "sdpa.yaml: check")
    assert info.value.where == where


def test_bad_check_flags_name_the_flag() -> None:
    with pytest.raises(SpecError) as info:
        check_values({"fudge": "lots"})
    assert info.value.where == "--fudge"


def test_a_check_section_that_is_not_a_mapping_is_an_input_error(tmp_path: Path) -> None:
    path = write(tmp_path, "sdpa.yaml", "check: strict\n")
    with pytest.raises(InputError) as info:
        check_config(str(tmp_path))
    assert info.value.where == f"{path}: check"


# --- a broken config file is exit 2 naming it, never an internal error -----------------------


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"tool = 3\n", "[tool] must be a table, got int"),
        (b'[tool.sdpa]\nsaturation = "\xff"\n', "is not UTF-8 text"),
        (b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", "is nested too deeply"),
        (
            b"[tool.sdpa\n",
            "not valid TOML: Expected ']' at the end of a table declaration (at line 1, column 11)",
        ),
    ],
)
def test_a_broken_pyproject_is_an_input_error_naming_it(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    """``tool = 3`` was exit 3 (AttributeError), a 5,000-deep array a RecursionError."""
    path = tmp_path / "pyproject.toml"
    path.write_bytes(content)
    with pytest.raises(InputError) as info:
        read_config(str(tmp_path))
    assert (info.value.where, info.value.problem) == (str(path), problem)


def test_a_deeply_nested_sdpa_yaml_is_an_input_error(tmp_path: Path) -> None:
    path = write(tmp_path, "sdpa.yaml", "saturation: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(InputError) as info:
        read_config(str(tmp_path))
    assert str(info.value) == f"{path}: is nested too deeply"


def test_a_duplicate_key_in_sdpa_yaml_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "sdpa.yaml", "saturation: 0.5\nsaturation: 0.9\n")
    with pytest.raises(InputError) as info:
        read_config(str(tmp_path))
    assert str(info.value) == f"{path}: invalid YAML at line 2 column 1: duplicate key 'saturation'"


def test_a_config_that_is_a_fifo_or_device_does_not_hang(tmp_path: Path) -> None:
    (tmp_path / "sdpa.yaml").symlink_to("/dev/zero")
    with pytest.raises(InputError) as info:
        read_config(str(tmp_path))
    assert info.value.problem == "is a character device, not a regular file"


# --- discovery upward, as ruff and pytest do; --config FILE ---------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository ``repo/`` (holding ``.git``) with a folder ``repo/a/b``."""
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "repo" / "a" / "b").mkdir(parents=True)
    return tmp_path / "repo"


def test_the_config_is_found_upward_to_the_repository_root(repo: Path) -> None:
    path = write(repo, "sdpa.yaml", "saturation: 0.5\n")
    assert read_config(str(repo / "a" / "b")) == (str(path), {"saturation": 0.5})


def test_the_nearest_config_wins(repo: Path) -> None:
    write(repo, "sdpa.yaml", "saturation: 0.5\n")
    near = write(repo / "a", "pyproject.toml", "[tool.sdpa]\nsaturation = 0.7\n")
    assert read_config(str(repo / "a" / "b")) == (f"{near} [tool.sdpa]", {"saturation": 0.7})


def test_a_pyproject_without_tool_sdpa_is_passed_over(repo: Path) -> None:
    path = write(repo, "sdpa.yaml", "saturation: 0.5\n")
    write(repo / "a", "pyproject.toml", '[project]\nname = "x"\n')
    assert read_config(str(repo / "a"))[0] == str(path)


def test_the_search_stops_at_the_repository_root(repo: Path) -> None:
    write(repo.parent, "sdpa.yaml", "saturation: 0.5\n")  # outside the repository
    assert read_config(str(repo / "a")) == (None, {})


def test_the_search_stops_at_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / "project").mkdir(parents=True)
    write(tmp_path, "sdpa.yaml", "saturation: 0.5\n")  # above home
    monkeypatch.setenv("HOME", str(home))
    assert read_config(str(home / "project")) == (None, {})


def test_found_from_the_working_directory_it_is_named_relative(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(repo, "sdpa.yaml", "saturation: 0.5\n")
    monkeypatch.chdir(repo / "a" / "b")
    assert read_config()[0] == "../../sdpa.yaml"


def test_config_option_reads_the_file_named(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clirunner import invoke

    custom = write(repo / "a", "strict.yaml", "max_findings: bad\n")
    monkeypatch.chdir(repo)
    (repo / "q.yaml").write_text("q: [[1.0]]\nk: [[1.0]]\nv: [[1.0]]\n")
    got = invoke("compute", "q.yaml", "--config", str(custom))
    assert got.exit_code == 2
    assert got.stderr.startswith(f"sdpa: error: {custom}: max_findings")
    assert invoke("compute", "q.yaml").exit_code == 0  # no --config: nothing found


def test_config_option_naming_a_pyproject_without_the_section_is_an_error(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clirunner import assert_one_error_line, invoke

    write(repo, "pyproject.toml", '[project]\nname = "x"\n')
    monkeypatch.chdir(repo)
    (repo / "q.yaml").write_text("q: [[1.0]]\nk: [[1.0]]\nv: [[1.0]]\n")
    line = assert_one_error_line(invoke("check", "q.yaml", "--config", "pyproject.toml"))
    assert line == "sdpa: error: pyproject.toml: has no [tool.sdpa] table"
