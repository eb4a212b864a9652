"""Atomic writes: a file (or several, all or none) appears at its path only once it is
written in full, with the mode of the file it replaces."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from sdpa_cli.errors import InputError


def write_atomic(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(fh)`` on a temporary file beside ``path``, then rename it into place.

    Nothing is created or clobbered at ``path`` unless ``write`` succeeds. The file gets
    the mode of the file it replaces, or the usual ``0o666 & ~umask`` for a new one.

    Raises:
        InputError: naming ``path`` when it cannot be written (no such directory, a
            directory in the way, no permission, disk full).
    """
    write_all_atomic([(path, write)])


def write_all_atomic(
    files: Sequence[tuple[str | os.PathLike[str], Callable[[BinaryIO], object]]],
) -> None:
    """Write several files all or none, as :func:`write_atomic` writes one: every
    temporary file is written first, then each is renamed into place. A failure
    (or Ctrl-C) before the renames leaves nothing behind.

    Raises:
        InputError: naming the path that cannot be written.
    """
    temps: list[tuple[str, Path]] = []
    try:
        for path, write in files:
            _write_temporary(path, write, temps)
        for label, written in temps:
            try:
                os.replace(written, label)
            except OSError as exc:
                raise InputError(label, f"cannot be written: {exc.strerror or exc}") from None
    finally:
        for _, leftover in temps:
            leftover.unlink(missing_ok=True)


def _write_temporary(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], object],
    temps: list[tuple[str, Path]],
) -> None:
    """Call ``write(fh)`` on a new temporary file beside ``path``, appending ``(path,
    temporary)`` to ``temps`` as soon as it exists so that the caller removes it."""
    target, label = Path(path), os.fspath(path)
    if target.is_dir():
        raise InputError(label, "is a directory; expected a file name")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except FileNotFoundError:
        raise InputError(
            label, f"cannot be written: directory {str(target.parent)!r} does not exist"
        ) from None
    except OSError as exc:
        raise InputError(label, f"cannot be written: {exc.strerror or exc}") from None
    temps.append((label, Path(tmp)))
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        # mkstemp makes 0o600; a saved file is not a secret
        os.chmod(tmp, _new_file_mode(target))
    except OSError as exc:
        raise InputError(label, f"cannot be written: {exc.strerror or exc}") from None


def _new_file_mode(target: Path) -> int:
    """The mode of the file ``target`` replaces, or ``0o666 & ~umask`` for a new file."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
