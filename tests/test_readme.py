"""The README's ``console`` blocks run and print exactly what the README shows.

Each ``$ sdpa ...`` line is run (as ``python -m sdpa_cli``) in the repository root,
at 80 columns with color off, stdout and stderr together; the lines up to the next
``$`` are its expected output (trailing spaces ignored). A line with shell syntax
(``| python3``, ``; echo "exit $?"``) runs in bash with this interpreter's ``sdpa``
and ``python3`` first on PATH.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Every test here runs sdpa (or bash) in a subprocess: `make test-fast` skips them.
pytestmark = pytest.mark.e2e


def console_examples() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    examples: list[tuple[str, str]] = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.DOTALL):
        command: str | None = None
        output: list[str] = []
        for line in block.splitlines():
            if line.startswith("$ "):
                if command is not None:
                    examples.append((command, "\n".join(output)))
                command, output = line[2:], []
            else:
                output.append(line)
        if command is not None:
            examples.append((command, "\n".join(output)))
    return examples


def normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


EXAMPLES = console_examples()


def test_the_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize(("command", "expected"), EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_readme_example_prints_what_the_readme_shows(command: str, expected: str) -> None:
    argv = shlex.split(command)
    assert argv[0] == "sdpa"
    env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
    env.pop("FORCE_COLOR", None)
    shell = " | " in command or "; " in command
    if shell:
        # Shell syntax: run by bash, with this interpreter first on PATH.
        shim = ROOT / ".pytest_cache" / "readme-bin"
        shim.mkdir(parents=True, exist_ok=True)
        for name, target in (
            ("sdpa", f'"{sys.executable}" -m sdpa_cli "$@"'),
            ("python3", f'"{sys.executable}" "$@"'),
        ):
            script = shim / name
            script.write_text(f"#!/bin/sh\nexec {target}\n", encoding="utf-8")
            script.chmod(0o755)
        env["PATH"] = f"{shim}{os.pathsep}{env.get('PATH', '')}"
        argv = ["bash", "-c", command]
    else:
        argv = [sys.executable, "-m", "sdpa_cli", *argv[1:]]
    result = subprocess.run(
        argv,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
        check=False,
    )
    assert normalise(result.stdout) == normalise(expected)
    if not shell:  # with shell syntax, the exit status is what the block shows
        assert result.returncode == (2 if "sdpa: error:" in expected else 0)
