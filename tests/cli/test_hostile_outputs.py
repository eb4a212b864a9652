"""Outputs tried as a hostile tester would: an output that is an input (however it is
named) or another output, an empty name, stdout on a full device or closed early
(``| head``), stderr on a full device, an ASCII-only terminal, a COLUMNS of 0.

Every case: the documented exit code, at most one error line, no traceback, no
temporary file, and no input changed.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clirunner import CLEAN_ENV, assert_one_error_line, invoke, sdpa_executable, strict_json

from sdpa_cli.errors import ExitCode

QKV = ("q.npy", "k.npy", "v.npy")
MANIFEST = "cases:\n  - {name: one, q: q.npy, k: k.npy, v: v.npy}\n"


@pytest.fixture
def qkv(workdir: Path) -> dict[str, bytes]:
    """q.npy, k.npy, v.npy and a manifest m.yaml of them; their bytes, to compare after."""
    rng = np.random.default_rng(7)
    for name in ("q", "k", "v"):
        np.save(workdir / f"{name}.npy", rng.standard_normal((2, 3, 4)))
    (workdir / "m.yaml").write_text(MANIFEST)
    return snapshot(workdir)


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# --- outputs that destroy inputs ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["compute", *QKV, "--save", "q.npy"],
            "--save q.npy: is the same file as the input q.npy; writing it would destroy it",
        ),
        (
            ["compute", *QKV, "--save", "./q.npy"],
            "--save ./q.npy: is the same file as the input q.npy; writing it would destroy it",
        ),
        (
            ["compute", *QKV, "--save", "alias.npy"],
            "--save alias.npy: is the same file as the input q.npy; writing it would destroy it",
        ),
        (
            ["compute", *QKV, "--save", "hard.npy"],
            "--save hard.npy: is the same file as the input q.npy; writing it would destroy it",
        ),
        (
            ["grad", *QKV, "--save", "v.npy"],
            "--save v.npy: is the same file as the input v.npy; writing it would destroy it",
        ),
        (
            ["explain", *QKV, "--export-svg", "k.npy"],
            "--export-svg k.npy: is the same file as the input k.npy; writing it would destroy it",
        ),
        (
            ["check", "--manifest", "m.yaml", "--report", "m.yaml"],
            "--report m.yaml: is the same file as the input m.yaml; writing it would destroy it",
        ),
        (
            ["check", "--manifest", "m.yaml", "--junit", "k.npy"],
            "--junit k.npy: is the same file as the input k.npy; writing it would destroy it",
        ),
        (
            ["check", *QKV, "--report", "r.json", "--junit", "./r.json"],
            "--report r.json: is the same file as --junit ./r.json; one report would be lost",
        ),
        (["compute", *QKV, "--save", ""], "--save: the file name is empty"),
    ],
)
def test_output_that_is_an_input_or_another_output(
    qkv: dict[str, bytes], workdir: Path, args: list[str], line: str
) -> None:
    (workdir / "alias.npy").symlink_to("q.npy")
    os.link(workdir / "q.npy", workdir / "hard.npy")
    before = snapshot(workdir)
    result = invoke(*args)
    assert assert_one_error_line(result) == f"sdpa: error: {line}"
    assert snapshot(workdir) == before


def test_distinct_reports_are_both_written(qkv: dict[str, bytes], workdir: Path) -> None:
    result = invoke("check", *QKV, "--report", "r.json", "--junit", "r.xml")
    assert result.exit_code == ExitCode.OK, result.stderr
    assert strict_json((workdir / "r.json").read_text())["exit_code"] == 0
    assert (workdir / "r.xml").read_text().startswith("<?xml")


# --- streams that fail (the real sdpa, in a subprocess) ------------------------------------


def run(
    args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess[bytes]:
    environ = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    environ["COLUMNS"] = "80"
    environ.update(env or {})
    proc: subprocess.CompletedProcess[bytes] = subprocess.run(
        [sdpa_executable(), *args], cwd=cwd, env=environ, timeout=60, **kwargs
    )
    return proc


full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


@pytest.mark.e2e
@full
@pytest.mark.parametrize(
    ("args", "output"),
    [
        (["compute", *QKV, "--save", "out.npz"], "out.npz"),
        (["compute", *QKV, "--format", "json", "--save", "out.npz"], "out.npz"),
        (["check", "--manifest", "m.yaml", "--report", "r.json"], "r.json"),
    ],
)
def test_stdout_on_a_full_device(
    qkv: dict[str, bytes], workdir: Path, args: list[str], output: str
) -> None:
    """Exit 2 with one line, and the result file is not written: it waits for stdout."""
    with open("/dev/full", "wb") as stdout:
        proc = run(args, workdir, stdout=stdout, stderr=subprocess.PIPE)
    assert proc.returncode == ExitCode.BAD_INPUT
    assert proc.stderr == b"sdpa: error: stdout: cannot be written: No space left on device\n"
    assert snapshot(workdir) == qkv  # no output, no temporary


@pytest.mark.e2e
@full
def test_stderr_on_a_full_device(qkv: dict[str, bytes], workdir: Path) -> None:
    with open("/dev/full", "wb") as stderr:
        proc = run(["compute", "q.npy", "k.npy", "missing.npy"], workdir, stderr=stderr)
    assert proc.returncode == ExitCode.BAD_INPUT  # not Python's 120


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args",
    [
        ["compute", *QKV],
        ["compute", *QKV, "--format", "json"],
        ["check", "--manifest", "m.yaml", "--report", "r.json"],
    ],
)
def test_reader_that_goes_away_is_not_a_failure(
    qkv: dict[str, bytes], workdir: Path, args: list[str]
) -> None:
    """``sdpa ... | head -c 1``: exit 0 and nothing on stderr (click said exit 1)."""
    proc = subprocess.Popen(
        [sdpa_executable(), *args],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if k not in CLEAN_ENV}, "COLUMNS": "80"},
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    first = proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == ExitCode.OK, err
    assert first
    assert err == b""


@pytest.mark.e2e
def test_ascii_only_stdout_gets_ascii_stand_ins(workdir: Path) -> None:
    sample = Path(__file__).parents[2] / "samples" / "scorecard.yaml"
    proc = run(
        ["compute", str(sample)], workdir, capture_output=True, env={"PYTHONIOENCODING": "ascii"}
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b""
    text = proc.stdout.decode("ascii")  # raises on any byte above 127
    assert "1/sqrt" in text
    assert "Q*K^T" in text


@pytest.mark.e2e
@pytest.mark.parametrize("columns", ["0", "5", "-3", "wide"])
def test_columns_that_make_no_sense_are_ignored(
    qkv: dict[str, bytes], workdir: Path, columns: str
) -> None:
    """COLUMNS=0 printed nothing and exited 0: now the 80 columns of an unset COLUMNS."""
    proc = run(["compute", *QKV], workdir, capture_output=True, env={"COLUMNS": columns})
    plain = run(["compute", *QKV], workdir, capture_output=True)
    assert proc.returncode == 0
    assert proc.stderr == b""
    assert proc.stdout == plain.stdout
    assert max(len(line) for line in proc.stdout.decode().splitlines()) == 80


@pytest.mark.e2e
def test_reader_that_goes_away_keeps_a_failed_check(qkv: dict[str, bytes], workdir: Path) -> None:
    """``sdpa check ... | head -c 1`` under pipefail: a failed check still exits 1."""
    np.save(workdir / "wrong.npy", np.zeros((2, 3, 4)))
    args = ["check", *QKV, "--expect-output", "wrong.npy"]
    proc = subprocess.Popen(
        [sdpa_executable(), *args],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if k not in CLEAN_ENV}, "COLUMNS": "80"},
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert proc.stdout.read(1)
    proc.stdout.close()
    assert proc.stderr.read() == b""
    assert proc.wait(timeout=60) == ExitCode.CHECK_FAILED


def close_fd(fd: int) -> Callable[[], None]:
    return lambda: os.close(fd)


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform == "win32", reason="closes a descriptor in the child")
def test_closed_stdout(qkv: dict[str, bytes], workdir: Path) -> None:
    """``sdpa ... >&-``: exit 2 and one line before anything runs (was exit 3)."""
    proc = run(
        ["compute", *QKV, "--save", "out.npz"],
        workdir,
        stderr=subprocess.PIPE,
        preexec_fn=close_fd(1),
    )
    assert proc.returncode == ExitCode.BAD_INPUT
    assert proc.stderr == (
        b"sdpa: error: stdout: cannot be written: it is closed (>&-); use >/dev/null\n"
    )
    assert snapshot(workdir) == qkv


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform == "win32", reason="closes a descriptor in the child")
def test_closed_stderr_keeps_the_exit_code(qkv: dict[str, bytes], workdir: Path) -> None:
    proc = run(["compute", "q.npy", "k.npy", "missing.npy"], workdir, preexec_fn=close_fd(2))
    assert proc.returncode == ExitCode.BAD_INPUT  # was 1, from an AttributeError


# --- devices and FIFOs as outputs ----------------------------------------------------------


def sdpa_of(workdir: Path) -> Any:
    """softmax(q kᵀ / √d) v of the fixture's q, k, v, in float64."""
    q, k, v = (np.load(workdir / f) for f in QKV)
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.e2e
@pytest.mark.skipif(not os.path.exists(os.devnull), reason="needs /dev/null")
@pytest.mark.parametrize("command", ["compute", "grad"])
def test_save_into_dev_null(qkv: dict[str, bytes], workdir: Path, command: str) -> None:
    """An .npz into /dev/null was exit 3 (a zip cannot seek in a device)."""
    proc = run([command, *QKV, "--save", os.devnull], workdir, capture_output=True)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert proc.stderr == b""
    assert os.stat(os.devnull).st_mode & 0o170000 == 0o020000  # still a character device
    assert snapshot(workdir) == qkv


@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_save_into_a_fifo_with_a_reader(qkv: dict[str, bytes], workdir: Path) -> None:
    os.mkfifo(workdir / "pipe")
    with subprocess.Popen(["cat", "pipe"], cwd=workdir, stdout=subprocess.PIPE) as reader:
        proc = run(["compute", *QKV, "--save", "pipe"], workdir, capture_output=True)
        sent, _ = reader.communicate(timeout=60)
    assert proc.returncode == ExitCode.OK, proc.stderr
    with np.load(io.BytesIO(sent), allow_pickle=False) as npz:
        assert npz["output"].shape == (2, 3, 4)
        np.testing.assert_allclose(npz["output"], sdpa_of(workdir), rtol=1e-12)


@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_report_into_a_fifo_without_a_reader(qkv: dict[str, bytes], workdir: Path) -> None:
    """It used to hang forever in the open; it gives up after 3 s, as an input FIFO does."""
    os.mkfifo(workdir / "rep")
    proc = run(["check", *QKV, "--report", "rep"], workdir, capture_output=True)
    assert proc.returncode == ExitCode.BAD_INPUT
    assert proc.stdout == b""
    assert proc.stderr == (
        b"sdpa: error: rep: is a FIFO that no process reads within 3 s; start its reader first\n"
    )
    assert snapshot(workdir) == qkv


def test_the_grid_and_its_key_read_on_an_ascii_only_stdout(workdir: Path) -> None:
    """report model's grid (its key ▁…█, the shared name ‹case›, ÷): every character
    has a stand-in; none is a "?"."""
    manifest = Path(__file__).parents[2] / "samples" / "model" / "manifest.yaml"
    proc = run(
        ["report", "model", str(manifest)],
        workdir,
        capture_output=True,
        env={"PYTHONIOENCODING": "ascii", "COLUMNS": "80"},
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.decode("ascii")
    assert "?" not in text
    assert "  0 _.:-=+*# 1" in text
    assert "case: model.layers.<case>.self_attn" in text
    assert "mean entropy / log(visible keys)" in text
