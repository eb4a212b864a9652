"""Hardening, round three: a hostile catalog's classes, each with tests named by the
class, run as a user would meet them (the installed ``sdpa`` in a process where a
terminal or an environment matters). Every case: the documented exit code, one clear
line on stderr naming the file and the problem, no traceback, nothing written that
the run did not make."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clirunner import CLEAN_ENV, assert_one_error_line, clean_environ, invoke, sdpa_executable

from sdpa_cli.errors import ExitCode

QKV = ("q.npy", "k.npy", "v.npy")


@pytest.fixture
def qkv(workdir: Path) -> Path:
    rng = np.random.default_rng(3)
    for name in "qkv":
        np.save(workdir / f"{name}.npy", rng.standard_normal((2, 4, 3)))
    return workdir


def run(
    *args: str, cwd: Path | None = None, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """The installed ``sdpa`` in a process: its bytes as a terminal would get them."""
    set_ = {k: v for k, v in CLEAN_ENV.items() if v is not None}
    env = clean_environ(**set_, PYTHONIOENCODING="utf-8")
    return subprocess.run(
        [sdpa_executable(), *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )


# --- text that reaches a terminal ----------------------------------------------------------


HOSTILE_TEXT = "osc \x1b]0;pwned\x07 clear \x1b[2J\x1b[H cr \r bidi \u202e end \ud800 lone"


def test_text_that_reaches_a_terminal_a_description_prints_no_escape_code(qkv: Path) -> None:
    case = {
        "description": HOSTILE_TEXT,
        "q": [[1, 0]],
        "k": [[1, 0], [0, 1]],
        "v": [[1, 2], [3, 4]],
    }
    (qkv / "case.json").write_text(json.dumps(case))  # every control character escaped
    for args in (("compute", "case.json"), ("explain", "case.json"), ("check", "case.json")):
        done = run(*args, "--no-color", cwd=qkv)
        assert done.returncode == ExitCode.OK, done.stderr
        assert b"\x1b" not in done.stdout
        assert b"\x07" not in done.stdout
        assert b"\r" not in done.stdout
        assert "\u202e".encode() not in done.stdout
        out = done.stdout.decode("utf-8")  # no lone surrogate: it decodes
        assert "\\x1b]0;pwned\\x07" in out
        assert "\\ud800" in out


def test_text_that_reaches_a_terminal_a_descriptions_lines_stay_lines(qkv: Path) -> None:
    (qkv / "case.yaml").write_text(
        "description: |\n  first line\n  second line\nq: [[1, 0]]\nk: [[1, 0]]\nv: [[1, 2]]\n"
    )
    result = invoke("compute", "case.yaml", "--no-color")
    assert result.exit_code == ExitCode.OK
    assert result.stdout.splitlines()[:2] == ["first line", "second line"]


# --- container strictness -----------------------------------------------------------------


def _safetensors(entries: dict[str, tuple[list[int], list[int]]], data: bytes) -> bytes:
    """A safetensors file written by hand: float32 tensors with the given shapes and
    data_offsets (as a hostile writer would lay them out), then ``data``."""
    header = {
        name: {"dtype": "F32", "shape": shape, "data_offsets": offsets}
        for name, (shape, offsets) in entries.items()
    }
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


LAYOUTS = {
    "overlap": (
        {"q": ([2, 2], [0, 16]), "k": ([2, 2], [8, 24])},
        "tensors 'q' and 'k' share bytes",
    ),
    "hole-before": ({"q": ([2, 2], [8, 24])}, "8 bytes of its data buffer before the first"),
    "hole-between": (
        {"q": ([1, 2], [0, 8]), "k": ([1, 2], [12, 20])},
        "4 bytes of its data buffer after 'q' belong to no tensor",
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_container_strictness_safetensors_offsets_that_overlap_or_leave_a_hole(
    workdir: Path, layout: str
) -> None:
    entries, message = LAYOUTS[layout]
    end = max(offsets[1] for _, offsets in entries.values())
    (workdir / "t.safetensors").write_bytes(_safetensors(entries, bytes(end)))
    safetensors = pytest.importorskip("safetensors.numpy")
    with pytest.raises(Exception, match=r"(?i)offset|buffer"):  # the format's own loader
        safetensors.load_file(str(workdir / "t.safetensors"))
    for args in (
        ("inspect", "t.safetensors"),
        ("compute", "t.safetensors:q", "t.safetensors:q", "t.safetensors:q"),
    ):
        line = assert_one_error_line(invoke(*args))
        assert line.startswith("sdpa: error: t.safetensors: has a corrupt .safetensors header: ")
        assert message in line


def test_container_strictness_safetensors_bytes_past_the_last_tensor(workdir: Path) -> None:
    (workdir / "t.safetensors").write_bytes(_safetensors({"q": ([1, 2], [0, 8])}, bytes(12)))
    line = assert_one_error_line(invoke("compute", *["t.safetensors:q"] * 3))
    assert line.endswith("its last 4 bytes belong to no tensor; the format allows no hole")


def test_container_strictness_an_npz_with_two_members_of_one_name(workdir: Path) -> None:
    import io
    import warnings
    import zipfile

    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w") as zf:
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name
        for value in (1.0, 2.0):
            member = io.BytesIO()
            np.save(member, np.full((2, 2), value))
            zf.writestr("q.npy", member.getvalue())
    (workdir / "x.npz").write_bytes(buf.getvalue())
    for args in (("inspect", "x.npz"), ("compute", *["x.npz:q"] * 3)):
        line = assert_one_error_line(invoke(*args))
        assert line == (
            "sdpa: error: x.npz: holds two arrays named 'q' ('q.npy' and 'q.npy'); an archive "
            "names each array once"
        )


# --- the environment ----------------------------------------------------------------------


def _in_a_deleted_folder(qkv: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``sdpa ARGS`` run from a working directory deleted before it starts."""
    gone = qkv / "gone"
    gone.mkdir()
    script = f'cd "{gone}" && rmdir "{gone}" && exec "{sdpa_executable()}" "$@"'
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    return subprocess.run(
        ["bash", "-c", script, "sdpa", *args],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("command", ["compute", "check", "explain", "grad", "inspect"])
def test_the_environment_a_deleted_working_directory_with_absolute_paths(
    qkv: Path, command: str
) -> None:
    files = [str(qkv / n) for n in QKV]
    done = _in_a_deleted_folder(qkv, command, *(files[:1] if command == "inspect" else files))
    assert done.returncode == ExitCode.OK, done.stderr
    assert done.stderr == b""


def test_the_environment_a_deleted_working_directory_with_a_relative_path(qkv: Path) -> None:
    done = _in_a_deleted_folder(qkv, "compute", "q.npy", str(qkv / "k.npy"), str(qkv / "v.npy"))
    assert done.returncode == ExitCode.BAD_INPUT
    assert done.stderr.decode() == (
        "sdpa: error: q.npy: cannot be found: the working directory no longer exists; name "
        "it by an absolute path\n"
    )
    files = [str(qkv / n) for n in QKV]
    done = _in_a_deleted_folder(qkv, "compute", *files, "--save", "t.npz")
    assert done.returncode == ExitCode.BAD_INPUT
    assert done.stderr.decode().startswith("sdpa: error: t.npz: cannot be written: the working")


@pytest.mark.parametrize(
    "args",
    [
        ("compute", *QKV, "--save", "-"),
        ("grad", *QKV, "--save", "-"),
        ("check", *QKV, "--report", "-"),
        ("check", *QKV, "--junit", "-"),
        ("explain", *QKV, "--export-svg", "-"),
    ],
)
def test_the_environment_an_output_named_dash_is_refused(qkv: Path, args: tuple[str, ...]) -> None:
    flag = args[-2]
    line = assert_one_error_line(invoke(*args))
    assert line == (
        f"sdpa: error: {flag} -: names standard output, where the tables or the --format "
        "document go; give a file name (./- for a file named -)"
    )
    assert not (qkv / "-").exists()


# --- confinement through standard input ---------------------------------------------------


@pytest.mark.parametrize("named", ["../outside.npy", "ABSOLUTE"])
def test_confinement_through_stdin_a_piped_case_file_stays_in_the_working_directory(
    qkv: Path, named: str
) -> None:
    inside = qkv / "inside"
    inside.mkdir()
    np.save(qkv / "outside.npy", np.ones((2, 4, 3)))
    path = str(qkv / "outside.npy") if named == "ABSOLUTE" else named
    case = f"q: {path}\nk: ../k.npy\nv: ../v.npy\n".encode()
    done = run("compute", "-", cwd=inside, stdin=case)
    assert done.returncode == ExitCode.BAD_INPUT
    line = done.stderr.decode()
    assert line.startswith("sdpa: error: <stdin>: q: '")
    assert line.endswith(
        "' is outside the working directory (the case file came through a pipe); give "
        "--allow-outside to read files outside it\n"
    )
    assert done.stdout == b""
    lifted = run("compute", "-", "--allow-outside", cwd=inside, stdin=case)
    assert lifted.returncode == ExitCode.OK, lifted.stderr


def test_confinement_through_stdin_files_inside_the_working_directory_are_read(qkv: Path) -> None:
    done = run(
        "compute", "-", cwd=qkv, stdin=b"q: q.npy\nk: ./k.npy\nv: " + str(qkv / "v.npy").encode()
    )
    assert done.returncode == ExitCode.OK, done.stderr


# --- integers at the edges ----------------------------------------------------------------


@pytest.mark.parametrize("value", [2**63 - 1, 10**20, 10**25, 2**31])
@pytest.mark.parametrize(
    "option",
    [
        ["--query-offset", "{}", "--causal"],
        ["--query-offset", "{}", "--alibi"],
        ["--query-offset", "{}", "--window", "2"],
        ["--window", "{}"],
        ["--key-lengths", "{}"],
        ["--query-lengths", "{}"],
    ],
)
def test_integers_at_the_edges_positions_past_int32_are_refused(
    qkv: Path, option: list[str], value: int
) -> None:
    args = [a.format(value) for a in option]
    line = assert_one_error_line(invoke("compute", *QKV, *args))
    assert line == (
        f"sdpa: error: {args[0]}: must be ≤ 2147483647 (2**31 − 1, as kernels hold "
        f"positions), got {value}"
    )


def test_integers_at_the_edges_the_largest_offset_computes_right(qkv: Path) -> None:
    from reference import attention

    q, k, v = (np.load(qkv / n) for n in QKV)
    offset = 2**31 - 1
    for flags, want in (
        (["--causal"], attention(q, k, v).output),  # every key is before the query
        (["--alibi"], attention(q, k, v, alibi=True, query_offset=(offset,)).output),
        (["--window", "3"], np.zeros_like(q)),  # every key is far behind the window
    ):
        result = invoke("compute", *QKV, "--query-offset", str(offset), *flags, "--format", "json")
        assert result.exit_code == ExitCode.OK, result.stderr
        got = np.array(json.loads(result.stdout)["output"])
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


# --- merged reports that lie --------------------------------------------------------------


@pytest.fixture
def shard_reports(workdir: Path) -> tuple[str, str]:
    from manifest_cases import write_manifest, write_shards

    write_manifest(workdir)
    one, two = write_shards(2)
    return one, two


def _lie(path: str, change: Callable[[dict[str, Any]], None]) -> str:
    doc = json.loads(Path(path).read_text())
    change(doc)
    Path("lie.json").write_text(json.dumps(doc))
    return "lie.json"


def _passes_a_failed_case(doc: dict[str, Any]) -> None:
    failing = next(c for c in doc["cases"] if c["error"] is None and not c["passed"])
    failing["passed"] = True


def _passes_its_failed_check(doc: dict[str, Any]) -> None:
    failing = next(c for case in doc["cases"] for c in case["checks"] if c["status"] == "fail")
    failing["passed"] = True


def _renames_a_case(doc: dict[str, Any]) -> None:
    doc["cases"][0]["name"] = "renamed"


def _a_passing_run(doc: dict[str, Any]) -> None:
    doc |= {"passed": True, "exit_code": 0}


LIES = {
    "a case says it passed over a failed check": (
        _passes_a_failed_case,
        r"lie\.json: cases\[\d\]: says passed true, but a check failed",
    ),
    "a check says it passed with status fail": (
        _passes_its_failed_check,
        r"lie\.json: cases\[\d\]\.checks\[\d\]: says passed true, but its status is fail",
    ),
    "a case renamed": (
        _renames_a_case,
        r"lie\.json: cases\[0\] is named 'renamed', but case 2 of m\.yaml is 'bad'",
    ),
    "a shard that says its run passed": (
        _a_passing_run,
        r"lie\.json: says passed true and exit code 0, but its cases give exit code [12]",
    ),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_merged_reports_that_lie_are_refused(shard_reports: tuple[str, str], lie: str) -> None:
    change, message = LIES[lie]
    one, two = shard_reports
    line = assert_one_error_line(
        invoke("report", "merge", one, _lie(two, change), "--report", "r.json")
    )
    assert re.fullmatch(f"sdpa: error: {message}", line), line
    assert not Path("r.json").exists()


def test_merged_reports_that_lie_a_manifest_elsewhere_is_named(
    shard_reports: tuple[str, str], workdir: Path
) -> None:
    Path("m.yaml").rename("moved.yaml")
    line = assert_one_error_line(invoke("report", "merge", *shard_reports))
    assert line == (
        "sdpa: error: m.yaml: no such file; the shards are verified against the manifest they "
        "ran: give --manifest FILE where it is"
    )
    merged = invoke("report", "merge", *shard_reports, "--manifest", "moved.yaml")
    assert merged.exit_code == ExitCode.BAD_INPUT  # the run's own: a case could not be read
    assert "sdpa: error: broken: " in merged.stderr


# --- a capture that loses what it recorded ------------------------------------------------

ABRUPT = """\
import os, sys
import torch
import torch.nn.functional as F

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
F.scaled_dot_product_attention(q, k, v, is_causal=True)
if sys.argv[1] == "chdir":  # as Hydra does before the program's work
    os.makedirs("elsewhere", exist_ok=True)
    os.chdir("elsewhere")
    F.scaled_dot_product_attention(q, k, v)
    sys.exit(0)
sys.stdout.flush()
os._exit(7)  # no atexit, no finally: the process is gone at once
"""


@pytest.mark.parametrize("how", ["os._exit", "chdir"])
def test_a_capture_that_loses_what_it_recorded_keeps_it(workdir: Path, how: str) -> None:
    pytest.importorskip("torch")
    (workdir / "abrupt.py").write_text(ABRUPT)
    done = run("capture", "--out", "run", "--", "python", "abrupt.py", how, cwd=workdir)
    assert done.returncode == (7 if how == "os._exit" else 0), done.stderr
    calls = 1 if how == "os._exit" else 2
    cases = sorted((workdir / "run" / "tensors").glob("*.yaml"))
    assert len(cases) == len(list((workdir / "run" / "tensors").glob("*.safetensors"))) == calls
    assert not (workdir / "elsewhere" / "run").exists()
    import yaml

    manifest = yaml.safe_load((workdir / "run" / "manifest.yaml").read_text())
    assert [c["name"] for c in manifest["cases"]] == [f"call-{i}" for i in range(1, calls + 1)]
    assert len(yaml.safe_load((workdir / "run" / "calls.yaml").read_text())["calls"]) == calls
    checked = invoke("check", "--manifest", "run/manifest.yaml", "--jobs", "1")
    assert checked.exit_code == ExitCode.OK, checked.output
    alone = invoke("compute", str(cases[0]))
    assert alone.exit_code == ExitCode.OK, alone.output


# --- our own review: what else a hostile or unlucky user met ------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    "args",
    [
        ("grad", "sample:scorecard", "--check-numeric", "--tolerance"),
        ("check", "--manifest", "m.yaml", "--cluster", "tcp://127.0.0.1:1", "--cluster-timeout"),
    ],
)
def test_own_review_a_tolerance_or_timeout_of_nan_or_inf_is_refused(
    workdir: Path, args: tuple[str, ...], value: str
) -> None:
    """Regression: click's open range let NaN through (a NaN tolerance failed every
    entry and still exited 0 without --check-numeric; a timeout of inf waited forever)."""
    result = invoke(*args, value)
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr.splitlines()[0] in (
        f"sdpa: error: Invalid value for '{args[-1]}': '{value}' is not a positive finite number.",
        f"sdpa: error: Invalid value for '{args[-1]}': {float(value)!r} is not in the range x>0.",
    )


# --- what declared sizes cost -------------------------------------------------------------

DECLARED = {
    "E": ((1, 4, 40_000), (1, 4, 40_000), (1, 4, 4)),  # 640 KB; an E × E array is 12.8 GB
    "Ev": ((1, 4, 4), (1, 4, 4), (1, 4, 400_000)),
    "L": ((1, 200_000, 1), (1, 2, 1), (1, 2, 1)),
    "S": ((1, 2, 1), (1, 200_000, 1), (1, 200_000, 1)),
}


@pytest.mark.parametrize("command", ["compute", "check", "grad", "explain"])
@pytest.mark.parametrize("dimension", list(DECLARED))
def test_what_declared_sizes_cost_is_bounded_by_the_data(
    workdir: Path, dimension: str, command: str
) -> None:
    """A small file with one long dimension runs in memory proportional to its data:
    under a 3 GB address-space limit (numpy's and BLAS's own reservations included),
    where an E × E step (E = 40,000) ran out of memory."""
    import resource

    rng = np.random.default_rng(0)
    for name, shape in zip("qkv", DECLARED[dimension], strict=True):
        np.save(workdir / f"{name}.npy", rng.standard_normal(shape).astype(np.float32))

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    done = subprocess.run(
        [sdpa_executable(), command, *QKV],
        cwd=workdir,
        capture_output=True,
        env=clean_environ(),
        preexec_fn=limited,
        timeout=300,
        check=False,
    )
    assert done.returncode == ExitCode.OK, done.stderr
