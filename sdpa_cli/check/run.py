"""``sdpa check``: exported attention tensors judged against a recomputed reference.

Pure data in, data out: a validated spec, the exported arrays and the settings go in;
a :class:`CheckReport` (a list of :class:`Check` records, the findings) comes out.
Rendering, JSON, JUnit and exit codes are the command line's business.

Element-wise comparison and tolerances live in :mod:`sdpa_cli.check.compare`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import (
    DTYPE_TOLERANCES,
    Mismatch,
    Tolerance,
    argmax_index,
    compare,
    measured_tolerance,
    mismatch_summary,
)
from sdpa_cli.diagnose.rules import KINDS, SEVERITIES, Diagnosis, Thresholds, diagnose
from sdpa_cli.engine import precision
from sdpa_cli.engine.block import (
    Block,
    Progress,
    SliceInputs,
    Trace,
    attend_block,
    float64_twin,
    key_range,
    merge_heads,
    native_dtype,
    softmax,
    sweep,
    trace,
)
from sdpa_cli.engine.spec import AttentionSpec, scale_factor
from sdpa_cli.engine.stats import Index, Records, Stats, input_dtypes, working_formats
from sdpa_cli.errors import SpecError
from sdpa_cli.files.config import CHECK_NAMES, check_values
from sdpa_cli.text import plural

F64 = NDArray[np.float64]

TENSORS = ("output", "weights", "lse")
"""What an export may hold: the output, the attention weights, the logsumexp per row."""

DEFAULT_GATE = ("nonfinite", "overflow")
"""Finding kinds that fail a check with no expectation: non-finite values, and
overflow in the run's own formats (the inputs' dtype or ``--dtype``)."""


# --- settings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckSettings:
    """How to judge an export. ``None`` means the default described on each field."""

    rtol: float | None = None
    """Relative tolerance; with ``atol`` (both or neither). Default: by the export's format."""
    atol: float | None = None
    reference: str | None = None
    """Format of the reference: float32 for 16- and 8-bit exports, float64 otherwise."""
    tolerance: str = "dtype"
    """``dtype`` (the defaults of :data:`DTYPE_TOLERANCES`) or ``measured``: no worse
    than the naive computation in the export's format, times ``fudge``."""
    fudge: float = 2.0
    fail_on: tuple[str, ...] | None = None
    """Finding kinds that fail the run; default :data:`DEFAULT_GATE` without
    expectations, none with them."""
    fail_on_severity: str | None = None
    """Fail on any finding at or above this severity."""
    equal_nan: bool = False
    """Whether NaN in both the export and the reference counts as a match."""

    def __post_init__(self) -> None:
        if (self.rtol is None) != (self.atol is None):
            raise SpecError(
                "--rtol/--atol", "give both rtol and atol, or neither (defaults by the dtype)"
            )
        # Each value as the config file and the flags are checked (one set of rules).
        check_values({name: getattr(self, name) for name in CHECK_NAMES})
        if self.tolerance == "measured" and self.rtol is not None:
            raise SpecError("--tolerance", "measured computes rtol and atol; drop --rtol/--atol")


# --- the records ------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One check: its name, status, a one-line figure, and the numbers behind it.

    ``index`` is the full index of the worst element (in the layout of the file
    checked), or None when nothing is wrong or the check is not about one element.
    """

    name: str
    status: str
    summary: str
    index: Index | None = None
    file: str | None = None
    tolerance: Tolerance | None = None
    mismatch: Mismatch | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    hint: str | None = None
    """What probably went wrong, when sdpa could tell (a failed comparison)."""

    @property
    def passed(self) -> bool:
        return self.status != "fail"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "passed": self.passed,
            "status": self.status,
            "summary": self.summary,
            "index": None if self.index is None else list(self.index),
        }
        if self.file is not None:
            out["file"] = self.file
        if self.tolerance is not None:
            out["tolerance"] = self.tolerance.to_dict()
        if self.mismatch is not None:
            out["mismatch"] = self.mismatch.to_dict()
        if self.hint is not None:
            out["hint"] = self.hint
        out.update(self.details)
        return out


@dataclass(frozen=True)
class Expected:
    """One exported tensor: what it is (``output``, ``weights``, ``lse``), its values
    and the file it came from."""

    name: str
    values: NDArray[Any]
    label: str


@dataclass(frozen=True)
class CheckReport:
    """Everything ``check`` concluded about one case."""

    checks: tuple[Check, ...]
    diagnosis: Diagnosis
    export_dtype: str
    reference: str
    gate: tuple[str, ...]
    fail_on_severity: str | None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)


# --- exported tensors: shapes and layouts -----------------------------------------------


def expected_shapes(spec: AttentionSpec, name: str) -> tuple[tuple[int, ...], ...]:
    """The layouts accepted for an exported ``name``: the computation's, and for the
    output under ``--heads`` the merged ``(..., L, heads·Ev)`` as well."""
    if name == "weights":
        return (spec.weights_shape,)
    if name == "lse":
        return ((*spec.lead, spec.L),)
    if spec.options.heads is not None:
        return (spec.merged_output_shape, spec.output_shape)
    return (spec.output_shape,)


def _strip_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return shape[i:]


@dataclass(frozen=True)
class _Fitted:
    """An export in the computation's layout (in its own dtype)."""

    exp: Expected
    values: F64
    merged: bool
    """An output in the merged ``(..., L, heads·Ev)`` layout (under ``--heads``)."""


def fit_expected(spec: AttentionSpec, exp: Expected) -> _Fitted:
    """The export as float64 in one of :func:`expected_shapes` (leading 1s may differ).

    Raises:
        SpecError: naming the file, when no layout fits.
    """
    got = tuple(exp.values.shape)
    for shape in expected_shapes(spec, exp.name):
        if got == shape or _strip_ones(got) == _strip_ones(shape):
            values = np.asarray(exp.values).reshape(shape)  # read (as float64) chunk by chunk
            merged = exp.name == "output" and shape != spec.output_shape
            return _Fitted(exp, values, merged)
    want = " or ".join(str(s) for s in expected_shapes(spec, exp.name))
    raise SpecError(exp.label, f"has shape {got}; the computation's {exp.name} is {want}")


def export_dtype(spec: AttentionSpec, expected: list[Expected]) -> str:
    """The format the export was computed in: ``--dtype`` when given, otherwise the
    narrowest of the exported files' and the inputs' dtypes (float64 when all are)."""
    if spec.options.emulated:
        return spec.options.dtype
    names = {str(e.values.dtype) for e in expected} | set(input_dtypes(spec))
    return next((d for d in reversed(precision.FORMATS) if d in names), "float64")


def _reference_spec(spec: AttentionSpec, fmt: str) -> AttentionSpec:
    """``spec`` with every step in the reference format ``fmt``."""
    options = dataclasses.replace(
        spec.options, dtype=fmt, accumulate=fmt, softmax_dtype=fmt, logits_dtype=fmt
    )
    return dataclasses.replace(spec, options=options)


def _naive_spec(spec: AttentionSpec, dtype: str) -> AttentionSpec:
    """``spec`` run naively in the export's format: the user's ``--accumulate`` and
    friends when ``--dtype`` is that format, a kernel's defaults otherwise."""
    o = spec.options
    if o.dtype == dtype:
        return spec
    options = dataclasses.replace(
        o, dtype=dtype, accumulate="float32", softmax_dtype="float32", logits_dtype=dtype
    )
    return dataclasses.replace(spec, options=options)


def softmax_lse(masked: NDArray[Any], weights: NDArray[Any]) -> F64:
    """Each row's logsumexp of the masked logits, read off their softmax: LSE =
    s_top − log w_top for the row's largest weight (every weight is exp(s − LSE));
    −inf for a row with no key to attend to, NaN for a row of NaN. Any leading axes;
    keys last."""
    if not weights.shape[-1]:
        return np.full(weights.shape[:-1], -math.inf)
    top = np.argmax(weights, axis=-1)[..., None]
    w_top = np.take_along_axis(weights, top, axis=-1)[..., 0].astype(np.float64)
    s_top = np.take_along_axis(masked, top, axis=-1)[..., 0].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = s_top - np.log(w_top)
    return np.where(np.isnan(w_top), math.nan, np.where(w_top > 0, lse, -math.inf))


def logsumexp(masked: F64) -> F64:
    """``log Σ_j exp(logit_j)`` per row (the engine's softmax, max-subtracted); −inf
    for a row with no visible key (every logit −inf)."""
    return softmax_lse(masked, softmax(np.asarray(masked, dtype=np.float64)))


def _merged_index(spec: AttentionSpec, at: Index) -> Index:
    """An index into the split output ``(..., heads, L, Ev)`` as an index into the
    merged ``(..., L, heads·Ev)`` layout the file has."""
    *lead, h, i, c = at
    return (*lead, i, h * spec.Ev + c)


# --- the checks -------------------------------------------------------------------------


def _finite_check(name: str, values: F64, label: str) -> Check:
    bad = ~np.isfinite(values)
    n = int(bad.sum())
    if not n:
        return Check(f"{name}.finite", "pass", f"all {values.size:,} finite", file=label)
    at = argmax_index(bad)
    nan = int(np.isnan(values).sum())
    return Check(
        f"{name}.finite",
        "fail",
        f"{n:,} of {values.size:,} not finite ({nan:,} NaN, {n - nan:,} inf); first at {list(at)}",
        index=at,
        file=label,
        details={"nonfinite": n, "nan": nan, "inf": n - nan},
    )


def _close_check(
    name: str, actual: F64, reference: F64, tol: Tolerance, label: str, equal_nan: bool
) -> Check:
    m = compare(actual, reference, tol.rtol, tol.atol, equal_nan=equal_nan)
    return Check(
        f"{name}.close",
        "fail" if m.mismatched else "pass",
        mismatch_summary(m, tol),
        index=m.worst_at,
        file=label,
        tolerance=tol,
        mismatch=m,
    )


def _weights_range(w: F64, tol: Tolerance, label: str) -> Check:
    """Every weight in [0, 1] (up to atol)."""
    with np.errstate(invalid="ignore"):
        bad = np.isfinite(w) & ((w < -tol.atol) | (w > 1 + tol.atol))
    n = int(bad.sum())
    if not n:
        return Check("weights.range", "pass", "all in [0, 1]", file=label)
    at = argmax_index(bad)
    return Check(
        "weights.range",
        "fail",
        f"{n:,} of {w.size:,} outside [0, 1]; first {w[at]:.6g} at {list(at)}",
        index=at,
        file=label,
        details={"outside": n, "first_value": float(w[at])},
    )


def _weights_rows(w: F64, support: NDArray[np.bool_], tol: Tolerance, label: str) -> Check:
    """Rows sum to 1 over the keys they may attend to, the others get nothing; a row
    with nothing to attend to sums to 0.

    ``support`` is where the computation can put weight: the visible keys, and the
    hidden ones a finite mask value still weighs (a row with no visible key is
    spread over every key under -1e9).
    """
    any_support = np.asarray(support.any(axis=-1))
    with np.errstate(invalid="ignore"):
        sums = np.where(support, w, 0.0).sum(axis=-1)
        target = np.where(any_support, 1.0, 0.0)
        leaked = np.where(support, 0.0, np.abs(w)).max(axis=-1, initial=0.0)
        off = np.abs(sums - target)
        bad_sum = np.isfinite(sums) & (off > tol.atol + tol.rtol)
        bad_leak = leaked > tol.atol
    bad = bad_sum | bad_leak
    n_rows = int(np.prod(sums.shape))
    n = int(bad.sum())
    if not n:
        empty = n_rows - int(any_support.sum())
        largest = float(off[np.isfinite(off)].max(initial=0.0))
        summary = f"all {n_rows:,} rows sum to 1 (largest |Σ − 1| {largest:.3g})"
        if empty:
            summary = (
                f"{n_rows - empty:,} rows sum to 1 (largest |Σ − 1| {largest:.3g}); "
                f"{empty:,} with no key to attend to sum to 0"
            )
        return Check("weights.rows", "pass", summary, file=label)
    row = argmax_index(bad)
    if bad_sum[row]:
        what = f"sums to {sums[row]:.6g}, not {target[row]:g}"
    else:
        what = f"puts {leaked[row]:.3g} on hidden keys"
    return Check(
        "weights.rows",
        "fail",
        f"{n:,} of {n_rows:,} rows off: row {list(row)} {what}",
        index=row,
        file=label,
        details={
            "rows_off": n,
            "bad_sums": int(bad_sum.sum()),
            "leaking_rows": int(bad_leak.sum()),
        },
    )


def v_range(
    v: F64,
    support: NDArray[np.bool_] | None,
    n_rows: int,
    running: tuple[F64, F64] | None = None,
) -> tuple[F64, F64]:
    """Per row and column, the smallest and largest of ``v`` (the block's keys, (keys,
    Ev)) over the keys the row may attend to (``support``, (rows, keys); None: every
    one); 0 for a row with none.

    Rows that see a prefix of the keys (causal, padding) or a suffix read running
    minima and maxima, O(keys·Ev) in all; only other rows (windows, arbitrary masks)
    reduce over their keys a few rows at a time. ``running``: V's running minima and
    maxima down these keys, when the caller keeps them.
    """
    S, Ev = v.shape
    if support is None:
        if not S:
            return np.zeros((n_rows, Ev)), np.zeros((n_rows, Ev))
        return np.broadcast_to(v.min(axis=0), (n_rows, Ev)), np.broadcast_to(
            v.max(axis=0), (n_rows, Ev)
        )
    lo = np.zeros((n_rows, Ev), dtype=v.dtype)
    hi = np.zeros((n_rows, Ev), dtype=v.dtype)
    if S == 0:
        return lo, hi
    vis = np.asarray(support, dtype=np.bool_)
    count = vis.sum(axis=-1)
    first = np.argmax(vis, axis=-1)
    last = S - 1 - np.argmax(vis[:, ::-1], axis=-1)
    contiguous = (count > 0) & (count == last - first + 1)
    prefix = contiguous & (first == 0)
    suffix = contiguous & (last == S - 1) & ~prefix
    if prefix.any():
        low, high = running or (np.minimum.accumulate(v, axis=0), np.maximum.accumulate(v, axis=0))
        lo[prefix] = low[last[prefix]]
        hi[prefix] = high[last[prefix]]
    if suffix.any():
        lo[suffix] = np.minimum.accumulate(v[::-1], axis=0)[::-1][first[suffix]]
        hi[suffix] = np.maximum.accumulate(v[::-1], axis=0)[::-1][first[suffix]]
    rest = np.flatnonzero((count > 0) & ~prefix & ~suffix)
    step = max(1, (1 << 21) // max(1, S * Ev))
    for j in range(0, rest.size, step):
        rows = rest[j : j + step]
        sel = vis[rows][:, :, None]
        lo[rows] = np.where(sel, v[None], np.inf).min(axis=1)
        hi[rows] = np.where(sel, v[None], -np.inf).max(axis=1)
    return lo, hi


def block_support(block: Block) -> NDArray[np.bool_] | None:
    """Where a block can put weight: its visible keys (a float mask's −inf hides too),
    and hidden keys a finite mask value still weighs (−1 leaves them weight; −1e9
    spreads a row with no visible key over every key). None: every key of the block."""
    if block.all_visible and float(np.min(block.masked, initial=np.inf)) > -math.inf:
        return None
    return weighable(block.visible, block.masked, block.weights)


def weighable(
    visible: NDArray[np.bool_], masked: NDArray[Any], weights: NDArray[Any]
) -> NDArray[np.bool_]:
    """The visible keys a logit of −inf does not hide, and any key holding weight."""
    with np.errstate(invalid="ignore"):
        support: NDArray[np.bool_] = visible & (masked != -math.inf)
        support |= weights > 0
    return support


def _output_range(
    spec: AttentionSpec,
    out: F64,
    bounds_lo: F64,
    bounds_hi: F64,
    tol: Tolerance,
    label: str,
    merged: bool,
) -> Check:
    """Each output inside the per-column range of V over the row's visible keys: it is
    a convex combination of those rows of V."""
    if spec.options.dropout > 0:
        return Check(
            "output.range",
            "pass",
            "skipped: dropout rescales the weights, so the output may leave V's range",
            file=label,
            details={"skipped": True},
        )
    n = 0
    first: Index | None = None
    first_value = 0.0
    bounds = (0.0, 0.0)
    for lead in np.ndindex(*spec.lead):
        lo, hi = bounds_lo[lead], bounds_hi[lead]
        o = out[lead]
        slack = tol.atol + tol.rtol * np.maximum(np.abs(lo), np.abs(hi))
        with np.errstate(invalid="ignore"):
            bad = np.isfinite(o) & ((o < lo - slack) | (o > hi + slack))
        k = int(bad.sum())
        if k and first is None:
            i, c = argmax_index(bad)
            first = (*lead, i, c)
            first_value = float(o[i, c])
            bounds = (float(lo[i, c]), float(hi[i, c]))
        n += k
    if not n:
        return Check(
            "output.range", "pass", "every value inside V's range over its visible keys", file=label
        )
    assert first is not None
    at = _merged_index(spec, first) if merged else first
    return Check(
        "output.range",
        "fail",
        f"{n:,} of {out.size:,} outside V's range over the visible keys; "
        f"{first_value:.6g} at {list(at)} is outside [{bounds[0]:.6g}, {bounds[1]:.6g}]",
        index=at,
        file=label,
        details={"outside": n, "first_value": first_value, "range": list(bounds)},
    )


def _lse_weights(
    masked: F64,
    lse: F64,
    lse_dtype: np.dtype[Any],
    w: F64,
    visible: NDArray[np.bool_],
    tol: Tolerance,
    label: str,
    equal_nan: bool,
) -> Check:
    """The exported weights equal exp(logit − exported LSE) on rows with a key to attend to.

    A row whose LSE is so large that one step of its own format exceeds rtol (−1e9 +
    log S in float32, under a finite mask value) cannot pin its weights to the
    tolerance: such rows are counted, not judged.
    """
    rows = np.asarray(visible.any(axis=-1)) & np.isfinite(lse)
    fmt = lse_dtype if lse_dtype.kind == "f" else np.dtype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        step = np.spacing(np.abs(np.where(rows, lse, 0.0)).astype(fmt)).astype(np.float64)
        coarse = rows & (step > tol.rtol)
        rows &= ~coarse
        implied = np.exp(masked - np.where(rows, lse, 0.0)[..., None])
    implied = np.where(rows[..., None], implied, w)  # rows not judged: compared to themselves
    m = compare(w, implied, tol.rtol, tol.atol, equal_nan=equal_nan)
    skipped = int(coarse.sum())
    note = (
        f" ({plural(skipped, 'row')} with an LSE too coarse in {fmt} not judged)" if skipped else ""
    )
    summary = (
        f"the exported weights equal exp(logit − LSE){note}"
        if not m.mismatched
        else f"weights ≠ exp(logit − LSE): {mismatch_summary(m, tol)}{note}"
    )
    return Check(
        "lse.weights",
        "fail" if m.mismatched else "pass",
        summary,
        index=m.worst_at,
        file=label,
        tolerance=tol,
        mismatch=m,
        details={"rows_not_judged": skipped},
    )


SUSPECT_LIMIT = 1 << 22
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


def tensor_values(run: Trace, name: str, merged: bool = False) -> F64:
    """What a run computed for the export ``name``: the output (merged under
    ``--heads`` when the file is), the weights, or the LSE of the masked logits."""
    if name == "lse":
        assert run.masked is not None
        assert run.weights is not None
        return softmax_lse(run.masked, run.weights)
    values = run.stage(name)
    assert values is not None
    return merge_heads(run.spec, values) if name == "output" and merged else values


def _gate(settings: CheckSettings, has_expectations: bool) -> tuple[tuple[str, ...], bool]:
    """The gated kinds, and whether overflow counts only in the run's own formats."""
    if settings.fail_on is not None:
        return settings.fail_on, False
    if has_expectations:
        return (), False
    return DEFAULT_GATE, True


def _finding_checks(
    diagnosis: Diagnosis,
    gate: tuple[str, ...],
    own_formats_only: bool,
    working: tuple[str, ...],
    severity: str | None,
) -> Iterator[Check]:
    def gated(kind: str) -> list[Any]:
        return [
            f
            for f in diagnosis.findings
            if f.kind == kind
            and not (own_formats_only and kind == "overflow" and f.dtype not in working)
        ]

    used: set[int] = set()
    for kind in gate:
        hits = gated(kind)
        used.update(id(f) for f in hits)
        filtered = own_formats_only and kind == "overflow"
        if not hits:
            scope = ""
            if filtered:
                scope = f" in {', '.join(working) or 'float64'}, the run's own format"
                if diagnosis.counts.get(kind):
                    scope += " (other formats: see findings)"
            yield Check(f"findings.{kind}", "pass", f"no {kind} findings{scope}")
            continue
        # Row findings are listed up to --max-findings but all counted.
        count = len(hits) if filtered else diagnosis.counts.get(kind, len(hits))
        yield Check(
            f"findings.{kind}",
            "fail",
            f"{plural(count, kind + ' finding')}; first: {hits[0].message}",
            index=hits[0].index,
            details={"findings": [f.to_dict() for f in hits[:5]], "count": count},
        )
    if severity is not None:
        rank = SEVERITIES.index(severity)
        hits = [f for f in diagnosis.findings if SEVERITIES.index(f.severity) >= rank]
        used.update(id(f) for f in hits)
        if hits:
            yield Check(
                "findings.severity",
                "fail",
                f"{plural(len(hits), 'finding')} at {severity} or worse; first: {hits[0].kind}: {hits[0].message}",
                index=hits[0].index,
                details={"findings": [f.to_dict() for f in hits[:5]], "count": len(hits)},
            )
        else:
            yield Check("findings.severity", "pass", f"no finding at {severity} or worse")
    rest = [f for f in diagnosis.findings if id(f) not in used]
    serious = [f for f in rest if f.severity != "info"]
    if serious:
        kinds = sorted({f.kind for f in serious}, key=KINDS.index)
        yield Check(
            "findings",
            "warn",
            f"{plural(len(serious), 'finding')} not gating ({', '.join(kinds)}); "
            f"first: {serious[0].message}",
            index=serious[0].index,
            details={"count": len(serious), "kinds": kinds},
        )
    else:
        note = f" ({plural(len(rest), 'info finding')})" if rest else ""
        yield Check("findings", "pass", f"nothing worth a warning{note}")


@dataclass
class _Pass:
    """What one pass over every block gives the checks: the findings' statistics and
    the output-sized results (``output`` in the computation's layout, ``lse``) of the
    reference and of the naive run. No score-sized array outlives its block."""

    stats: Stats
    reference: dict[str, F64] = field(default_factory=dict)
    naive: dict[str, F64] = field(default_factory=dict)
    lo: F64 | None = None
    """Per output element, the smallest value of V over the keys its row can weigh."""
    hi: F64 | None = None


def block_lse(block: Block) -> F64:
    """Each row's logsumexp of a block's masked logits (:func:`softmax_lse`)."""
    return softmax_lse(block.masked, block.weights)


def _judge_pass(
    spec: AttentionSpec,
    ref_spec: AttentionSpec,
    naive_spec: AttentionSpec | None,
    wanted: set[str],
    jobs: int,
    progress: Progress | None,
) -> _Pass:
    """Every block once: the findings' statistics (from the run as given, or from the
    reference when the run is not emulated: it computes the same thing, in a format
    at least as wide as the inputs'), and the reference's output, LSE and V range."""
    stats = Stats.empty(spec)
    cache = SliceInputs(keep=jobs + 1)
    ref_dtype = native_dtype(ref_spec) or np.dtype(np.float64)
    # V's own values bound the output: float32 holds those of a float16 or float32 V.
    bound_dtype = np.result_type(spec.v.dtype, np.float32)
    found = _Pass(stats)
    runs = [(ref_spec, found.reference, ref_dtype)]
    if naive_spec is not None:
        runs.append((naive_spec, found.naive, np.dtype(np.float64)))
    for _, values, dtype in runs:
        if "output" in wanted:
            values["output"] = np.empty(spec.output_shape, dtype=dtype)
        if "lse" in wanted:
            values["lse"] = np.empty((*spec.lead, spec.L))
    if "output" in wanted:
        found.lo = np.empty(spec.output_shape, dtype=bound_dtype)
        found.hi = np.empty(spec.output_shape, dtype=bound_dtype)

    def visit(lead: Index, r: slice) -> Records:
        keys = key_range(spec, lead, r)
        ref = attend_block(ref_spec, lead, r, keys=keys, inputs=cache.get(ref_spec, lead))
        run = ref
        computed = {id(ref_spec): ref}
        if spec.options.emulated:
            run = attend_block(spec, lead, r, keys=keys, inputs=cache.get(spec, lead))
            computed[id(spec)] = run
        records = stats.measure(run, float64_twin(spec, run, cache))
        at: tuple[int | slice, ...] = (*lead, r)
        for of, values, _ in runs:
            b = computed.get(id(of)) or attend_block(
                of, lead, r, keys=keys, inputs=cache.get(of, lead)
            )
            if "output" in values:
                values["output"][at] = b.output
            if "lse" in values:
                values["lse"][at] = block_lse(b)
        if found.lo is not None and found.hi is not None:
            inputs = cache.get(ref_spec, lead)
            running = None
            if keys.start == 0:
                low, high = inputs.v_running
                running = (low[: keys.stop], high[: keys.stop])
            found.lo[at], found.hi[at] = v_range(
                inputs.v[keys], block_support(ref), r.stop - r.start, running
            )
        return records

    for records in sweep(spec, visit, jobs=jobs, progress=progress):
        stats.merge(records)
    stats.add_all_moments()
    return found


def run_checks(
    spec: AttentionSpec,
    expected: list[Expected],
    settings: CheckSettings | None = None,
    thresholds: Thresholds | None = None,
    *,
    jobs: int = 1,
    progress: Progress | None = None,
) -> CheckReport:
    """Judge the exported tensors (any of output, weights, lse) against ``spec``.

    Without any export, the inputs and the computation themselves are judged: the
    findings of the computation (as ``compute`` would find them) gate the result.
    One pass over the blocks (on ``jobs`` threads) gives the findings and the
    reference's output and LSE; exported weights are compared with the reference's
    weights as whole arrays.

    Raises:
        SpecError: an export whose shape fits no layout of the computation.
    """
    settings = settings or CheckSettings()
    names = [e.name for e in expected]
    for name in names:
        if name not in TENSORS:
            raise SpecError(name, f"unknown export; expected one of {', '.join(TENSORS)}")
    fitted = {e.name: fit_expected(spec, e) for e in expected}

    export = export_dtype(spec, expected)
    ref_format = settings.reference or (
        "float64" if export in ("float64", "float32") else "float32"
    )
    ref_spec = spec if _same_run(spec, ref_format) else _reference_spec(spec, ref_format)
    measured = settings.tolerance == "measured"
    naive_spec = _naive_spec(spec, export) if measured and expected else None
    found = _judge_pass(spec, ref_spec, naive_spec, set(fitted), jobs, progress)
    diagnosis = diagnose(found.stats, thresholds)
    gate, own_only = _gate(settings, bool(expected))
    finding_checks = _finding_checks(
        diagnosis, gate, own_only, working_formats(spec), settings.fail_on_severity
    )
    checks = (
        _export_checks(spec, settings, fitted, export, ref_spec, naive_spec, found)
        if expected
        else []
    )
    checks.extend(finding_checks)
    return CheckReport(
        checks=tuple(checks),
        diagnosis=diagnosis,
        export_dtype=export,
        reference=ref_format,
        gate=gate,
        fail_on_severity=settings.fail_on_severity,
    )


def _same_run(spec: AttentionSpec, ref_format: str) -> bool:
    """Whether the run as given already is the reference (float64, not emulated)."""
    return ref_format == "float64" and not spec.options.emulated


RUN_STAGES = ("masked", "weights", "output")
"""The stages a check compares against: the LSE comes from the masked logits."""


def _whole(
    spec: AttentionSpec, values: Mapping[str, F64], name: str, run: Trace | None, merged: bool
) -> F64:
    """A run's values of an export, in the file's layout: the output and the LSE from
    the pass (``values``), the weights from the whole trace ``run``."""
    if name == "weights":
        assert run is not None
        return tensor_values(run, name)
    return merge_heads(spec, values[name]) if name == "output" and merged else values[name]


def _export_checks(
    spec: AttentionSpec,
    settings: CheckSettings,
    fitted: Mapping[str, _Fitted],
    export: str,
    ref_spec: AttentionSpec,
    naive_spec: AttentionSpec | None,
    found: _Pass,
) -> list[Check]:
    """The checks of the exported tensors, in order: output, weights, LSE; then the
    hints of the failed comparisons."""
    reference: Trace | None = None
    naive_weights: Trace | None = None
    if "weights" in fitted:
        # The one score-sized comparison: the export holds as many numbers itself.
        reference = trace(ref_spec, RUN_STAGES, gather_stats=False)
        if naive_spec is not None:
            naive_weights = trace(naive_spec, RUN_STAGES, gather_stats=False)
    ref = {
        name: _whole(spec, found.reference, name, reference, f.merged) for name, f in fitted.items()
    }
    if "lse" in ref:  # a row with no visible key: −inf, or +inf as FlashAttention 2 writes it
        lse = fitted["lse"].values
        ref["lse"] = np.where((ref["lse"] == -math.inf) & np.isinf(lse), lse, ref["lse"])

    def tolerance_for(name: str) -> Tolerance:
        if settings.rtol is not None and settings.atol is not None:
            return Tolerance(settings.rtol, settings.atol, "given")
        if naive_spec is not None:
            naive_values = _whole(spec, found.naive, name, naive_weights, fitted[name].merged)
            return measured_tolerance(ref[name], naive_values, export, settings.fudge)
        rtol, atol = DTYPE_TOLERANCES[export]
        return Tolerance(rtol, atol, f"{export} defaults")

    tols = {name: tolerance_for(name) for name in fitted}
    nan = settings.equal_nan
    checks: list[Check] = []
    if "output" in fitted:
        f, tol = fitted["output"], tols["output"]
        split = f.values
        if f.merged:
            heads = spec.merged_output_shape[-1] // spec.Ev
            split = np.moveaxis(f.values.reshape(*f.values.shape[:-1], heads, spec.Ev), -2, -3)
        assert found.lo is not None
        assert found.hi is not None
        checks.append(_finite_check("output", f.values, f.exp.label))
        checks.append(_output_range(spec, split, found.lo, found.hi, tol, f.exp.label, f.merged))
        checks.append(_close_check("output", f.values, ref["output"], tol, f.exp.label, nan))
    support: NDArray[np.bool_] | None = None
    if reference is not None:
        assert reference.masked is not None
        assert reference.weights is not None
        assert reference.visible is not None
        support = weighable(reference.visible, reference.masked, reference.weights)
    if "weights" in fitted:
        f, tol = fitted["weights"], tols["weights"]
        assert support is not None
        checks.append(_finite_check("weights", f.values, f.exp.label))
        checks.append(_weights_range(f.values, tol, f.exp.label))
        checks.append(_weights_rows(f.values, support, tol, f.exp.label))
        checks.append(_close_check("weights", f.values, ref["weights"], tol, f.exp.label, nan))
    if "lse" in fitted:
        f = fitted["lse"]
        checks.append(_close_check("lse", f.values, ref["lse"], tols["lse"], f.exp.label, nan))
        if "weights" in fitted:
            assert reference is not None
            assert reference.masked is not None
            assert support is not None
            checks.append(
                _lse_weights(
                    reference.masked,
                    f.values,
                    f.exp.values.dtype,
                    fitted["weights"].values,
                    support,
                    tols["weights"],
                    f.exp.label,
                    nan,
                )
            )
    if math.prod(spec.weights_shape) <= SUSPECT_LIMIT:
        ref_format = ref_spec.options.dtype
        checks = _with_hints(checks, spec, settings, fitted, ref, export, ref_format)
    return checks


def _with_hints(
    checks: list[Check],
    spec: AttentionSpec,
    settings: CheckSettings,
    fitted: Mapping[str, _Fitted],
    ref: Mapping[str, F64],
    export: str,
    ref_format: str,
) -> list[Check]:
    """A hint on each failed comparison that one changed option would pass, or that
    the measured tolerance (the naive low-precision error) would. Each alternative is
    computed once, for every failed comparison."""
    failing = {
        c.name.removesuffix(".close"): c
        for c in checks
        if c.status == "fail" and c.name.endswith(".close")
    }
    hints: dict[str, str] = {}
    for label, alt in _alternatives(spec):
        pending = [n for n in failing if n not in hints]
        if not pending:
            break
        run = trace(_reference_spec(alt, ref_format), RUN_STAGES, gather_stats=False)
        for name in pending:
            tol = failing[name].tolerance
            assert tol is not None
            got = tensor_values(run, name, fitted[name].merged)
            if not compare(fitted[name].values, got, tol.rtol, tol.atol).mismatched:
                hints[name] = (
                    f"the export matches the computation with {label}: "
                    "the kernel and these options disagree on it"
                )
    narrow = export not in ("float64", "float32")
    naive: Trace | None = None
    for name, c in failing.items():
        if name in hints or not narrow or c.tolerance is None:
            continue
        if not c.tolerance.source.endswith("defaults"):
            continue
        if naive is None:
            naive = trace(_naive_spec(spec, export), RUN_STAGES, gather_stats=False)
        naive_values = tensor_values(naive, name, fitted[name].merged)
        tol = measured_tolerance(ref[name], naive_values, export, settings.fudge)
        if not compare(fitted[name].values, ref[name], tol.rtol, tol.atol).mismatched:
            hints[name] = (
                f"it passes --tolerance measured (rtol {tol.rtol:.3g}, atol {tol.atol:.3g}): "
                f"no worse than the naive {export} computation ×{settings.fudge:g}, "
                "as PyTorch's kernel tests judge"
            )
    out = []
    for c in checks:
        name = c.name.removesuffix(".close")
        hint = hints.get(name) if c is failing.get(name) else None
        out.append(c if hint is None else dataclasses.replace(c, hint=hint))
    return out
