"""Who the hints blame for rows too flat or too peaked: the temperature where it, not the
scale, moves the effective scale; never a --scale the run already has."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sdpa_cli.diagnosis.findings import Diagnosis, Finding, Thresholds
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.diagnosis.scales import compare_scales
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace

SCALE_FINDINGS = ("saturated", "near_uniform", "dead_head", "collapsed_head", "unscaled")


def run(**options: Any) -> Diagnosis:
    """Random Q, K, V of unit normals, (1, 2, 64, 64): with 1/√64 the logits' std is 1."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 64, 64)) for _ in range(3))
    spec = build_spec(q, k, v, options=parse_options(options))
    return diagnose(trace(spec, stages=("output",)))


def first(d: Diagnosis, kind: str) -> Finding:
    return next(f for f in d.findings if f.kind == kind)


def test_a_temperature_of_100_is_named_where_the_scale_was_blamed() -> None:
    """Before: 'was the scale applied twice (1/d_k)' on every row, and an unscaled
    warning, '1/√d_k looks applied twice … use --scale sqrt-dk once', under the
    default --scale sqrt-dk."""
    d = run(temperature=100)
    assert "unscaled" not in d.counts
    assert d.counts["near_uniform"] == 128
    assert first(d, "near_uniform").hint == (
        "the logits barely differ: the temperature 100 flattens every row (scores are "
        "divided by it after the scale, 1/√d_k = 1/√64 = 0.125: an effective scale of "
        "0.00125)"
    )
    assert first(d, "dead_head").hint == (
        "the head averages V instead of attending; the temperature 100 flattens every row "
        "(scores are divided by it after the scale, 1/√d_k = 1/√64 = 0.125: an effective "
        "scale of 0.00125)"
    )


def test_a_temperature_of_0_05_is_named_where_the_scale_was_blamed() -> None:
    """Before: 'the scale is 1/√d_k = 1/√64 = 0.125: was 1/√d_k (1/√64 = 0.125)
    applied?', and '1/√d_k looks omitted … (--scale sqrt-dk)'."""
    d = run(temperature=0.05)
    assert "unscaled" not in d.counts
    assert first(d, "saturated").hint == (
        "the temperature 0.05 sharpens every row (scores are divided by it after the scale, "
        "1/√d_k = 1/√64 = 0.125: an effective scale of 2.5); a one-hot row passes almost no "
        "gradient"
    )


def test_logits_a_temperature_pushes_out_of_range_name_it() -> None:
    d = run(temperature=0.001)
    overflow = next(f for f in d.findings if f.kind == "overflow" and f.stage == "scaled")
    assert overflow.hint is not None
    assert overflow.hint.startswith(
        "the logits themselves are out of range: the temperature 0.001 sharpens every row"
    )
    assert first(d, "collapsed_head").hint is not None
    assert "the temperature 0.001 sharpens every row" in str(first(d, "collapsed_head").hint)


def test_no_scale_and_a_temperature_of_100_blame_the_temperature() -> None:
    """The scale alone (1) would sharpen; the temperature flattens: it is named, and
    no hint advises the --scale none the run has."""
    d = run(scale="none", temperature=100)
    hint = str(first(d, "near_uniform").hint)
    assert "the temperature 100 flattens every row" in hint
    assert "effective scale of 0.01" in hint
    assert all("--scale none" not in str(f.hint) for f in d.findings)


def test_a_temperature_that_only_adds_to_a_flat_scale_is_named_beside_it() -> None:
    d = run(scale="dk", temperature=1.5)
    assert first(d, "near_uniform").hint == (
        "the logits barely differ: the scale is 1/d_k = 1/64 = 0.015625, nearer 1/d_k than "
        "1/√d_k (1/√64 = 0.125): was 1/√d_k applied twice? And the temperature 1.5 "
        "flattens them 1.5× more"
    )
    # --scale dk is the user's; --scale sqrt-dk, advised, is not.
    assert "use --scale sqrt-dk once" in str(first(d, "unscaled").hint)


def test_a_temperature_of_the_square_root_of_d_k_over_no_scale_is_no_finding() -> None:
    """--scale none --temperature 8: 1/√64 by the temperature, the logits' std 1."""
    d = run(scale="none", temperature=8)
    assert not any(k in d.counts for k in SCALE_FINDINGS)


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 100},
        {"temperature": 0.05},
        {"temperature": 0.001},
        {"temperature": 2},
        {"scale": "none", "temperature": 100},
        {"scale": "none", "temperature": 0.5},
        {"scale": "dk"},
        {"scale": "dk", "temperature": 1.5},
        {"scale": "none"},
    ],
)
def test_no_hint_advises_the_scale_the_run_has(options: dict[str, Any]) -> None:
    d = run(**options)
    rule = options.get("scale", "sqrt-dk")
    assert any(f.kind in SCALE_FINDINGS for f in d.findings)
    for f in d.findings:
        assert f"--scale {rule}" not in str(f.hint), (f.kind, f.hint)
        if f.kind in SCALE_FINDINGS and options.get("temperature", 1) != 1:
            direction = "flattens" if f.kind in ("near_uniform", "dead_head") else "sharpens"
            if (direction == "flattens") == (options["temperature"] > 1):
                assert f"the temperature {options['temperature']:g} {direction}" in str(f.hint)


def test_compare_scales_says_every_scale_is_divided_by_the_temperature() -> None:
    """Under --temperature 100 no scale balances the rows: the conclusion says why."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 64, 64)) for _ in range(3))
    spec = build_spec(q, k, v, options=parse_options({"temperature": 100}))
    _, conclusion = compare_scales(spec, (0, 0), range(0, 4), Thresholds())
    assert conclusion == (
        "No scale gives balanced rows here; the standard 1/√d_k is too flat here (logit "
        "std 0.01022), every scale divided by the temperature 100."
    )
