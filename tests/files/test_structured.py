"""Tests of sdpa_cli.files.structured: duplicate keys refused, the C loader kept safe
(no aliases, a bounded depth), and the per-format caps on text inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from clirunner import assert_one_error_line, invoke

from sdpa_cli.engine.options import OPTION_NAMES
from sdpa_cli.errors import InputError
from sdpa_cli.files import structured
from sdpa_cli.files.cases import load_case
from sdpa_cli.files.loaders import load_array
from sdpa_cli.files.structured import TEXT_CAPS, parse_json, parse_text, parse_yaml


def problem(text: str, fmt: str) -> str:
    with pytest.raises(InputError) as info:
        (parse_json if fmt == "json" else parse_yaml)(text, "f")
    return info.value.problem


# --- duplicate keys ----------------------------------------------------------------------


def test_a_duplicate_json_key_is_refused_naming_it() -> None:
    """json keeps the last value silently: {"causal": false, "causal": true} is causal."""
    assert problem('{"q": 1, "causal": false, "causal": true}', "json") == (
        "duplicate key 'causal' in a JSON object"
    )
    assert problem('[{"a": 1}, {"b": {"x": 1, "x": 2}}]', "json") == (
        "duplicate key 'x' in a JSON object"
    )


def test_a_duplicate_yaml_key_is_refused_naming_it_and_its_line() -> None:
    assert problem("q: [1]\ncausal: false\ncausal: true\n", "yaml") == (
        "invalid YAML at line 3 column 1: duplicate key 'causal'"
    )
    assert problem("a:\n  b: {x: 1, x: 2}\n", "yaml") == (
        "invalid YAML at line 2 column 13: duplicate key 'x'"
    )


def test_keys_equal_as_values_are_duplicates() -> None:
    assert problem("1: a\n1.0: b\n", "yaml") == "invalid YAML at line 2 column 1: duplicate key 1.0"


def test_unique_keys_still_read_as_before() -> None:
    text = "a: [1, 2]\nb: {c: 3, d: null}\ne: !!set {x}\n"
    assert parse_yaml(text, "f") == yaml.safe_load(text)
    assert parse_json('{"a": {"b": [1, {"c": 2}]}}', "f") == {"a": {"b": [1, {"c": 2}]}}


def test_a_case_file_with_a_duplicate_key_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "case.yaml"
    path.write_text("q: [[1.0]]\nk: [[1.0]]\nv: [[1.0]]\nq: [[2.0]]\n")
    line = assert_one_error_line(invoke("compute", str(path)))
    assert line == f"sdpa: error: {path}: invalid YAML at line 4 column 1: duplicate key 'q'"
    with pytest.raises(InputError):
        load_case(str(path), OPTION_NAMES)


def test_a_manifest_with_a_duplicate_key_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('{"cases": [], "cases": []}')
    line = assert_one_error_line(invoke("check", "--manifest", str(path)))
    assert line == f"sdpa: error: {path}: duplicate key 'cases' in a JSON object"


# --- the C loader, kept as safe as the pure one -------------------------------------------


def test_yaml_reads_through_libyaml_where_present() -> None:
    if structured._C_YAML:
        assert issubclass(structured._StrictLoader, yaml._yaml.CParser)


def test_aliases_are_refused() -> None:
    assert problem("a: &x [1, 2]\nb: *x\n", "yaml") == (
        "invalid YAML at line 2 column 4: YAML aliases (*name) are not accepted"
    )


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    """libyaml's own composer recursed without a limit: 100,000 ``[`` killed the process."""
    depth = 100_000
    assert problem("[" * depth + "]" * depth, "yaml") == "is nested too deeply"
    assert problem("- " * 5000 + "1\n", "yaml") == "is nested too deeply"


# --- the caps --------------------------------------------------------------------------


def test_the_caps_bound_time_and_memory_as_measured() -> None:
    """The docstring's measured costs: each cap reads in ≤ ~20 s and ≤ ~1 GiB."""
    cost = {"json": (0.1, 11), "yaml": (4.1, 145) if structured._C_YAML else (16.4, 145)}
    for fmt, (seconds_per_mb, mib_per_mb) in cost.items():
        mb = TEXT_CAPS[fmt] / 1e6
        assert seconds_per_mb * mb <= 20
        assert mib_per_mb * mb <= 1024


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_text_past_its_cap_is_refused_suggesting_binary_formats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    monkeypatch.setitem(TEXT_CAPS, fmt, 1 << 20)
    path = tmp_path / f"q.{fmt}"
    path.write_text(json.dumps([[0.5] * 1000] * 300))
    size = path.stat().st_size
    with pytest.raises(InputError) as info:
        load_array(str(path))
    assert info.value.problem == (
        f"is {size} bytes of text; the most sdpa reads as {fmt.upper()} is 1 MiB (more would "
        "take minutes and gigabytes): tensors this large belong in .npy or .safetensors"
    )


def test_text_at_its_cap_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "q.json"
    path.write_text("[1, 2, 3]")
    monkeypatch.setitem(TEXT_CAPS, "json", 9)
    assert parse_text(path, "json", "q.json") == [1, 2, 3]
