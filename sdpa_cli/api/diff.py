"""``sdpa diff`` as one call: two runs of a model (two captures, or two manifests)
compared call by call (:mod:`sdpa_cli.check.diff`), the first call where they part
named, upstream of attention or in the kernel.

Each run's manifest is read as ``sdpa check --manifest`` reads it, its layers from the
``calls.yaml`` beside it as ``sdpa report model`` reads them; each of run B's
outputs is judged as ``sdpa check`` judges it (:func:`~sdpa_cli.api.judge.check_case`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sdpa_cli.api.case import Case, Watch, unwatched
from sdpa_cli.api.judge import check_case, read_case
from sdpa_cli.api.manifest import load_manifest
from sdpa_cli.api.model import capture_layers
from sdpa_cli.check.diff import BOUND, JUMP, CallDiff, Kernel, RunDiff, compare_call, mismatch
from sdpa_cli.check.exports import export_dtype, output_of
from sdpa_cli.check.pairing import pair_calls
from sdpa_cli.check.records import Expected
from sdpa_cli.check.settings import Overrides
from sdpa_cli.engine import precision
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.errors import InputError, SdpaError
from sdpa_cli.text import printable

MANIFEST = "manifest.yaml"
"""The manifest a capture's folder holds."""


def run_manifest(run: str) -> str:
    """A run as given (a capture's folder, or a manifest) → its manifest's path.

    Raises:
        InputError: nothing there, or a folder without a manifest, naming it.
    """
    if not Path(run).exists():
        raise InputError(printable(run), "not found: expected a capture's folder or a manifest")
    if Path(run).is_dir():
        manifest = Path(run) / MANIFEST
        if not manifest.is_file():
            raise InputError(
                printable(run),
                f"is a folder without {MANIFEST}: expected a capture's folder "
                "(sdpa capture --out DIR) or a manifest",
            )
        return str(manifest)
    return run


def diff_runs(
    run_a: str,
    run_b: str,
    over: Overrides | None = None,
    *,
    bound: float | None = None,
    jump: float = JUMP,
    jobs: int = 1,
    watch: Watch = unwatched,
) -> RunDiff:
    """Runs ``run_a`` and ``run_b`` (each a capture's folder or a manifest) compared
    call by call: their calls paired (:func:`~sdpa_cli.check.pairing.pair_calls`),
    each pair's inputs compared within ``max(bound · u, jump · m)`` (``bound``:
    :data:`~sdpa_cli.check.diff.BOUND` unless given) and B's output
    judged against its own inputs (``over``: the command line's settings, as for
    ``sdpa check``). A pair that cannot be read has its error instead.

    Raises:
        SdpaError: a run that cannot be read, naming its file; nothing pairs.
    """
    over = over or Overrides()
    bound = BOUND if bound is None else bound
    manifest_a, manifest_b = run_manifest(run_a), run_manifest(run_b)
    cases_a, cases_b = load_manifest(manifest_a), load_manifest(manifest_b)
    pairing = pair_calls(
        [c.name for c in cases_a],
        [c.name for c in cases_b],
        capture_layers(manifest_a),
        capture_layers(manifest_b),
        (printable(manifest_a), printable(manifest_b)),
    )
    calls: list[CallDiff] = []
    earlier = 0.0  # the largest difference of an input so far
    for i, j in pairing.pairs:
        call = _compared(cases_a[i], cases_b[j], over, (bound, jump * earlier), jobs, watch)
        earlier = max(earlier, call.largest_input())
        calls.append(call)
    return RunDiff(printable(manifest_a), printable(manifest_b), pairing, tuple(calls), bound, jump)


def _compared(
    a: Case, b: Case, over: Overrides, rule: tuple[float, float], jobs: int, watch: Watch
) -> CallDiff:
    """One pair compared (``rule``: the bound in units, and the jump's floor); its
    error instead when either call cannot be read."""
    try:
        read_a, read_b = read_case(a, over), read_case(b, over)
        (spec_a, _, exports_a), (spec_b, _, exports_b) = read_a, read_b
        out_a, out_b = output_of(spec_a, exports_a), output_of(spec_b, exports_b)
        fmt = _narrower(export_dtype(spec_a, exports_a), export_dtype(spec_b, exports_b))
        unit = precision.fmt(fmt).unit_roundoff
        call = CallDiff(a.name, b.name, fmt, limit=max(rule[0] * unit, rule[1]))
        problem = mismatch(spec_a, spec_b)
        if problem is None:
            found, rows, mask_rows = compare_call(spec_a, spec_b, (out_a, out_b), unit)
            call = dataclasses.replace(call, differences=found, rows=rows, mask_rows=mask_rows)
        else:
            call = dataclasses.replace(call, mismatch=problem)
        if out_b is not None:
            call = dataclasses.replace(call, kernel=_kernel(b, read_b, "b", over, jobs, watch))
        if _outputs_part(call) and out_a is not None:
            kernel_a = _kernel(a, read_a, "a", over, jobs, watch)
            call = dataclasses.replace(call, kernel_a=kernel_a)
    except SdpaError as exc:
        return CallDiff(a.name, b.name, error=str(exc))
    return call


def _narrower(a: str, b: str | None) -> str:
    """The narrower of two formats (one that is no float format counts for nothing)."""
    known = [f for f in (a, b) if f in precision.FORMATS]
    return max(known, key=precision.FORMATS.index, default="float64")


def _outputs_part(call: CallDiff) -> bool:
    """Whether B's output passed its check while the inputs agree and the outputs
    still differ by more than an input may: then run A's kernel is judged too."""
    out = call.differences.get("output")
    kernel_passed = call.kernel is None or call.kernel.passed
    return call.where is None and kernel_passed and out is not None and out.relative > call.limit


def _kernel(
    case: Case,
    read: tuple[AttentionSpec, str | None, list[Expected]],
    run: str,
    over: Overrides,
    jobs: int,
    watch: Watch,
) -> Kernel | None:
    """A run's exports judged against attention from its own inputs, as ``sdpa check``
    judges them (its findings aside: they describe the inputs); None when it has none.

    Raises:
        SdpaError: an export that does not fit its call.
    """
    result = check_case(case, over, jobs=jobs, watch=watch, read=read)
    assert result.report is not None  # check_case raises rather than leave none
    judged = [c for c in result.report.checks if not c.name.startswith("findings")]
    if not judged:
        return None
    failed = next((c for c in judged if not c.passed), None)
    if failed is None:
        return Kernel(run, True)
    return Kernel(run, False, failed.name, failed.summary)
