"""``sdpa report model`` as one call: every case of a manifest (every attention call of a
model) measured head by head into a layer × head grid (:mod:`sdpa_cli.diagnosis.model`),
each case read as ``sdpa check --manifest`` reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from sdpa_cli.api.case import Case, Watch, unwatched
from sdpa_cli.api.manifest import load_manifest
from sdpa_cli.check.exports import load_expected, output_of
from sdpa_cli.check.records import CaseResult
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.model import GridRow, ModelGrid, head_metrics, model_grid, pattern_pool
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.errors import InputError, SdpaError, SpecError
from sdpa_cli.files.structured import parse_text
from sdpa_cli.files.tokens import TOKENS_FILE, Tokens, read_tokens


def model_report(
    manifest: str,
    thresholds: Thresholds | None = None,
    *,
    errors: bool = False,
    jobs: int = 1,
    watch: Watch = unwatched,
    patterns: bool = False,
) -> ModelGrid:
    """The grid of ``manifest``'s cases, a row each (labelled by its layer where sdpa
    capture's ``calls.yaml`` beside the manifest gives one); a case that cannot be read
    has its row's error instead. With ``errors``, some case must have an
    expect-output (the error metric is asked for). With ``patterns``, each head's
    attention pattern comes too, pooled so that the whole grid's patterns hold about
    :data:`PATTERN_CELLS` cells (a page's pictures).

    Raises:
        SdpaError: the manifest cannot be read; ``errors`` and no case has an
            expect-output.
    """
    th = thresholds or Thresholds()
    cases = load_manifest(manifest)
    if errors and not any("output" in c.expect for c in cases):
        raise SpecError("--metric error", f"no case of {manifest} has an expect-output")
    layers = capture_layers(manifest)
    share = len(cases) if patterns else 0
    rows = [_grid_row(case, layers.get(case.title(None)), th, jobs, watch, share) for case in cases]
    return model_grid(rows, th)


def model_page_of(grid: ModelGrid, manifest: str, tokens: str | None = None) -> str:
    """The page of ``grid`` (``report model --html``), its patterns labelled by the
    ``tokens`` file when given, else by the capture's ``tokens.json`` beside the
    manifest when it has one.

    Raises:
        InputError: a tokens file that cannot be read, or does not fit a case.
    """
    # imported here: only --html draws a page
    from sdpa_cli.render.pages.model import model_page

    return model_page(grid, manifest, _labels(grid, manifest, tokens))


def manifest_page(results: list[CaseResult], manifest: str, title: str) -> str:
    """``check --manifest --html``: the manifest's cases as a model's grid (each case's
    row read from its check's own pass, ``CheckReport.heads``), coloured by its verdict
    too, then each case's checks; labelled as :func:`model_page_of` labels them."""
    layers = capture_layers(manifest)
    rows = [
        GridRow(
            r.name,
            layers.get(r.name),
            r.report.heads if r.report is not None else None,
            None if r.report is not None else r.error or "not checked",
        )
        for r in results
    ]
    th = next((r.report.diagnosis.thresholds for r in results if r.report), Thresholds())
    grid = model_grid(rows, th)
    # imported here: only --html draws a page
    from sdpa_cli.render.pages.model import model_page

    return model_page(grid, manifest, _labels(grid, manifest), checks=results, title=title)


def _labels(grid: ModelGrid, manifest: str, tokens: str | None = None) -> dict[str, Tokens]:
    """Each read case's query and key labels: from the ``tokens`` file (``--tokens``), else from
    a capture's ``tokens.json`` beside the manifest, else none; each fitted to its case.

    Raises:
        InputError: a labels file that cannot be read, or does not fit a case, naming it
            (as ``--tokens FILE``, or the file beside the manifest).
    """
    label = f"--tokens {tokens}"
    if tokens is None:
        beside = Path(manifest).parent / TOKENS_FILE
        if not beside.is_file():
            return {}
        tokens = label = str(beside)
    labels = read_tokens(tokens, label)
    out = {}
    for row in grid.rows:
        if row.heads is None or row.heads.patterns is None:
            continue
        L, S = row.heads.lengths
        try:
            out[row.name] = labels.fit(L, S, label)
        except InputError as exc:
            raise InputError(label, f"{exc.problem} (case {row.name})") from None
    return out


def capture_layers(manifest: str) -> dict[str, int]:
    """Case name → layer, from the ``calls.yaml`` sdpa capture writes beside its
    manifest (a ``name`` and a ``layer`` for each call); nothing where there is no such
    file, or it does not read as one: the layers only label the grid's rows."""
    path = Path(manifest).parent / "calls.yaml"
    if not path.is_file():
        return {}
    try:
        data = parse_text(path, "yaml", str(path))
    except SdpaError:
        return {}
    calls = data.get("calls") if isinstance(data, dict) else None
    return {
        str(call["name"]): call["layer"]
        for call in (calls if isinstance(calls, list) else [])
        if isinstance(call, dict)
        and "name" in call
        and isinstance(call.get("layer"), int)
        and not isinstance(call.get("layer"), bool)
    }


def _grid_row(
    case: Case, layer: int | None, th: Thresholds, jobs: int, watch: Watch, share: int
) -> GridRow:
    """One case's row of the grid: loaded as sdpa check --manifest loads it (options
    from the manifest), its heads measured (with their patterns when ``share``, the
    cases the pictures' budget is shared by); or the one-line reason it cannot be read."""
    name = case.title(None)
    try:
        spec, _ = case.load()
        with case.reading():
            expected = expected_output(spec, case)
        with watch(spec, name) as progress:
            pool = pattern_pool(spec.L, spec.S, share * spec.H) if share else 0
            heads = head_metrics(spec, th, expected, jobs=jobs, progress=progress, pool=pool)
    except SdpaError as exc:
        return GridRow(name, layer, error=str(exc))
    return GridRow(name, layer, heads)


def expected_output(spec: AttentionSpec, case: Case) -> NDArray[Any] | None:
    """The case's expect-output in the computation's layout ``(*lead, L, Ev)`` (heads
    split under ``heads``), fitted as sdpa check fits it; None without one."""
    return output_of(spec, load_expected({"output": case.expect.get("output")}))
