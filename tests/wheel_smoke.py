"""The wheel, built and tried as a new user would: ``make test-wheel``.

    python tests/wheel_smoke.py [--wheel FILE.whl] [--keep]

Builds the sdist and, from it, the wheel (``python -m build``: the way pip and PyPI
build them), failing on any setuptools warning; checks the wheel holds the package,
``py.typed``, the samples and the license; installs it into a clean virtual
environment in a temporary folder outside the repository (its dependencies from the
package index); and there, in an empty folder, runs ``sdpa --version``, ``sdpa samples
--copy .`` and every example of every ``--help`` (the group's and each command's, read
from the installed ``sdpa``'s own output). Q, K, V and the files the examples name
beside them (``dout.npy``, ``out.npy``, ``w.npy``) are made with numpy first. An
example runs when every input file it names exists; each must exit 0, or 1 (a check
that fails by design), never 2 or 3. Exits 1 on the first problem found, after saying
what it was.

Not part of ``make test`` (a minute or more, mostly the install); ``tests/test_wheel.py``
checks the parsing and the wheel's contents quickly.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

INPUT_SUFFIXES = (".npy", ".npz", ".safetensors", ".pt", ".pth", ".yaml", ".yml", ".json", ".py")
"""A token ending so (before any ``:member``) names an input file the example needs."""

OUTPUT_OPTIONS = frozenset(
    {"--save", "--junit", "--report", "--out", "--export-svg", "--export-html", "--plot"}
)
"""Options whose value is a file the example writes, not one it needs."""

NEEDS_MORE = {
    "--cluster": "needs a running Dask scheduler",
    "--plot": "needs the plot extra (matplotlib)",
    "capture": "runs a model script under PyTorch",
}
"""What a clean install cannot run, by the token that says so."""

EXIT_OK = (0, 1)
"""0, or 1 for a check that fails by design; 2 (bad input) and 3 (a bug) never."""

TENSORS = """
import numpy as np

rng = np.random.default_rng(0)
shape = (1, 4, 128, 16)  # --head 3 and --rows 100:116 in the examples need H 4, L 116+
q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
scores = q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2) / np.sqrt(shape[-1])


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


causal = np.triu(np.ones(scores.shape[-2:], bool), 1)
np.save("q.npy", q)
np.save("k.npy", k)
np.save("v.npy", v)
np.save("dout.npy", rng.standard_normal(shape).astype(np.float32))
np.save("out.npy", (softmax(np.where(causal, -np.inf, scores)) @ v).astype(np.float32))
np.save("w.npy", softmax(scores).astype(np.float32))
"""


class SmokeError(Exception):
    """A problem the smoke test found: its message says what."""


def example_lines(help_text: str) -> list[str]:
    """The command lines of the ``Example:``/``Examples:`` blocks of a help text."""
    lines: list[str] = []
    inside = False
    for raw in help_text.splitlines():
        line = raw.strip()
        if re.fullmatch(r"Examples?:", line):
            inside = True
        elif not line:
            inside = False
        elif inside and line.startswith("sdpa "):
            lines.append(line)
    return lines


def subcommands(help_text: str) -> list[str]:
    """The names listed under ``Commands:`` in a group's help text."""
    names: list[str] = []
    inside = False
    for raw in help_text.splitlines():
        if raw.strip() == "Commands:":
            inside = True
        elif inside and re.match(r"  \S", raw):
            names.append(raw.split()[0])
        elif inside and raw.strip():
            inside = raw.startswith("   ")  # a wrapped description line
        elif inside:
            break
    return names


def needed_files(argv: list[str]) -> list[str]:
    """The input files an example names (``file.npz:name`` as ``file.npz``)."""
    needed = []
    for before, token in zip(["", *argv], argv, strict=False):
        if token.startswith("-") or before in OUTPUT_OPTIONS:
            continue
        path = re.sub(r"\.(npz|safetensors|pt|pth|bin):[^/]*$", r".\1", token)
        if path.lower().endswith(INPUT_SUFFIXES):
            needed.append(path)
    return needed


def why_skipped(argv: list[str], cwd: Path) -> str | None:
    """Why an example cannot run here, or None when it can."""
    if any(t in (">", ">>", "<", "|") or t.startswith(("$(", ">", "<")) for t in argv):
        return "shell syntax (a redirection or a pipe): run without a shell here"
    for token, reason in NEEDS_MORE.items():
        if token in argv[1:3] or (token.startswith("-") and token in argv):
            return reason
    missing = [f for f in needed_files(argv) if not (cwd / f).exists()]
    return f"no {', '.join(missing)}" if missing else None


def run(
    argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def build(outdir: Path, source: Path = ROOT, *, isolated: bool = True) -> Path:
    """The sdist of ``source``, then the wheel from it; any setuptools warning is a
    failure. ``isolated=False`` builds with this Python's setuptools (no download)."""
    flags = [] if isolated else ["--no-isolation"]
    command = [sys.executable, "-m", "build", *flags, "--outdir", str(outdir), str(source)]
    done = run(command, source, dict(os.environ))
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise SmokeError(f"python -m build failed (exit {done.returncode}):\n{log[-4000:]}")
    warnings = [
        line
        for line in log.splitlines()
        if re.search(r"SetuptoolsDeprecationWarning|SetuptoolsWarning|^warning: ", line)
        # PYTHONDONTWRITEBYTECODE in the environment: a note, not a problem of the build
        and "byte-compiling is disabled" not in line
    ]
    if warnings:
        raise SmokeError("the build warns:\n" + "\n".join(warnings))
    (wheel,) = outdir.glob("*.whl")
    return wheel


def wheel_problems(wheel: Path, samples: Path = ROOT / "samples") -> list[str]:
    """What the wheel lacks: the package, ``py.typed``, the JSON Schemas, each sample, the
    license."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    wanted = ["sdpa_cli/__init__.py", "sdpa_cli/cli/__init__.py", "sdpa_cli/py.typed"]
    wanted += [
        f"sdpa_cli/schemas/{p.name}" for p in sorted((ROOT / "sdpa_cli" / "schemas").glob("*.json"))
    ]
    wanted += [
        "sdpa_cli/samples/" + p.relative_to(samples).as_posix()
        for p in sorted(samples.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    ]
    problems = [f"no {name}" for name in wanted if name not in names]
    if not any(re.fullmatch(r"[^/]+\.dist-info/licenses/LICENSE", n) for n in names):
        problems.append("no *.dist-info/licenses/LICENSE")
    problems += [f"stray {n}" for n in sorted(names) if n.startswith("samples/") or ".pyc" in n]
    return problems


def help_examples(sdpa: str, cwd: Path, env: dict[str, str]) -> Iterator[str]:
    """Every example of ``sdpa --help`` and of each command's (and subcommand's) help,
    its ``--help-all`` too."""
    queue: list[list[str]] = [[]]
    seen: set[str] = set()
    while queue:
        words = queue.pop(0)
        done = run([sdpa, *words, "--help"], cwd, env, timeout=60)
        if done.returncode != 0:
            raise SmokeError(
                f"sdpa {' '.join(words)} --help: exit {done.returncode}\n{done.stderr}"
            )
        queue += [[*words, name] for name in subcommands(done.stdout)]
        text = done.stdout
        if "--help-all" in text:  # the examples the default help leaves out too
            text += "\n" + run([sdpa, *words, "--help-all"], cwd, env, timeout=60).stdout
        for line in example_lines(text):
            if line not in seen:
                seen.add(line)
                yield line


def smoke(wheel: Path, tmp: Path) -> None:
    problems = wheel_problems(wheel)
    if problems:
        raise SmokeError(f"{wheel.name}: " + "; ".join(problems))
    print(f"wheel: {wheel.name} holds the package, py.typed, the samples and LICENSE")
    venv = tmp / "venv"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, sdpa = str(venv / "bin" / "python"), str(venv / "bin" / "sdpa")
    subprocess.run([python, "-m", "pip", "install", "--quiet", str(wheel)], check=True)
    print(f"installed into a clean venv in {time.monotonic() - started:.0f} s: {venv}")
    work, home = tmp / "work", tmp / "home"
    work.mkdir()
    home.mkdir()
    # No developer's settings reach the run: a home of its own, no color, 80 columns.
    env = {
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(home),
        "NO_COLOR": "1",
        "COLUMNS": "80",
        "LANG": "C.UTF-8",
    }
    steps = [[sdpa, "--version"], [sdpa, "samples", "--copy", "."], [python, "-c", TENSORS]]
    for argv in steps:
        done = run(argv, work, env)
        if done.returncode != 0:
            raise SmokeError(f"{shlex.join(argv)}: exit {done.returncode}\n{done.stderr}")
    where = run([sdpa, "samples", "--path"], work, env).stdout.strip()
    if not Path(where).is_relative_to(venv):
        raise SmokeError(f"sdpa samples --path: {where}, not the installed package's samples")
    print(f"sdpa --version: {run([sdpa, '--version'], work, env).stdout.strip()}; samples copied")
    ran = skipped = failed_by_design = 0
    for line in help_examples(sdpa, work, env):
        argv = shlex.split(line)
        # The samples command's examples make the samples folder: an empty folder each.
        cwd = Path(tempfile.mkdtemp(dir=tmp)) if argv[1:2] == ["samples"] else work
        reason = why_skipped(argv, cwd)
        if reason:
            skipped += 1
            print(f"  skip  {line}  ({reason})")
            continue
        started = time.monotonic()
        done = run([sdpa, *argv[1:]], cwd, env)
        seconds = time.monotonic() - started
        if done.returncode not in EXIT_OK:
            raise SmokeError(
                f"{line}: exit {done.returncode} in {cwd}\n{done.stderr[-2000:]}{done.stdout[-2000:]}"
            )
        ran += 1
        failed_by_design += done.returncode == 1
        print(f"  {done.returncode:>4}  {line}  ({seconds:.1f} s)")
    if ran == 0:
        raise SmokeError("no --help example ran")
    print(
        f"{ran} examples ran ({failed_by_design} exit 1, a check failing by design), {skipped} skipped"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help="a wheel already built (default: build one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="sdpa-wheel-"))
    try:
        wheel = args.wheel.resolve() if args.wheel else build(tmp / "dist")
        print(
            f"built in {time.monotonic() - started:.0f} s" if not args.wheel else f"wheel: {wheel}"
        )
        smoke(wheel, tmp)
    except (SmokeError, subprocess.SubprocessError) as exc:
        print(f"wheel smoke: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"wheel smoke: passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
