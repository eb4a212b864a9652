"""``sdpa report model`` as one call: every case of a manifest (every attention call of a
model) measured head by head into a layer × head grid (:mod:`sdpa_cli.diagnosis.model`),
each case read as ``sdpa check --manifest`` reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from sdpa_cli.api.case import Case, Watch, unwatched
from sdpa_cli.api.manifest import load_manifest
from sdpa_cli.check.exports import fit_expected, load_expected
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.model import GridRow, ModelGrid, head_metrics, model_grid
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import split_heads_of_output
from sdpa_cli.errors import SdpaError, SpecError
from sdpa_cli.files.structured import parse_text


def model_report(
    manifest: str,
    thresholds: Thresholds | None = None,
    *,
    errors: bool = False,
    jobs: int = 1,
    watch: Watch = unwatched,
) -> ModelGrid:
    """The grid of ``manifest``'s cases, a row each (labelled by its layer where sdpa
    capture's ``calls.yaml`` beside the manifest gives one); a case that cannot be read
    has its row's error instead. With ``errors``, some case must have an
    expect-output (the error metric is asked for).

    Raises:
        SdpaError: the manifest cannot be read; ``errors`` and no case has an
            expect-output.
    """
    th = thresholds or Thresholds()
    cases = load_manifest(manifest)
    if errors and not any("output" in c.expect for c in cases):
        raise SpecError("--metric error", f"no case of {manifest} has an expect-output")
    layers = capture_layers(manifest)
    rows = [_grid_row(case, layers.get(case.title(None)), th, jobs, watch) for case in cases]
    return model_grid(rows, th)


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


def _grid_row(case: Case, layer: int | None, th: Thresholds, jobs: int, watch: Watch) -> GridRow:
    """One case's row of the grid: loaded as sdpa check --manifest loads it (options
    from the manifest), its heads measured; or the one-line reason it cannot be read."""
    name = case.title(None)
    try:
        spec, _ = case.load()
        with case.reading():
            expected = _expected_output(spec, case)
        with watch(spec, name) as progress:
            heads = head_metrics(spec, th, expected, jobs=jobs, progress=progress)
    except SdpaError as exc:
        return GridRow(name, layer, error=str(exc))
    return GridRow(name, layer, heads)


def _expected_output(spec: AttentionSpec, case: Case) -> NDArray[Any] | None:
    """The case's expect-output in the computation's layout ``(*lead, L, Ev)`` (heads
    split under ``heads``), fitted as sdpa check fits it; None without one."""
    path = case.expect.get("output")
    if path is None:
        return None
    fitted = fit_expected(spec, load_expected({"output": path})[0])
    return split_heads_of_output(spec, fitted.values) if fitted.merged else fitted.values
