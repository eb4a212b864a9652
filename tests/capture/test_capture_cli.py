"""Tests of `sdpa capture -- python script.py ARGS`: the program run in this process under
a capture, its exit code passed on, one summary line, and the errors (one line, exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from clirunner import assert_one_error_line, invoke

from sdpa_cli.capture import INSTALL_TORCH
from sdpa_cli.capture.script import Program

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """\
import sys
import torch
import torch.nn.functional as F

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 8, 16, generator=g).to(torch.bfloat16) for _ in range(3))
for _ in range(int(sys.argv[1])):
    F.scaled_dot_product_attention(q, k, v, is_causal=True)
print("script ran as", __name__, "with", sys.argv[1:])
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def script(workdir: Path) -> Path:
    path = workdir / "attend.py"
    path.write_text(SCRIPT)
    return path


def test_a_script_runs_under_the_capture_and_its_calls_pass_check(script: Path) -> None:
    result = invoke("capture", "--out", "run", "--", "python", "attend.py", "3", "0")
    assert result.exit_code == 0, result.output
    assert result.stdout == "script ran as __main__ with ['3', '0']\n"
    assert result.stderr == (
        "sdpa capture: 3 of 3 attention calls captured (7.3 kB) in run; "
        "check them: sdpa check --manifest run/manifest.yaml\n"
    )
    cases = yaml.safe_load(Path("run/manifest.yaml").read_text())["cases"]
    assert [c["name"] for c in cases] == ["call-1", "call-2", "call-3"]
    checked = invoke("check", "--manifest", "run/manifest.yaml", "--jobs", "1")
    assert checked.exit_code == 0, checked.output


def test_each_call_is_also_a_case_file_compute_takes_alone(script: Path) -> None:
    """tensors/NNNNN-NAME.yaml beside each call's tensors: sdpa compute reads it alone
    and gives the output the bfloat16 kernel gave (to bfloat16 rounding)."""
    import json

    import numpy as np

    from sdpa_cli.files.loaders import load_array

    assert invoke("capture", "--out", "run", "attend.py", "2", "0").exit_code == 0
    case = Path("run/tensors/00001-call-1.yaml")
    assert case.exists()
    data = yaml.safe_load(case.read_text())
    assert data["q"] == "00001-call-1.safetensors:q"
    assert not any(key.startswith("expect") for key in data)
    result = invoke("compute", str(case), "--stages", "output", "--format", "json")
    assert result.exit_code == 0, result.output
    got = np.array(json.loads(result.stdout)["output"])
    kernel = load_array("run/tensors/00001-call-1.safetensors:output")
    np.testing.assert_allclose(got, kernel, rtol=2**-7, atol=2**-9)


def test_the_script_s_exit_code_passes_through_with_the_bounds(script: Path) -> None:
    result = invoke(
        "capture", "--out", "run", "--every", "2", "--max-calls", "2", "--", "attend.py", "7", "3"
    )
    assert result.exit_code == 3
    assert "2 of 7 attention calls captured" in result.stderr
    names = [c["name"] for c in yaml.safe_load(Path("run/calls.yaml").read_text())["calls"]]
    assert names == ["call-1", "call-3"]


def test_match_and_max_bytes_from_the_command_line(script: Path) -> None:
    result = invoke(
        "capture",
        "--out",
        "run",
        "--match",
        "call-[12]",
        "--max-bytes",
        "3kB",
        "attend.py",
        "3",
        "0",
    )
    assert result.exit_code == 0
    stopped, summary = result.stderr.splitlines()
    assert stopped.startswith("sdpa capture: stopped at 1 call (2.43 kB): call 2 (call-2, 2.43 kB)")
    assert summary.startswith("sdpa capture: 1 of 3 attention calls captured")
    assert summary.endswith(
        "; stopped by max_bytes; check them: sdpa check --manifest run/manifest.yaml"
    )


def test_a_module_runs_with_dash_m(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(script.parent))
    result = invoke("capture", "--out", "run", "--", "-m", "attend", "1", "0")
    assert result.exit_code == 0, result.output
    assert "script ran as __main__ with ['1', '0']" in result.stdout
    assert "1 of 1 attention call captured" in result.stderr
    assert sys.argv[0] != "attend"  # put back


def test_an_uncaught_exception_is_the_script_s_traceback_and_exit_1(workdir: Path) -> None:
    Path("boom.py").write_text("def f():\n    raise ValueError('boom')\n\nf()\n")
    result = invoke("capture", "--out", "run", "--", "python", "boom.py")
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert 'File "boom.py", line 4, in <module>' in lines[1]  # from the script's own frame
    assert "ValueError: boom" in lines
    assert lines[-1].startswith("sdpa capture: no attention call captured (0 calls seen)")


def test_sys_exit_with_a_message_is_exit_1(workdir: Path) -> None:
    Path("bye.py").write_text("import sys\nsys.exit('bye')\n")
    result = invoke("capture", "--out", "run", "bye.py")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == "bye"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("missing.py",), "sdpa: error: missing.py: no such script"),
        (
            ("python",),
            "sdpa: error: capture: give the program to run: -- python script.py ARGS or -- -m module ARGS",
        ),
        (
            ("-c", "pass"),
            "sdpa: error: -c: is an interpreter option capture does not take; give script.py ARGS or -m module ARGS",
        ),
        (("-m", "no_such_module_here"), "sdpa: error: -m: no module named 'no_such_module_here'"),
        (
            ("--max-bytes", "lots", "x.py"),
            "sdpa: error: --max-bytes: expected a size such as 500MB or 2GiB, got 'lots'",
        ),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(
    workdir: Path, args: tuple[str, ...], message: str
) -> None:
    out = ("--out", "run") if args[0] != "--max-bytes" else ("--out", "run", *args[:2])
    rest = args if args[0] != "--max-bytes" else args[2:]
    assert assert_one_error_line(invoke("capture", *out, *rest)) == message


def test_out_is_required(workdir: Path) -> None:
    line = assert_one_error_line(invoke("capture", "x.py"))
    assert "--out" in line


def test_without_torch_it_says_what_to_install(
    script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    line = assert_one_error_line(invoke("capture", "--out", "run", "attend.py", "1", "0"))
    assert line == (
        f"sdpa: error: capture: needs PyTorch, which is not installed; install it with {INSTALL_TORCH}"
    )
    assert not Path("run").exists()


def test_a_folder_holding_a_capture_is_refused(script: Path) -> None:
    assert invoke("capture", "--out", "run", "attend.py", "1", "0").exit_code == 0
    line = assert_one_error_line(invoke("capture", "--out", "run", "attend.py", "1", "0"))
    assert line == (
        "sdpa: error: run: already holds a capture (manifest.yaml or tensors/); "
        "remove it, pick another, or replace it (--replace)"
    )


def test_replace_swaps_an_earlier_capture_for_the_new_one(script: Path) -> None:
    assert invoke("capture", "--out", "run", "attend.py", "3", "0").exit_code == 0
    Path("run/notes.txt").write_text("mine")
    result = invoke("capture", "--out", "run", "--replace", "attend.py", "1", "0")
    assert result.exit_code == 0, result.output
    cases = yaml.safe_load(Path("run/manifest.yaml").read_text())["cases"]
    assert [c["name"] for c in cases] == ["call-1"]
    assert len(list(Path("run/tensors").glob("*.safetensors"))) == 1
    assert Path("run/notes.txt").read_text() == "mine"  # not the capture's: kept


def test_replace_refuses_a_tensor_folder_holding_something_else(script: Path) -> None:
    assert invoke("capture", "--out", "run", "attend.py", "1", "0").exit_code == 0
    Path("run/tensors/keep.npy").write_bytes(b"x")
    line = assert_one_error_line(invoke("capture", "--out", "run", "--replace", "attend.py", "1"))
    assert line == (
        "sdpa: error: run/tensors/keep.npy: is not a capture's tensor file; "
        "the capture is not replaced"
    )
    assert Path("run/tensors/keep.npy").exists()
    assert Path("run/manifest.yaml").exists()


def test_the_program_forms_parse(workdir: Path) -> None:
    Path("s.py").write_text("")
    assert Program.parse(["python3.11", "s.py", "-x"]) == Program("s.py", ("-x",))
    assert Program.parse(["/usr/bin/python", "-m", "pkg.mod", "a"]) == Program(
        "pkg.mod", ("a",), module=True
    )
    assert Program.parse(["s.py"]) == Program("s.py", ())


@pytest.mark.e2e
def test_the_installed_command_runs_a_script(script: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this tree's sdpa_cli, whatever is installed
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdpa_cli",
            "capture",
            "--out",
            "run",
            "--",
            "python",
            "attend.py",
            "2",
            "5",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 5, done.stderr
    assert done.stdout == "script ran as __main__ with ['2', '5']\n"
    assert done.stderr.startswith("sdpa capture: 2 of 2 attention calls captured")
    assert (script.parent / "run" / "manifest.yaml").is_file()
