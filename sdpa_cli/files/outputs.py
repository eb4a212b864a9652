"""Outputs that would destroy an input: a run's output paths checked, before anything is
computed, against its inputs and against each other, and for what
:func:`~sdpa_cli.files.writers.resolve_output` refuses (a directory, a block device).

Two paths name the same file when they reach the same inode (``st_dev``, ``st_ino``:
``./q.npy``, a symbolic link to ``q.npy`` and a hard link all count), or, for a file
that does not exist yet, when they resolve to the same real path. Character devices
(``/dev/null``, ``/dev/stdout``) are written through, never replaced: any number of
outputs may name one.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from sdpa_cli.errors import InputError
from sdpa_cli.files.checks import GONE, working_directory
from sdpa_cli.files.remote import is_url
from sdpa_cli.files.writers import resolve_output


def check_outputs(
    inputs: Iterable[tuple[str, str | None]], outputs: Iterable[tuple[str, str | None]]
) -> None:
    """Refuse an output that is one of the inputs, or the same file as another output.

    Args:
        inputs: ``(what, path)`` of every file the run reads (a path may carry a
            ``:name`` suffix, as ``x.npz:q``; a URL or None is skipped).
        outputs: ``(option, path)`` of every file the run writes (None: not asked for).

    Raises:
        InputError: naming the output and the file it would destroy, in one line.
    """
    read = [(what, path, _identity(path, input_path=True)) for what, path in inputs if path]
    seen: list[tuple[str, str, tuple[object, ...] | None]] = []
    for option, path in outputs:
        if path is None:
            continue
        if not path:
            raise InputError(option, "the file name is empty")
        if path == "-":  # standard output: the tables' or --format's, not a file named -
            raise InputError(
                f"{option} -",
                "names standard output, where the tables or the --format document go; "
                "give a file name (./- for a file named -)",
            )
        resolve_output(path)  # a directory, a block device: refused now, not after the work
        ident = _identity(path, input_path=False)
        if ident is None:
            continue
        for what, other, other_ident in read:
            if other_ident == ident:
                raise InputError(
                    f"{option} {path}",
                    f"is the same file as {_named(what, other)}; writing it would destroy it",
                )
        for other_option, other, other_ident in seen:
            if other_ident == ident:
                raise InputError(
                    f"{option} {path}",
                    f"is the same file as {other_option} {other}; one report would be lost",
                )
        seen.append((option, path, ident))


def _named(what: str, path: str) -> str:
    return f"the input {path}" if what == "input" else f"{what} {path}"


def _identity(path: str, *, input_path: bool) -> tuple[object, ...] | None:
    """What makes two paths the same file: the inode of an existing file, else its
    resolved real path; None for what is never replaced (a URL, a character device)."""
    if not path or is_url(path):
        return None
    candidates = [path]
    if input_path and ":" in path:  # x.npz:q, x.safetensors:q: the file before the name
        candidates.append(path.rsplit(":", 1)[0])
    for candidate in candidates:
        try:
            st = os.stat(os.path.expanduser(candidate))
        except (OSError, ValueError):
            continue
        if stat.S_ISCHR(st.st_mode):
            return None
        return ("inode", st.st_dev, st.st_ino)
    if input_path:  # an input that does not exist cannot be destroyed
        return None
    named = os.path.expanduser(path)
    if not os.path.isabs(named) and working_directory() is None:
        raise InputError(path, GONE.replace("cannot be found", "cannot be written"))
    return ("path", os.path.realpath(named))
