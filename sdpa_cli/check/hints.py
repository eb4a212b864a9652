"""Hints on failed comparisons: the computation re-run under the options a kernel most
often gets wrong, one at a time, and under the measured tolerance; a hint says which
one the export matches."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

from sdpa_cli.check.compare import compare, measured_tolerance
from sdpa_cli.check.exports import (
    RUN_STAGES,
    Fitted,
    as_naive,
    as_reference,
    tensor_values,
)
from sdpa_cli.check.records import Check
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine.spec import AttentionSpec, scale_factor
from sdpa_cli.engine.trace import Trace, trace
from sdpa_cli.engine.types import F64
from sdpa_cli.text import sig

_SUSPECT_LIMIT = 1 << 22
"""Scores in a case above which a failed comparison is not re-tried under other options."""


def _alternatives(spec: AttentionSpec) -> Iterator[tuple[str, AttentionSpec]]:
    """The computation under the options a kernel most often gets wrong, one at a time."""
    o = spec.options

    def alt(**changes: Any) -> AttentionSpec:
        return dataclasses.replace(spec, options=dataclasses.replace(o, **changes))

    for rule, what in (("dk", "1/E"), ("sqrt-dk", "1/√E"), ("none", "1")):
        if o.scale != rule and not math.isclose(spec.scale, scale_factor(rule, spec.E)):
            yield f"--scale {rule} (scale {what})", spec.with_scale(rule)
    yield ("--no-causal" if o.causal else "--causal"), alt(causal=not o.causal)
    if (o.causal or o.window is not None) and spec.L != spec.S:
        other = "lower-right" if o.causal_align == "upper-left" else "upper-left"
        yield f"--causal-align {other}", alt(causal_align=other)
    if spec.mask_is_bool:
        other = "masked" if o.mask_true_means == "attend" else "attend"
        yield f"--mask-true-means {other}", alt(mask_true_means=other)
    if o.key_lengths is not None:
        yield "no --key-lengths (padding keys attended)", alt(key_lengths=None)
    if spec.bias is not None:
        yield "no --bias", dataclasses.replace(spec, bias=None)


def with_hints(
    checks: list[Check],
    spec: AttentionSpec,
    settings: CheckSettings,
    fitted: Mapping[str, Fitted],
    ref: Mapping[str, F64],
    export: str,
    ref_format: str,
) -> list[Check]:
    """A hint on each failed comparison that one changed option would pass, or that
    the measured tolerance (the naive low-precision error) would. Each alternative is
    computed once, for every failed comparison; a case of more than
    :data:`_SUSPECT_LIMIT` scores gets none."""
    if math.prod(spec.weights_shape) > _SUSPECT_LIMIT:
        return checks
    failing = {
        c.name.removesuffix(".close"): c
        for c in checks
        if c.status == "fail" and c.name.endswith(".close")
    }
    hints = _option_hints(failing, spec, fitted, ref_format)
    unexplained = {name: c for name, c in failing.items() if name not in hints}
    hints.update(_tolerance_hints(unexplained, spec, settings, fitted, ref, export))
    out = []
    for c in checks:
        name = c.name.removesuffix(".close")
        hint = hints.get(name) if c is failing.get(name) else None
        out.append(c if hint is None else dataclasses.replace(c, hint=hint))
    return out


def _option_hints(
    failing: Mapping[str, Check],
    spec: AttentionSpec,
    fitted: Mapping[str, Fitted],
    ref_format: str,
) -> dict[str, str]:
    """For each failed comparison (by export), the first alternative option under
    which the export matches the reference."""
    hints: dict[str, str] = {}
    for label, alt in _alternatives(spec):
        pending = [n for n in failing if n not in hints]
        if not pending:
            break
        run = trace(as_reference(alt, ref_format), RUN_STAGES, gather_stats=False)
        for name in pending:
            tol = failing[name].tolerance
            assert tol is not None
            got = tensor_values(run, name, fitted[name].merged)
            if not compare(fitted[name].values, got, tol.rtol, tol.atol).mismatched:
                hints[name] = (
                    f"the export matches the computation with {label}: "
                    "the kernel and these options disagree on it"
                )
    return hints


def _tolerance_hints(
    failing: Mapping[str, Check],
    spec: AttentionSpec,
    settings: CheckSettings,
    fitted: Mapping[str, Fitted],
    ref: Mapping[str, F64],
    export: str,
) -> dict[str, str]:
    """For each failed comparison of a 16- or 8-bit export under the dtype's default
    tolerance, whether the measured tolerance would pass it."""
    hints: dict[str, str] = {}
    narrow = export not in ("float64", "float32")
    naive: Trace | None = None
    for name, c in failing.items():
        if not narrow or c.tolerance is None:
            continue
        if not c.tolerance.source.endswith("defaults"):
            continue
        if naive is None:
            naive = trace(as_naive(spec, export), RUN_STAGES, gather_stats=False)
        naive_values = tensor_values(naive, name, fitted[name].merged)
        tol = measured_tolerance(ref[name], naive_values, export, settings.fudge)
        if not compare(fitted[name].values, ref[name], tol.rtol, tol.atol).mismatched:
            hints[name] = (
                f"it passes --tolerance measured (rtol {sig(tol.rtol, 3)}, atol {sig(tol.atol, 3)}): "
                f"no worse than the naive {export} computation ×{sig(settings.fudge, 6)}, "
                "as PyTorch's kernel tests judge"
            )
    return hints
