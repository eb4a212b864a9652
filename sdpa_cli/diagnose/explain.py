"""One (batch, head) slice explained stage by stage: values, what changed, what went wrong.

Pure numpy: :func:`explain` returns an :class:`Explanation` that the renderer draws
and the report writes as JSON. Values come from the engine (:func:`compute.attend_block`)
for the rows shown; the notes come from one pass over every row of the slice, block
by block, so they describe the whole slice however few rows are shown; the findings
come from the diagnosis of the whole input, each put at the stage where it arose.

Stage names are the engine's, except ``dropped``, which is ``dropout`` here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnose.rules import (
    Diagnosis,
    Finding,
    RowClasses,
    Thresholds,
    classify_rows,
    format_index,
    plural,
    row_flags,
)
from sdpa_cli.diagnose.scales import ScaleRun, compare_scales
from sdpa_cli.diagnose.scorecard import Scorecard, scorecard
from sdpa_cli.engine.block import (
    STAGES,
    applicable_stages,
    attend_block,
    block_rows,
    softmax,
)
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Index, Moments, Stats, finite_std, working_formats
from sdpa_cli.text import prose, share

if TYPE_CHECKING:
    from sdpa_cli.diagnose.explain_grad import Backward

F64 = NDArray[np.float64]

NAMES = {"dropped": "dropout"}
"""Engine stage → its name in ``explain`` (the rest keep theirs)."""

CHANGED = 0.01
"""A soft-capped logit counts as changed when it moved by more than this fraction."""


def explain_name(stage: str) -> str:
    return NAMES.get(stage, stage)


def explained_stages(spec: AttentionSpec) -> tuple[str, ...]:
    """The engine's stages that apply, without ``masked`` when nothing masks."""
    o = spec.options
    masks = o.causal or o.window is not None or o.key_lengths is not None
    masks = masks or spec.mask is not None
    return tuple(s for s in applicable_stages(spec) if s != "masked" or masks)


@dataclass
class _SlicePass:
    """What one pass over every row of a slice gathers for the notes."""

    moments: dict[str, Moments]
    hidden: int = 0
    cells: int = 0
    visible_per_row: list[int] = field(default_factory=list)
    hidden_mass: list[float] = field(default_factory=list)  # weight the mask took away
    hidden_nonfinite: int = 0  # hidden keys whose own logits are NaN or inf
    top_moved: int = 0  # rows whose largest logit moved to another key with the bias
    capped_changed: int = 0
    dropped_zeroed: int = 0
    dropped_kept: int = 0
    dropped_sums: Moments = field(default_factory=Moments)
    row_sum_error: float = 0.0


def _slice_pass(spec: AttentionSpec, lead: Index, stages: Sequence[str]) -> _SlicePass:
    """Every row of the slice at ``lead``, block by block; no score-sized array kept."""
    gathered = _SlicePass(moments={s: Moments() for s in stages})
    step = block_rows(spec)
    with np.errstate(invalid="ignore", over="ignore"):
        for i0 in range(0, spec.L, step):
            block = attend_block(spec, lead, slice(i0, min(i0 + step, spec.L)))
            visible = block.attended
            for s in stages:
                values = getattr(block, s)
                # The masked logits are described over the keys they let through.
                gathered.moments[s].add(values, visible if s == "masked" else None)
            gathered.cells += visible.size
            gathered.hidden += int(visible.size - np.count_nonzero(visible))
            gathered.visible_per_row += visible.sum(axis=1).tolist()
            pre_mask = block.logits_before("masked")
            gathered.hidden_nonfinite += int(np.count_nonzero(~visible & ~np.isfinite(pre_mask)))
            mass = np.where(visible, 0.0, softmax(pre_mask)).sum(axis=1)
            gathered.hidden_mass += mass.tolist()
            if block.capped is not None:
                moved = np.abs(block.capped - block.scaled) > CHANGED * np.abs(block.scaled)
                gathered.capped_changed += int(np.count_nonzero(moved))
            if block.biased is not None and spec.S:
                before = block.logits_before("biased")
                gathered.top_moved += int(
                    np.count_nonzero(
                        np.argmax(np.where(visible, before, -np.inf), axis=1)
                        != np.argmax(np.where(visible, block.biased, -np.inf), axis=1)
                    )
                )
            sums = block.weights.sum(axis=1)
            has_keys = visible.any(axis=1) & np.isfinite(sums)
            if has_keys.any():
                err = float(np.abs(sums[has_keys] - 1.0).max())
                gathered.row_sum_error = max(gathered.row_sum_error, err)
            if block.dropped is not None:
                live = block.weights > 0
                gathered.dropped_zeroed += int(np.count_nonzero(live & (block.dropped == 0)))
                gathered.dropped_kept += int(np.count_nonzero(live & (block.dropped != 0)))
                gathered.dropped_sums.add(block.dropped.sum(axis=1), has_keys)
    return gathered


# --- records ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageExplained:
    """One stage of the slice: the shown rows' values, a note, the findings there."""

    name: str
    step: str
    values: F64
    note: str
    summary: Mapping[str, Any]
    findings: tuple[Finding, ...]


@dataclass(frozen=True)
class RowStats:
    """Per shown row: its visible keys, the sum of its weights over every key (a
    finite mask value leaves weight on hidden ones), and the entropy and largest
    weight over its visible keys."""

    rows: range
    visible: NDArray[np.int64]
    sums: F64
    entropy: F64
    normalized_entropy: F64
    max_weight: F64
    argmax: NDArray[np.int64]
    flags: Mapping[int, tuple[str, str]]

    def to_list(self) -> list[dict[str, Any]]:
        out = []
        for r, i in enumerate(self.rows):
            flag = self.flags.get(i)
            out.append(
                {
                    "row": i,
                    "visible": int(self.visible[r]),
                    "sum": float(self.sums[r]),
                    "entropy": float(self.entropy[r]),
                    "normalized_entropy": float(self.normalized_entropy[r]),
                    "max_weight": float(self.max_weight[r]),
                    "argmax": int(self.argmax[r]),
                    "flag": flag[0] if flag else None,
                }
            )
        return out


@dataclass(frozen=True)
class Variance:
    """The variance argument with the slice's own numbers.

    With independent, zero-mean components, qᵀk has std √d_k·σ_q·σ_k; 1/√d_k
    brings it back to σ_q·σ_k. ``raw_std`` and ``scaled_std`` are what the slice has.
    """

    E: int
    sigma_q: float
    sigma_k: float
    predicted_raw_std: float
    raw_std: float
    factor: float
    scaled_std: float
    sqrt_dk_std: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "d_k": self.E,
            "sigma_q": self.sigma_q,
            "sigma_k": self.sigma_k,
            "predicted_raw_std": self.predicted_raw_std,
            "raw_std": self.raw_std,
            "effective_scale": self.factor,
            "scaled_std": self.scaled_std,
            "std_with_sqrt_dk": self.sqrt_dk_std,
        }


@dataclass(frozen=True)
class Explanation:
    """Everything ``sdpa explain`` shows for one slice."""

    spec: AttentionSpec
    lead: Index
    rows: range
    visible: NDArray[np.bool_]
    stages: tuple[StageExplained, ...]
    row_stats: RowStats
    variance: Variance | None
    input_findings: tuple[Finding, ...]
    elsewhere: tuple[Finding, ...]
    diagnosis: Diagnosis
    scorecard: Scorecard | None = None
    scales: tuple[ScaleRun, ...] = ()
    scales_verdict: str | None = None
    backward: Backward | None = None
    """With ``--backward``: the gradient's stages (:mod:`sdpa_cli.diagnose.explain_grad`)."""

    def stage(self, name: str) -> StageExplained | None:
        return next((s for s in self.stages if s.name == name), None)


# --- the notes -----------------------------------------------------------------------------


def _span(m: Moments) -> str:
    """``−1 … 5``, with the values that are not finite counted."""
    span = f"{prose(m.lo)} … {prose(m.hi)}" if m.count else "no finite value"
    return span + (f" ({m.nonfinite:,} not finite)" if m.nonfinite and m.count else "")


def _change(before: Moments, after: Moments) -> str:
    return f"range {_span(before)} → {_span(after)}"


def _variance(spec: AttentionSpec, lead: Index, gathered: _SlicePass) -> Variance | None:
    raw, scaled = gathered.moments["raw"], gathered.moments["scaled"]
    if spec.E < 1 or raw.count < 2:
        return None
    sq = finite_std(spec.q[spec.operand_index("q", lead)])
    sk = finite_std(spec.k[spec.operand_index("k", lead)])
    factor = spec.scale / spec.options.temperature
    raw_std = raw.std if not spec.options.prescale else raw.std / factor
    return Variance(
        E=spec.E,
        sigma_q=sq,
        sigma_k=sk,
        predicted_raw_std=math.sqrt(spec.E) * sq * sk,
        raw_std=raw_std,
        factor=factor,
        scaled_std=scaled.std,
        sqrt_dk_std=raw_std / math.sqrt(spec.E),
    )


def _notes(
    spec: AttentionSpec,
    gathered: _SlicePass,
    stats: Stats,
    th: Thresholds,
    classes: RowClasses,
    lead: Index,
    variance: Variance | None,
) -> dict[str, str]:
    o = spec.options
    m = gathered.moments
    if not spec.L or not spec.S:
        none = f"No scores: the slice has L = {spec.L} queries and S = {spec.S} keys."
        notes = {s: none for s in m}
        if spec.L:
            notes["output"] = none + " With no key to attend to, every output row is zero."
        return notes
    notes = {}
    per_slice = f"{spec.L}×{spec.S}"
    if o.prescale:
        notes["raw"] = (
            f"Q and K were each multiplied by √scale first (--prescale), so these dot "
            f"products are already the scaled logits: {_span(m['raw'])} over the slice's "
            f"{per_slice} scores."
        )
    else:
        notes["raw"] = (
            f"Each query's dot product with each key, a sum of d_k = {spec.E} products: "
            f"{_span(m['raw'])}, mean {prose(m['raw'].mean)}, std {prose(m['raw'].std)} over the "
            f"slice's {per_slice} scores."
        )
    temp = f" and ÷ temperature {o.temperature:g}" if o.temperature != 1 else ""
    scaled = (
        f"× scale {spec.scale_label}{temp}: {_change(m['raw'], m['scaled'])}; "
        f"std {prose(m['raw'].std)} → {prose(m['scaled'].std)}."
    )
    if o.prescale:
        scaled = "The same values as the raw scores: the scale went into Q and K (--prescale)."
    if variance is not None and math.isfinite(variance.predicted_raw_std):
        v = variance
        scaled += (
            f" Why 1/√d_k: for independent components qᵀk has std √d_k·σ_q·σ_k = "
            f"√{v.E}·{prose(v.sigma_q)}·{prose(v.sigma_k)} = {prose(v.predicted_raw_std)} (here "
            f"{prose(v.raw_std)}), which grows with d_k; dividing by √d_k = "
            f"{prose(math.sqrt(v.E))} leaves σ_q·σ_k whatever d_k is (here "
            f"{prose(v.sqrt_dk_std)}), so the softmax neither saturates nor flattens as "
            "heads get wider."
        )
    notes["scaled"] = scaled
    if "capped" in m:
        cap = o.softcap
        assert cap is not None
        notes["capped"] = (
            f"Soft cap C·tanh(x / C) with C = {cap:g}: {_change(m['scaled'], m['capped'])}; "
            f"{gathered.capped_changed:,} of {gathered.cells:,} logits moved by more "
            f"than {CHANGED:.0%} (those beyond about ±{0.17 * cap:.3g}); nothing can "
            f"pass ±{cap:g}."
        )
    if "biased" in m:
        what = []
        if spec.bias is not None:
            what.append(f"the bias {spec.names.get('bias', 'bias')}")
        if o.alibi:
            h = lead[-1] if lead else 0
            what.append(f"ALiBi (slope {float(spec.alibi_slopes[h]):.4g} × distance)")
        before = m["capped"] if "capped" in m else m["scaled"]
        notes["biased"] = (
            f"Added {' and '.join(what)}: {_change(before, m['biased'])}; the top key "
            f"changed in {gathered.top_moved:,} of {spec.L:,} rows."
        )
    notes["masked"] = _mask_note(spec, gathered, lead)
    n_vis = stats.n_visible[lead]
    rows_ok = classes.eligible
    weights = (
        "Softmax over each row: e^(x − row max) / Σ e^(x − row max), so every weight "
        f"is in [0, 1] and each row with a visible key sums to 1 (largest deviation "
        f"{gathered.row_sum_error:.2g})."
    )
    if rows_ok.any():
        mw = stats.max_weight[lead][rows_ok]
        ent = classes.normalized[rows_ok]
        weights += (
            f" Over the {plural(int(rows_ok.sum()), 'row')} with ≥ 2 visible keys: max "
            f"weight {prose(float(mw.min()))} … {prose(float(mw.max()))} (mean "
            f"{prose(float(mw.mean()))}); entropy {prose(float(ent.min()))} … "
            f"{prose(float(ent.max()))} of its maximum log(keys). "
            f"{int(classes.saturated.sum())} one-hot (max ≥ {th.saturation:g}), "
            f"{int(classes.uniform.sum())} near uniform (entropy ≥ {th.uniform:g})."
        )
    empty = int((n_vis == 0).sum()) if spec.S else spec.L
    if empty and math.isfinite(o.effective_mask_value) and spec.S:
        weights += (
            f" {plural(empty, 'row')} with no visible key get uniform weights 1/{spec.S} over "
            f"the hidden keys: the finite mask value {o.mask_value_label} leaves them equal."
        )
    elif empty:
        weights += f" {plural(empty, 'row')} with no visible key get zero weights."
    notes["weights"] = weights
    if "dropped" in m:
        kept = gathered.dropped_kept + gathered.dropped_zeroed
        notes["dropped"] = (
            f"Dropout p = {o.dropout:g} (seed {o.seed}): zeroed "
            f"{gathered.dropped_zeroed:,} of {kept:,} nonzero weights "
            f"({share(gathered.dropped_zeroed, kept)}); the kept ones × 1/(1 − p) = "
            f"{1 / (1 - o.dropout):.4g}, so row sums now run {_span(gathered.dropped_sums)} "
            "(1 only on average)."
        )
    values = np.asarray(spec.v[spec.operand_index("v", lead)], dtype=np.float64)
    finite_v = values[np.isfinite(values)]
    v_span = (
        f"{prose(float(finite_v.min()))} … {prose(float(finite_v.max()))}" if finite_v.size else "—"
    )
    if "dropped" in m:
        notes["output"] = (
            "Each output row is its weights after dropout · V: a sum of V's rows whose "
            f"weights sum to 1 only on average, so it can leave V's range: "
            f"{_span(m['output'])} over {spec.Ev} columns; V holds {v_span}."
        )
    else:
        notes["output"] = (
            "Each output row is a weighted average of V's rows (weights · V), so each "
            f"column stays inside V's range: here {_span(m['output'])} over {spec.Ev} "
            f"columns, V {v_span}."
        )
    return notes


def _first_upper(text: str) -> str:
    return text[:1].upper() + text[1:]


def _mask_note(spec: AttentionSpec, gathered: _SlicePass, lead: Index) -> str:
    o = spec.options
    rules = []
    if o.causal:
        rules.append(f"causal ({o.causal_align})")
    if o.window is not None:
        rules.append(f"a window of {o.window[0]} left, {o.window[1]} right")
    if o.key_lengths is not None:
        if len(o.key_lengths) > 1:  # one per batch item: this slice's
            b = lead[-2]
            rules.append(f"key length {o.key_lengths[b]} (batch item {b})")
        else:
            rules.append(f"key length {o.key_lengths[0]}")
    if spec.mask is not None:
        rules.append(
            f"the {'boolean' if spec.mask_is_bool else 'float'} mask "
            f"{spec.names.get('mask', 'mask')}"
        )
    if spec.bias is not None and bool(np.isneginf(np.asarray(spec.bias)).any()):
        rules.append(f"−inf in the bias {spec.names.get('bias', 'bias')}")
    added = (
        " (the float mask added to the logits)"
        if spec.mask is not None and not spec.mask_is_bool
        else ""
    )
    if not gathered.hidden:
        if not rules:
            return "No mask: every key is visible to every query."
        verb = "hide" if len(rules) > 1 else "hides"
        return (
            f"{_first_upper(' + '.join(rules))} {verb} nothing here: every key is visible{added}."
        )
    counts = gathered.visible_per_row
    mass = np.asarray(gathered.hidden_mass)  # NaN for a row with a NaN logit
    known = np.where(np.isfinite(mass), mass, -1.0)
    worst = int(np.argmax(known)) if mass.size else 0
    empty = sum(1 for c in counts if c == 0)
    note = (
        f"{_first_upper(' + '.join(rules)) or 'The mask'} hid {gathered.hidden:,} of "
        f"{gathered.cells:,} scores ({share(gathered.hidden, gathered.cells)}), set to "
        f"{o.mask_value_label}{added}; rows see {min(counts)} … {max(counts)} keys"
    )
    note += f", {plural(empty, 'row')} none." if empty else "."
    if gathered.hidden_nonfinite:
        note += (
            f" {plural(gathered.hidden_nonfinite, 'hidden score')} "
            f"{'is' if gathered.hidden_nonfinite == 1 else 'are'} NaN or inf themselves, "
            "so what the hidden keys would have taken unmasked is unknown."
        )
    elif (known >= 0).any():
        note += (
            f" Unmasked, the hidden keys would have taken {share(float(np.nanmean(mass)), 1)} of a "
            f"row's weight on average (at most {share(float(mass[worst]), 1)}, row q{worst})."
        )
    return note


# --- findings in their place -------------------------------------------------------------------


def _in_slice(f: Finding, spec: AttentionSpec, lead: Index) -> bool:
    """Whether finding ``f`` concerns the slice at ``lead``.

    A non-finite input is indexed in its own file's layout: it concerns the slice
    when the slice reads a non-finite value of that tensor (a GQA head reads its kv
    head). Other findings are indexed in the scores' layout, or not at all.
    """
    tensor = f.details.get("tensor") if f.stage == "input" else None
    if f.kind == "nonfinite" and isinstance(tensor, str):
        arr = getattr(spec, tensor)
        part = np.asarray(arr[spec.operand_index(tensor, lead)], dtype=np.float64)
        with np.errstate(invalid="ignore"):
            if tensor in ("bias", "mask"):
                return bool((np.isnan(part) | (part == math.inf)).any())
            return bool((~np.isfinite(part)).any())
    return f.index is None or tuple(f.index[: len(lead)]) == lead


def _placed(
    diagnosis: Diagnosis, spec: AttentionSpec, lead: Index, stages: Sequence[str]
) -> tuple[dict[str, list[Finding]], list[Finding], list[Finding]]:
    """Findings of this slice by stage, its other findings (inputs), and the rest.

    A finding at a stage not shown (``masked`` with nothing masked) goes to the
    last shown stage before it.
    """
    by_stage: dict[str, list[Finding]] = {s: [] for s in stages}
    inputs: list[Finding] = []
    elsewhere: list[Finding] = []
    for f in diagnosis.findings:
        if not _in_slice(f, spec, lead):
            elsewhere.append(f)
        elif f.stage in STAGES:
            earlier = [s for s in STAGES[: STAGES.index(f.stage) + 1] if s in by_stage]
            (by_stage[earlier[-1]] if earlier else inputs).append(f)
        else:
            inputs.append(f)
    return by_stage, inputs, elsewhere


# --- the whole explanation -----------------------------------------------------------------------


def explain(
    spec: AttentionSpec,
    stats: Stats,
    diagnosis: Diagnosis,
    lead: Index,
    rows: range,
    *,
    query: int | None = None,
    scales: bool = False,
    key_limit: int = 16,
) -> Explanation:
    """Explain the slice at ``lead`` (a position of ``spec.lead``), showing ``rows``.

    Args:
        spec: the validated computation.
        stats, diagnosis: the whole input's statistics and findings (``trace`` and
            ``diagnose``); the slice's rows are read from them.
        lead: the (…, batch, head) position explained.
        rows: the query rows whose values are kept (a contiguous range).
        query: also build the scorecard of this query row.
        scales: also compare no scaling, 1/√d_k and 1/d_k.
        key_limit: keys listed in a scorecard of more keys (the heaviest).
    """
    th = diagnosis.thresholds
    engine = explained_stages(spec)
    gathered = _slice_pass(spec, lead, engine)
    variance = _variance(spec, lead, gathered)
    classes = classify_rows(stats, th, lead)
    notes = _notes(spec, gathered, stats, th, classes, lead, variance)
    by_stage, inputs, elsewhere = _placed(diagnosis, spec, lead, engine)
    block = attend_block(spec, lead, slice(rows.start, rows.stop))
    stages = tuple(
        StageExplained(
            name=explain_name(s),
            step=s,
            values=getattr(block, s),
            note=notes[s],
            summary=gathered.moments[s].to_dict(),
            findings=tuple(by_stage[s]),
        )
        for s in engine
    )
    picked: tuple[int | slice, ...] = (*lead, slice(rows.start, rows.stop))
    attended = block.attended
    row_stats = RowStats(
        rows=rows,
        visible=attended.sum(axis=1).astype(np.int64),
        sums=block.weights.sum(axis=1),
        entropy=stats.entropy[picked].copy(),
        normalized_entropy=np.asarray(classes.normalized)[rows.start : rows.stop].copy(),
        max_weight=stats.max_weight[picked].copy(),
        argmax=stats.argmax[picked].astype(np.int64),
        flags={
            i: f for i, f in row_flags(stats, th, lead, working_formats(spec)).items() if i in rows
        },
    )
    card = scorecard(spec, lead, query, key_limit) if query is not None else None
    runs: tuple[ScaleRun, ...] = ()
    verdict = None
    if scales:
        runs, verdict = compare_scales(spec, lead, rows, th)
    return Explanation(
        spec=spec,
        lead=lead,
        rows=rows,
        visible=attended,
        stages=stages,
        row_stats=row_stats,
        variance=variance,
        input_findings=tuple(inputs),
        elsewhere=tuple(elsewhere),
        diagnosis=diagnosis,
        scorecard=card,
        scales=runs,
        scales_verdict=verdict,
    )


def slice_at(spec: AttentionSpec, batch: int = 0, head: int = 0) -> Index:
    """The lead position of (batch, head); any axis before the batch at 0."""
    lead = [0] * len(spec.lead)
    if lead:
        lead[-1] = head
    if len(lead) >= 2:
        lead[-2] = batch
    return tuple(lead)


def elsewhere_summary(found: Sequence[Finding], lead: Index) -> str | None:
    """``3 findings in other slices: saturated at [0, 2, 5], …`` or None."""
    if not found:
        return None
    places = []
    for f in found:
        at = f.index[: len(lead)] if f.index is not None else None
        label = f"{f.kind.replace('_', ' ')} in {format_index(at)}"
        if label not in places:
            places.append(label)
    more = " …" if len(places) > 4 else ""
    return f"{plural(len(found), 'finding')} in other slices: {', '.join(places[:4])}{more}"
