"""``assert_attention_close``: its keywords, its failure message, its default tolerance.

The checks themselves are ``sdpa check``'s (``tests/check/test_check.py``); here, what
the assertion adds: an unknown keyword refused as Python refuses one, with the closest
valid name; a failure message with no line said twice; the tolerance left to ``sdpa
check``'s default unless one is asked for. Exports come from the float64 loop oracle.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from reference import attention

from sdpa_cli import assert_attention_close
from sdpa_cli.check.records import Check, CheckReport, Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.errors import SpecError
from sdpa_cli.testing import report_text

F64 = NDArray[np.float64]


def normal(seed: int, *shape: int) -> F64:
    return np.random.default_rng(seed).normal(size=shape)


def qkv() -> tuple[F64, F64, F64]:
    """Q (2, 3, 4), K (2, 5, 4), V (2, 5, 3)."""
    return normal(1, 2, 3, 4), normal(2, 2, 5, 4), normal(3, 2, 5, 3)


def close_of(report: CheckReport) -> Check:
    (close,) = [c for c in report.checks if c.name == "output.close"]
    return close


# --- unknown keywords -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("casual", "causal"),  # an option
        ("key_length", "key_lengths"),
        ("softcapp", "softcap"),
        ("tolerence", "tolerance"),  # a setting of the check
        ("equal_nans", "equal_nan"),
        ("ouptut", "output"),  # an export
    ],
)
def test_a_misspelt_keyword_raises_type_error_naming_the_closest(typed: str, meant: str) -> None:
    q, k, v = qkv()
    typo: dict[str, Any] = {typed: True}
    with pytest.raises(TypeError) as caught:
        assert_attention_close(q, k, v, **typo)
    assert str(caught.value) == (
        f"assert_attention_close() got an unexpected keyword argument {typed!r}; "
        f"did you mean {meant!r}?"
    )


def test_a_keyword_like_no_other_gets_no_suggestion() -> None:
    q, k, v = qkv()
    with pytest.raises(TypeError) as caught:
        assert_attention_close(q, k, v, zzyzx=1)
    assert (
        str(caught.value) == "assert_attention_close() got an unexpected keyword argument 'zzyzx'"
    )


def test_an_unknown_keyword_is_refused_before_anything_is_computed() -> None:
    """K's key dim (3) is not Q's (4): computing anything would raise SpecError first."""
    q, _, v = qkv()
    bad_k = normal(2, 2, 5, 3)
    with pytest.raises(SpecError):
        assert_attention_close(q, bad_k, v, causal=True)
    with pytest.raises(TypeError, match="did you mean 'causal'"):
        assert_attention_close(q, bad_k, v, casual=True)


def test_valid_options_are_still_taken_as_keywords() -> None:
    q, k, v = qkv()
    out = attention(q, k, v, causal=True, window=(1, 0)).output
    assert assert_attention_close(q, k, v, output=out, causal=True, window=(1, 0)).passed
    with pytest.raises(AssertionError):
        assert_attention_close(q, k, v, output=out, causal=True)


# --- the failure message ----------------------------------------------------------------


def blocks(message: str) -> dict[str, list[str]]:
    """The message's lines by check: its ``STATUS name: summary`` line, then its report."""
    out: dict[str, list[str]] = {}
    name = ""
    for line in message.splitlines()[1:]:
        if not line.startswith("         "):
            name = line.split()[1].rstrip(":")
        out.setdefault(name, []).append(line)
    return out


def test_a_failure_message_says_no_line_twice() -> None:
    """The export without the causal mask fails output.range, output.close,
    weights.rows and weights.close; a check with no mismatch report restated its
    summary under itself."""
    q, k, v = qkv()
    full = attention(q, k, v)
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(q, k, v, output=full.output, weights=full.weights, causal=True)
    message = str(caught.value)
    by_check = blocks(message)
    assert [n for n, lines in by_check.items() if lines[0].startswith("  FAIL")] == [
        "output.range",
        "output.close",
        "weights.rows",
        "weights.close",
    ]
    for lines in by_check.values():
        summary = lines[0].split(": ", 1)[1]
        details = [line.strip() for line in lines[1:]]
        assert summary not in details
        assert len(details) == len(set(details)), details
    assert by_check["output.range"][1:] == ["         index: [0, 0, 0]"]
    assert by_check["weights.rows"][1:] == ["         index: [0, 0]"]
    assert message.count("mismatched elements:") == 2  # one report per failed comparison


def test_a_failure_message_begins_with_how_many_checks_failed_of_how_many_and_which() -> None:
    # Regression: it began "sdpa check 4 failed (...)", a count with nothing counted.
    q, k, v = qkv()
    full = attention(q, k, v)
    with pytest.raises(AssertionError) as caught:
        assert_attention_close(q, k, v, output=full.output, weights=full.weights, causal=True)
    assert str(caught.value).splitlines()[0] == (
        "sdpa check: 4 of 8 checks failed, output.range, output.close, weights.rows and "
        "weights.close (export float64, reference float64):"
    )


def test_a_report_with_one_check_says_which_one_failed_or_that_it_passed() -> None:
    q, k, v = qkv()
    spec = build_spec(q, k, v, options=parse_options({}))
    report = run_checks(spec, [])
    failed = Check("findings.nonfinite", "fail", "3 findings")
    text = report_text(
        CheckReport((failed,), report.diagnosis, "float64", "float64", ("nonfinite",), None)
    )
    assert text.splitlines()[0] == (
        "sdpa check: 1 of 1 check failed, findings.nonfinite (export float64, reference float64):"
    )
    passed = Check("findings", "pass", "nothing worth a warning")
    text = report_text(CheckReport((passed,), report.diagnosis, "float64", "float64", (), None))
    assert text.splitlines()[0] == (
        "sdpa check: the 1 check passed (export float64, reference float64):"
    )


def test_report_text_keeps_the_order_of_a_failures_lines() -> None:
    """Two findings with the same message: the second bullet goes, the rest stays in order."""
    q, k, v = qkv()
    spec = build_spec(q, k, v, options=parse_options({}))
    report = run_checks(spec, [])
    findings = [{"message": "a"}, {"message": "b", "hint": "fix b"}, {"message": "a"}]
    failed = Check("findings.nonfinite", "fail", "3 findings", details={"findings": findings})
    text = report_text(
        CheckReport((failed,), report.diagnosis, "float64", "float64", ("nonfinite",), None)
    )
    assert text.splitlines()[1:] == [
        "  FAIL findings.nonfinite: 3 findings",
        "         3 findings:",
        "         • a",
        "         • b",
        "           hint: fix b",
    ]


# --- the default tolerance --------------------------------------------------------------


def test_the_default_tolerance_is_sdpa_checks() -> None:
    assert inspect.signature(assert_attention_close).parameters["tolerance"].default is None
    q, k, v = qkv()
    out = attention(q, k, v, causal=True).output.astype(np.float16)
    spec = build_spec(q, k, v, options=parse_options({"causal": True}))
    by_check = close_of(run_checks(spec, [Expected("output", out, "output")], CheckSettings()))
    given = close_of(assert_attention_close(q, k, v, output=out, causal=True))
    assert given.status == by_check.status == "pass"
    assert given.tolerance == by_check.tolerance
    assert given.summary == by_check.summary


@pytest.mark.parametrize("tolerance", ["dtype", "measured"])
def test_a_tolerance_asked_for_is_passed_through(tolerance: str) -> None:
    q, k, v = qkv()
    out = attention(q, k, v, causal=True).output.astype(np.float16)
    report = assert_attention_close(q, k, v, output=out, causal=True, tolerance=tolerance)
    tol = close_of(report).tolerance
    assert tol is not None
    assert tol.source.startswith({"dtype": "float16 defaults", "measured": "measured"}[tolerance])


def test_a_bad_tolerance_name_is_a_spec_error() -> None:
    q, k, v = qkv()
    out: Any = attention(q, k, v).output
    with pytest.raises(SpecError):
        assert_attention_close(q, k, v, output=out, tolerance="loose")
