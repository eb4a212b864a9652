"""Statistics + thresholds → findings: the ``diagnose`` step and the input rules.

:func:`diagnose` gathers every rule's findings, in :data:`KINDS` order: non-finite
values and the masks' and the scale's suspects here, the precision rules in
:mod:`sdpa_cli.diagnosis.formats`, the rows' and heads' in :mod:`sdpa_cli.diagnosis.rows`.
Findings are data (:mod:`sdpa_cli.diagnosis.findings`), never exceptions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnosis.causes import (
    scale_looks_doubled,
    scale_looks_omitted,
    temperature_also,
    temperature_flattens,
    temperature_sharpens,
)
from sdpa_cli.diagnosis.findings import Diagnosis, Finding, Tally, Thresholds
from sdpa_cli.diagnosis.formats import emulation, headroom, overflow
from sdpa_cli.diagnosis.pages import input_page, page_sharing, score_page
from sdpa_cli.diagnosis.rows import classify_rows, head_findings, head_summaries, row_findings
from sdpa_cli.diagnosis.sentinels import sentinel_fully_masked, sentinel_overflow, weak_sentinels
from sdpa_cli.engine import precision
from sdpa_cli.engine.records import argmax_index, finite_std
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats, working_formats
from sdpa_cli.engine.trace import Trace
from sdpa_cli.names import KINDS, STAGES
from sdpa_cli.text import format_index, sig


def diagnose(source: Trace | Stats, thresholds: Thresholds | None = None) -> Diagnosis:
    """Read the statistics (a trace's, or gathered by a pass of one's own) and return
    every finding, in :data:`KINDS` order."""
    th = thresholds or Thresholds()
    stats = source if isinstance(source, Stats) else source.stats
    spec = stats.spec
    working = working_formats(spec)
    tally = Tally(KINDS)
    tally.add(_nonfinite(spec, stats))
    tally.add(page_sharing(spec))
    tally.add(overflow(spec, stats, working))
    tally.add(sentinel_overflow(spec, stats, working))
    classes = classify_rows(stats, th)  # once: its chance test reads every row
    heads = head_summaries(stats, classes)
    for kind, rows in row_findings(spec, stats, classes, working):
        tally.rows(kind, rows, th.max_findings)
    tally.add(_mask_suspect(spec, stats))
    tally.add(_unscaled(spec, stats))
    tally.add(head_findings(spec, heads, th))
    return Diagnosis(
        findings=tally.findings,
        counts=tally.counts,
        heads=heads,
        headroom=headroom(stats),
        emulation=emulation(spec, stats),
        thresholds=th,
    )


# --- non-finite values -----------------------------------------------------------------


def _nonfinite(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    """The inputs holding NaN or inf, then the stage where non-finite values first
    appear (and the output's, when it is not that stage)."""
    inputs = list(_nonfinite_inputs(spec))
    yield from inputs
    yield from _nonfinite_stages(stats, bad_input=bool(inputs))


def nonfinite_values(name: str, a: NDArray[Any]) -> NDArray[np.bool_]:
    """Where input ``name`` holds a value no score can be computed from: NaN or inf,
    but not −inf in a bias or float mask, a legitimate way to hide keys."""
    with np.errstate(invalid="ignore"):
        if name in ("bias", "mask"):
            return np.isnan(a) | (a == math.inf)  # type: ignore[no-any-return]
        return ~np.isfinite(a)  # type: ignore[no-any-return]


def _inputs(spec: AttentionSpec) -> Iterator[tuple[str, NDArray[Any]]]:
    """Each float input as its file holds it; with the qv term, Q and K split back into
    Q and qv, and K (the rest of K is V's, judged as V)."""
    narrow = spec.E - spec.qv_width
    for name in ("q", "k", "v", "bias", "mask"):
        arr = getattr(spec, name)
        if arr is None or not precision.is_float(arr.dtype):
            continue
        if spec.qv_width and name in ("q", "k"):
            yield name, spec.as_loaded(name, arr[..., :narrow])
            if name == "q":
                yield "qv", spec.as_loaded("q", arr[..., narrow:])
        else:
            yield name, spec.as_loaded(name)


def _nonfinite_inputs(spec: AttentionSpec) -> Iterator[Finding]:
    """Each input tensor holding NaN or inf (−inf in a bias or float mask hides keys)."""
    for name, a in _inputs(spec):
        bad = nonfinite_values(name, a)
        n = int(np.count_nonzero(bad))
        if not n:
            continue
        nans = int(np.count_nonzero(np.isnan(a)))
        label = name.upper() if name in ("q", "k", "v") else name
        source = spec.names.get(name, name)
        if spec.paging is not None and name in ("k", "v"):  # counted and placed as gathered
            source += ", gathered through the block table: a page counts for each item reading it"
        what = ", ".join(
            part
            for part in (f"{nans} NaN" if nans else "", f"{n - nans} inf" if n - nans else "")
            if part
        )
        first = argmax_index(bad)
        page, at_page = input_page(spec, name, first)  # a paged cache: the key's page
        yield Finding(
            "nonfinite",
            "error",
            f"{label} ({source}) holds {what}; the first at {format_index(first)}{page}",
            hint="every score computed from it is NaN or inf; fix the export, or mask those keys",
            index=first,
            stage="input",
            count=n,
            details={"tensor": name, **at_page},
        )


def _nonfinite_stages(stats: Stats, *, bad_input: bool) -> Iterator[Finding]:
    """The first stage holding non-finite values, and the output when it is a later one."""
    titles = {"raw": "the raw scores", "output": "the output"}
    first_stage = None
    for stage in STAGES:
        record = stats.records.nonfinite.get(stage)
        if record is None or not record.count:
            continue
        if first_stage is None:
            first_stage = stage
            cause = " (from the non-finite input)" if bad_input else ""
            page, at_page = score_page(stats.spec, record.first) if stage != "output" else ("", {})
            hint = None
            if stage in ("raw", "scaled", "capped") and not bad_input:
                hint = "the inputs' products exceed the format's range; check their magnitudes"
            elif stage == "weights" and not bad_input:
                hint = "a +inf or NaN logit makes the softmax NaN (inf − inf)"
            yield Finding(
                "nonfinite",
                "error",
                f"non-finite values first appear at {titles.get(stage, stage)}{cause}: "
                f"{record.count}, the first at {format_index(record.first)}{page}",
                hint=hint,
                index=record.first,
                stage=stage,
                count=record.count,
                details=at_page,
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


# --- the scale -------------------------------------------------------------------------------


def _unscaled(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    """1/√d_k left out (logits spread enough to saturate) or applied twice (too flat);
    not where the scale is right and the temperature moves the effective scale (the
    rows' hints name it: :mod:`~sdpa_cli.diagnosis.causes`)."""
    E = spec.E
    raw_std = stats.raw_std
    if E < 2 or not math.isfinite(raw_std) or raw_std == 0:
        return
    factor = spec.factor
    logit_std = raw_std * factor
    proper = raw_std / math.sqrt(E)
    # Closer (in log) to 1 than to 1/√d_k, and the logits spread enough to saturate.
    if scale_looks_omitted(spec) and not temperature_sharpens(spec) and logit_std > 2:
        numbers, details = _scale_numbers(spec, raw_std)
        yield Finding(
            "unscaled",
            "warning",
            f"1/√d_k looks omitted: {numbers}; with 1/√{E} it would be {sig(proper)}",
            hint=f"divide the scores by √d_k = {sig(math.sqrt(E))} (--scale sqrt-dk)"
            + (f"; {also}" if (also := temperature_also(spec, below=True)) else ""),
            stage="scaled",
            details=details,
        )
    # Closer to 1/d_k than to 1/√d_k, and the logits too flat to select anything.
    elif scale_looks_doubled(spec) and not temperature_flattens(spec) and logit_std < 0.5:
        numbers, details = _scale_numbers(spec, raw_std)
        yield Finding(
            "unscaled",
            "warning",
            f"1/√d_k looks applied twice: {numbers}; with 1/√{E} once it would be {sig(proper)}",
            hint="the scores were divided by d_k (or scaled before export and again here); "
            "use --scale sqrt-dk once, or --scale none for pre-scaled Q"
            + (f"; {also}" if (also := temperature_also(spec, below=False)) else ""),
            stage="scaled",
            details=details,
        )


def _scale_numbers(spec: AttentionSpec, raw_std: float) -> tuple[str, dict[str, float]]:
    """The numbers behind a scale finding: the spreads of Q, K and the scores (σ_q and
    σ_k read the whole tensors: only once a finding is made)."""
    E = spec.E
    factor = spec.factor
    logit_std = raw_std * factor
    sq, sk = finite_std(spec.q), finite_std(spec.k)
    predicted = math.sqrt(E) * sq * sk
    numbers = (
        f"std of QKᵀ {sig(raw_std)} (√d_k·σ_q·σ_k = √{E}·{sig(sq, 3)}·{sig(sk, 3)} = {sig(predicted)}); "
        f"effective scale {sig(factor)}, so the logits' std is {sig(logit_std)}"
    )
    details = {
        "raw_std": raw_std,
        "predicted_raw_std": predicted,
        "sigma_q": sq,
        "sigma_k": sk,
        "effective_scale": factor,
        "logit_std": logit_std,
        "logit_std_with_sqrt_dk": raw_std / math.sqrt(E),
    }
    return numbers, details


# --- masks -------------------------------------------------------------------------------------


def _mask_suspect(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    """Masks that look wrong: a float mask of 0 and 1, a boolean mask hiding most keys,
    a finite mask value (or a float mask's finite sentinel) on fully masked rows, a
    sentinel too weak for the logits, NaN or inf behind hidden keys."""
    yield from _zero_one_masks(spec)
    yield from _bool_mask(spec)
    yield from _finite_mask_value(spec, stats)
    yield from sentinel_fully_masked(spec, stats)
    yield from weak_sentinels(spec, stats)
    yield from _hidden_nonfinite(stats)


def _zero_one_masks(spec: AttentionSpec) -> Iterator[Finding]:
    """A float or integer mask or bias holding only 0 and 1: a boolean mask cast to
    numbers? An integer one (Hugging Face's int64 attention_mask) is said to be one:
    it is read as numbers, as a float mask, not as boolean."""
    for name in ("mask", "bias"):
        arr = getattr(spec, name)
        if arr is None or arr.dtype == np.bool_:
            continue
        a = np.asarray(arr)
        zeros, ones = a == 0, a == 1
        if (zeros | ones).all() and zeros.any() and ones.any():
            integer = a.dtype.kind in "iu"
            kind = f"integer ({a.dtype})" if integer else "float"
            refused = "PyTorch's SDPA refuses an integer mask. " if integer else ""
            yield Finding(
                "mask_suspect",
                "warning",
                f"the {kind} {name} ({spec.names.get(name, name)}) holds only 0 and 1: "
                "it is read as numbers added to the logits, +1 to some, not as a boolean "
                "mask, so it hides no key",
                hint=f"{refused}A boolean mask cast to numbers? Pass it as bool "
                "(True = may attend), or as 0 / −inf",
                stage="input",
                count=int(ones.sum()),
                details={"tensor": name},
            )


def _bool_mask(spec: AttentionSpec) -> Iterator[Finding]:
    """A boolean mask hiding more than half the keys: is True read the wrong way?"""
    if not spec.mask_is_bool:
        return
    o = spec.options
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


def _finite_mask_value(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    """Fully masked rows under a finite mask value: uniform weights, not zeros."""
    o = spec.options
    empty = int(stats.empty_rows.sum()) if spec.S else 0
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


def _hidden_nonfinite(stats: Stats) -> Iterator[Finding]:
    """K or V holding NaN or inf at keys the mask hides (padding exported unzeroed)."""
    for name, rec in stats.records.hidden_bad.items():
        if not rec.count:
            continue
        page, at_page = score_page(stats.spec, rec.first)  # a paged cache: the key's page
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
            f"first at {format_index(rec.first)}{page}: {effect}",
            hint=f"zero the padded rows of {label} before export",
            index=rec.first,
            stage="input",
            count=rec.count,
            details={"tensor": name, **at_page},
        )
