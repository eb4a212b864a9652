"""``sdpa check`` of a KV-cache step: an export computed with per-item cache lengths
(``--query-offset``) passes; checked with the global lower-right alignment it fails,
and the hint names the per-item offsets. Rows past ``--query-lengths`` are absent:
whatever a kernel leaves there is not compared."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from clirunner import invoke
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.check.records import Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.errors import ExitCode

F64 = NDArray[np.float64]
B, H, L, S, E = 3, 2, 4, 12, 5
LENGTHS = (12, 6, 9)  # each item's cache plus its L new tokens
OFFSETS = tuple(n - L for n in LENGTHS)


def inputs() -> tuple[F64, F64, F64]:
    rng = np.random.default_rng(7)
    return (
        rng.normal(size=(B, H, L, E)),
        rng.normal(size=(B, H, S, E)),
        rng.normal(size=(B, H, S, 3)),
    )


def kernel_output() -> F64:
    """A kernel's output: each item's queries at its own cache position (the loop)."""
    q, k, v = inputs()
    return attention(q, k, v, causal=True, key_lengths=LENGTHS, query_offset=OFFSETS).output


def closes(options: Options, export: F64) -> list[tuple[str, str, str | None]]:
    q, k, v = inputs()
    report = run_checks(
        build_spec(q, k, v, options=options), [Expected("output", export, "out.npy")]
    )
    return [(c.name, c.status, c.hint) for c in report.checks if c.name == "output.close"]


def test_the_export_with_its_offsets_passes() -> None:
    options = Options(causal=True, key_lengths=LENGTHS, query_offset=OFFSETS)
    ((_, status, _),) = closes(options, kernel_output())
    assert status == "pass"


def test_the_global_lower_right_alignment_fails_and_the_hint_names_the_offsets() -> None:
    options = Options(causal=True, key_lengths=LENGTHS, causal_align="lower-right")
    ((_, status, hint),) = closes(options, kernel_output())
    assert status == "fail"
    assert hint is not None
    assert "--query-offset 8,2,5" in hint


def test_absent_rows_are_not_compared() -> None:
    export = kernel_output()
    export[1, :, 2:] = np.nan  # past item 1's two real queries: padding, left as garbage
    export[2, :, 3:] = 123.0
    options = Options(
        causal=True, key_lengths=LENGTHS, query_offset=OFFSETS, query_lengths=(4, 2, 3)
    )
    ((_, status, _),) = closes(options, export)
    assert status == "pass"
    export[1, 0, 1, 0] += 0.1  # a present row still is compared
    ((_, status, _),) = closes(options, export)
    assert status == "fail"


def test_the_cli_checks_an_export_with_offsets(tmp_path: Path) -> None:
    q, k, v = inputs()
    for name, a in (("q", q), ("k", k), ("v", v), ("out", kernel_output())):
        np.save(tmp_path / f"{name}.npy", a)
    files = [str(tmp_path / f"{n}.npy") for n in "qkv"]
    common = ["--causal", "--key-lengths", "12,6,9", "--expect-output", str(tmp_path / "out.npy")]
    ok = invoke("check", *files, *common, "--query-offset", "8,2,5")
    assert ok.exit_code == ExitCode.OK, ok.output
    bad = invoke("check", *files, *common, "--causal-align", "lower-right")
    assert bad.exit_code == ExitCode.CHECK_FAILED
    assert "--query-offset 8,2,5" in bad.output


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--query-offset", "1,2"],
            "sdpa: error: --query-offset: 2 offsets given but the batch axis has 3 items; give one offset or one per item\n",
        ),
        (
            ["--query-offset=-1.5"],
            "sdpa: error: --query-offset: expected an integer, got '-1.5'\n",
        ),
        (
            ["--query-lengths", "9"],
            "sdpa: error: --query-lengths: 9 exceeds the number of queries, L = 4\n",
        ),
    ],
)
def test_bad_values_are_one_line_and_exit_2(tmp_path: Path, flags: list[str], line: str) -> None:
    q, k, v = inputs()
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", a)
    result = invoke("compute", *(str(tmp_path / f"{n}.npy") for n in "qkv"), "--causal", *flags)
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr == line
