"""The row and head rules: which query rows are one-hot, near uniform, fully masked or
losing weight to underflow, which heads collapsed or died; their findings, the heads'
summaries and the tables' row flags.

A row qualifies for the saturation and uniformity rules with ≥ 2 visible keys and
finite weights, and is flagged only where random logits are as peaked or as flat in
fewer than 1 in 50,000 rows over as many keys (:mod:`~sdpa_cli.diagnosis.chance`:
over a few keys, they often are); every rule reads the statistics, so every flagged
row is counted, whether or not it is listed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnosis.causes import flat_cause, peaked_cause, saturation_hint
from sdpa_cli.diagnosis.chance import CHANCE, flat_chance, peaked_chance
from sdpa_cli.diagnosis.findings import Finding, HeadSummary, Thresholds
from sdpa_cli.engine import precision
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.text import format_index, plural, sig

LOST_MASS = 1e-3
"""Weight flushed to zero in one row above which underflow in a working format warns."""

SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
"""Formats as a row flag names them (``underflow f16``)."""


@dataclass(frozen=True)
class RowClasses:
    """The row rules, applied once: which rows are one-hot or near-uniform.

    Arrays are shaped like the rows they were computed for (``(*lead, L)``, or one
    slice's ``(L,)``). A row qualifies with ≥ 2 visible keys and finite weights; past
    its threshold it is flagged where random logits are rarely as peaked or as flat
    (:data:`~sdpa_cli.diagnosis.chance.CHANCE`), left in ``by_chance`` where not.
    """

    normalized: F64
    eligible: NDArray[np.bool_]
    saturated: NDArray[np.bool_]
    uniform: NDArray[np.bool_]
    by_chance: NDArray[np.bool_]


def classify_rows(stats: Stats, th: Thresholds, at: Index = ()) -> RowClasses:
    """Apply the saturation and uniformity thresholds to the rows at ``at``."""
    n = stats.n_visible[at]
    mw = stats.max_weight[at]
    with np.errstate(invalid="ignore", divide="ignore"):
        normalized = stats.entropy[at] / np.log(np.maximum(n, 2))
    eligible = (n >= 2) & np.isfinite(mw)
    peaked = eligible & (mw >= th.saturation)
    flat = eligible & (normalized >= th.uniform) & ~peaked
    saturated, uniform = peaked.copy(), flat.copy()
    pair = peaked & (n == 2)  # over 3 keys or more 0.99 is rarer than CHANCE already
    saturated[pair] = peaked_chance(mw[pair]) < CHANCE
    uniform[flat] = flat_chance(n[flat], normalized[flat]) < CHANCE
    by_chance = (peaked & ~saturated) | (flat & ~uniform)
    return RowClasses(normalized, eligible, saturated, uniform, by_chance)


def _rows(flagged: NDArray[np.bool_]) -> Iterator[Index]:
    for idx in np.argwhere(flagged):
        yield tuple(int(i) for i in idx)


# --- row findings ------------------------------------------------------------------------


def row_findings(
    spec: AttentionSpec, stats: Stats, classes: RowClasses, working: tuple[str, ...]
) -> Iterator[tuple[str, list[Finding]]]:
    """Every flagged row, kind by kind (``classes``: :func:`classify_rows` of every
    row): ``(kind, all its findings)``; the caller lists ``max_findings`` of them and
    counts the rest."""
    yield "saturated", list(_saturated(spec, stats, classes))
    yield "near_uniform", list(_near_uniform(spec, stats, classes))
    yield "fully_masked", list(_fully_masked(spec, stats))
    yield "underflow", list(_underflow(stats, working))


def _saturated(spec: AttentionSpec, stats: Stats, classes: RowClasses) -> Iterator[Finding]:
    """Rows whose weight sits on one key (max weight ≥ ``saturation``)."""
    n, mw = stats.n_visible, stats.max_weight
    hint = saturation_hint(spec)
    for idx in _rows(classes.saturated):
        j = int(stats.argmax[idx])
        yield Finding(
            "saturated",
            "warning",
            f"row {format_index(idx)} is one-hot: {float(mw[idx]):.4f} of its weight on key "
            f"{j} of {int(n[idx])} visible",
            hint=hint,
            index=idx,
            stage="weights",
            details={"max_weight": float(mw[idx]), "key": j, "visible": int(n[idx])},
        )


def _near_uniform(spec: AttentionSpec, stats: Stats, classes: RowClasses) -> Iterator[Finding]:
    """Rows whose entropy is near its maximum log(visible keys)."""
    n, mw, normalized = stats.n_visible, stats.max_weight, classes.normalized
    hint = f"the logits barely differ: {flat_cause(spec)}"
    for idx in _rows(classes.uniform):
        yield Finding(
            "near_uniform",
            "info",
            f"row {format_index(idx)} is nearly uniform over its {int(n[idx])} visible keys: "
            f"entropy {float(normalized[idx]):.3f} of the maximum, max weight "
            f"{float(mw[idx]):.4f}",
            hint=hint,
            index=idx,
            stage="weights",
            details={
                "entropy": float(stats.entropy[idx]),
                "normalized_entropy": float(normalized[idx]),
                "max_weight": float(mw[idx]),
                "visible": int(n[idx]),
            },
        )


def _fully_masked(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    """Rows with no visible key, and what sdpa returns for them."""
    # S = 0 included: every row then has no key at all.
    finite_mv = math.isfinite(spec.options.effective_mask_value)
    returns = (
        f"sdpa returns uniform weights over all {spec.S} keys (the mean of V), "
        f"as the finite mask value {spec.options.mask_value_label} makes it"
        if finite_mv and spec.S
        else "sdpa returns zeros for it"
        + (" (there are no keys at all: S = 0)" if not spec.S else "")
    )
    spread = (
        "sdpa returns the weights the float mask leaves: its finite sentinel "
        f"{spec.sentinels.label()} is added to the logits, not substituted, so the row's "
        "weight goes to the keys it hides (as kernels that add the mask give it)"
        if spec.sentinels and spec.sentinels.finite
        else returns
    )
    for idx in _rows(stats.empty_rows):
        yield Finding(
            "fully_masked",
            "warning",
            f"row {format_index(idx)} has no visible key: "
            f"{spread if stats.hidden_weight[idx] > 0 and not finite_mv else returns}",
            hint="PyTorch ≥ 2.5 and FlashAttention return zeros; JAX (mask value "
            "−0.7·finfo.max) returns the mean of V; a plain softmax over all −inf "
            "(PyTorch < 2.5, unguarded kernels, ONNX graphs) returns NaN. Check the "
            "mask: causal lower-right with L > S, a key length of 0, an inverted mask",
            index=idx,
            stage="masked",
        )


def _underflow(stats: Stats, working: tuple[str, ...]) -> Iterator[Finding]:
    """Rows whose weights flush to zero in a narrow format; a warning where the run
    computes in it and the lost weight reaches :data:`LOST_MASS`."""
    for d in stats.narrow:
        f = precision.fmt(d)
        counts = stats.underflow[d]
        for idx in _rows(counts > 0):
            lost = float(stats.lost[d][idx])
            serious = d in working and lost >= LOST_MASS
            yield Finding(
                "underflow",
                "warning" if serious else "info",
                f"row {format_index(idx)}: {plural(int(counts[idx]), 'weight')} "
                f"(together {sig(lost, 3)}) flush to zero in {d} (below {sig(f.tiny / 2)})",
                hint="harmless when the lost weight is tiny; otherwise keep the weights in "
                "float32 or bfloat16",
                index=idx,
                stage="weights",
                dtype=d,
                count=int(counts[idx]),
                details={"lost_weight": lost},
            )


# --- heads -------------------------------------------------------------------------------


def head_summaries(stats: Stats, classes: RowClasses) -> tuple[HeadSummary, ...]:
    """Each (batch, head) slice: its rows with ≥ 2 visible keys, their mean entropy
    and max weight, and how many are one-hot or near uniform (``classes``:
    :func:`classify_rows` of every row)."""
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


def head_findings(
    spec: AttentionSpec, heads: tuple[HeadSummary, ...], th: Thresholds
) -> Iterator[Finding]:
    """Heads whose rows are, for ``head_fraction`` of them, one-hot (collapsed) or
    near uniform (dead)."""
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
                hint=f"every query copies a single key; {peaked_cause(spec)}",
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
                hint=f"the head averages V instead of attending; {flat_cause(spec)}",
                index=h.index,
                stage="weights",
                count=h.near_uniform,
                details=details,
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
    empty = stats.empty_rows[lead]
    for i in range(n.shape[0]):
        if n[i] == 0 and not empty[i]:  # past --query-lengths: absent, not masked
            flags[i] = ("absent", "info")
        elif stats.spec.S and n[i] == 0:
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
