"""What ``check --html`` draws of a failed comparison: the report keeps, when asked,
each export and the reference's and plain computation's values of it, the rule's
terms, and the computation a hint found the export matches; the picture of the error
÷ its allowance fails exactly the elements the rule fails."""

from __future__ import annotations

from typing import Any

import numpy as np
from reference import attention

from sdpa_cli.check.records import Expected
from sdpa_cli.check.relative import error_ratio
from sdpa_cli.check.run import run_checks
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.visible import visibility


def float16_case(seed: int = 4) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, 2, 48, 16)).astype(np.float16) for _ in range(3))  # type: ignore[return-value]


def test_no_evidence_is_kept_unless_asked() -> None:
    q, k, v = float16_case()
    spec = build_spec(q, k, v, options=parse_options({"causal": True}))
    out = attention(q, k, v, causal=True).output.astype(np.float16)
    assert run_checks(spec, [Expected("output", out, "out.npy")]).evidence is None


def test_a_flipped_causal_mask_keeps_the_computation_it_matches() -> None:
    """A kernel that wrote triu for tril: the hint names it, and the evidence holds
    that computation, whose mask differs from the one asked for in a triangle."""
    q, k, v = float16_case()
    spec = build_spec(q, k, v, options=parse_options({"causal": True}))
    flipped = attention(q, k, v, mask=np.triu(np.ones((48, 48), dtype=np.bool_)))
    report = run_checks(
        spec, [Expected("output", flipped.output.astype(np.float16), "out.npy")], evidence=True
    )
    (close,) = [c for c in report.checks if c.name == "output.close"]
    assert close.status == "fail"
    assert close.hint is not None
    assert "transposed" in close.hint
    evidence = report.evidence
    assert evidence is not None
    assert set(evidence.matched) == {"output"}
    asked = visibility(spec, (0, 0), slice(0, 48))
    theirs = visibility(evidence.matched["output"], (0, 0), slice(0, 48))
    assert asked is not None
    assert theirs is not None
    assert np.array_equal(asked, np.tril(np.ones((48, 48), dtype=np.bool_)))
    assert np.array_equal(theirs, np.triu(np.ones((48, 48), dtype=np.bool_)))


def test_the_pictured_ratio_fails_what_the_rule_fails() -> None:
    """Half the rows of one head nudged by a few ulp: the page's error ÷ allowance
    is above 1 on exactly the elements the rule counts beyond it."""
    q, k, v = float16_case(7)
    spec = build_spec(q, k, v, options=parse_options({"causal": True}))
    out = attention(q, k, v, causal=True).output
    export = out.astype(np.float16)
    ulp = np.spacing(np.abs(export[0, 1, :24]).astype(np.float16)).astype(np.float64)
    export[0, 1, :24] = (export[0, 1, :24] + 6 * ulp).astype(np.float16)
    report = run_checks(spec, [Expected("output", export, "out.npy")], evidence=True)
    ev = report.evidence
    assert ev is not None
    assert ev.judgement is not None
    assert ev.judgement.export == "float16"
    (close,) = [c for c in report.checks if c.name == "output.close"]
    assert close.status == "fail"
    assert close.mismatch is not None
    a = np.asarray(ev.exports["output"], np.float64).reshape(2, 48, 16)
    r = np.asarray(ev.reference["output"], np.float64).reshape(2, 48, 16)
    plain = ev.plain["output"]
    p = None if plain is None else np.asarray(plain, np.float64).reshape(2, 48, 16)
    ratio = error_ratio(a, r, p, ev.judgement, rows=True)
    assert int(np.count_nonzero(ratio > 1)) == close.mismatch.mismatched
    assert not (ratio[0] > 1).any()  # the head left alone passes everywhere
