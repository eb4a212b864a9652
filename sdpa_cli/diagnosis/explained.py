"""The records of ``sdpa explain``: a stage explained, the shown rows' statistics, the
variance argument, the backward stages, and the whole :class:`Explanation`.

Plain data, built by :func:`~sdpa_cli.diagnosis.explain.explain` (forward) and
:func:`~sdpa_cli.diagnosis.explain_grad.explain_backward` (``--backward``); the renderer
draws them and the report writes them as JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnosis.findings import Diagnosis, Finding
from sdpa_cli.diagnosis.grad import GradDiagnosis
from sdpa_cli.diagnosis.scales import ScaleRun
from sdpa_cli.diagnosis.scorecard import Scorecard
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index


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
class Backward:
    """The backward stages of the slice, the gradient findings placed at them, and
    the whole input's gradient health."""

    dout_label: str
    stages: tuple[StageExplained, ...]
    elsewhere: tuple[Finding, ...]
    health: GradDiagnosis

    def to_dict(self) -> dict[str, Any]:
        return {"dout": self.dout_label, **self.health.to_dict()}


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
    """With ``--backward``: the gradient's stages (:mod:`sdpa_cli.diagnosis.explain_grad`)."""

    def stage(self, name: str) -> StageExplained | None:
        return next((s for s in self.stages if s.name == name), None)
