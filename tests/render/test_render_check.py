"""``sdpa check`` rendered as golden text, through the command line, at fixed widths with
color off, on the bundled samples.

Regenerate with ``make golden`` (or ``SDPA_REGEN_GOLDEN=1 python -m pytest -q
tests/render/test_render_check.py``) and review the diff: a change in a golden file is a change
in what users read.

The comparisons use a float64 reference (``--reference float64``) wherever the export is
float16: against the default float32 reference the greatest relative difference of
``samples/check/out_scale_bug.npy`` (a reference value near zero) differs in its 4th digit
from one numpy build to another.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from clirunner import invoke
from golden_files import check_golden

from sdpa_cli.errors import ExitCode

ROOT = Path(__file__).resolve().parents[2]

QKV = ("samples/check/q.npy", "samples/check/k.npy", "samples/check/v.npy")
OUT = "samples/check/out.npy"
LSE = "samples/check/lse.npy"
BUG = "samples/check/out_scale_bug.npy"
F64 = ("--reference", "float64")

# golden file: (arguments after `sdpa check`, width, exit code)
CASES: dict[str, tuple[tuple[str, ...], int, int]] = {
    # Seed of the README: PyTorch's causal export and its LSE pass.
    "check_pass_80.txt": (
        (*QKV, "--causal", "--expect-output", OUT, "--expect-lse", LSE, *F64),
        80,
        ExitCode.OK,
    ),
    # The export scaled by 1/d_k: a mismatch report and the hint naming --scale dk.
    "check_scale_bug_80.txt": (
        (*QKV, "--causal", "--expect-output", BUG, *F64),
        80,
        ExitCode.CHECK_FAILED,
    ),
    # The causal export checked without --causal: two reports, each hinting --causal.
    "check_missing_causal_80.txt": (
        (*QKV, "--expect-output", OUT, "--expect-lse", LSE, *F64),
        80,
        ExitCode.CHECK_FAILED,
    ),
    # No expectations: the findings gate (nonfinite fails, mask_suspect warns).
    "check_padded_nan_80.txt": (("samples/padded_nan.yaml",), 80, ExitCode.CHECK_FAILED),
    # The manifest: one passing and one failing case, then the failing case's report.
    "check_manifest_80.txt": (
        ("--manifest", "samples/check/checks.yaml", *F64, "--jobs", "1"),
        80,
        ExitCode.CHECK_FAILED,
    ),
    # Emulated float16: overflow and nonfinite gates, two finding panels, at 100 columns.
    "check_fp16_overflow_100.txt": (
        ("samples/fp16_overflow.yaml", "--dtype", "float16"),
        100,
        ExitCode.CHECK_FAILED,
    ),
}


@pytest.fixture(autouse=True)
def at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root, so that paths print as typed (relative)."""
    monkeypatch.chdir(ROOT)


def render(args: tuple[str, ...], width: int, code: int) -> str:
    """``sdpa check ARGS`` at ``width`` columns with color off: stdout, trailing spaces cut."""
    result = invoke("check", *args, env={"COLUMNS": str(width), "NO_COLOR": "1"})
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stderr == ""
    return "\n".join(line.rstrip() for line in result.stdout.splitlines()) + "\n"


@pytest.mark.parametrize("golden", sorted(CASES))
def test_check_renders_as_the_golden_text(golden: str) -> None:
    args, width, code = CASES[golden]
    text = render(args, width, code)
    assert max(len(line) for line in text.splitlines()) <= width
    assert str(ROOT) not in text
    check_golden(golden, text)


def test_the_goldens_say_what_failed_and_why() -> None:
    """What the goldens must show, so that a regeneration cannot quietly bless a wrong one."""
    text = render(*CASES["check_pass_80.txt"])
    assert text.rstrip().endswith("PASS: 5 checks passed")
    text = render(*CASES["check_scale_bug_80.txt"])
    assert "236 of 256 (92.19%) beyond 2× the plain computation's" in text
    assert "not rounding:" in text
    assert "--fudge 5" not in text  # no tolerance suggested over a bug (it needs 554)
    assert "greatest absolute difference: 0.907478 at index [0, 1, 2, 3]" in text
    assert "matches the computation with --scale dk" in text
    assert text.rstrip().endswith("FAIL: 1 of 4 checks failed")
    text = render(*CASES["check_missing_causal_80.txt"])
    assert text.count("matches the computation with --causal") == 2
    text = render(*CASES["check_manifest_80.txt"])
    assert "layer1 › output.close · samples/check/out_scale_bug.npy" in text
    assert text.rstrip().endswith("FAIL: 1 of 2 cases failed")


def test_worst_element_is_told_apart_from_the_greatest_difference() -> None:
    """Where both appear, one line says why they name different elements."""
    lines = render(*CASES["check_scale_bug_80.txt"]).splitlines()
    at = next(n for n, line in enumerate(lines) if "worst element: index [0, 1, 14, 4]" in line)
    assert "greatest absolute difference: 0.907478 at index [0, 1, 2, 3]" in lines[at - 2]
    assert lines[at + 1].strip(" │") == "at the worst element: |Δ| 0.68, allowed 0.00246 (277×)"
    assert lines[at + 2].strip(" │") == (
        "(worst: furthest past its own tolerance; not always the greatest |Δ|)"
    )
    passing = render(*CASES["check_pass_80.txt"])
    assert "worst" not in passing
