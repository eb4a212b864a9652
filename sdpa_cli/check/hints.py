"""Hints on failed comparisons: the computation re-run under the slips a kernel or a port
most often makes (:mod:`~sdpa_cli.check.alternatives`), one at a time, and under the
measured tolerance; a hint says which one the export matches.

Whether an alternative matches does not depend on the failed check's own tolerance
(:func:`export_matches`): the export must sit within the export format's default
tolerances, loosened ×4, nearly everywhere, and much closer to the alternative than to
the reference of the options given.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.alternatives import alternatives
from sdpa_cli.check.compare import (
    DTYPE_TOLERANCES,
    MEASURED_FUDGE,
    compare,
    measured_tolerance,
)
from sdpa_cli.check.error_stats import by_slice, pairs
from sdpa_cli.check.exports import EXPORT_STAGES, Fitted, as_naive, tensor_values
from sdpa_cli.check.records import Check
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine import precision
from sdpa_cli.engine.fp8 import judged_in
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import Trace, trace
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.text import sig

_SUSPECT_LIMIT = 1 << 22
"""Scores in a case above which a failed comparison is re-tried under other options on
its worst slices only."""

MATCH_LOOSENING = 4.0
"""How much looser than the export format's defaults an alternative may be matched."""
MATCH_OUTLIERS = 1e-3
"""The share of elements (0.1%) an alternative may miss and still match."""
MATCH_GAIN = 10.0
"""How many times smaller the RMS error against an alternative must be than against
the reference of the options given."""


def export_matches(
    export: NDArray[Any], alternative: NDArray[Any], reference: NDArray[Any], export_format: str
) -> bool:
    """Whether an export is the alternative computation rather than the reference.

    It is when (a) ``|export − alternative| ≤ 4·atol + 4·rtol·m`` (the defaults of
    ``export_format``, :data:`~sdpa_cli.check.compare.DTYPE_TOLERANCES`; ``m`` the
    largest finite |alternative| of the element's row, its last axis) on all but 0.1%
    of the elements finite on either side (one finite side counts as a miss), and (b)
    the RMS of ``export − alternative`` is at most a tenth of the RMS of ``export −
    reference`` (each over the pairs finite on both sides). A row's scale, not the
    element's own: a 16-bit kernel rounds its weights at the row's scale, so an
    output element near zero is off by what its row's largest is (a bfloat16 Gemma 2
    export with its scale applied twice left 0.2% of its elements past their own
    tolerance, none past their row's). (b) keeps an alternative that changes nothing,
    or next to nothing, from matching an export that fails for another reason. All
    three arrays have one shape.
    """
    rtol, atol = (MATCH_LOOSENING * t for t in DTYPE_TOLERANCES[export_format])
    got = np.asarray(export, dtype=np.float64)
    alt = np.asarray(alternative, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        both = np.isfinite(got) & np.isfinite(alt)
        counted = int(np.count_nonzero(np.isfinite(got) | np.isfinite(alt)))
        if not both.any():
            return False
        magnitude = np.where(np.isfinite(alt), np.abs(alt), 0.0)
        if alt.ndim:
            magnitude = np.broadcast_to(np.max(magnitude, axis=-1, keepdims=True), alt.shape)
        diff = np.abs(got[both] - alt[both])
        within = int(np.count_nonzero(diff <= atol + rtol * magnitude[both]))
        if counted - within > MATCH_OUTLIERS * counted:
            return False
        against = np.isfinite(got) & np.isfinite(ref)
        if not against.any():
            return False
        rms_alt = math.sqrt(float(np.mean(np.square(diff))))
        rms_ref = math.sqrt(float(np.mean(np.square(got[against] - ref[against]))))
    # A reference exact on every finite pair leaves nothing for an alternative to explain.
    return rms_ref > 0 and rms_alt * MATCH_GAIN <= rms_ref


# --- the hints --------------------------------------------------------------------------


def with_hints(
    checks: list[Check],
    spec: AttentionSpec,
    settings: CheckSettings,
    fitted: Mapping[str, Fitted],
    ref: Mapping[str, F64],
    export: str,
    ref_format: str,
    matched: dict[str, AttentionSpec] | None = None,
) -> list[Check]:
    """A hint on each failed comparison that one alternative computation explains
    (:func:`export_matches` against ``ref``, the reference of the options given), or
    that the measured tolerance (the naive low-precision error) would pass. Each
    alternative is computed once, for every failed comparison; in a case of more than
    :data:`_SUSPECT_LIMIT` scores, on the slices whose error is largest (as many as
    that many scores hold, at least one), and without the alternatives that read the
    tensors across slices (another layout, the bias inside the softcap). ``matched``,
    when given, is told the computation each explained export matches, where the
    alternative is one (:attr:`Alternative.spec`)."""
    failing = {
        c.name.removesuffix(".close"): c
        for c in checks
        if c.status == "fail" and c.name.endswith(".close")
    }
    leads = None
    if math.prod(spec.weights_shape) > _SUSPECT_LIMIT:
        # A large case: the alternatives on its worst slices only, for the exports in
        # the engine's layout (a merged or bshd output's slices are not its own).
        failing = {n: c for n, c in failing.items() if not fitted[n].merged}
        leads = _worst_slices(failing, spec, fitted, ref)
    hints = _format_hints(failing, fitted, export)
    hints.update(
        _option_hints(
            {n: c for n, c in failing.items() if n not in hints},
            spec,
            fitted,
            ref,
            export,
            ref_format,
            leads,
            matched,
        )
    )
    unexplained = {name: c for name, c in failing.items() if name not in hints}
    hints.update(_tolerance_hints(unexplained, spec, settings, fitted, ref, export))
    out = []
    for c in checks:
        name = c.name.removesuffix(".close")
        hint = hints.get(name) if c is failing.get(name) else None
        out.append(c if hint is None else dataclasses.replace(c, hint=hint))
    return out


NARROWER = ("bfloat16", "float16")
"""Formats a float32 or float64 export is most often computed in and stored wider."""


def _format_hints(
    failing: Mapping[str, Check], fitted: Mapping[str, Fitted], export: str
) -> dict[str, str]:
    """For each failed comparison of a float32 or float64 export whose every value is
    a number of a narrower format: the export was likely computed in that format and
    stored wider (at least 16 non-zero values, so that a few round numbers prove
    nothing)."""
    hints: dict[str, str] = {}
    if export not in ("float32", "float64"):
        return hints
    for name in failing:
        values = np.asarray(fitted[name].exp.values, dtype=np.float64)
        finite = values[np.isfinite(values)]
        if np.count_nonzero(finite) < 16:
            continue
        for fmt in NARROWER:
            if np.array_equal(precision.round_to(finite, fmt), finite):
                hints[name] = (
                    f"every exported value is a {fmt} number: the export looks computed "
                    f"in {fmt} and stored as {export}; if so, check it with --dtype {fmt}"
                )
                break
    return hints


def _option_hints(
    failing: Mapping[str, Check],
    spec: AttentionSpec,
    fitted: Mapping[str, Fitted],
    ref: Mapping[str, F64],
    export: str,
    ref_format: str,
    leads: Sequence[Index] | None = None,
    matched: dict[str, AttentionSpec] | None = None,
) -> dict[str, str]:
    """For each failed comparison (by export), the first alternative the export
    matches (on the slices ``leads`` only, when given)."""

    def pick(values: NDArray[Any]) -> NDArray[Any]:
        return values if leads is None else np.stack([values[at] for at in leads])

    hints: dict[str, str] = {}
    for alt in alternatives(spec, ref_format, leads):
        pending = [n for n in failing if n not in hints]
        if not pending:
            break
        for name in pending:
            got = alt.values(name, fitted[name].merged)
            if got is not None and export_matches(
                pick(fitted[name].values), pick(got), pick(ref[name]), judged_in(spec, export)
            ):
                hints[name] = alt.hint
                if matched is not None and alt.spec is not None:
                    matched[name] = alt.spec
    return hints


def _worst_slices(
    failing: Iterable[str],
    spec: AttentionSpec,
    fitted: Mapping[str, Fitted],
    ref: Mapping[str, F64],
) -> list[Index]:
    """The (batch, head) slices a large case's alternatives are computed on: those
    whose RMS error is largest in the failed exports, as many as
    :data:`_SUSPECT_LIMIT` scores hold (at least one), in C order."""
    room = max(1, _SUSPECT_LIMIT // max(spec.L * spec.S, 1))
    n = math.prod(spec.lead)
    error = np.zeros(n)
    for name in failing:
        axes = 1 if name == "lse" else 2
        a_view, r_view = by_slice(fitted[name].values, axes), by_slice(ref[name], axes)
        for at, a, r, finite in pairs(a_view, r_view):
            with np.errstate(invalid="ignore", over="ignore"):
                err = np.where(finite, a - r, 0.0).reshape(len(a), -1)
            error[at] = np.maximum(error[at], np.sqrt(np.mean(err * err, axis=1)))
    worst = np.argsort(-error, kind="stable")[:room]
    return [tuple(int(i) for i in np.unravel_index(k, spec.lead)) for k in sorted(worst)]


def _tolerance_hints(
    failing: Mapping[str, Check],
    spec: AttentionSpec,
    settings: CheckSettings,
    fitted: Mapping[str, Fitted],
    ref: Mapping[str, F64],
    export: str,
) -> dict[str, str]:
    """For each failed comparison of a 16- or 8-bit export under the dtype's default
    tolerance, whether the measured tolerance would pass it. Only a check whose
    tolerance came from the defaults (its source ends with ``defaults``) gets one: a
    given or measured tolerance, or a kernel-relative one, is left as judged."""
    hints: dict[str, str] = {}
    if export in ("float64", "float32"):
        return hints
    judged = {
        name: c
        for name, c in failing.items()
        if c.tolerance is not None and c.tolerance.source.endswith("defaults")
    }
    # the stages those exports read, not every score-sized one
    stages = tuple(dict.fromkeys(s for name in judged for s in EXPORT_STAGES[name]))
    naive: Trace | None = None
    for name in judged:
        if naive is None:
            naive = trace(as_naive(spec, export), stages, gather_stats=False)
        naive_values = tensor_values(naive, name, fitted[name].merged)
        tol = measured_tolerance(ref[name], naive_values, export, settings.fudge)
        if not compare(fitted[name].values, ref[name], tol.rtol, tol.atol).mismatched:
            hints[name] = (
                f"it passes --tolerance measured (rtol {sig(tol.rtol, 3)}, atol {sig(tol.atol, 3)}): "
                f"no worse than the naive {export} computation ×{sig(settings.fudge or MEASURED_FUDGE, 6)}, "
                "as PyTorch's kernel tests judge"
            )
    return hints
