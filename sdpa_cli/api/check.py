"""``sdpa check`` as one call: a case, or a manifest's cases (locally, a shard of them, or
on a Dask cluster), judged into a :class:`CheckRun`, whose documents (the JSON report,
JUnit XML) every output writes from.

The rules of a run live here, where the command line and the Python API both meet
them: a manifest lists its own inputs, a cluster runs the cases on its own workers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from sdpa_cli.api.case import Case, Watch, unwatched
from sdpa_cli.api.cluster import CONNECT_TIMEOUT, run_cases_on_cluster
from sdpa_cli.api.judge import check_case
from sdpa_cli.api.manifest import Shard, fingerprint, load_manifest, run_cases, shard_document
from sdpa_cli.api.outputs import Outputs
from sdpa_cli.check.records import CaseResult
from sdpa_cli.check.settings import Overrides
from sdpa_cli.errors import ExitCode, SpecError
from sdpa_cli.files.limits import cores
from sdpa_cli.files.writers import Writer
from sdpa_cli.names import INPUT_TENSORS
from sdpa_cli.report import check_document, check_exit_code, junit_xml, to_json


@dataclass(frozen=True)
class ManifestRun:
    """How a manifest's cases run: all of them or one ``shard`` (``I/N``), in local
    processes or on the Dask ``cluster`` at an address (waiting ``timeout`` seconds
    for its scheduler)."""

    path: str
    shard: str | None = None
    cluster: str | None = None
    timeout: float | None = None


@dataclass(frozen=True)
class CheckRun:
    """What a run of ``sdpa check`` concluded: each case's result, and what heads it
    (``manifest``, and a shard's ``title``; ``sharding``: what a shard's report says
    of it, :func:`~sdpa_cli.api.merge.shard_document`'s keywords)."""

    results: list[CaseResult]
    manifest: str | None = None
    title: str | None = None
    sharding: dict[str, Any] | None = None
    merged: dict[str, Any] | None = None
    """A merged run's JSON report, as its shards wrote it (:mod:`~sdpa_cli.api.merge`)."""

    @cached_property
    def document(self) -> dict[str, Any]:
        """The JSON report: one shape for one case and for a manifest (a shard's says
        which shard it is)."""
        if self.merged is not None:
            return self.merged
        document = check_document(self.results, manifest=self.manifest)
        if self.sharding is not None:
            document = shard_document(document, **self.sharding)
        return document

    @cached_property
    def json_text(self) -> str:
        return to_json(self.document) + "\n"

    @property
    def exit_code(self) -> ExitCode:
        return check_exit_code(self.results)

    def writers(self) -> dict[str, Writer]:
        """The writers of the report files a run writes, one for each kind of
        :data:`~sdpa_cli.api.outputs.REPORTS`: ``report`` (the JSON report) and
        ``junit``."""
        return {
            "report": lambda fh: fh.write(self.json_text.encode()),
            "junit": lambda fh: fh.write(junit_xml(self.results)),
        }

    def page(self) -> str:
        """The run as one self-contained HTML page (``--html``): a case's verdict with
        the pictures of each failed comparison (``Overrides.evidence``); a manifest's
        as its model grid, with each case's verdict, then its checks."""
        # imported here: only --html draws a page (13 ms of imports every check saved)
        from sdpa_cli.api.model import manifest_page
        from sdpa_cli.render.pages.check import check_page

        title = self.title or self.manifest or (self.results[0].name if self.results else "")
        if self.manifest is None or not any(r.report and r.report.heads for r in self.results):
            return check_page(self.results, title)
        return manifest_page(self.results, self.manifest, title)


def run_check(
    case: Case,
    over: Overrides | None = None,
    *,
    manifest: ManifestRun | None = None,
    outputs: Outputs | None = None,
    jobs: int | None = None,
    watch: Watch = unwatched,
) -> CheckRun:
    """Judge ``case``, or with ``manifest`` every case it lists (``case`` then names
    nothing: the manifest lists the inputs), each with ``over`` (the settings every
    case shares). ``outputs`` are refused up front when one would destroy a file a
    case reads. ``jobs``: threads computing one case's blocks, or a manifest's cases
    run at once (None: as many as the cores; not with a cluster, whose workers run
    the cases).

    Raises:
        SdpaError: bad input, naming it: the case's (a manifest's bad case is that
            case's error in the run instead), the manifest's, or settings that do
            not fit together in any case of the manifest, before any case runs.
    """
    over = over or Overrides()
    outputs = outputs or Outputs()
    threads = jobs or cores()
    if manifest is None:
        outputs.check(case.files())
        if "page" in outputs:  # the page draws each failed comparison: keep what it reads
            over = dataclasses.replace(over, evidence=True)
        result = check_case(case, over, jobs=threads, watch=watch)
        return CheckRun([result], title=result.name)
    if case.decode:
        raise SpecError(
            "--decode", "checks the one case given; in a manifest, give its cases decode: true"
        )
    if case.inputs or case.tensors or case.expect or case.partials:
        raise SpecError(
            "--manifest",
            "the manifest lists inputs and expectations; give no Q K V, "
            + ", ".join(f"--{n.replace('_', '-')}" for n in INPUT_TENSORS[3:])
            + " or --expect-* beside it",
        )
    if manifest.cluster is not None and jobs is not None:
        raise SpecError("--jobs", "the cluster's workers run the cases; give --jobs or --cluster")
    if manifest.cluster is None and manifest.timeout is not None:
        raise SpecError(
            "--cluster-timeout", "bounds the wait for a --cluster scheduler; give --cluster ADDRESS"
        )
    return _run_manifest(manifest, over, outputs, threads)


def _run_manifest(run: ManifestRun, over: Overrides, outputs: Outputs, jobs: int) -> CheckRun:
    """The cases of the manifest (those of its shard when given), ``jobs`` at a time in
    local processes or as tasks on its cluster. Settings that do not fit together, in
    any case, stop the run before any case runs, as does an output that is one of the
    cases' files."""
    outputs.check([run.path])
    picked = None if run.shard is None else Shard.parse(run.shard)
    cases = load_manifest(run.path)
    outputs.check(path for c in cases for path in c.files())
    for case in cases:
        try:
            over.settings(case.check)
        except SpecError as exc:
            raise SpecError(f"{run.path}: case {case.name}", str(exc)) from None
    sharding = title = None
    if picked is not None:
        sharding = {"shard": picked, "total": len(cases), "fingerprint": fingerprint(cases, over)}
        cases = [cases[p - 1] for p in picked.positions(len(cases))]
        title = f"{run.path} · shard {picked}"
    if "page" in outputs:  # the page's grid: each case's row from its check's pass
        over = dataclasses.replace(over, grid_share=len(cases))
    if run.cluster is None:
        results = run_cases(cases, over, jobs)
    else:
        timeout = run.timeout or CONNECT_TIMEOUT
        results = run_cases_on_cluster(cases, over, run.cluster, timeout=timeout)
    return CheckRun(results, manifest=run.path, title=title, sharding=sharding)
