"""Tests of shell completion: click's protocol (``_SDPA_COMPLETE=bash_complete``,
``COMP_WORDS``, ``COMP_CWORD``) answered in-process, as a shell would ask, and
``sdpa completion SHELL``."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from clirunner import CLEAN_ENV, assert_one_error_line, invoke

from sdpa_cli.cli import cli
from sdpa_cli.names import STAGE_TITLES as TITLES


def complete(line: str) -> list[tuple[str, str]]:
    """What bash gets for the last word of ``line`` (``type``, ``value`` per item)."""
    words = line.split(" ")
    env = {
        **CLEAN_ENV,
        "_SDPA_COMPLETE": "bash_complete",
        "COMP_WORDS": line,
        "COMP_CWORD": str(len(words) - 1),
    }
    result = CliRunner(env=env).invoke(cli, [], prog_name="sdpa", catch_exceptions=False)
    assert result.exit_code == 0, (result.exit_code, result.output)
    items = [item.partition(",") for item in result.stdout.splitlines()]
    return [(kind, value) for kind, _, value in items]


@pytest.mark.parametrize(
    "line",
    [
        "sdpa compute samples/sc",
        "sdpa explain samples/causal.yaml samples/",
        "sdpa grad q",
        "sdpa check q.npy k.npy v.npy --expect-output out",
        "sdpa check --manifest che",
        "sdpa inspect samples/cr",
        "sdpa compute q.npy k.npy v.npy --mask ma",
        "sdpa compute q.npy --config sd",
        "sdpa compute q.npy --export-svg tr",
        "sdpa explain q.npy --plot pl",
        "sdpa report merge sha",
        "sdpa report model capture/man",
        "sdpa capture --out capt -- scr",
    ],
)
def test_file_arguments_and_options_complete_paths(line: str) -> None:
    assert complete(line) == [("file", line.rsplit(" ", 1)[1])]


def test_every_file_parameter_completes_paths() -> None:
    """Every argument or option whose metavar names a file, in every command."""
    checked = 0
    for name, command in cli.commands.items():
        commands = command.commands if isinstance(command, click.Group) else {"": command}
        for sub, cmd in commands.items():
            for param in cmd.params:
                metavar = param.metavar or ""
                if not any(w in metavar for w in ("FILE", "CASE", "SHARD", "MANIFEST")):
                    continue
                # An option after an input; an argument as the first word.
                given = ("x.npy", param.opts[0]) if isinstance(param, click.Option) else ()
                words = " ".join(w for w in ("sdpa", name, sub, *given, "pa") if w)
                assert ("file", "pa") in complete(words), (name, sub, param.name)
                checked += 1
    assert checked >= 40


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("sdpa compute q.npy --dtype bf", ["bfloat16"]),
        ("sdpa compute q.npy --dtype float8", ["float8_e4m3fn", "float8_e5m2"]),
        ("sdpa check q.npy --accumulate s", ["same"]),
        ("sdpa compute q.npy --scale d", ["dk"]),
        ("sdpa compute q.npy --mask-value f", ["finfo-min"]),
        ("sdpa compute q.npy --layout ", ["bhsd", "bshd"]),
        ("sdpa compute q.npy --as f", ["flash"]),
        ("sdpa compute q.npy --causal-align l", ["lower-right", "lower-right-per-item"]),
        ("sdpa compute q.npy --format y", ["yaml"]),
        ("sdpa check q.npy --format ", ["table", "json"]),
        ("sdpa check q.npy --tolerance m", ["measured"]),
        ("sdpa check q.npy --fail-on-severity w", ["warning"]),
        ("sdpa report model m.yaml --metric a", ["all"]),
        ("sdpa completion ", ["bash", "zsh", "fish"]),
        ("sdpa co", ["completion", "compute"]),
    ],
)
def test_choices_complete(line: str, expected: list[str]) -> None:
    assert complete(line) == [("plain", v) for v in expected]


def test_stages_complete_after_the_last_comma_without_repeats() -> None:
    assert complete("sdpa compute q.npy --stages raw,w") == [("plain", "raw,weights")]
    rest = [s for s in TITLES if s != "raw"]
    assert complete("sdpa compute q.npy --stages raw,") == [("plain", f"raw,{s}") for s in rest]
    assert complete("sdpa compute q.npy --stages ou") == [("plain", "output")]


def test_fail_on_completes_finding_kinds() -> None:
    assert complete("sdpa check q.npy --fail-on overflow,nonf") == [("plain", "overflow,nonfinite")]
    assert complete("sdpa check q.npy --fail-on no") == [("plain", "nonfinite"), ("plain", "none")]


def test_capture_out_completes_folders() -> None:
    assert complete("sdpa capture --out cap") == [("dir", "cap")]
    assert complete("sdpa samples --copy sam") == [("dir", "sam")]


def test_dout_completes_its_words_and_a_path() -> None:
    assert complete("sdpa grad q.npy --dout r") == [("plain", "random"), ("file", "r")]
    assert complete("sdpa explain q.npy --dout o") == [("plain", "ones"), ("file", "o")]


@pytest.mark.parametrize(
    ("shell", "marker"),
    [("bash", "_SDPA_COMPLETE=bash_complete"), ("zsh", "zsh_complete"), ("fish", "fish_complete")],
)
def test_completion_prints_the_shells_script(shell: str, marker: str) -> None:
    result = invoke("completion", shell)
    assert result.exit_code == 0
    assert marker in result.stdout
    assert "sdpa" in result.stdout


def test_completion_of_an_unknown_shell_is_bad_usage() -> None:
    line = assert_one_error_line(invoke("completion", "tcsh"))
    assert line.startswith("sdpa: error: Invalid value for '{bash|zsh|fish}'")


def test_help_says_how_to_turn_completion_on() -> None:
    result = invoke("--help")
    assert 'eval "$(sdpa completion bash)"' in result.stdout
    assert 'eval "$(sdpa completion zsh)"' in result.stdout
    assert "sdpa completion fish > ~/.config/fish/completions/sdpa.fish" in result.stdout
