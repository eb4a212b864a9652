"""``sdpa compute`` as one call: a loaded computation's statistics and findings
(:func:`compute`), or its answer under each framework's conventions (:func:`frameworks`);
the files such a run writes (:func:`compute_writers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

from sdpa_cli.api.case import Watch, unwatched
from sdpa_cli.api.outputs import Outputs
from sdpa_cli.diagnosis.findings import Diagnosis, Thresholds
from sdpa_cli.diagnosis.frameworks import Comparison, compare_frameworks
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.block import applicable_stages
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import Trace, trace
from sdpa_cli.errors import SpecError
from sdpa_cli.files.writers import Writer
from sdpa_cli.stream import check_document_room, trace_stages
from sdpa_cli.stream_save import check_room, stages_writer


@dataclass(frozen=True)
class Computed:
    """What ``sdpa compute`` found: the run's statistics (and the stages a document
    keeps whole), its findings, and the stages asked for."""

    trace: Trace
    diagnosis: Diagnosis
    stages: tuple[str, ...]

    @property
    def spec(self) -> AttentionSpec:
        return self.trace.spec


def compute(
    spec: AttentionSpec,
    thresholds: Thresholds | None = None,
    *,
    stages: tuple[str, ...] | None = None,
    document: str | None = None,
    outputs: Outputs | None = None,
    stdout: int = -1,
    jobs: int = 1,
    watch: Watch = unwatched,
) -> Computed:
    """The statistics and findings of ``spec``, and nothing score-sized: a table
    computes the rows it shows, a ``document`` (``json``, ``yaml``) and ``--save``
    each stage again, block by block, as they write it. ``stages``: those asked for
    (default every one the options bring about). What ``outputs`` (``save``) and the
    document (on the file descriptor ``stdout``) will need of the disk is checked
    first.

    Raises:
        InputError: a file or the document that cannot fit on its disk.
    """
    chosen = stages or applicable_stages(spec)
    outputs = outputs or Outputs()
    if "save" in outputs:
        check_room(spec, outputs.paths["save"])
    if document is not None:
        check_document_room(spec, chosen, document, stdout)
    keep = trace_stages(spec, chosen) if document is not None else ()
    with watch(spec, "computing") as progress:
        result = trace(spec, stages=keep, summarize=chosen, jobs=jobs, progress=progress)
    return Computed(result, diagnose(result, thresholds), chosen)


def compute_writers(
    spec: AttentionSpec, outputs: Outputs, *, jobs: int = 1, watch: Watch = unwatched
) -> dict[str, Writer]:
    """The writers of the files ``sdpa compute`` writes of its own: ``save``, every
    stage (full shape) and ``visible`` as an .npz, computed again as it is written."""
    if "save" not in outputs:
        return {}
    path = outputs.paths["save"]

    def write(fh: BinaryIO) -> None:
        with watch(spec, "saving") as progress:
            stages_writer(spec, path, jobs=jobs, progress=progress)(fh)

    return {"save": write}


def frameworks(spec: AttentionSpec, outputs: Outputs | None = None, *, jobs: int = 1) -> Comparison:
    """``compute --frameworks``: what each framework would output for ``spec`` under
    its own conventions, and where they disagree.

    Raises:
        SpecError: a ``save`` output asked for (there are no stages to save).
    """
    if outputs is not None and "save" in outputs:
        raise SpecError("--frameworks", "shows no stages to save; leave out --save")
    return compare_frameworks(spec, jobs=jobs)
