"""Element-wise comparison of an export with its reference, and the tolerances.

Every comparison is ``|actual − reference| ≤ atol + rtol · |reference|`` (the rule of
``torch.testing.assert_close`` and ``numpy.isclose`` with the reference second), so
a mismatch report reads the same as theirs. Pure numpy: no spec, no trace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.residual import Readable
from sdpa_cli.engine.records import argmax_index
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.text import ceil_sig, format_index, percent, sig

DTYPE_TOLERANCES: Mapping[str, tuple[float, float]] = {
    # (rtol, atol). float16 and bfloat16: the floors of PyTorch's own SDPA kernel tests
    # (test_transformers.py default_rtol/default_atol), not assert_close's defaults.
    "float16": (1e-3, 1e-3),
    "bfloat16": (1.6e-2, 1e-3),
    # float32: the same tests' floor; float64: assert_close's default.
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    # float8 (no PyTorch floor): rtol one machine epsilon, atol an eighth of it.
    "float8_e4m3fn": (1.25e-1, 1.5625e-2),
    "float8_e5m2": (2.5e-1, 3.125e-2),
}
"""Default tolerances by the export's format."""


@dataclass(frozen=True)
class Tolerance:
    """An ``rtol``/``atol`` pair and where it came from (for the report)."""

    rtol: float
    atol: float
    source: str
    factor: float | None = None
    """Under the kernel-relative judgement (:mod:`sdpa_cli.check.relative`): how much
    worse than the plain computation an element may be; rtol and atol are then 0."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rtol": self.rtol, "atol": self.atol, "source": self.source}
        if self.factor is not None:
            out["factor"] = self.factor
        return out


@dataclass(frozen=True)
class Mismatch:
    """How an exported tensor differs from its reference (the best validators' report).

    Attributes:
        total: elements compared.
        mismatched: elements outside the tolerance (non-finite ones included).
        nan_mismatches: of those, elements NaN on one side only (or on both, unless
            ``equal_nan``).
        inf_mismatches: of those, elements infinite on a side without a matching infinity.
        max_abs, max_abs_at: the greatest absolute difference over finite pairs, and where.
        max_rel, max_rel_at: the greatest relative difference ``|Δ|/|reference|``.
        worst_at: the element furthest outside the tolerance (a non-finite mismatch first),
            with ``worst_actual`` and ``worst_reference``.
        passing_atol: the smallest atol that would pass at the same rtol; ``None`` when
            non-finite mismatches make every tolerance fail.
        passing_rtol: the smallest rtol that would pass at the same atol (``inf`` when a
            zero reference is missed by more than atol).
    """

    total: int
    mismatched: int
    nan_mismatches: int
    inf_mismatches: int
    max_abs: float
    max_abs_at: Index | None
    max_rel: float
    max_rel_at: Index | None
    worst_at: Index | None
    worst_actual: float | None
    worst_reference: float | None
    passing_atol: float | None
    passing_rtol: float | None
    passing_factor: float | None = None
    """Under the kernel-relative judgement: the smallest factor that would pass (None
    where the error is no rounding: no factor is suggested)."""
    worst_allowed: float | None = None
    """Under the kernel-relative judgement: the largest |Δ| the worst element was
    allowed (under a fixed tolerance it is ``atol + rtol·|reference|``)."""

    @property
    def fraction(self) -> float:
        return self.mismatched / self.total if self.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("max_abs_at", "max_rel_at", "worst_at"):
            d[key] = None if d[key] is None else list(d[key])
        d["fraction"] = self.fraction
        return d


def _enough(t: float, passes: Callable[[float], NDArray[np.bool_]]) -> float:
    """``t``, nudged up by an ulp or two until every element passes with it: the
    division that found it may round one step too low."""
    for _ in range(4):
        if not math.isfinite(t) or bool(passes(t).all()):
            return t
        t = float(np.nextafter(t, math.inf))
    return t


CHUNK = 1 << 18
"""Elements compared at a time: the temporaries stay in cache, and nothing the size
of a whole tensor is allocated."""


def compare(
    actual: NDArray[Any],
    reference: Readable,
    rtol: float,
    atol: float,
    *,
    equal_nan: bool = False,
) -> Mismatch:
    """Compare ``actual`` to ``reference`` (same shape) element by element.

    An element passes when ``|a − r| ≤ atol + rtol·|r|``; when either side is not
    finite, it passes only if both are the same infinity (or both NaN with
    ``equal_nan``). The arrays are read :data:`CHUNK` elements at a time (in float64)
    and the chunks' figures combined: the largest, the first non-finite mismatch.
    """
    shape = tuple(actual.shape) if hasattr(actual, "shape") else np.shape(actual)
    flat_a, flat_r = _flat(actual), _flat(reference)
    n = flat_a.size
    parts = []
    for i0 in range(0, max(n, 1), CHUNK):
        a = np.asarray(flat_a[i0 : i0 + CHUNK], dtype=np.float64)
        r = np.asarray(flat_r[i0 : i0 + CHUNK], dtype=np.float64)
        parts.append((i0, _compare_chunk(a, r, rtol, atol, equal_nan)))
    m = _combine(parts, shape, rtol, atol)
    if m.worst_reference is None or not math.isfinite(m.worst_reference):
        return m
    return dataclasses.replace(m, worst_allowed=atol + rtol * abs(m.worst_reference))


def _flat(x: Readable) -> Readable:
    """``x`` flat, a view where it can be (an array-like with ``reshape``, a
    :class:`~sdpa_cli.check.residual.Residual`, as it is)."""
    return x.reshape(-1) if hasattr(x, "reshape") else np.asarray(x).reshape(-1)


def _combine(
    parts: list[tuple[int, Mismatch]], shape: tuple[int, ...], rtol: float, atol: float
) -> Mismatch:
    """The figures of a whole array from those of its consecutive flat chunks."""

    def full(i0: int, at: Index | None) -> Index | None:
        if at is None:
            return None
        return tuple(int(x) for x in np.unravel_index(i0 + at[0], shape)) if shape else ()

    def ratio(m: Mismatch) -> float:
        assert m.worst_actual is not None
        assert m.worst_reference is not None
        allowed = atol + rtol * abs(m.worst_reference)
        d = abs(m.worst_actual - m.worst_reference)
        return d / allowed if allowed > 0 else math.inf

    finite = [p for p in parts if p[1].max_abs_at is not None] or parts  # chunks with a pair
    best_abs = max(finite, key=lambda p: p[1].max_abs)
    best_rel = max(finite, key=lambda p: p[1].max_rel)
    worst: tuple[int, Mismatch] | None = None
    for i0, m in parts:
        if m.worst_at is None:
            continue
        if m.nan_mismatches or m.inf_mismatches:  # non-finite first, in C order
            if worst is None or not (worst[1].nan_mismatches or worst[1].inf_mismatches):
                worst = (i0, m)
            break
        if worst is None or ratio(m) > ratio(worst[1]):
            worst = (i0, m)

    def loosest(values: list[float | None]) -> float | None:
        """The largest tolerance that passes, or None when one chunk cannot pass."""
        known = [x for x in values if x is not None]
        return max(known, default=0.0) if len(known) == len(values) else None

    return Mismatch(
        total=sum(m.total for _, m in parts),
        mismatched=sum(m.mismatched for _, m in parts),
        nan_mismatches=sum(m.nan_mismatches for _, m in parts),
        inf_mismatches=sum(m.inf_mismatches for _, m in parts),
        max_abs=best_abs[1].max_abs,
        max_abs_at=full(best_abs[0], best_abs[1].max_abs_at),
        max_rel=best_rel[1].max_rel,
        max_rel_at=full(best_rel[0], best_rel[1].max_rel_at),
        worst_at=None if worst is None else full(worst[0], worst[1].worst_at),
        worst_actual=None if worst is None else worst[1].worst_actual,
        worst_reference=None if worst is None else worst[1].worst_reference,
        passing_atol=loosest([m.passing_atol for _, m in parts]),
        passing_rtol=loosest([m.passing_rtol for _, m in parts]),
    )


def _compare_chunk(a: F64, r: F64, rtol: float, atol: float, equal_nan: bool) -> Mismatch:
    """:func:`compare` on one flat chunk (indices are into the chunk): the figures of
    its finite pairs, and the non-finite mismatches counted and put first."""
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(a) & np.isfinite(r)
        if finite.all():
            return _compare_finite(a, r, rtol, atol)
        a_nan, r_nan = np.isnan(a), np.isnan(r)
        nan_bad = (a_nan | r_nan) & ~(a_nan & r_nan & equal_nan)
        inf_bad = ~finite & ~(a_nan | r_nan) & (a != r)
    pairs = np.flatnonzero(finite)
    m = _compare_finite(a[pairs], r[pairs], rtol, atol)

    def back(at: Index | None) -> Index | None:
        return None if at is None else (int(pairs[at[0]]),)

    worst_at = back(m.worst_at)
    passing_atol, passing_rtol = m.passing_atol, m.passing_rtol
    bad = nan_bad | inf_bad
    if bad.any():
        worst_at = argmax_index(bad)
        passing_atol = passing_rtol = None
    return dataclasses.replace(
        m,
        total=int(a.size),
        mismatched=m.mismatched + int(bad.sum()),
        nan_mismatches=int(nan_bad.sum()),
        inf_mismatches=int(inf_bad.sum()),
        max_abs_at=back(m.max_abs_at),
        max_rel_at=back(m.max_rel_at),
        worst_at=worst_at,
        worst_actual=None if worst_at is None else float(a[worst_at]),
        worst_reference=None if worst_at is None else float(r[worst_at]),
        passing_atol=passing_atol,
        passing_rtol=passing_rtol,
    )


def tolerance_ratio(a: F64, r: F64, rtol: float, atol: float) -> F64:
    """|a − r| ÷ (atol + rtol·|r|), element by element: above 1 fails (the picture of a
    fixed tolerance, as :func:`~sdpa_cli.check.relative.error_ratio` is of the
    kernel-relative rule); NaN where a side is not finite."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        ratio = np.abs(a - r) / (atol + rtol * np.abs(r))
    return np.where(np.isfinite(a) & np.isfinite(r), ratio, np.nan)


def relative_error(diff: F64, mag: F64) -> F64:
    """|a − r| / |r| from ``diff`` = |a − r| and ``mag`` = |r| (finite pairs): inf where
    a zero reference is missed by anything, 0 where it is met."""
    with np.errstate(divide="ignore", invalid="ignore"):
        rel: F64 = np.divide(diff, mag, out=np.zeros_like(diff), where=mag > 0)
    if not mag.all():
        rel[(mag == 0) & (diff > 0)] = math.inf
    return rel


def _compare_finite(a: F64, r: F64, rtol: float, atol: float) -> Mismatch:
    """The figures of two all-finite arrays. With rtol 0 and atol inf (the
    kernel-relative rule's first look) every pair passes and no tolerance is searched."""
    if not a.size:
        return Mismatch(0, 0, 0, 0, 0.0, None, 0.0, None, None, None, None, 0.0, 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.abs(a - r)
        mag = np.abs(r)
        max_abs_at = argmax_index(diff)
        max_abs = float(diff[max_abs_at])
        rel = relative_error(diff, mag)
        max_rel_at = argmax_index(rel)
        max_rel = float(rel[max_rel_at])
        worst_at = None
        if rtol == 0 and atol == math.inf:
            mismatched, passing_atol, passing_rtol = 0, max_abs, 0.0
        else:
            allowed = mag * rtol
            allowed += atol
            bad = diff > allowed
            mismatched = int(np.count_nonzero(bad))
            excess = diff - mag * rtol
            passing_atol = _enough(
                max(0.0, float(excess.max())), lambda t: diff <= t + allowed - atol
            )
            need = np.divide(diff - atol, mag, out=np.zeros_like(diff), where=diff > atol)
            need[(mag == 0) & (diff > atol)] = math.inf
            passing_rtol = _enough(float(need.max()), lambda t: diff <= atol + t * mag)
            if mismatched:
                ratio = np.divide(diff, allowed, out=np.zeros_like(diff), where=bad & (allowed > 0))
                ratio[bad & (allowed == 0)] = math.inf
                worst_at = argmax_index(ratio)
    return Mismatch(
        total=int(a.size),
        mismatched=mismatched,
        nan_mismatches=0,
        inf_mismatches=0,
        max_abs=max_abs,
        max_abs_at=max_abs_at,
        max_rel=max_rel,
        max_rel_at=max_rel_at,
        worst_at=worst_at,
        worst_actual=None if worst_at is None else float(a[worst_at]),
        worst_reference=None if worst_at is None else float(r[worst_at]),
        passing_atol=passing_atol,
        passing_rtol=passing_rtol,
    )


MEASURED_FUDGE = 2.0
"""``--tolerance measured``'s default factor, as PyTorch's ``get_tolerances``."""


def measured_tolerance(
    reference: F64, naive: F64, export_dtype: str, fudge: float | None
) -> Tolerance:
    """PyTorch's ``get_tolerances``: how far the naive computation in the export's
    format strays from the reference, floored at the dtype defaults, times ``fudge``.

    Only pairs finite on both sides count; a relative deviation beyond 1e30 (a zero
    reference) falls back to the default rtol, as PyTorch does.
    """
    rtol0, atol0 = DTYPE_TOLERANCES[export_dtype]
    fudge = MEASURED_FUDGE if fudge is None else fudge
    ref = np.asarray(reference, dtype=np.float64)
    got = np.asarray(naive, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        finite = np.isfinite(ref) & np.isfinite(got)
        dev = np.where(finite, np.abs(ref - got), 0.0)
        rel = np.where(finite & (dev > 0), dev / np.abs(ref), 0.0)
    atol = fudge * max(float(dev.max(initial=0.0)), atol0)
    rtol = fudge * max(float(rel.max(initial=0.0)), rtol0)
    if rtol > 1e30:
        rtol = rtol0
    return Tolerance(rtol, atol, f"measured ×{sig(fudge, 6)} (naive {export_dtype})")


def mismatch_summary(m: Mismatch, tol: Tolerance) -> str:
    """``37 of 4,096 (0.90%) beyond rtol 0.001, atol 0.001; greatest |Δ| 0.0125``."""
    head = f"{m.mismatched:,} of {m.total:,} ({percent(m.fraction)})"
    if not m.mismatched:
        return f"all {m.total:,} within rtol {sig(tol.rtol, 6)}, atol {sig(tol.atol, 6)} (greatest |Δ| {sig(m.max_abs, 3)})"
    extra = []
    if m.nan_mismatches:
        extra.append(f"{m.nan_mismatches:,} NaN")
    if m.inf_mismatches:
        extra.append(f"{m.inf_mismatches:,} inf")
    kinds = f" ({', '.join(extra)})" if extra else ""
    return f"{head}{kinds} beyond rtol {sig(tol.rtol, 6)}, atol {sig(tol.atol, 6)}; greatest |Δ| {sig(m.max_abs, 3)}"


def mismatch_lines(
    m: Mismatch, tol: Tolerance | None, diagnosis: Mapping[str, Any] | None = None
) -> list[str]:
    """A mismatch as the lines of the report (shared by the table, JUnit and
    assertions); ``diagnosis`` says whether the error looks like rounding
    (:mod:`~sdpa_cli.check.structure`): only rounding is told the --fudge that passes."""
    lines = [
        f"mismatched elements: {m.mismatched:,} / {m.total:,} ({percent(m.fraction)})",
        f"NaN mismatches: {m.nan_mismatches:,} · inf mismatches: {m.inf_mismatches:,}",
        f"greatest absolute difference: {sig(m.max_abs, 6)} at index {_at(m.max_abs_at)}",
        f"greatest relative difference: {sig(m.max_rel, 4)} at index {_at(m.max_rel_at)}",
    ]
    if m.worst_at is not None:
        assert m.worst_actual is not None
        assert m.worst_reference is not None
        got, ref = apart(m.worst_actual, m.worst_reference)
        lines.append(f"worst element: index {format_index(m.worst_at)}: got {got}, reference {ref}")
        allowed, delta = m.worst_allowed, abs(m.worst_actual - m.worst_reference)
        if allowed is not None and math.isfinite(allowed) and math.isfinite(delta):
            over = f" ({sig(delta / allowed, 3)}×)" if allowed > 0 else ""
            lines.append(
                f"at the worst element: |Δ| {sig(delta, 3)}, allowed {sig(allowed, 3)}{over}"
            )
    if diagnosis is not None and diagnosis.get("error") == "structural":
        ratio = diagnosis.get("times_plain_rms")
        # two digits, as the RMS errors: the third moves with the CPU's BLAS kernel
        how = f"{sig(ratio, 2)}× the plain computation's RMS error, " if ratio else ""
        where = diagnosis.get("where") or "where rounding does not put it"
        lines.append(f"not rounding: {how}{where}; a larger --fudge would hide it, not fix it")
    if tol is not None and tol.factor is not None:
        lines.append(f"judged: {tol.source}")
        if (
            m.mismatched
            and m.passing_factor is not None
            and not (m.nan_mismatches or m.inf_mismatches)
        ):
            lines.append(f"would pass with: --fudge {ceil_sig(m.passing_factor)}")
    elif tol is not None:
        lines.append(f"tolerance: rtol {sig(tol.rtol, 6)}, atol {sig(tol.atol, 6)} ({tol.source})")
        if m.mismatched:
            if m.passing_atol is None:
                lines.append("would pass with: no tolerance (non-finite mismatches)")
            else:
                rtol_text = "none" if m.passing_rtol is None else ceil_sig(m.passing_rtol)
                lines.append(
                    f"would pass with: atol ≥ {ceil_sig(m.passing_atol)} (rtol {sig(tol.rtol, 6)}) "
                    f"or rtol ≥ {rtol_text} (atol {sig(tol.atol, 6)})"
                )
    return lines


def apart(got: float, reference: float, fewest: int = 6, most: int = 9) -> tuple[str, str]:
    """``got`` and ``reference`` with the fewest significant digits from ``fewest`` that
    tell them apart (at most ``most``): a float32 reference's eighth digit is its own
    rounding, which moves with the CPU's BLAS kernel, and is not shown unless needed."""
    digits = fewest
    while digits < most and sig(got, digits) == sig(reference, digits):
        digits += 1
    return sig(got, digits, zeros=True), sig(reference, digits, zeros=True)


def _at(at: Index | None) -> str:
    return "-" if at is None else format_index(at)


FACTOR = 2.0
"""How much worse than the plain computation an element may be (``--fudge``), in the
16- and 8-bit formats: there the plain computation rounds its logits and weights to
the format, which kernels accumulating in float32 do not, so a faithful kernel's error
is well under it (0.25 to 1 of it, measured), and twice is a margin."""

FACTORS = {"float32": 4.0}
"""The factor where it differs: in float32 a kernel's errors and the plain
computation's are the same kind (the rounding of sums taken in other orders), and
their largest per slice differ by up to 2.1×, measured on PyTorch's kernels."""


def factor_for(export: str, fudge: float | None) -> float:
    """``--fudge`` when given, else the export format's factor."""
    return fudge if fudge is not None else FACTORS.get(export, FACTOR)


FLOOR_ULPS = 2.0
"""The floor of each element's allowance, in units in the last place of the format at
the row's scale."""


@dataclass(frozen=True)
class Judgement:
    """How an export is judged against the plain computation in its format."""

    export: str
    factor: float = FACTOR
    floor_ulps: float = FLOOR_ULPS
    floor_of: str = "the row's scale"
    """What the floor's ulps are of, as the report names it (a gradient's: the sum of
    its terms' magnitudes, ``relative_check``'s ``terms``)."""

    @property
    def tolerance(self) -> Tolerance:
        """The rule as the report names it (no single rtol/atol: 0 and 0)."""
        source = (
            f"kernel: ≤ {sig(self.factor, 6)}× the plain {self.export} computation's largest "
            f"error in the (batch, head) slice, floor {sig(self.floor_ulps, 6)} ulp of {self.floor_of}"
        )
        return Tolerance(0.0, 0.0, source, factor=self.factor)
