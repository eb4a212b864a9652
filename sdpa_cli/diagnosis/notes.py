"""The notes of ``sdpa explain``: what each stage did to the slice, in words and numbers.

Each note reads what one pass over every row of the slice gathered (:class:`SlicePass`),
so it describes the whole slice however few rows are shown; one function per stage,
gathered by :func:`stage_notes`. The variance argument for 1/√d_k is worked with the
slice's own numbers (:func:`slice_variance`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sdpa_cli.diagnosis.chance import CHANCE
from sdpa_cli.diagnosis.explained import Variance
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.rows import RowClasses
from sdpa_cli.engine.block import sink_logit, softmax
from sdpa_cli.engine.driver import slice_blocks
from sdpa_cli.engine.records import Moments, finite_std
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.types import Index
from sdpa_cli.text import plural, prose, share, sig

CHANGED = 0.01
"""A soft-capped logit counts as changed when it moved by more than this fraction."""


@dataclass
class SlicePass:
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
    sink_mass: list[float] = field(default_factory=list)  # p_sink per row (--sinks)


def gather_slice(spec: AttentionSpec, lead: Index, stages: Sequence[str]) -> SlicePass:
    """Every row of the slice at ``lead``, block by block; no score-sized array kept."""
    gathered = SlicePass(moments={s: Moments() for s in stages})
    with np.errstate(invalid="ignore", over="ignore"):
        for block in slice_blocks(spec, lead):
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
            if block.sink is not None:  # a row's weights sum to 1 − p_sink
                gathered.sink_mass += block.sink.tolist()
                sums = sums + block.sink
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


def _span(m: Moments) -> str:
    """``−1 … 5``, with the values that are not finite counted."""
    span = f"{prose(m.lo)} … {prose(m.hi)}" if m.count else "no finite value"
    return span + (f" ({m.nonfinite:,} not finite)" if m.nonfinite and m.count else "")


def _change(before: Moments, after: Moments) -> str:
    return f"range {_span(before)} → {_span(after)}"


def _first_upper(text: str) -> str:
    return text[:1].upper() + text[1:]


def slice_variance(spec: AttentionSpec, lead: Index, gathered: SlicePass) -> Variance | None:
    """The variance argument with the slice's numbers: σ_q, σ_k, the predicted and
    actual std of QKᵀ, and the std 1/√d_k would leave; None without two raw scores."""
    raw, scaled = gathered.moments["raw"], gathered.moments["scaled"]
    if spec.E < 1 or raw.count < 2:
        return None
    sq = finite_std(spec.q[spec.operand_index("q", lead)])
    sk = finite_std(spec.k[spec.operand_index("k", lead)])
    factor = spec.factor
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


def stage_notes(
    spec: AttentionSpec,
    gathered: SlicePass,
    stats: Stats,
    th: Thresholds,
    classes: RowClasses,
    lead: Index,
    variance: Variance | None,
) -> dict[str, str]:
    """Engine stage → its note, for every stage the pass gathered."""
    m = gathered.moments
    if not spec.L or not spec.S:
        none = f"No scores: the slice has L = {spec.L} queries and S = {spec.S} keys."
        notes = {s: none for s in m}
        if spec.L:
            notes["output"] = none + " With no key to attend to, every output row is zero."
        return notes
    notes = {"raw": _raw_note(spec, m["raw"]), "scaled": _scaled_note(spec, m, variance)}
    if "capped" in m:
        notes["capped"] = _capped_note(spec, gathered)
    if "biased" in m:
        notes["biased"] = _biased_note(spec, gathered, lead)
    notes["masked"] = _mask_note(spec, gathered, lead)
    notes["weights"] = _weights_note(spec, gathered, stats, th, classes, lead)
    if "dropped" in m:
        notes["dropped"] = _dropped_note(spec, gathered)
    notes["output"] = _output_note(spec, m, lead)
    return notes


# --- the logits ----------------------------------------------------------------------------


def _raw_note(spec: AttentionSpec, raw: Moments) -> str:
    per_slice = f"{spec.L}×{spec.S}"
    if spec.options.prescale:
        return (
            f"Q and K were each multiplied by √scale first (--prescale), so these dot "
            f"products are already the scaled logits: {_span(raw)} over the slice's "
            f"{per_slice} scores."
        )
    return (
        f"Each query's dot product with each key, a sum of d_k = {spec.E} products: "
        f"{_span(raw)}, mean {prose(raw.mean)}, std {prose(raw.std)} over the "
        f"slice's {per_slice} scores."
    )


def _scaled_note(spec: AttentionSpec, m: dict[str, Moments], variance: Variance | None) -> str:
    """The scale's effect, then why 1/√d_k, with the slice's own numbers."""
    o = spec.options
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
    return scaled


def _capped_note(spec: AttentionSpec, gathered: SlicePass) -> str:
    m = gathered.moments
    cap = spec.options.softcap
    assert cap is not None
    return (
        f"Soft cap C·tanh(x / C) with C = {cap:g}: {_change(m['scaled'], m['capped'])}; "
        f"{gathered.capped_changed:,} of {gathered.cells:,} logits moved by more "
        f"than {CHANGED:.0%} (those beyond about ±{sig(0.17 * cap, 3)}); nothing can "
        f"pass ±{cap:g}."
    )


def _biased_note(spec: AttentionSpec, gathered: SlicePass, lead: Index) -> str:
    m = gathered.moments
    if spec.options.score_mod is not None:
        return (
            f"Through --score-mod {spec.options.score_mod}: {_change(m['scaled'], m['biased'])}; "
            f"the top key changed in {gathered.top_moved:,} of {spec.L:,} rows."
        )
    what = []
    if spec.bias is not None:
        what.append(f"the bias {spec.names.get('bias', 'bias')}")
    if spec.options.alibi:
        h = lead[-1] if lead else 0
        what.append(f"ALiBi (slope {sig(float(spec.alibi_slopes[h]))} × distance)")
    before = m["capped"] if "capped" in m else m["scaled"]
    return (
        f"Added {' and '.join(what)}: {_change(before, m['biased'])}; the top key "
        f"changed in {gathered.top_moved:,} of {spec.L:,} rows."
    )


# --- the mask ------------------------------------------------------------------------------


def _mask_rules(spec: AttentionSpec, lead: Index) -> list[str]:
    """What hides keys from this slice: ``causal (upper-left)``, a window, …"""
    o = spec.options
    rules = []
    if o.causal:
        rules.append(f"causal ({o.causal_align if o.query_offset is None else 'query offset'})")
    if o.query_offset is not None:
        b = lead[-2] if len(o.query_offset) > 1 else 0
        rules.append(f"query 0 at position {o.query_offset[b]}")
    if o.query_lengths is not None:
        b = lead[-2] if len(o.query_lengths) > 1 else 0
        rules.append(f"query length {o.query_lengths[b]}")
    if o.cu_seqlens is not None:
        rules.append(f"{len(o.cu_seqlens) - 1} packed documents")
    if o.window is not None:
        rules.append(f"a window of {o.window[0]} left, {o.window[1]} right")
    if o.attention_chunk is not None:
        rules.append(f"chunks of {o.attention_chunk} positions")
    if o.key_lengths is not None:
        if len(o.key_lengths) > 1:  # one per batch item: this slice's
            b = lead[-2]
            rules.append(f"key length {o.key_lengths[b]} (batch item {b})")
        else:
            rules.append(f"key length {o.key_lengths[0]}")
    if o.mask_mod is not None:
        rules.append(f"--mask-mod {o.mask_mod}")
    if spec.mask is not None:
        rules.append(
            f"the {'boolean' if spec.mask_is_bool else 'float'} mask "
            f"{spec.names.get('mask', 'mask')}"
        )
    if spec.bias is not None and bool(np.isneginf(np.asarray(spec.bias)).any()):
        rules.append(f"−inf in the bias {spec.names.get('bias', 'bias')}")
    return rules


def _mask_note(spec: AttentionSpec, gathered: SlicePass, lead: Index) -> str:
    """What the mask hid, how many keys each row sees, and the weight it took away."""
    rules = _mask_rules(spec, lead)
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
    fate = f"set to {spec.options.mask_value_label}{added}"
    sentinels = spec.sentinels
    if sentinels is not None and sentinels.values:
        # A sentinel hides its key for the findings, but is added, not substituted.
        o = spec.options
        sentinel = f"the float mask's sentinel {sentinels.label()} added to their logits"
        replaced = o.hides_by_position
        fate = f"set to {o.mask_value_label} or {sentinel}" if replaced else sentinel
    note = (
        f"{_first_upper(' + '.join(rules)) or 'The mask'} hid {gathered.hidden:,} of "
        f"{gathered.cells:,} scores ({share(gathered.hidden, gathered.cells)}), {fate}; "
        f"rows see {min(counts)} … {max(counts)} keys"
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


# --- the weights and the output ------------------------------------------------------------


def _weights_note(
    spec: AttentionSpec,
    gathered: SlicePass,
    stats: Stats,
    th: Thresholds,
    classes: RowClasses,
    lead: Index,
) -> str:
    """The softmax, its rows' max weight and entropy, and the rows with no key."""
    o = spec.options
    n_vis = stats.n_visible[lead]
    rows_ok = classes.eligible
    weights = (
        "Softmax over each row: e^(x − row max) / Σ e^(x − row max), so every weight "
        f"is in [0, 1] and each row with a visible key sums to 1 (largest deviation "
        f"{sig(gathered.row_sum_error, 2)})."
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
        chance = int(classes.by_chance.sum())
        if chance:
            weights += (
                f" {plural(chance, 'row')} past a threshold {'is' if chance == 1 else 'are'}"
                " not counted: random logits over as few keys are as peaked or as flat in "
                f"more than 1 row of {round(1 / CHANCE):,}."
            )
    if gathered.sink_mass:
        weights = weights.replace(
            "e^(x − row max) / Σ e^(x − row max)", "e^(x − m) / (Σ e^(x − m) + e^(sink − m))"
        ).replace("sums to 1", "sums to 1 with the sink's column (1 − p_sink without it)")
        weights += _sink_note(spec, gathered.sink_mass, lead)
    empty = int((n_vis == 0).sum()) if spec.S else spec.L
    if empty and math.isfinite(o.effective_mask_value) and spec.S:
        weights += (
            f" {plural(empty, 'row')} with no visible key get uniform weights 1/{spec.S} over "
            f"the hidden keys: the finite mask value {o.mask_value_label} leaves them equal."
        )
    elif empty:
        weights += f" {plural(empty, 'row')} with no visible key get zero weights."
    return weights


def _sink_note(spec: AttentionSpec, mass: list[float], lead: Index) -> str:
    """How much of each row the head's sink takes (gpt-oss attention sinks)."""
    p = np.asarray(mass)
    mostly = int(np.count_nonzero(p > 0.5))
    return (
        f" The sink (logit {prose(sink_logit(spec, lead) or 0.0)}) takes p_sink "
        f"{prose(float(p.min()))} … {prose(float(p.max()))} (mean {prose(float(p.mean()))}) "
        f"of each row; {plural(mostly, 'row')} mostly on the sink (p_sink > 0.5). The max "
        "weight and entropy above read the weights as they are, the sink's share left out."
    )


def _dropped_note(spec: AttentionSpec, gathered: SlicePass) -> str:
    o = spec.options
    kept = gathered.dropped_kept + gathered.dropped_zeroed
    source = "keep mask --dropout-mask" if spec.dropout_mask is not None else f"seed {o.seed}"
    return (
        f"Dropout p = {o.dropout:g} ({source}): zeroed "
        f"{gathered.dropped_zeroed:,} of {kept:,} nonzero weights "
        f"({share(gathered.dropped_zeroed, kept)}); the kept ones × 1/(1 − p) = "
        f"{sig(1 / (1 - o.dropout))}, so row sums now run {_span(gathered.dropped_sums)} "
        "(1 only on average)."
    )


def _output_note(spec: AttentionSpec, m: dict[str, Moments], lead: Index) -> str:
    """The output against V's range: inside it, unless dropout let the sums stray."""
    values = np.asarray(spec.v[spec.operand_index("v", lead)], dtype=np.float64)
    finite_v = values[np.isfinite(values)]
    v_span = (
        f"{prose(float(finite_v.min()))} … {prose(float(finite_v.max()))}" if finite_v.size else "—"
    )
    if "dropped" in m:
        return (
            "Each output row is its weights after dropout · V: a sum of V's rows whose "
            f"weights sum to 1 only on average, so it can leave V's range: "
            f"{_span(m['output'])} over {spec.Ev} columns; V holds {v_span}."
        )
    return (
        "Each output row is a weighted average of V's rows (weights · V), so each "
        f"column stays inside V's range: here {_span(m['output'])} over {spec.Ev} "
        f"columns, V {v_span}."
    )
