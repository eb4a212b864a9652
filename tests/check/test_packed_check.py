"""``sdpa check`` of packed documents (``--cu-seqlens``): weights exported by a kernel
that ignored the document boundaries leak across them, and the failing check names
the two documents and where."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from clirunner import assert_one_error_line, invoke
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.check.records import Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.errors import ExitCode

F64 = NDArray[np.float64]
H, L, E = 2, 12, 4
CU = (0, 5, 12)


def inputs() -> tuple[F64, F64, F64]:
    rng = np.random.default_rng(3)
    return (
        rng.normal(size=(1, H, L, E)),
        rng.normal(size=(1, H, L, E)),
        rng.normal(size=(1, H, L, 3)),
    )


def packed_weights() -> F64:
    """Each document run alone, its weights placed on the block diagonal."""
    q, k, v = inputs()
    w = np.zeros((1, H, L, L))
    for a, b in itertools.pairwise(CU):
        part = attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True)
        w[:, :, a:b, a:b] = part.weights
    return w


def weights_rows(export: F64) -> tuple[str, str]:
    q, k, v = inputs()
    spec = build_spec(q, k, v, options=Options(causal=True, cu_seqlens=CU))
    report = run_checks(spec, [Expected("weights", export, "w.npy")])
    (check,) = (c for c in report.checks if c.name == "weights.rows")
    return check.status, check.summary


def test_block_diagonal_weights_pass() -> None:
    assert weights_rows(packed_weights())[0] == "pass"


def test_weight_across_documents_names_them() -> None:
    export = packed_weights()
    export[0, 0, 7, 3] = 0.12  # query 7 (document 1) on key 3 (document 0)
    export[0, 0, 7, 5:8] *= 0.88
    status, summary = weights_rows(export)
    assert status == "fail"
    assert (
        summary
        == "1 of 24 rows off: weight 0.12 crosses from document 1 into document 0 at [0, 0, 7, 3]"
    )


def test_a_causal_kernel_over_the_whole_pack_fails_naming_the_documents(tmp_path: Path) -> None:
    q, k, v = inputs()
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", a)
    np.save(tmp_path / "w.npy", attention(q, k, v, causal=True).weights)
    files = [str(tmp_path / f"{n}.npy") for n in ("q", "k", "v")]
    result = invoke(
        "check",
        *files,
        "--causal",
        "--cu-seqlens",
        "0,5,12",
        "--expect-weights",
        str(tmp_path / "w.npy"),
    )
    assert result.exit_code == ExitCode.CHECK_FAILED, result.output
    assert "weight 0.429 crosses from document 1 into document 0 at [0, 0, 5, 3]" in result.stdout


def test_bad_cu_seqlens_exit_2_with_one_line(tmp_path: Path) -> None:
    q, k, v = inputs()
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", a)
    files = [str(tmp_path / f"{n}.npy") for n in ("q", "k", "v")]
    result = invoke("compute", *files, "--cu-seqlens", "0,5,11")
    line = assert_one_error_line(result)
    assert line == "sdpa: error: --cu-seqlens: ends at 11, but the queries number L = 12"
    result = invoke("compute", *files, "--cu-seqlens", "0,7,5,12")
    assert (
        assert_one_error_line(result)
        == "sdpa: error: --cu-seqlens: must not decrease, got 5 after 7"
    )
