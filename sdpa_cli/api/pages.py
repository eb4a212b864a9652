"""The pages of one slice (``explain --html``, ``compute --html``) as one call: the
window the options choose, its pictures, its findings and labels
(:mod:`~sdpa_cli.render.pages.slice`)."""

from __future__ import annotations

from sdpa_cli.api.picks import parse_rows
from sdpa_cli.diagnosis.explain import in_slice, slice_at
from sdpa_cli.diagnosis.findings import Diagnosis
from sdpa_cli.diagnosis.pictures import SlicePictures, slice_pictures
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.files.tokens import read_tokens
from sdpa_cli.render.pages.slice import slice_page


def window_pictures(
    spec: AttentionSpec,
    at: tuple[int, int],
    rows: str | None,
    keys: str | None,
    jobs: int = 1,
) -> SlicePictures:
    """The stages of the slice ``at`` (batch, head) over the window ``rows`` × ``keys``
    (as ``--rows`` and ``--keys`` give them; default the whole slice), for a page or
    ``--plot``.

    Raises:
        SpecError: a window outside the slice.
    """
    picked_rows = parse_rows(rows, spec.L) if rows is not None else None
    picked_keys = parse_rows(keys, spec.S, "--keys", "keys") if keys is not None else None
    return slice_pictures(
        spec,
        slice_at(spec, *at),
        None if picked_rows is None else range(spec.L)[picked_rows],
        None if picked_keys is None else range(spec.S)[picked_keys],
        jobs=jobs,
    )


def slice_page_of(
    spec: AttentionSpec,
    diagnosis: Diagnosis,
    at: tuple[int, int],
    *,
    rows: str | None,
    keys: str | None,
    title: str,
    about: str,
    text: str,
    tokens: str | None = None,
    jobs: int = 1,
) -> str:
    """The page of the slice ``at`` (batch, head) over the window ``rows`` × ``keys``
    (as ``--rows`` and ``--keys`` give them; default the whole slice), labelled by the
    ``tokens`` file when given.

    Raises:
        SdpaError: a window outside the slice; a tokens file that cannot be read or
            does not fit the computation's lengths.
    """
    labels = None
    if tokens is not None:
        labels = read_tokens(tokens).fit(spec.L, spec.S, f"--tokens {tokens}")
    pictures = window_pictures(spec, at, rows, keys, jobs)
    lead = pictures.lead
    found = [f for f in diagnosis.findings if in_slice(f, spec, lead)]
    return slice_page(pictures, title=title, about=about, findings=found, text=text, tokens=labels)
