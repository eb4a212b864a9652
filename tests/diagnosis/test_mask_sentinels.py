"""Float masks as models build them: keys under a sentinel (−inf, finfo(dtype).min,
−1e4, −1e9) are hidden for the findings, as ``--causal`` hides them, while the mask is
still added as given; the header names the sentinel; a sentinel too weak for its
logits, or beyond the format the run computes in, is a finding of its own.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from clirunner import invoke
from numpy.typing import NDArray

from sdpa_cli.diagnosis.findings import Diagnosis, Finding
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.masks import HIDES, sentinel_label, sentinels
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace

F64 = NDArray[np.float64]
F32 = NDArray[np.float32]

SENTINELS = {
    "-inf": -math.inf,
    "finfo(float16).min": float(np.finfo(np.float16).min),
    "finfo(bfloat16).min": float(ml_dtypes.finfo(ml_dtypes.bfloat16).min),  # type: ignore[no-untyped-call]
    "finfo(float32).min": float(np.finfo(np.float32).min),
    "-1e4": -1e4,
    "-1e9": -1e9,
}

B, H, L, E = 1, 2, 6, 8
EMPTY_ROW = 2
"""The query row the masks below leave with no visible key."""


def qkv(scale: float = 1.0) -> tuple[F32, F32, F32]:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, E)).astype(np.float32) for _ in range(3))
    return q * np.float32(scale), k, v


def causal_allowed(empty_row: bool) -> NDArray[np.bool_]:
    allowed = np.tril(np.ones((L, L), dtype=np.bool_))
    if empty_row:
        allowed[EMPTY_ROW] = False
    return allowed


def float_mask(value: float, empty_row: bool = False) -> NDArray[np.float32]:
    """An additive causal mask as a model builds it: 0 where allowed, ``value`` elsewhere."""
    return np.where(causal_allowed(empty_row), 0.0, value).astype(np.float32)


def run(mask: NDArray[Any] | None = None, scale: float = 1.0, **options: Any) -> Diagnosis:
    spec = build_spec(*qkv(scale), mask=mask, options=Options(**options))
    return diagnose(trace(spec))


def summary(findings: tuple[Finding, ...], drop: tuple[str, ...] = ()) -> list[tuple[Any, ...]]:
    """Each finding's kind, severity, index and count: what must match the boolean mask's."""
    return [
        (f.kind, f.severity, f.index, f.count, f.dtype)
        for f in findings
        if not any(word in f.message for word in drop)
    ]


# --- the rule --------------------------------------------------------------------------


def test_the_rule_reads_values_at_or_below_minus_1e4_as_hiding() -> None:
    mask = np.array([0.0, -1.0, -9999.0, HIDES, -1e9, -math.inf, math.nan, math.inf])
    assert sentinels(mask).values == (-math.inf, -1e9, -1e4)
    assert sentinels(np.zeros(3)).values == ()


def test_sentinels_are_named_as_models_build_them() -> None:
    assert [sentinel_label(x) for x in SENTINELS.values()] == [
        "-inf",
        "-65504 (finfo(float16).min)",
        "-3.38953e+38 (finfo(bfloat16).min)",
        "-3.40282e+38 (finfo(float32).min)",
        "-10000",
        "-1e+09",
    ]
    jax = -0.7 * float(np.finfo(np.float32).max)
    assert sentinel_label(jax) == "-2.38198e+38 (-0.7·finfo(float32).max, JAX's)"


@pytest.mark.parametrize(("name", "value"), SENTINELS.items())
def test_a_causal_float_mask_gives_the_findings_of_causal(name: str, value: float) -> None:
    want = run(causal=True)
    got = run(float_mask(value))
    assert summary(got.findings) == summary(want.findings)
    assert got.counts == want.counts
    # No false saturated rows (row 0 sees one key), no weights said to flush in float16.
    assert "saturated" not in got.counts
    assert "underflow" not in got.counts


@pytest.mark.parametrize(("name", "value"), SENTINELS.items())
def test_a_fully_masked_row_is_reported_as_such(name: str, value: float) -> None:
    want = run(causal_allowed(empty_row=True))
    got = run(float_mask(value, empty_row=True))
    rows = [f.index for f in got.findings if f.kind == "fully_masked"]
    assert rows == [(0, 0, EMPTY_ROW), (0, 1, EMPTY_ROW)]
    if value == -math.inf:
        assert summary(got.findings) == summary(want.findings)
        assert "sdpa returns zeros for it" in got.findings[0].message
    else:
        # Added, a finite sentinel leaves the row's weight on the keys it hides (the
        # numbers do not change): said in the row's finding and once as a suspect mask.
        spread = [f for f in got.findings if f.kind == "mask_suspect"]
        assert len(spread) == 1
        assert spread[0].count == 2
        assert "leaves their weight on the keys it hides" in spread[0].message
        assert summary(got.findings, drop=("leaves their weight",)) == summary(want.findings)


def test_the_numbers_do_not_change_only_what_is_called_hidden() -> None:
    q, k, v = qkv()
    mask = float_mask(-1e4, empty_row=True)
    got = trace(build_spec(q, k, v, mask=mask), stages=("masked", "weights", "output"))
    logits = np.einsum("BHLE,BHSE->BHLS", q.astype(np.float64), k.astype(np.float64)) / math.sqrt(E)
    assert got.masked is not None
    assert got.weights is not None
    assert got.visible is not None
    np.testing.assert_allclose(got.masked, logits + mask, rtol=1e-15, atol=1e-12)  # as given
    np.testing.assert_array_equal(
        got.visible, np.broadcast_to(causal_allowed(True), got.visible.shape)
    )
    # The empty row's weights are the softmax of its logits − 1e4: its logits' own.
    row = logits[0, 0, EMPTY_ROW]
    want = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    np.testing.assert_allclose(got.weights[0, 0, EMPTY_ROW], want, rtol=1e-12)


def test_check_and_the_findings_agree_on_hidden_keys() -> None:
    """The per-row statistics count the keys the sentinel leaves, as check's support does."""
    spec = build_spec(*qkv(), mask=float_mask(float(np.finfo(np.float32).min)))
    stats = trace(spec).stats
    np.testing.assert_array_equal(stats.n_visible[0, 0], np.arange(1, L + 1))


# --- the lints -----------------------------------------------------------------------------


def test_a_sentinel_too_weak_for_its_logits_is_a_finding() -> None:
    """−1e4 against logits of about 1e4: the hidden keys keep much of the weight."""
    got = run(float_mask(-1e4), scale=2e4)
    weak = [f for f in got.findings if f.kind == "mask_suspect" and "hides too little" in f.message]
    assert len(weak) == 1
    assert weak[0].severity == "warning"
    assert weak[0].count is not None
    assert weak[0].count > 0
    assert weak[0].details["largest_hidden_weight"] > 0.01
    assert weak[0].details["sentinels"] == [-1e4]
    # The same logits under finfo(float32).min: nothing leaks.
    strong = run(float_mask(float(np.finfo(np.float32).min)), scale=2e4)
    assert not [f for f in strong.findings if "hides too little" in f.message]


def test_a_sentinel_beyond_the_run_format_is_minus_inf_there() -> None:
    """A float32 mask's finfo(float32).min against float16 inputs: −inf in float16."""
    q, k, v = (a.astype(np.float16) for a in qkv())
    value = float(np.finfo(np.float32).min)
    spec = build_spec(q, k, v, mask=float_mask(value))
    found = [f for f in diagnose(trace(spec)).findings if f.kind == "overflow"]
    assert [(f.severity, f.dtype) for f in found] == [("info", "float16")]
    assert found[0].message == (
        "the float mask's sentinel -3.40282e+38 (finfo(float32).min) is −inf in float16 "
        "(beyond ±6.55e+04)"
    )
    # A fully masked row makes it matter: a warning.
    spec = build_spec(q, k, v, mask=float_mask(value, empty_row=True))
    found = [f for f in diagnose(trace(spec)).findings if f.kind == "overflow"]
    assert [f.severity for f in found] == ["warning"]


def test_finfo_min_plus_negative_logits_overflows_the_format_it_was_built_for() -> None:
    """HF's finfo(float16).min in a float16 run: −65504 plus a logit below −16 is −inf."""
    q, k, v = (a.astype(np.float16) for a in qkv(scale=8.0))
    spec = build_spec(q, k, v, mask=float_mask(float(np.finfo(np.float16).min)))
    found = [f for f in diagnose(trace(spec)).findings if f.kind == "overflow"]
    sums = [f for f in found if "plus the logits" in f.message]
    assert len(sums) == 1
    assert sums[0].dtype == "float16"
    assert sums[0].severity == "info"
    assert sums[0].count is not None
    assert sums[0].count > 0


# --- on the command line ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "value"), SENTINELS.items())
def test_compute_prints_the_sentinel_in_the_header(name: str, value: float, workdir: Any) -> None:
    q, k, v = qkv()
    for n, a in (("q", q), ("k", k), ("v", v), ("m", float_mask(value))):
        np.save(f"{n}.npy", a)
    result = invoke("compute", "q.npy", "k.npy", "v.npy", "--mask", "m.npy", "--stages", "weights")
    assert result.exit_code == 0, result.output
    header = " ".join(line.strip("│ ") for line in result.stdout.splitlines()[:14])
    assert f"float mask {sentinel_label(value)} read as hiding" in header.replace("  ", " ")
    assert "findings  none: no saturated" in result.stdout
    # check sees the same: it passes its own reference, with no warning findings.
    out = trace(build_spec(q, k, v, mask=float_mask(value)), stages=("output",)).output
    assert out is not None
    np.save("out.npy", out)
    checked = invoke(
        "check", "q.npy", "k.npy", "v.npy", "--mask", "m.npy", "--expect-output", "out.npy"
    )
    assert checked.exit_code == 0, checked.output
