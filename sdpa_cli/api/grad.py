"""``sdpa grad`` as one call: the backward pass of a loaded computation, the findings of
both passes, and the numeric check (:func:`gradients`); the files such a run writes
(:func:`grad_writers`)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sdpa_cli.api.case import Watch, unwatched
from sdpa_cli.api.outputs import Outputs
from sdpa_cli.diagnosis.findings import Diagnosis, Thresholds
from sdpa_cli.diagnosis.grad import GradDiagnosis, backward_health, combined
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.grad import Gradients
from sdpa_cli.engine.inputs import load_dout
from sdpa_cli.engine.numeric import NumericCheck, numeric_check
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.types import Index
from sdpa_cli.files.writers import Writer
from sdpa_cli.stream_save import gradients_writer


@dataclass(frozen=True)
class GradRun:
    """What ``sdpa grad`` computed: the gradients, their health, every finding
    (forward and gradient), how dO reads (a label, a JSON record), the numeric check
    (None: not asked for) and the relative error it accepts; ``dtype``, the format the
    gradients' range is judged in (``--dtype``: the pass itself is float64)."""

    dtype: str
    grads: Gradients
    health: GradDiagnosis
    diagnosis: Diagnosis
    dout_label: str
    dout_info: dict[str, Any]
    numeric: list[NumericCheck] | None
    tolerance: float

    @property
    def failed(self) -> bool:
        """Whether the numeric check found an entry off by more than its tolerance."""
        return self.numeric is not None and not all(c.passed(self.tolerance) for c in self.numeric)


def gradients(
    spec: AttentionSpec,
    dout: str = "ones",
    thresholds: Thresholds | None = None,
    *,
    samples: int | None = None,
    tolerance: float = 1e-5,
    keep: Collection[Index] | None = None,
    jobs: int = 1,
    watch: Watch = unwatched,
) -> GradRun:
    """The backward pass of the loss Σ O ⊙ ``dout`` (a file, ``ones`` or ``random``),
    which gathers the forward statistics too; the findings of both; with ``samples``,
    the numeric check of that many entries per gradient against ``tolerance``.
    ``keep``: the query slices whose gradients are kept whole (None: all), the others
    judged as the pass finishes them.

    Raises:
        SpecError: a ``dout`` that is neither a file nor a source, or whose shape is
            not the output's.
    """
    thresholds = thresholds or Thresholds()
    values, dout_label, dout_info = load_dout(spec, dout)
    stats = Stats.empty(spec.in_float64())
    with watch(spec, "gradients") as progress:
        grads, health = backward_health(
            spec, values, thresholds, jobs=jobs, stats=stats, progress=progress, keep=keep
        )
    diagnosis = combined(diagnose(stats, thresholds), health)
    numeric = numeric_check(grads, samples, spec.options.seed) if samples is not None else None
    return GradRun(
        spec.options.dtype, grads, health, diagnosis, dout_label, dout_info, numeric, tolerance
    )


def grad_writers(run: GradRun, outputs: Outputs) -> dict[str, Writer]:
    """The writers of the files ``sdpa grad`` writes of its own: ``save``, dQ, dK, dV
    (and d(bias)) in their inputs' shapes and dO, as an .npz."""
    return {"save": gradients_writer(run.grads)} if "save" in outputs else {}
