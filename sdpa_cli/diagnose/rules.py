"""Statistics + thresholds → findings: data, never exceptions.

Every finding has a ``kind`` (exactly one of :data:`KINDS`), a ``severity``
(``info``, ``warning`` or ``error``), a message and, where they apply, a hint, the
``index`` of the row (``[*lead, i]``) or head (``[*lead]``), the ``stage``, the
``dtype`` and a ``count``. Row findings are listed up to ``max_findings`` per kind
and always counted in full (:attr:`Diagnosis.counts`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import argmax_index
from sdpa_cli.engine import precision
from sdpa_cli.engine.block import STAGES, Trace
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import F64, OVERFLOW_STAGES, Index, Stats, finite_std, working_formats
from sdpa_cli.text import finite_or_none, format_index, plural, sig

KINDS = (
    "nonfinite",
    "overflow",
    "fully_masked",
    "mask_suspect",
    "unscaled",
    "collapsed_head",
    "dead_head",
    "saturated",
    "near_uniform",
    "underflow",
)
"""Every finding kind, in the order they are listed (causes before symptoms)."""

GRADIENT_KINDS = (
    "gradient_nonfinite",
    "gradient_range",
    "vanishing_gradient",
    "weak_head_gradient",
    "no_gradient_keys",
)
"""The kinds ``sdpa grad`` adds (:mod:`sdpa_cli.diagnose.grad`), listed after the rest."""

ALL_KINDS = KINDS + GRADIENT_KINDS

SEVERITIES = ("info", "warning", "error")

CONTRACT_STAGE = {"capped": "scaled", "biased": "masked", "dropped": "weights"}
"""Engine steps reported under the contract's stage names."""

LOST_MASS = 1e-3
"""Weight flushed to zero in one row above which underflow in a working format warns."""

PRECISION_LOSS = 16
"""An emulated stage whose error exceeds this many unit roundoffs lost precision."""


@dataclass(frozen=True)
class Thresholds:
    """When a row or head is flagged. Set by options or a config file (README)."""

    saturation: float = 0.99
    uniform: float = 0.98
    head_fraction: float = 0.9
    max_findings: int = 50
    vanishing: float = 1e-3
    """``sdpa grad``: a row whose softmax passes back at most this fraction of its
    incoming gradient (1 − Σ w², the Jacobian's norm bound) has a vanishing gradient."""


THRESHOLD_NAMES = tuple(Thresholds.__dataclass_fields__)


@dataclass(frozen=True)
class Finding:
    """One thing worth knowing about the computation."""

    kind: str
    severity: str
    message: str
    hint: str | None = None
    index: Index | None = None
    stage: str | None = None
    dtype: str | None = None
    count: int | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract: ``kind``, ``severity``, ``message``, then what applies.

        ``stage`` is one of the contract's six: soft-capping counts as ``scaled``,
        the bias as ``masked`` (the logits with bias and mask), dropout as
        ``weights``; ``details.step`` keeps the exact step when it differs.
        """
        out: dict[str, Any] = {"kind": self.kind, "severity": self.severity}
        out["message"] = self.message
        if self.hint is not None:
            out["hint"] = self.hint
        if self.index is not None:
            out["index"] = list(self.index)
        details = dict(self.details)
        if self.stage is not None:
            out["stage"] = CONTRACT_STAGE.get(self.stage, self.stage)
            if out["stage"] != self.stage:
                details["step"] = self.stage
        for name in ("dtype", "count"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if details:
            out["details"] = details
        return out


@dataclass(frozen=True)
class HeadSummary:
    """One (batch, head) slice: how its rows with ≥ 2 visible keys behave."""

    index: Index
    rows: int
    mean_entropy: float
    mean_normalized_entropy: float
    mean_max_weight: float
    saturated: int
    near_uniform: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": list(self.index),
            "rows": self.rows,
            "mean_entropy": finite_or_none(self.mean_entropy),
            "mean_normalized_entropy": finite_or_none(self.mean_normalized_entropy),
            "mean_max_weight": finite_or_none(self.mean_max_weight),
            "saturated": self.saturated,
            "near_uniform": self.near_uniform,
        }


@dataclass(frozen=True)
class StageAccuracy:
    """One stage of an emulated run against float64."""

    stage: str
    max_abs: float
    max_abs_at: Index | None
    normwise: float
    max_row_rel: float
    max_row_rel_at: Index | None
    new_nonfinite: int
    new_nonfinite_at: Index | None
    problem: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "max_abs_error": finite_or_none(self.max_abs),
            "max_abs_error_at": _idx(self.max_abs_at),
            "normwise_error": finite_or_none(self.normwise),
            "max_row_relative_error": finite_or_none(self.max_row_rel),
            "max_row_relative_error_at": _idx(self.max_row_rel_at),
            "new_nonfinite": self.new_nonfinite,
            "new_nonfinite_at": _idx(self.new_nonfinite_at),
            "problem": self.problem,
        }


@dataclass(frozen=True)
class Emulation:
    """How far an emulated low-precision run strays from float64, stage by stage."""

    dtype: str
    accumulate: str
    softmax_dtype: str
    logits_dtype: str
    prescale: bool
    stages: tuple[StageAccuracy, ...]

    @property
    def first_problem(self) -> StageAccuracy | None:
        """The first stage that overflowed or lost precision, if any."""
        return next((s for s in self.stages if s.problem), None)

    def stage(self, name: str) -> StageAccuracy | None:
        return next((s for s in self.stages if s.stage == name), None)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_problem
        return {
            "dtype": self.dtype,
            "accumulate": self.accumulate,
            "softmax_dtype": self.softmax_dtype,
            "logits_dtype": self.logits_dtype,
            "prescale": self.prescale,
            "first_problem": None
            if first is None
            else {"stage": first.stage, "problem": first.problem},
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass(frozen=True)
class Diagnosis:
    """Everything the diagnose step concluded."""

    findings: tuple[Finding, ...]
    counts: Mapping[str, int]
    heads: tuple[HeadSummary, ...]
    headroom: Mapping[str, Mapping[str, float]]
    emulation: Emulation | None
    thresholds: Thresholds

    @property
    def truncated(self) -> bool:
        """Whether some row findings were counted but not listed."""
        listed: dict[str, int] = {}
        for f in self.findings:
            listed[f.kind] = listed.get(f.kind, 0) + 1
        return any(n > listed.get(k, 0) for k, n in self.counts.items())

    def worst(self) -> str | None:
        """The highest severity found, or None when nothing was."""
        found = {f.severity for f in self.findings}
        return next((s for s in reversed(SEVERITIES) if s in found), None)


def _idx(at: Index | None) -> list[int] | None:
    return None if at is None else list(at)


# --- the diagnose step ----------------------------------------------------------------


def diagnose(source: Trace | Stats, thresholds: Thresholds | None = None) -> Diagnosis:
    """Read the statistics (a trace's, or gathered by a pass of one's own) and return
    every finding, in :data:`KINDS` order."""
    th = thresholds or Thresholds()
    stats = source if isinstance(source, Stats) else source.stats
    spec = stats.spec
    working = working_formats(spec)
    found: dict[str, list[Finding]] = {k: [] for k in KINDS}
    counts: dict[str, int] = {k: 0 for k in KINDS}

    def add(f: Finding, n: int = 1) -> None:
        counts[f.kind] += n
        found[f.kind].append(f)

    for f in _nonfinite(spec, stats):
        add(f)
    for f in _overflow(spec, stats, working):
        add(f)
    heads = _heads(stats, th)
    for kind, rows in _row_findings(spec, stats, th, working):
        counts[kind] += len(rows)
        found[kind].extend(rows[: th.max_findings])
    for f in _mask_suspect(spec, stats):
        add(f)
    for f in _unscaled(spec, stats):
        add(f)
    for f in _head_findings(heads, th):
        add(f)

    ordered = tuple(f for k in KINDS for f in found[k])
    return Diagnosis(
        findings=ordered,
        counts={k: n for k, n in counts.items() if n},
        heads=heads,
        headroom=_headroom(stats),
        emulation=_emulation(spec, stats),
        thresholds=th,
    )


def severity_for(dtype: str, working: tuple[str, ...]) -> str:
    """An overflow's severity: an error in a format the computation runs in;
    a warning in float16 (the mission's concern) otherwise; info for the rest."""
    if dtype in working:
        return "error"
    return "warning" if dtype == "float16" else "info"


# --- non-finite values -----------------------------------------------------------------


def _nonfinite(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    bad_input = False
    for name in ("q", "k", "v", "bias", "mask"):
        arr = getattr(spec, name)
        if arr is None or not precision.is_float(arr.dtype):
            continue
        a = spec.as_loaded(name)
        with np.errstate(invalid="ignore"):
            # −inf is a legitimate way to hide keys in a bias or float mask.
            bad = np.isnan(a) | (a == math.inf) if name in ("bias", "mask") else ~np.isfinite(a)
        n = int(np.count_nonzero(bad))
        if not n:
            continue
        bad_input = True
        nans = int(np.count_nonzero(np.isnan(a)))
        label = name.upper() if name in "qkv" else name
        what = ", ".join(
            part
            for part in (f"{nans} NaN" if nans else "", f"{n - nans} inf" if n - nans else "")
            if part
        )
        first = argmax_index(bad)
        yield Finding(
            "nonfinite",
            "error",
            f"{label} ({spec.names.get(name, name)}) holds {what}; the first at {format_index(first)}",
            hint="every score computed from it is NaN or inf; fix the export, or mask those keys",
            index=first,
            stage="input",
            count=n,
            details={"tensor": name},
        )
    titles = {"raw": "the raw scores", "output": "the output"}
    first_stage = None
    for stage in STAGES:
        record = stats.nonfinite.get(stage)
        if record is None or not record.count:
            continue
        if first_stage is None:
            first_stage = stage
            cause = " (from the non-finite input)" if bad_input else ""
            hint = None
            if stage in ("raw", "scaled", "capped") and not bad_input:
                hint = "the inputs' products exceed the format's range; check their magnitudes"
            elif stage == "weights" and not bad_input:
                hint = "a +inf or NaN logit makes the softmax NaN (inf − inf)"
            yield Finding(
                "nonfinite",
                "error",
                f"non-finite values first appear at {titles.get(stage, stage)}{cause}: "
                f"{record.count}, the first at {format_index(record.first)}",
                hint=hint,
                index=record.first,
                stage=stage,
                count=record.count,
            )
        elif stage == "output":
            yield Finding(
                "nonfinite",
                "error",
                f"the output holds {record.count} non-finite values; the first at "
                f"{format_index(record.first)}",
                index=record.first,
                stage="output",
                count=record.count,
            )


# --- overflow ---------------------------------------------------------------------------

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


def _overflow(spec: AttentionSpec, stats: Stats, working: tuple[str, ...]) -> Iterator[Finding]:
    for d in stats.checked:
        for stage in OVERFLOW_STAGES:
            rec = stats.overflow[(stage, d)]
            # A logit stage is reported where some value first goes out of range, not
            # where it merely inherits the stage before's overflow: causes, not echoes.
            if not stats.fresh_overflow[(stage, d)].count:
                continue
            f = precision.fmt(d)
            what, unit = _OVERFLOW_WHAT[stage]
            yield Finding(
                "overflow",
                severity_for(d, working),
                f"{what} {d}: {plural(rec.count, unit)} beyond ±{sig(f.max)} "
                f"(largest {sig(rec.extreme)} at {format_index(rec.extreme_at)}; "
                f"headroom {f.headroom(rec.extreme):+.1f} bits)",
                hint=_OVERFLOW_HINT[stage],
                index=rec.first,
                stage=stage,
                dtype=d,
                count=rec.count,
                details={
                    "largest": rec.extreme,
                    "largest_at": _idx(rec.extreme_at),
                    "headroom_bits": f.headroom(rec.extreme),
                },
            )
    for d in stats.narrow:
        rec = stats.exp_overflow[d]
        if rec.count:
            f = precision.fmt(d)
            yield Finding(
                "overflow",
                severity_for(d, working),
                f"exp without max-subtraction overflows {d}: {plural(rec.count, 'logit')} above "
                f"log({sig(f.max)}) = {f.exp_limit:.4g} (largest {sig(rec.extreme)} at "
                f"{format_index(rec.extreme_at)})",
                hint="a softmax that subtracts the row max first (every framework's) is safe; "
                "a hand-written exp(x) / Σexp(x) is not",
                index=rec.first,
                stage="weights",
                dtype=d,
                count=rec.count,
                details={"largest": rec.extreme, "limit": f.exp_limit},
            )
    mv = spec.options.effective_mask_value
    if math.isfinite(mv) and _anything_hidden(stats):
        # Logits are not stored in float8 (FP8 kernels keep them in float32).
        for d in stats.mask_add_overflow:
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
            rec = stats.mask_add_overflow[d]
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


def _headroom(stats: Stats) -> dict[str, dict[str, float]]:
    """Per checked format, per stage: log2(format max / largest magnitude seen)."""
    out: dict[str, dict[str, float]] = {}
    for d in stats.checked:
        f = precision.fmt(d)
        out[d] = {
            stage: f.headroom(stats.absmax[stage].extreme)
            for stage in OVERFLOW_STAGES
            if stats.absmax[stage].count
        }
    return out


# --- rows and heads -----------------------------------------------------------------------


@dataclass(frozen=True)
class RowClasses:
    """The row rules, applied once: which rows are one-hot or near-uniform.

    Arrays are shaped like the rows they were computed for (``(*lead, L)``, or one
    slice's ``(L,)``). A row qualifies with ≥ 2 visible keys and finite weights.
    """

    normalized: F64
    eligible: NDArray[np.bool_]
    saturated: NDArray[np.bool_]
    uniform: NDArray[np.bool_]


def classify_rows(stats: Stats, th: Thresholds, at: Index = ()) -> RowClasses:
    """Apply the saturation and uniformity thresholds to the rows at ``at``."""
    n = stats.n_visible[at]
    mw = stats.max_weight[at]
    with np.errstate(invalid="ignore", divide="ignore"):
        normalized = stats.entropy[at] / np.log(np.maximum(n, 2))
    eligible = (n >= 2) & np.isfinite(mw)
    saturated = eligible & (mw >= th.saturation)
    uniform = eligible & (normalized >= th.uniform) & ~saturated
    return RowClasses(normalized, eligible, saturated, uniform)


def _rows(stats: Stats, flagged: NDArray[np.bool_]) -> Iterator[Index]:
    for idx in np.argwhere(flagged):
        yield tuple(int(i) for i in idx)


def _row_findings(
    spec: AttentionSpec, stats: Stats, th: Thresholds, working: tuple[str, ...]
) -> Iterator[tuple[str, list[Finding]]]:
    n = stats.n_visible
    mw = stats.max_weight
    classes = classify_rows(stats, th)
    normalized, saturated, uniform = classes.normalized, classes.saturated, classes.uniform

    hint = saturation_hint(spec)
    rows = []
    for idx in _rows(stats, saturated):
        j = int(stats.argmax[idx])
        rows.append(
            Finding(
                "saturated",
                "warning",
                f"row {format_index(idx)} is one-hot: {float(mw[idx]):.4f} of its weight on key "
                f"{j} of {int(n[idx])} visible",
                hint=hint,
                index=idx,
                stage="weights",
                details={"max_weight": float(mw[idx]), "key": j, "visible": int(n[idx])},
            )
        )
    yield "saturated", rows

    rows = []
    for idx in _rows(stats, uniform):
        rows.append(
            Finding(
                "near_uniform",
                "info",
                f"row {format_index(idx)} is nearly uniform over its {int(n[idx])} visible keys: "
                f"entropy {float(normalized[idx]):.3f} of the maximum, max weight "
                f"{float(mw[idx]):.4f}",
                hint="the logits barely differ: was the scale applied twice (1/d_k), "
                "or are Q and K near zero?",
                index=idx,
                stage="weights",
                details={
                    "entropy": float(stats.entropy[idx]),
                    "normalized_entropy": float(normalized[idx]),
                    "max_weight": float(mw[idx]),
                    "visible": int(n[idx]),
                },
            )
        )
    yield "near_uniform", rows

    rows = []
    # S = 0 included: every row then has no key at all.
    finite_mv = math.isfinite(spec.options.effective_mask_value)
    returns = (
        f"sdpa returns uniform weights over all {spec.S} keys (the mean of V), "
        f"as the finite mask value {spec.options.mask_value_label} makes it"
        if finite_mv and spec.S
        else "sdpa returns zeros for it"
        + (" (there are no keys at all: S = 0)" if not spec.S else "")
    )
    for idx in _rows(stats, n == 0):
        rows.append(
            Finding(
                "fully_masked",
                "warning",
                f"row {format_index(idx)} has no visible key: {returns}",
                hint="PyTorch ≥ 2.5 and FlashAttention return zeros; JAX (mask value "
                "−0.7·finfo.max) returns the mean of V; a plain softmax over all −inf "
                "(PyTorch < 2.5, unguarded kernels, ONNX graphs) returns NaN. Check the "
                "mask: causal lower-right with L > S, a key length of 0, an inverted mask",
                index=idx,
                stage="masked",
            )
        )
    yield "fully_masked", rows

    rows = []
    for d in stats.narrow:
        f = precision.fmt(d)
        counts = stats.underflow[d]
        for idx in _rows(stats, counts > 0):
            lost = float(stats.lost[d][idx])
            serious = d in working and lost >= LOST_MASS
            rows.append(
                Finding(
                    "underflow",
                    "warning" if serious else "info",
                    f"row {format_index(idx)}: {plural(int(counts[idx]), 'weight')} "
                    f"(together {lost:.3g}) flush to zero in {d} (below {sig(f.tiny / 2)})",
                    hint="harmless when the lost weight is tiny; otherwise keep the weights in "
                    "float32 or bfloat16",
                    index=idx,
                    stage="weights",
                    dtype=d,
                    count=int(counts[idx]),
                    details={"lost_weight": lost},
                )
            )
    yield "underflow", rows


def saturation_hint(spec: AttentionSpec) -> str:
    factor = spec.scale / spec.options.temperature
    if spec.E > 1 and factor > spec.E**-0.25:
        return (
            f"the scale is {spec.scale_label}: was 1/√d_k (1/√{spec.E} = "
            f"{1 / math.sqrt(spec.E):.4g}) applied? Without it the logits' spread grows "
            "with √d_k and the softmax saturates"
        )
    return (
        "very large logit gaps saturate the softmax: check that 1/√d_k was applied once, "
        "and that low precision did not clip the logits; a one-hot row passes almost no gradient"
    )


def _heads(stats: Stats, th: Thresholds) -> tuple[HeadSummary, ...]:
    classes = classify_rows(stats, th)
    heads = []
    for lead in np.ndindex(*stats.spec.lead):
        e = classes.eligible[lead]
        rows = int(e.sum())
        if rows:
            heads.append(
                HeadSummary(
                    index=tuple(int(i) for i in lead),
                    rows=rows,
                    mean_entropy=float(stats.entropy[lead][e].mean()),
                    mean_normalized_entropy=float(classes.normalized[lead][e].mean()),
                    mean_max_weight=float(stats.max_weight[lead][e].mean()),
                    saturated=int(classes.saturated[lead].sum()),
                    near_uniform=int(classes.uniform[lead].sum()),
                )
            )
        else:
            heads.append(
                HeadSummary(tuple(int(i) for i in lead), 0, math.nan, math.nan, math.nan, 0, 0)
            )
    return tuple(heads)


def _head_findings(heads: tuple[HeadSummary, ...], th: Thresholds) -> Iterator[Finding]:
    for h in heads:
        if h.rows < 2:
            continue
        name = f"head {format_index(h.index)}" if h.index else "the head (a single slice)"
        summary = (
            f"mean entropy {h.mean_normalized_entropy:.3f} of the maximum, "
            f"mean max weight {h.mean_max_weight:.4f}"
        )
        details = {
            "rows": h.rows,
            "mean_entropy": h.mean_entropy,
            "mean_normalized_entropy": h.mean_normalized_entropy,
            "mean_max_weight": h.mean_max_weight,
        }
        if h.saturated >= th.head_fraction * h.rows:
            yield Finding(
                "collapsed_head",
                "warning",
                f"{name} has collapsed: {h.saturated} of {h.rows} rows are one-hot ({summary})",
                hint="every query copies a single key: check the scale and the logits' range",
                index=h.index,
                stage="weights",
                count=h.saturated,
                details=details,
            )
        elif h.near_uniform >= th.head_fraction * h.rows:
            yield Finding(
                "dead_head",
                "warning",
                f"{name} is dead: {h.near_uniform} of {h.rows} rows are nearly uniform ({summary})",
                hint="the head averages V instead of attending: Q or K near zero, "
                "the scale applied twice, or a temperature too high",
                index=h.index,
                stage="weights",
                count=h.near_uniform,
                details=details,
            )


# --- the scale -------------------------------------------------------------------------------


def _unscaled(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    E = spec.E
    raw_std = stats.raw_std
    if E < 2 or not math.isfinite(raw_std) or raw_std == 0:
        return
    factor = spec.scale / spec.options.temperature
    logit_std = raw_std * factor
    sq, sk = finite_std(spec.q), finite_std(spec.k)
    predicted = math.sqrt(E) * sq * sk
    numbers = (
        f"std of QKᵀ {raw_std:.4g} (√d_k·σ_q·σ_k = √{E}·{sq:.3g}·{sk:.3g} = {predicted:.4g}); "
        f"effective scale {factor:.4g}, so the logits' std is {logit_std:.4g}"
    )
    proper = raw_std / math.sqrt(E)
    details = {
        "raw_std": raw_std,
        "predicted_raw_std": predicted,
        "sigma_q": sq,
        "sigma_k": sk,
        "effective_scale": factor,
        "logit_std": logit_std,
        "logit_std_with_sqrt_dk": proper,
    }
    # Closer (in log) to 1 than to 1/√d_k, and the logits spread enough to saturate.
    if factor > E**-0.25 and logit_std > 2:
        yield Finding(
            "unscaled",
            "warning",
            f"1/√d_k looks omitted: {numbers}; with 1/√{E} it would be {proper:.4g}",
            hint=f"divide the scores by √d_k = {math.sqrt(E):.4g} (--scale sqrt-dk)",
            stage="scaled",
            details=details,
        )
    # Closer to 1/d_k than to 1/√d_k, and the logits too flat to select anything.
    elif factor < E**-0.75 and logit_std < 0.5:
        yield Finding(
            "unscaled",
            "warning",
            f"1/√d_k looks applied twice: {numbers}; with 1/√{E} once it would be {proper:.4g}",
            hint="the scores were divided by d_k (or scaled before export and again here); "
            "use --scale sqrt-dk once, or --scale none for pre-scaled Q",
            stage="scaled",
            details=details,
        )


# --- masks -------------------------------------------------------------------------------------


def _mask_suspect(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    o = spec.options
    for name in ("mask", "bias"):
        arr = getattr(spec, name)
        if arr is None or arr.dtype == np.bool_:
            continue
        a = np.asarray(arr)
        zeros, ones = a == 0, a == 1
        if (zeros | ones).all() and zeros.any() and ones.any():
            yield Finding(
                "mask_suspect",
                "warning",
                f"the float {name} ({spec.names.get(name, name)}) holds only 0 and 1: it adds "
                "+1 to some logits instead of hiding keys",
                hint="a boolean mask cast to float? Pass it as bool (True = may attend), "
                "or as 0 / −inf",
                stage="input",
                count=int(ones.sum()),
                details={"tensor": name},
            )
    if spec.mask_is_bool:
        assert spec.mask is not None
        m = np.asarray(spec.mask)
        allowed = ~m if o.mask_true_means == "masked" else m
        hidden = 1.0 - float(allowed.mean()) if allowed.size else 0.0
        if hidden > 0.5:
            empty_rows = bool((~allowed.any(axis=-1)).any())
            diag_hidden = False
            if spec.L == spec.S and spec.L > 1 and allowed.shape[-1] == allowed.shape[-2]:
                diag = np.diagonal(allowed, axis1=-2, axis2=-1)
                diag_hidden = float(diag.mean()) < 0.5
            other = "masked" if o.mask_true_means == "attend" else "attend"
            yield Finding(
                "mask_suspect",
                "warning" if empty_rows or diag_hidden else "info",
                f"the boolean mask hides {hidden:.0%} of the keys (True = {o.mask_true_means})"
                + ("; it hides the diagonal" if diag_hidden else "")
                + ("; it leaves rows with no key" if empty_rows else ""),
                hint=f"if True means {other} in your framework, pass --mask-true-means {other}",
                stage="input",
                details={"hidden_fraction": hidden},
            )
    empty = int((stats.n_visible == 0).sum()) if spec.S else 0
    if empty and math.isfinite(o.effective_mask_value):
        yield Finding(
            "mask_suspect",
            "warning",
            f"{empty} rows have no visible key, and the finite mask value "
            f"{o.mask_value_label} makes their weights uniform over hidden keys "
            "(the output is the mean of V) instead of zero",
            hint="mask with −inf (and a safe softmax) to get zeros, or make sure no row is "
            "fully masked",
            stage="masked",
            count=empty,
        )
    for name, rec in stats.hidden_bad.items():
        if not rec.count:
            continue
        label = name.upper()
        effect = (
            "sdpa's weights ignore it, but kernels that add the mask (−inf + NaN) return NaN"
            if name == "k"
            else "0 · NaN = NaN, so the output is poisoned here and in most kernels"
        )
        yield Finding(
            "mask_suspect",
            "warning",
            f"{label} holds NaN or inf at keys hidden from {rec.count} (row, key) pairs, the "
            f"first at {format_index(rec.first)}: {effect}",
            hint=f"zero the padded rows of {label} before export",
            index=rec.first,
            stage="input",
            count=rec.count,
            details={"tensor": name},
        )


# --- emulation ----------------------------------------------------------------------------------


def _emulation(spec: AttentionSpec, stats: Stats) -> Emulation | None:
    o = spec.options
    if not o.emulated:
        return None
    u = precision.fmt(o.dtype).unit_roundoff
    stages = []
    for stage, err in stats.errors.items():
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


# --- flags for the tables ------------------------------------------------------------------


def row_flags(
    stats: Stats, th: Thresholds, lead: Index, working: tuple[str, ...] = ()
) -> dict[int, tuple[str, str]]:
    """Query row → (short label, severity) for the flagged rows of one slice.

    Read from the statistics, so every flagged row is marked, listed or not.
    Underflow marks a row only where it loses weight in a format the run uses.
    """
    n = stats.n_visible[lead]
    mw = stats.max_weight[lead]
    classes = classify_rows(stats, th, lead)
    flags: dict[int, tuple[str, str]] = {}
    for i in range(n.shape[0]):
        if stats.spec.S and n[i] == 0:
            flags[i] = ("no keys", "warning")
        elif not math.isfinite(float(mw[i])):
            flags[i] = ("NaN", "error")
        elif classes.saturated[i]:
            flags[i] = ("one-hot", "warning")
        elif classes.uniform[i]:
            flags[i] = ("uniform", "info")
        else:
            for d in working:
                lost = stats.lost.get(d)
                if lost is not None and lost[(*lead, i)] >= LOST_MASS:
                    flags[i] = (f"underflow {SHORT.get(d, d)}", "warning")
                    break
    return flags


SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
