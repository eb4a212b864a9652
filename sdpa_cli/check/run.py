"""``sdpa check``: exported attention tensors judged against a recomputed reference.

Pure data in and out: a validated spec, the exports and the settings in, a
:class:`~sdpa_cli.check.records.CheckReport` out; rendering, reports and exit codes are
the command line's. One pass over the blocks gives the findings and the reference's
output and LSE (:func:`_judge_pass`); then each export is checked (:mod:`~sdpa_cli.check.elements`),
failed comparisons get hints (:mod:`~sdpa_cli.check.hints`), and the findings of the
kinds gated fail the run (:mod:`~sdpa_cli.check.gate`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import (
    DTYPE_TOLERANCES,
    Judgement,
    Tolerance,
    factor_for,
    measured_tolerance,
)
from sdpa_cli.check.elements import (
    VBounds,
    block_support,
    close_check,
    finite_check,
    lse_weights,
    output_range,
    v_range,
    weighable,
    weights_range,
    weights_rows,
)
from sdpa_cli.check.error_stats import error_limit_check, error_stats
from sdpa_cli.check.evidence import grid_row, kept_for_pages
from sdpa_cli.check.exports import (
    RUN_STAGES,
    Fitted,
    absent_from_reference,
    as_naive,
    as_reference,
    as_seen_by_kernel,
    export_dtype,
    fit_expected,
    tensor_values,
)
from sdpa_cli.check.gate import finding_checks, gated_kinds
from sdpa_cli.check.hints import with_hints
from sdpa_cli.check.plain import needed_rows, plain_values
from sdpa_cli.check.records import Check, CheckReport, Expected
from sdpa_cli.check.relative import relative_check
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.model import HeadGather
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.arrays import NUMPY, Backend
from sdpa_cli.engine.block import block_lse, native_dtype
from sdpa_cli.engine.driver import Place, Progress, sweep
from sdpa_cli.engine.forward import first_moments, forward, lean_backend, query_block
from sdpa_cli.engine.fp8 import judged_in
from sdpa_cli.engine.online import weighed_keys
from sdpa_cli.engine.positions import documents
from sdpa_cli.engine.records import Moments, Records
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats, working_formats
from sdpa_cli.engine.trace import Trace, merge_heads, split_heads_of_output, trace
from sdpa_cli.engine.types import F64
from sdpa_cli.errors import SpecError
from sdpa_cli.files.limits import release_freed_blocks
from sdpa_cli.names import FORWARD_EXPORTS

# --- the pass ---------------------------------------------------------------------------


@dataclass
class _Pass:
    """What one pass over every block gives the checks: the findings' statistics and
    the output-sized results (``output`` in the computation's layout, ``lse``) of the
    reference and of the naive run. No score-sized array outlives its block."""

    stats: Stats
    reference: dict[str, F64] = field(default_factory=dict)
    naive: dict[str, F64] = field(default_factory=dict)
    bounds: VBounds | None = None
    """Per output element, V's range over the keys its row can weigh."""
    backend: Backend = NUMPY
    """What computed the pass (numpy's per-stage path where the lean pass does not apply)."""


def _judge_pass(
    spec: AttentionSpec,
    ref_spec: AttentionSpec,
    naive_spec: AttentionSpec | None,
    wanted: set[str],
    jobs: int,
    progress: Progress | None,
    gather: HeadGather | None = None,
) -> _Pass:
    """Every block once: the findings' statistics (from the run as given, or from the
    reference when the run is not emulated: the same computation, at least as wide),
    the reference's output, LSE and V range, and what a model's grid reads (``gather``)."""
    stats = Stats.empty(spec)
    ref_dtype = native_dtype(ref_spec) or np.dtype(np.float64)
    # V's own values bound the output: its own format holds them (float16: half the
    # memory of float32), else float32 holds those of a bfloat16 V.
    v_dtype = np.dtype(ref_spec.v.dtype)
    bound_dtype = v_dtype if v_dtype.kind == "f" else np.result_type(v_dtype, np.float32)
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
        found.bounds = VBounds(spec.L, bound_dtype, sinks=ref_spec.sinks is not None)

    # The lean pass (output, LSE and statistics at once) when the run as given is the
    # reference's computation, not an emulation read against it.
    lean = not spec.options.emulated and naive_spec is None

    def bounds(place: Place, support: NDArray[np.bool_] | None, rows: slice, keys: slice) -> None:
        """Per output element of ``rows``, V's range over the keys each row weighs."""
        if found.bounds is None:
            return
        inputs = place.inputs.get(ref_spec, place.lead)
        if support is None and (keys.start, keys.stop) == (0, spec.S):
            found.bounds.put(place.lead, rows, *inputs.v_extremes)  # the slice's, once
            return
        running = None
        if keys.start == 0:
            low, high = inputs.v_running
            running = (low[: keys.stop], high[: keys.stop])
        lo, hi = v_range(inputs.v[keys], support, rows.stop - rows.start, running)
        found.bounds.put(place.lead, rows, lo, hi)

    pool = gather.pool if gather is not None else 0

    def visit_lean(place: Place) -> tuple[Records | None, Moments | None]:
        lse = "lse" in found.reference or gather is not None
        fw = forward(place, ref_spec, stats, lse=lse, pool=pool)
        if gather is not None and fw.lse is not None:
            gather.add(place, fw.lse, fw.pattern)
        values = found.reference
        if "output" in values:
            values["output"][place.at] = fw.output
        if "lse" in values and fw.lse is not None:
            values["lse"][place.at] = fw.lse
        if fw.blocks:
            for b in fw.blocks:
                bounds(place, block_support(b), b.rows, b.keys)
        else:
            bounds(
                place,
                weighed_keys(ref_spec, place.lead, place.rows, place.keys),
                place.rows,
                place.keys,
            )
        return fw.records, first_moments(place, stats)

    def visit(place: Place) -> tuple[Records | None, Moments | None]:
        r, keys, at = place.rows, place.keys, place.at
        ref = place.attend(ref_spec)
        run = ref
        computed = {id(ref_spec): ref}
        if spec.options.emulated:
            run = place.attend(spec)
            computed[id(spec)] = run
        records = stats.measure(run, place.twin(spec, run))
        for of, values, _ in runs:
            b = computed.get(id(of)) or place.attend(of)
            if "output" in values:
                values["output"][at] = b.output
            if "lse" in values:
                values["lse"][at] = block_lse(b)
        bounds(place, block_support(ref), r, keys)
        if gather is not None:
            gather.add_block(place, ref)
        return records, first_moments(place, stats)

    rows = query_block(ref_spec) if lean else None
    found.backend = lean_backend(ref_spec) if lean and not pool else NUMPY  # pooling: numpy
    visitor = visit_lean if lean else visit
    walk = sweep(spec, visitor, jobs=jobs, rows=rows, progress=progress, backend=found.backend)
    for records, moments in walk:
        if records is not None:
            stats.merge(records)
        if moments is not None:
            stats.moments.merge(moments)
    return found


# --- the run ----------------------------------------------------------------------------


def run_checks(
    spec: AttentionSpec,
    expected: list[Expected],
    settings: CheckSettings | None = None,
    thresholds: Thresholds | None = None,
    *,
    jobs: int = 1,
    progress: Progress | None = None,
    judged: bool | None = None,
    evidence: bool = False,
    grid_pool: int | None = None,
) -> CheckReport:
    """Judge the exported tensors (any of output, weights, lse) against ``spec``;
    with ``evidence``, the report keeps what a page draws of it (:class:`Evidence`);
    with ``grid_pool`` (0 or a pooling), the case's row of a model's grid, read from
    the same pass (:class:`~sdpa_cli.diagnosis.model.HeadGather`).

    Without any export (``judged``: whether the run judges exports all the same, its
    gradients; default: whether ``expected`` holds any), the inputs and the
    computation themselves are judged: the findings of the computation (as
    ``compute`` would find them) gate the result.
    One pass over the blocks (on ``jobs`` threads) gives the findings and the
    reference's output and LSE; exported weights are compared with the reference's
    weights as whole arrays.

    Raises:
        SpecError: an export whose shape fits no layout of the computation.
    """
    settings = settings or CheckSettings()
    names = [e.name for e in expected]
    for name in names:
        if name not in FORWARD_EXPORTS:
            raise SpecError(name, f"unknown export; expected one of {', '.join(FORWARD_EXPORTS)}")
    fitted = {e.name: fit_expected(spec, e) for e in expected}

    export = export_dtype(spec, expected)
    ref_format = settings.reference or (
        "float64" if export in ("float64", "float32") else "float32"
    )
    seen = as_seen_by_kernel(spec, export) if expected else spec
    ref_spec = seen if _same_run(seen, ref_format) else as_reference(seen, ref_format)
    naive_spec = as_naive(seen, export) if expected and _plain_needed(settings, export) else None
    # The kernel-relative rule reads the plain computation afterwards, for the rows
    # that need it; PyTorch's measured tolerance reads all of it, in the pass.
    in_pass = naive_spec if settings.tolerance == "measured" else None
    gather = None if grid_pool is None else HeadGather(ref_spec, grid_pool)
    found = _judge_pass(spec, ref_spec, in_pass, set(fitted), jobs, progress, gather)
    release_freed_blocks()  # the pass's blocks, before the plain computation and the checks
    diagnosis = diagnose(found.stats, thresholds)
    gated, own_only = gated_kinds(settings, bool(expected) if judged is None else judged)
    findings = finding_checks(
        diagnosis, gated, own_only, working_formats(spec), settings.fail_on_severity
    )
    checks: list[Check] = []
    kept = None
    if expected:
        against = _compared_with(spec, settings, fitted, export, ref_spec, naive_spec, found, jobs)
        fitted = {n: absent_from_reference(spec, f, against.values[n]) for n, f in fitted.items()}
        checks = _export_checks(spec, fitted, against, found, settings.equal_nan)
        matched: dict[str, AttentionSpec] = {}
        checks = with_hints(
            checks, spec, settings, fitted, against.values, export, ref_format, matched
        )
        checks += _error_checks(checks, fitted, against, settings.max_error)
        if evidence or gather is not None:
            kept = kept_for_pages(spec, fitted, against.values, against.plain, against.judgement)
            kept = dataclasses.replace(kept, matched=matched)
    heads = None if gather is None else grid_row(gather, found.stats, kept, thresholds)
    checks.extend(findings)
    return CheckReport(
        checks=tuple(checks),
        diagnosis=diagnosis,
        export_dtype=export,
        reference=ref_format,
        gate=gated,
        fail_on_severity=settings.fail_on_severity,
        backend=found.backend.name,
        device=found.backend.device,
        evidence=kept if evidence else None,
        heads=heads,
    )


def _plain_needed(settings: CheckSettings, export: str) -> bool:
    """Whether the judgement reads the plain computation in the export's format: the
    kernel-relative default (for exports narrower than float64) and ``measured``."""
    if settings.rtol is not None:
        return False
    return settings.tolerance == "measured" or (
        settings.tolerance == "kernel" and export != "float64"
    )


def _same_run(spec: AttentionSpec, ref_format: str) -> bool:
    """Whether the run as given already is the reference (float64, not emulated)."""
    return ref_format == "float64" and not spec.options.emulated


# --- the exports ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Against:
    """What the exports are compared with: the reference's value of each, in its
    file's layout, and each one's tolerance; when the weights are exported, the
    reference's whole trace and where its rows can put weight."""

    values: dict[str, F64]
    tolerances: dict[str, Tolerance]
    trace: Trace | None = None
    support: NDArray[np.bool_] | None = None
    plain: dict[str, F64 | None] | None = None
    """The plain computation's values, with the kernel-relative judgement."""
    judgement: Judgement | None = None


def _export_checks(
    spec: AttentionSpec,
    fitted: Mapping[str, Fitted],
    against: _Against,
    found: _Pass,
    nan: bool,
) -> list[Check]:
    """The checks of the exported tensors, in order: output, weights, LSE (``nan``:
    whether NaN on both sides counts as a match)."""
    tols = against.tolerances
    checks: list[Check] = []
    if "output" in fitted:
        checks += _output_checks(spec, fitted["output"], tols["output"], found)
        checks.append(_close("output", fitted["output"], against, nan))
    if "weights" in fitted:
        assert against.support is not None
        checks += _weights_checks(spec, fitted["weights"], tols["weights"], against.support)
        checks.append(_close("weights", fitted["weights"], against, nan))
    if "lse" in fitted:
        checks.append(_close("lse", fitted["lse"], against, nan))
        checks += _lse_checks(fitted, against, nan)
    return checks


def _error_checks(
    checks: list[Check],
    fitted: Mapping[str, Fitted],
    against: _Against,
    limits: tuple[tuple[str, float], ...],
) -> list[Check]:
    """With ``--max-error``, each export's error statistics against its limits (read
    from the kernel-relative check, or computed under a fixed tolerance)."""
    if not limits:
        return []
    out = []
    for name, f in fitted.items():
        close = next(c for c in checks if c.name == f"{name}.close")
        stats = close.details.get("error_stats")
        if stats is None:
            stats = error_stats(f.values, against.values[name], 1 if name == "lse" else 2)
        out.append(error_limit_check(name, stats, limits, f.exp.label))
    return out


def _close(name: str, f: Fitted, against: _Against, nan: bool) -> Check:
    """``name.close``: under the kernel-relative judgement, against the plain
    computation; else within the tolerance (``nan``: NaN on both sides matches)."""
    ref = against.values[name]
    if against.judgement is None or against.plain is None:
        return close_check(name, f.values, ref, against.tolerances[name], f.exp.label, nan)
    return relative_check(
        name,
        f.values,
        ref,
        against.plain[name],
        against.judgement,
        f.exp.label,
        nan,
        rows=name != "lse",
        slices=1 if name == "lse" else 2,
    )


def _compared_with(
    spec: AttentionSpec,
    settings: CheckSettings,
    fitted: Mapping[str, Fitted],
    export: str,
    ref_spec: AttentionSpec,
    naive_spec: AttentionSpec | None,
    found: _Pass,
    jobs: int = 1,
) -> _Against:
    """The reference's values of the exports and their tolerances (given, by the
    export's format, or measured on the naive run; the plain computation on ``jobs``
    threads)."""
    reference: Trace | None = None
    naive_weights: Trace | None = None
    if "weights" in fitted:
        # The one score-sized comparison: the export holds as many numbers itself.
        reference = trace(ref_spec, RUN_STAGES, gather_stats=False)
        if naive_spec is not None and settings.tolerance == "measured":
            naive_weights = trace(naive_spec, RUN_STAGES, gather_stats=False)
    ref = {
        name: _whole(spec, found.reference, name, reference, f.merged) for name, f in fitted.items()
    }
    if "lse" in ref:  # a row with no visible key: −inf, or +inf as FlashAttention 2 writes it
        lse = fitted["lse"].values
        ref["lse"] = np.where((ref["lse"] == -math.inf) & np.isinf(lse), lse, ref["lse"])
    tols = {}
    for name, f in fitted.items():
        naive = None
        if naive_spec is not None and found.naive:
            naive = _whole(spec, found.naive, name, naive_weights, f.merged)
        tols[name] = _tolerance(settings, export, ref[name], naive)
    judgement = plain = None
    if settings.tolerance == "kernel" and naive_spec is not None:
        judgement = Judgement(judged_in(spec, export), factor=factor_for(export, settings.fudge))
        need = needed_rows(spec, fitted, found.reference, judgement)
        plain = plain_values(naive_spec, fitted, need, jobs)
    support = None
    if reference is not None:
        assert reference.masked is not None
        assert reference.weights is not None
        assert reference.visible is not None
        support = weighable(reference.visible, reference.masked, reference.weights)
    return _Against(ref, tols, reference, support, plain, judgement)


def _whole(
    spec: AttentionSpec, values: Mapping[str, F64], name: str, run: Trace | None, merged: bool
) -> F64:
    """A run's values of an export, in the file's layout: the output and the LSE from
    the pass (``values``), the weights from the whole trace ``run``."""
    if name == "weights":
        assert run is not None
        return tensor_values(run, name)
    return merge_heads(spec, values[name]) if name == "output" and merged else values[name]


def _tolerance(settings: CheckSettings, export: str, ref: F64, naive: F64 | None) -> Tolerance:
    """The given tolerance; else the one measured on the naive run's values (when
    measured); else the defaults of the export's format."""
    if settings.rtol is not None and settings.atol is not None:
        return Tolerance(settings.rtol, settings.atol, "given")
    if naive is not None:
        return measured_tolerance(ref, naive, export, settings.fudge)
    rtol, atol = DTYPE_TOLERANCES[export]
    return Tolerance(rtol, atol, f"{export} defaults")


def _output_checks(spec: AttentionSpec, f: Fitted, tol: Tolerance, found: _Pass) -> list[Check]:
    """The exported output: finite, inside V's range (its closeness: :func:`_close`)."""
    split = split_heads_of_output(spec, f.values) if f.merged else f.values
    assert found.bounds is not None
    label = f.exp.label
    return [
        finite_check("output", f.values, label),
        output_range(spec, split, found.bounds, tol, label, f.merged),
    ]


def _weights_checks(
    spec: AttentionSpec, f: Fitted, tol: Tolerance, support: NDArray[np.bool_]
) -> list[Check]:
    """The exported weights: finite, in [0, 1], rows summing to 1 over ``support``
    (weight across packed documents named); their closeness: :func:`_close`."""
    label = f.exp.label
    return [
        finite_check("weights", f.values, label),
        weights_range(f.values, tol, label),
        weights_rows(f.values, support, tol, label, documents(spec)),
    ]


def _lse_checks(fitted: Mapping[str, Fitted], against: _Against, equal_nan: bool) -> list[Check]:
    """With exported weights, the weights equal to exp(logit − the exported LSE)
    (the LSE's closeness: :func:`_close`)."""
    f = fitted["lse"]
    label = f.exp.label
    tols = against.tolerances
    checks: list[Check] = []
    if "weights" in fitted:
        reference = against.trace
        assert reference is not None
        assert reference.masked is not None
        assert against.support is not None
        weights = fitted["weights"].values
        checks.append(
            lse_weights(
                reference.masked,
                f.values,
                f.exp.values.dtype,
                weights,
                against.support,
                tols["weights"],
                label,
                equal_nan,
            )
        )
    return checks
