"""Merged partials (``--expect-partials``): split-KV, ring and context-parallel attention
compute an output and an LSE per key shard, then merge them. Each partial is judged
against the reference restricted to its keys, and their merge against the whole one.

The merge is the kernels' (flash-decoding's combine): ``m = max_i lse_i``,
``w_i = exp(lse_i − m)``, ``out = Σ w_i out_i / Σ w_i``, ``lse = m + log Σ w_i``; a
shard with ``lse = −inf`` (no visible key in it) contributes nothing. The
tolerances are fixed: ``--rtol``/``--atol`` when given, else the export format's row
of :data:`~sdpa_cli.check.compare.DTYPE_TOLERANCES`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import DTYPE_TOLERANCES, Tolerance
from sdpa_cli.check.elements import close_check
from sdpa_cli.check.exports import as_reference, as_seen_by_kernel, export_dtype
from sdpa_cli.check.records import Check, Expected
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import trace
from sdpa_cli.engine.types import F64
from sdpa_cli.errors import InputError, SpecError
from sdpa_cli.files.confine import confine
from sdpa_cli.files.loaders import Source, load_array
from sdpa_cli.files.structured import parse_text
from sdpa_cli.text import printable, unechoed


@dataclass(frozen=True)
class Partial:
    """One key shard's export: its keys ``[start, stop)``, its output ``(..., L, Ev)``
    and its LSE ``(..., L)``, as loaded."""

    start: int
    stop: int
    output: NDArray[Any]
    lse: NDArray[Any]
    label: str

    @property
    def keys(self) -> str:
        return f"{self.start}:{self.stop}"


# --- the file ---------------------------------------------------------------------------


def load_partials(path_text: str) -> list[Partial]:
    """The partials listed in a YAML/JSON file: a list of ``{keys: "0:512", output:
    FILE, lse: FILE}`` (or a mapping with such a list under ``partials``), paths
    relative to the file.

    Raises:
        InputError: a file that cannot be read or an entry that is not of that form.
    """
    path = Path(path_text)
    label = printable(path_text)
    fmt = "json" if path.suffix.lower() == ".json" else "yaml"
    data = parse_text(path, fmt, label)
    if isinstance(data, dict) and "partials" in data:
        data = data["partials"]
    if not isinstance(data, list) or not data:
        raise InputError(label, "should list the partials: [{keys: '0:512', output: F, lse: F}]")
    partials = []
    for n, entry in enumerate(data):
        where = f"{label}: partial {n}"
        if not isinstance(entry, dict) or set(entry) != {"keys", "output", "lse"}:
            raise InputError(where, "should have exactly keys, output and lse")
        start, stop = _key_range(str(entry["keys"]), where)
        arrays = {}
        for name in ("output", "lse"):
            ref = Source.parse(str(entry[name]), path.parent)
            confine(str(entry[name]), ref.path, path.parent, f"{where}: {name}")
            with unechoed():  # a file the user did not name: its content stays out of messages
                arrays[name] = load_array(ref, name=name)
        partials.append(Partial(start, stop, arrays["output"], arrays["lse"], where))
    return partials


def _key_range(text: str, where: str) -> tuple[int, int]:
    start, sep, stop = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(start), int(stop)
    except ValueError:
        raise InputError(where, f"keys should be START:STOP, e.g. 0:512; got {text!r}") from None


def check_tiling(partials: Sequence[Partial], S: int) -> None:
    """The key ranges, sorted, cover ``0..S`` once each.

    Raises:
        SpecError: a gap, an overlap, an empty range or keys past S.
    """
    at = 0
    for p in sorted(partials, key=lambda p: p.start):
        if p.stop <= p.start:
            raise SpecError("--expect-partials", f"keys {p.keys} are empty")
        if p.start != at:
            what = "overlap" if p.start < at else "leave a gap"
            raise SpecError(
                "--expect-partials",
                f"key ranges should tile 0:{S} without overlap: {p.keys} and the ranges "
                f"before it {what} at key {min(at, p.start)}",
            )
        at = p.stop
    if at != S:
        raise SpecError("--expect-partials", f"key ranges end at {at}, not at S = {S}")


# --- the merge --------------------------------------------------------------------------


def merge_partials(outputs: Sequence[F64], lses: Sequence[F64]) -> tuple[F64, F64]:
    """The kernels' merge of partial outputs ``(..., L, Ev)`` and LSEs ``(..., L)``.

    ``m = max_i lse_i``, ``w_i = exp(lse_i − m)``, ``out = Σ w_i out_i / Σ w_i``,
    ``lse = m + log Σ w_i``. A row whose every LSE is −inf gets output 0, LSE −inf.
    """
    lse = np.stack([np.asarray(x, dtype=np.float64) for x in lses])
    m = lse.max(axis=0)
    # Subtract the row's largest LSE so that exp stays ≤ 1 (no overflow); a row with
    # no visible key anywhere uses 0 in its place, so that −inf − −inf is not NaN.
    safe_m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - safe_m)  # a shard with lse = −inf: weight 0
    total = w.sum(axis=0)
    out = np.zeros(np.shape(outputs[0]), dtype=np.float64)
    for wi, oi in zip(w, outputs, strict=True):
        # a weightless shard's output (NaN, garbage) must not reach the sum: 0 · NaN is NaN
        out += np.where(wi[..., None] > 0, wi[..., None] * np.asarray(oi, np.float64), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(total[..., None] > 0, out / total[..., None], 0.0)
        merged_lse = np.where(total > 0, safe_m + np.log(total), -math.inf)
    return out, merged_lse


# --- the checks -------------------------------------------------------------------------


def partial_checks(
    spec: AttentionSpec, partials: Sequence[Partial], settings: CheckSettings
) -> list[Check]:
    """``partial[a:b].output.close`` and ``partial[a:b].lse.close`` for each partial
    (against the reference over keys ``a:b`` alone), then ``merged.output.close`` and
    ``merged.lse.close`` (their merge against the whole reference).

    Raises:
        SpecError: ranges that do not tile ``0..S``, a partial of the wrong shape, or
            options the per-range reference does not cover.
    """
    check_tiling(partials, spec.S)
    for name, given in (
        ("--heads", spec.options.heads is not None),
        ("--sinks", spec.sinks is not None),
        ("--dropout-mask", spec.dropout_mask is not None),
    ):
        if given:
            raise SpecError("--expect-partials", f"is not supported with {name}")
    out_shape, lse_shape = spec.output_shape, (*spec.lead, spec.L)
    outputs, lses = [], []
    for p in partials:
        outputs.append(_fit(p.output, out_shape, f"{p.label} output"))
        lses.append(_fit(p.lse, lse_shape, f"{p.label} lse"))
    export = export_dtype(spec, [Expected("output", p.output, p.label) for p in partials])
    tol = _tolerance(settings, export)
    ref_out, ref_lse, masked, v = _reference(spec, export)
    nan = settings.equal_nan
    checks: list[Check] = []
    for p, out, lse in zip(partials, outputs, lses, strict=True):
        r_out, r_lse = _restricted(masked, v, p.start, p.stop)
        # A row with no visible key in the range has no output: kernels leave 0 or NaN.
        r_out = np.where(np.isfinite(r_lse)[..., None], r_out, out)
        name = f"partial[{p.keys}]"
        checks.append(close_check(f"{name}.output", out, r_out, tol, p.label, nan))
        checks.append(close_check(f"{name}.lse", lse, r_lse, tol, p.label, nan))
    m_out, m_lse = merge_partials(outputs, lses)
    checks.append(close_check("merged.output", m_out, ref_out, tol, "merged", nan))
    checks.append(close_check("merged.lse", m_lse, ref_lse, tol, "merged", nan))
    return checks


def _fit(values: NDArray[Any], shape: tuple[int, ...], label: str) -> F64:
    if values.size != math.prod(shape) or tuple(s for s in values.shape if s != 1) != tuple(
        s for s in shape if s != 1
    ):
        raise SpecError(label, f"has shape {values.shape}; expected {shape}")
    return np.asarray(values, dtype=np.float64).reshape(shape)


def _tolerance(settings: CheckSettings, export: str) -> Tolerance:
    if settings.rtol is not None and settings.atol is not None:
        return Tolerance(settings.rtol, settings.atol, "given")
    rtol, atol = DTYPE_TOLERANCES[export]
    return Tolerance(rtol, atol, f"{export} defaults")


def _reference(spec: AttentionSpec, export: str) -> tuple[F64, F64, F64, F64]:
    """The float64 reference from the inputs as the kernel saw them: its output and
    LSE, its masked logits ``(..., L, S)`` with hidden keys at −inf, and V per query
    head ``(..., S, Ev)``."""
    ref_spec = as_reference(as_seen_by_kernel(spec, export), "float64")
    run = trace(ref_spec, ("masked", "weights", "output"), gather_stats=False)
    assert run.masked is not None
    assert run.output is not None
    masked = np.asarray(run.masked, dtype=np.float64)
    if run.visible is not None:
        masked = np.where(run.visible, masked, -math.inf)
    v = np.asarray(ref_spec.v, dtype=np.float64)
    if spec.options.layout == "bshd" and v.ndim >= 3:
        v = v.swapaxes(-2, -3)
    if spec.group > 1:  # query head h reads key/value head h // group
        v = np.repeat(v, spec.group, axis=-3)
    return np.asarray(run.output, np.float64), _logsumexp(masked), masked, v


def _restricted(masked: F64, v: F64, start: int, stop: int) -> tuple[F64, F64]:
    """The attention over keys ``start:stop`` alone: its output and LSE."""
    part = masked[..., start:stop]
    lse = _logsumexp(part)
    # exp(logit − the range's LSE) ≤ 1: no overflow; a row with no visible key uses 0.
    safe = np.where(np.isfinite(lse), lse, 0.0)[..., None]
    w = np.exp(part - safe)
    return np.matmul(w, v[..., start:stop, :]), lse


def _logsumexp(x: F64) -> F64:
    """log Σ exp over the last axis; −inf for a row of −inf."""
    m = x.max(axis=-1, keepdims=True)
    # shift by the row's largest logit so that exp stays ≤ 1 (no overflow)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.asarray((np.log(np.exp(x - safe).sum(axis=-1)) + safe[..., 0]), np.float64)
