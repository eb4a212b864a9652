"""The low-precision rules: what overflows which format at which stage, each format's
headroom, and how far an emulated low-precision run strays from float64.

Formats are checked as the statistics were gathered (:attr:`Stats.checked`,
:attr:`Stats.narrow`); an overflow is an error in a format the run computes in
(:func:`severity_for`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from sdpa_cli.diagnosis.causes import temperature_cause, temperature_sharpens
from sdpa_cli.diagnosis.findings import Emulation, Finding, StageAccuracy, index_list
from sdpa_cli.engine import precision
from sdpa_cli.engine.conventions import convention
from sdpa_cli.engine.records import OVERFLOW_STAGES
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.text import format_index, plural, sig

PRECISION_LOSS = 16
"""An emulated stage whose error exceeds this many unit roundoffs lost precision."""

_OVERFLOW_WHAT = {
    "raw": ("QKᵀ overflows", "raw score"),
    "scaled": ("the scaled logits overflow", "logit"),
    "masked": ("the logits with bias and mask overflow", "logit"),
    "output": ("the output overflows", "value"),
}
_OVERFLOW_HINT = {
    "raw": "kernels that store QKᵀ before scaling overflow here; scaling Q and K by √scale "
    "first avoids it (--prescale shows the effect), as does bfloat16",
    "scaled": "the logits themselves are out of range: was 1/√d_k applied? "
    "a softcap (--softcap) or float32 logits avoid it",
    "masked": "the bias or float mask pushes logits out of range",
    "output": "V's values (or the weights on them) are out of range for this format",
}


def severity_for(dtype: str, working: tuple[str, ...]) -> str:
    """An overflow's severity: an error in a format the computation runs in;
    a warning in float16 (the mission's concern) otherwise; info for the rest."""
    if dtype in working:
        return "error"
    return "warning" if dtype == "float16" else "info"


# --- overflow ---------------------------------------------------------------------------


def overflow(spec: AttentionSpec, stats: Stats, working: tuple[str, ...]) -> Iterator[Finding]:
    """Every overflow: of a stage's values, of an exp without max-subtraction, of the
    mask value (alone, or added to the logits)."""
    yield from _stage_overflow(spec, stats, working)
    yield from _exp_overflow(stats, working)
    yield from _mask_value_overflow(spec, stats, working)


def _stage_overflow(
    spec: AttentionSpec, stats: Stats, working: tuple[str, ...]
) -> Iterator[Finding]:
    """The stages whose values go beyond a checked format's range."""
    # A temperature below 1 that sharpens every row, not the scale, puts the logits there.
    hints = dict(_OVERFLOW_HINT)
    if temperature_sharpens(spec):
        hints["scaled"] = (
            f"the logits themselves are out of range: {temperature_cause(spec, 'sharpens')}; "
            "a softcap (--softcap) or float32 logits avoid it"
        )
    for d in stats.checked:
        for stage in OVERFLOW_STAGES:
            rec = stats.records.overflow[(stage, d)]
            # A logit stage is reported where some value first goes out of range, not
            # where it merely inherits the stage before's overflow: causes, not echoes.
            if not stats.records.fresh_overflow[(stage, d)].count:
                continue
            f = precision.fmt(d)
            what, unit = _OVERFLOW_WHAT[stage]
            yield Finding(
                "overflow",
                severity_for(d, working),
                f"{what} {d}: {plural(rec.count, unit)} beyond ±{sig(f.max)} "
                f"(largest {sig(rec.extreme)} at {format_index(rec.extreme_at)}; "
                f"headroom {f.headroom(rec.extreme):+.1f} bits)",
                hint=hints[stage],
                index=rec.first,
                stage=stage,
                dtype=d,
                count=rec.count,
                details={
                    "largest": rec.extreme,
                    "largest_at": index_list(rec.extreme_at),
                    "headroom_bits": f.headroom(rec.extreme),
                },
            )


def _exp_overflow(stats: Stats, working: tuple[str, ...]) -> Iterator[Finding]:
    """Logits whose exp overflows a narrow format when the row max is not subtracted."""
    for d in stats.narrow:
        rec = stats.records.exp_overflow[d]
        if rec.count:
            f = precision.fmt(d)
            yield Finding(
                "overflow",
                severity_for(d, working),
                f"exp without max-subtraction overflows {d}: {plural(rec.count, 'logit')} above "
                f"log({sig(f.max)}) = {sig(f.exp_limit)} (largest {sig(rec.extreme)} at "
                f"{format_index(rec.extreme_at)})",
                hint="a softmax that subtracts the row max first (every framework's) is safe; "
                "a hand-written exp(x) / Σexp(x) is not",
                index=rec.first,
                stage="weights",
                dtype=d,
                count=rec.count,
                details={"largest": rec.extreme, "limit": f.exp_limit},
            )


def _mask_value_overflow(
    spec: AttentionSpec, stats: Stats, working: tuple[str, ...]
) -> Iterator[Finding]:
    """A finite mask value beyond a logit format, or overflowing it once added to the
    logits; only when some key is hidden."""
    mv = spec.options.effective_mask_value
    if not (math.isfinite(mv) and _anything_hidden(stats)):
        return
    framework = spec.options.framework
    if framework is not None and convention(framework).float32_logits:
        return  # its logits, and the mask value in them, are float32 or wider
    # Logits are not stored in float8 (FP8 kernels keep them in float32).
    for d in stats.records.mask_add_overflow:
        f = precision.fmt(d)
        # finfo-min is each format's own minimum: it never overflows by itself.
        own = spec.options.mask_value_is_finfo_min
        if not own and bool(f.overflows(np.asarray([mv]))[0]):
            yield Finding(
                "overflow",
                severity_for(d, working),
                f"the mask value {spec.options.mask_value_label} is −inf in {d} "
                f"(beyond ±{sig(f.max)})",
                hint="harmless while every row keeps a visible key; a fully masked row then "
                f"gives NaN in kernels without a safe softmax; finfo({d}).min = "
                f"{sig(-f.max)} stays finite",
                stage="masked",
                dtype=d,
                count=None,
            )
            continue
        rec = stats.records.mask_add_overflow[d]
        if rec.count:
            yield Finding(
                "overflow",
                severity_for(d, working),
                f"the mask value {_mask_value_in(spec, d)} plus the logits overflows "
                f"{d} at {rec.count} hidden positions (e.g. {sig(-rec.extreme)} at "
                f"{format_index(rec.extreme_at)})",
                hint="kernels that add finfo.min to the logits (rather than replace them) "
                "get −inf there; fine unless a row is fully masked (then NaN)",
                index=rec.first,
                stage="masked",
                dtype=d,
                count=rec.count,
            )


def _mask_value_in(spec: AttentionSpec, d: str) -> str:
    o = spec.options
    if o.mask_value_is_finfo_min:
        return f"finfo({d}).min = {sig(o.mask_value_in(d))}"
    return o.mask_value_label


def _anything_hidden(stats: Stats) -> bool:
    return bool((stats.n_visible < stats.spec.S).any())


# --- headroom and emulation -----------------------------------------------------------------


def headroom(stats: Stats) -> dict[str, dict[str, float]]:
    """Per checked format, per stage: log2(format max / largest magnitude seen)."""
    out: dict[str, dict[str, float]] = {}
    for d in stats.checked:
        f = precision.fmt(d)
        out[d] = {
            stage: f.headroom(stats.records.absmax[stage].extreme)
            for stage in OVERFLOW_STAGES
            if stats.records.absmax[stage].count
        }
    return out


def emulation(spec: AttentionSpec, stats: Stats) -> Emulation | None:
    """Each emulated stage against float64, and whether it overflowed or lost
    precision (an error beyond :data:`PRECISION_LOSS` unit roundoffs); None when the
    run is not emulated."""
    o = spec.options
    if not o.emulated:
        return None
    u = precision.fmt(o.dtype).unit_roundoff
    stages = []
    for stage, err in stats.records.errors.items():
        normwise = err.max_abs / err.ref_absmax if err.ref_absmax > 0 else 0.0
        problem = None
        if err.new_nonfinite.count:
            problem = "overflowed"
        elif normwise > PRECISION_LOSS * u:
            problem = "lost precision"
        stages.append(
            StageAccuracy(
                stage=stage,
                max_abs=err.max_abs,
                max_abs_at=err.max_abs_at,
                normwise=normwise,
                max_row_rel=err.max_row_rel,
                max_row_rel_at=err.max_row_rel_at,
                new_nonfinite=err.new_nonfinite.count,
                new_nonfinite_at=err.new_nonfinite.first,
                problem=problem,
            )
        )
    return Emulation(
        o.dtype, o.accumulate, o.softmax_dtype, o.logits_dtype, o.prescale, tuple(stages)
    )
