"""One case judged: what ``sdpa check`` concludes of a case, whoever gives it (the command
line, a manifest's worker process, a Dask worker, ``assert_attention_close``).

:func:`judge` composes what a case asks for over a loaded computation: the exports'
checks (:func:`~sdpa_cli.check.run.run_checks`), a split-KV kernel's partials and a
decode run; :func:`check_case` reads a :class:`~sdpa_cli.api.case.Case` and judges it;
:func:`run_case` does so for a manifest, where a case that cannot be read is that
case's error, not the run's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from numpy.typing import NDArray

from sdpa_cli.api.case import Case, Watch, unwatched
from sdpa_cli.check.decode import decode_checks
from sdpa_cli.check.exports import export_dtype, load_expected
from sdpa_cli.check.gradients import gradient_checks
from sdpa_cli.check.partials import Partial, load_partials, partial_checks
from sdpa_cli.check.records import CaseResult, Check, CheckReport, Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.check.settings import CheckSettings, Overrides
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.model import pattern_pool
from sdpa_cli.engine.arrays import using
from sdpa_cli.engine.driver import Progress
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.errors import SdpaError, SpecError
from sdpa_cli.files.confine import allow_outside
from sdpa_cli.files.loaders import load_array
from sdpa_cli.names import GRADIENTS


def judge(
    spec: AttentionSpec,
    expected: Sequence[Expected] = (),
    settings: CheckSettings | None = None,
    thresholds: Thresholds | None = None,
    *,
    partials: Sequence[Partial] | None = None,
    decode: bool = False,
    dout: NDArray[Any] | None = None,
    dout_label: str = "--dout",
    jobs: int = 1,
    progress: Progress | None = None,
    evidence: bool = False,
    grid_pool: int | None = None,
) -> CheckReport:
    """Everything ``sdpa check`` concludes of one computation: each of ``expected``
    judged against the reference, the findings gated, and, when asked for, the
    ``partials`` of a split-KV kernel (each over its keys, then their merge) and the
    prefill against its tokens decoded one by one (``decode``). The partials' and the
    decode run's checks come first; exported gradients (``dq``, ``dk``, ``dv``), of the
    loss Σ O ⊙ ``dout`` (named ``dout_label`` in messages), are judged after the
    forward exports
    (:func:`~sdpa_cli.check.gradients.gradient_checks`).

    Raises:
        SpecError: an export, a partial or a decode run that does not fit the
            computation; a gradient without ``dout``.
    """
    settings = settings or CheckSettings()
    first: list[Check] = []
    if partials is not None:
        first += partial_checks(spec, list(partials), settings)
    if decode:
        first += decode_checks(spec, settings)
    forward = [e for e in expected if e.name not in GRADIENTS]
    backward = [e for e in expected if e.name in GRADIENTS]
    report = run_checks(
        spec,
        forward,
        settings,
        thresholds,
        jobs=jobs,
        progress=progress,
        judged=bool(expected),
        evidence=evidence,
        grid_pool=grid_pool,
    )
    if backward:
        export = export_dtype(spec, list(expected))
        grads = gradient_checks(
            spec, backward, dout, settings, export, dout_label=dout_label, jobs=jobs
        )
        n = next((i for i, c in enumerate(report.checks) if c.name.startswith("findings")), None)
        n = len(report.checks) if n is None else n
        checks = (*report.checks[:n], *grads, *report.checks[n:])
        # gradients are read against the float64 backward pass: a run of them alone
        # says so (beside forward exports, the reference named is the forward's)
        reference = report.reference if forward else "float64"
        report = dataclasses.replace(
            report, checks=checks, export_dtype=export, reference=reference
        )
    if first:
        report = dataclasses.replace(report, checks=(*first, *report.checks))
    return report


def read_case(
    case: Case, over: Overrides | None = None
) -> tuple[AttentionSpec, str | None, list[Expected]]:
    """A case's computation (with ``over``'s flags), its description and its exports,
    read once: what :func:`check_case` judges, and what ``sdpa diff`` compares first.

    Raises:
        SdpaError: the case cannot be read, naming the file, the option or the entry.
    """
    case = case.given((over or Overrides()).option_flags)
    spec, description = case.load()
    with case.reading():
        return spec, description, load_expected(dict(case.expect))


def check_case(
    case: Case,
    over: Overrides | None = None,
    *,
    jobs: int = 1,
    watch: Watch = unwatched,
    read: tuple[AttentionSpec, str | None, list[Expected]] | None = None,
) -> CaseResult:
    """Read ``case`` and judge it (``over``: what every case of the run shares, the
    command line's flags and settings; ``read``: the case as :func:`read_case` read it
    already).

    Raises:
        SdpaError: the case cannot be read, or its settings do not fit together,
            naming the file, the option or the manifest's entry.
    """
    over = over or Overrides()
    if not case.inputs:
        raise SpecError("", "give Q K V (or one case file), or --manifest FILE")
    settings = over.settings(case.check)
    spec, description, expected = read or read_case(case, over)
    case = case.given(over.option_flags)
    with case.reading():
        partials = load_partials(case.partials) if case.partials is not None else None
        dout = load_array(case.dout, name="dout") if case.dout is not None else None
    with watch(spec, "checking") as progress, using(over.backend):
        report = judge(
            spec,
            expected,
            settings,
            over.thresholds,
            partials=partials,
            decode=case.decode,
            dout=dout,
            jobs=jobs,
            progress=progress,
            evidence=over.evidence,
            grid_pool=pattern_pool(spec.L, spec.S, over.grid_share * spec.H)
            if over.grid_share
            else None,
        )
    return CaseResult(case.title(description), report)


def run_case(case: Case, over: Overrides) -> CaseResult:
    """:func:`check_case` for one case of a manifest, in a worker: never raises, a case
    that cannot be read (or a bug met in it) is its error and the others still run."""
    try:
        allow_outside(over.allow_outside)  # this worker's run: the flag of its parent's
        return check_case(case, over)
    except SdpaError as exc:
        return CaseResult(case.title(None), error=str(exc))
    except Exception as exc:  # a bug: reported for this case, the others still run
        return CaseResult(
            case.title(None), error=f"internal error: {type(exc).__name__}: {exc}", internal=True
        )
