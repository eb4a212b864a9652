"""The documentation's ``console`` blocks run and print exactly what they show.

Pages: README.md and every ``docs/**/*.md``. In a ``console`` block each ``$ sdpa ...``
line is run (as ``python -m sdpa_cli``) in the repository root, at 80 columns with
color off, stdout and stderr together; the lines up to the next ``$`` are its expected
output (trailing spaces ignored). A line with shell syntax (``| python3``,
``; echo "exit $?"``) runs in bash with this interpreter's ``sdpa`` and ``python3``
first on PATH. The site itself must build with ``mkdocs build --strict`` (no warning:
every page in the nav, every relative link valid) where mkdocs is installed.

After a change to what sdpa prints, rewrite every shown output from a real run and
review the diff: ``python tests/test_docs.py --regen``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Every test here runs sdpa, bash or mkdocs in a subprocess: `make test-fast` skips them.
pytestmark = pytest.mark.e2e

BLOCK = re.compile(r"(```console\n)(.*?)(```)", flags=re.DOTALL)


class Example(NamedTuple):
    page: str  # relative to the repository root
    command: str  # without the leading "$ "
    expected: str


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def split_block(block: str) -> list[tuple[str, list[str]]]:
    """A console block's ``$`` commands, each with the lines shown after it."""
    runs: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:], []))
        elif runs:
            runs[-1][1].append(line)
    return runs


def console_examples() -> list[Example]:
    examples: list[Example] = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        for match in BLOCK.finditer(text):
            for command, output in split_block(match.group(2)):
                examples.append(Example(name, command, "\n".join(output)))
    return examples


def normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def run(command: str) -> subprocess.CompletedProcess[str]:
    """Run one shown command as a reader would, at 80 columns, color off."""
    argv = shlex.split(command)
    assert argv[0] == "sdpa", f"a console example runs sdpa: {command}"
    env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
    env.pop("FORCE_COLOR", None)
    if " | " in command or "; " in command:
        # Shell syntax: run by bash, with this interpreter first on PATH.
        shim = ROOT / ".pytest_cache" / "docs-bin"
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
    return subprocess.run(
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


EXAMPLES = console_examples()


def test_every_page_in_the_tour_has_examples() -> None:
    shown = {example.page for example in EXAMPLES}
    assert "README.md" in shown
    assert sum(example.page == "README.md" for example in EXAMPLES) >= 7
    assert len(shown) >= 10


NEEDS = {"sdpa capture ": "torch"}
"""Examples that run an optional package (a command's start → the package): skipped,
saying so, where it is not installed."""


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.page}: {e.command[:60]}" for e in EXAMPLES])
def test_the_docs_example_prints_what_the_page_shows(example: Example) -> None:
    for start, package in NEEDS.items():
        if example.command.startswith(start):
            pytest.importorskip(package, reason=f"the example needs {package}")
    result = run(example.command)
    assert normalise(result.stdout) == normalise(example.expected)
    if " | " not in example.command and "; " not in example.command:
        # With shell syntax the exit status is what the block shows (echo "exit $?").
        assert result.returncode == (2 if "sdpa: error:" in example.expected else 0)


def test_the_site_builds_without_a_warning(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is in the docs and dev extras")
    pytest.importorskip("material", reason="mkdocs-material is in the docs and dev extras")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout
    assert (tmp_path / "reference" / "findings" / "index.html").is_file()


def regenerate() -> None:
    """Rewrite every shown output from a real run (review the diff)."""

    def rewrite(match: re.Match[str]) -> str:
        lines: list[str] = []
        for command, _ in split_block(match.group(2)):
            output = normalise(run(command).stdout)
            if "internal error" in output:
                sys.exit(f"{command}: {output}")  # never write a bug into the docs
            lines += [f"$ {command}", output]
        return match.group(1) + "\n".join(lines) + "\n" + match.group(3)

    for page in pages():
        text = page.read_text(encoding="utf-8")
        page.write_text(BLOCK.sub(rewrite, text), encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regen"]:
        sys.exit("usage: python tests/test_docs.py --regen")
    regenerate()
