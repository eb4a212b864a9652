"""Files named inside other files: a case file's tensors, a manifest's cases, a
partials list. In CI such a file may come from a pull request, so by default what it
names must stay in its own folder tree, and what those files hold is not echoed.

- :func:`confine`: a path a file names, resolved against that file's folder, is
  refused when it leaves the folder (an absolute path, ``..``, a symlink pointing
  out) or is a URL, unless the run allows it (``--allow-outside``, which
  :func:`allow_outside` records for the run).
- :func:`~sdpa_cli.text.unechoed` (in ``text``, where values are shown): errors
  about the content of such files say what kind of value was found, not the value.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from sdpa_cli.errors import InputError
from sdpa_cli.files.remote import is_url
from sdpa_cli.text import printable, shown

_ANYWHERE: ContextVar[bool] = ContextVar("sdpa_allow_outside", default=False)
_ROOT: ContextVar[Path | None] = ContextVar("sdpa_confined_to", default=None)

LIFT = "give --allow-outside to read files outside it"


def allow_outside(allowed: bool) -> None:
    """Record for this run (this context) whether named files may leave their folder."""
    _ANYWHERE.set(allowed)


def outside_allowed() -> bool:
    """Whether this run lets a file name files outside its folder tree."""
    return _ANYWHERE.get()


@contextlib.contextmanager
def rooted(root: str | os.PathLike[str]) -> Iterator[None]:
    """Within it, files are confined to ``root``'s tree (a manifest's folder: the case
    files it names may share tensors anywhere under it) instead of their own folder's."""
    token = _ROOT.set(Path(root))
    try:
        yield
    finally:
        _ROOT.reset(token)


def confine(
    named: str,
    path: str | os.PathLike[str],
    base: Path,
    where: str,
    whose: str = "the folder {base} of the file naming it",
) -> None:
    """Refuse ``path``, which a file in folder ``base`` names as ``named`` (resolved
    against ``base``: ``m.yaml``'s ``q: ../x.npy`` is ``base/../x.npy``), when it
    leaves ``base``'s tree or is a URL, unless the run allows it; ``whose`` says what
    ``base`` is, in messages.

    Raises:
        InputError: naming ``where`` (``m.yaml: cases[2]: q``).
    """
    if _ANYWHERE.get():
        return
    manifest = _ROOT.get()
    if manifest is not None:
        base = manifest
    if is_url(named):
        raise InputError(where, f"names a URL; a file's inputs are read from its folder; {LIFT}")
    try:
        root = os.path.realpath(base)
        real = os.path.realpath(path)
    except ValueError:  # a NUL in the name: the reader says so, naming the file
        return
    if os.path.commonpath([root, real]) != root:
        folder = repr(printable(str(base)))
        what = f"the folder {folder} of the manifest" if manifest is not None else whose
        raise InputError(
            where, f"{shown(printable(named))} is outside {what.format(base=folder)}; {LIFT}"
        )
