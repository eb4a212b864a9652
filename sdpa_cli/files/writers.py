"""Atomic writes: a file (or several, all or none) appears at its path only once it is
written in full, with the mode of the file it replaces.

What is at the path decides how it is written:

- nothing, or a regular file: a temporary file beside it, renamed into place;
- a symbolic link: the same, at the link's target (the link stays a link);
- a character device or a FIFO (``/dev/null``, ``/dev/stdout``, a named pipe): written
  in full into an anonymous temporary file first (a writer may seek: a zip does), then
  copied into it, never replaced by a regular file (as ``>`` does in a shell); a FIFO
  that no process reads within :data:`FIFO_WAIT` seconds is
  refused (an open would wait forever);
- a directory, a block device, a socket: refused, in one line.

Inside :func:`staged`, the renames wait until the command has delivered its output
(:meth:`Stage.commit`), so that a run whose stdout fails replaces no file; a run that
fails or is interrupted removes its temporaries (:meth:`Stage.discard`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, BinaryIO

from sdpa_cli.errors import InputError

FIFO_WAIT = 3
"""Seconds a named FIFO (``mkfifo``) is given to receive its first bytes as an input,
or its first reader as an output."""


if TYPE_CHECKING:  # sdpa --help imports this module (staged): pathlib, shutil and
    # tempfile are imported where a file is written
    from pathlib import Path

Writer = Callable[[BinaryIO], object]


class Stage:
    """Temporaries written in full, waiting to be renamed into place."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, Path, Path]] = []  # (label, temporary, target)

    def commit(self) -> None:
        """Rename every temporary into place, in the order they were written."""
        try:
            while self.pending:
                label, temporary, target = self.pending[0]
                try:
                    os.replace(temporary, target)
                except OSError as exc:
                    raise InputError(label, f"cannot be written: {exc.strerror or exc}") from None
                self.pending.pop(0)
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove every temporary not yet renamed."""
        while self.pending:
            _, temporary, _ = self.pending.pop()
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)


_stage: Stage | None = None


@contextlib.contextmanager
def staged() -> Iterator[Stage]:
    """Hold back the renames of the writes inside until ``commit()``; on an exception
    (or if ``commit`` is never called) the temporaries are removed."""
    global _stage
    outer, _stage = _stage, Stage()
    stage = _stage
    try:
        yield stage
    finally:
        _stage = outer
        stage.discard()


@contextlib.contextmanager
def immediate() -> Iterator[None]:
    """Writes inside are renamed into place at once, even within :func:`staged` (a
    capture writes its files as they come)."""
    global _stage
    outer, _stage = _stage, None
    try:
        yield
    finally:
        _stage = outer


def write_atomic(path: str | os.PathLike[str], write: Writer) -> None:
    """Call ``write(fh)`` on a temporary file beside ``path``, then rename it into place.

    Nothing is created or clobbered at ``path`` unless ``write`` succeeds. The file gets
    the mode of the file it replaces, or the usual ``0o666 & ~umask`` for a new one.

    Raises:
        InputError: naming ``path`` when it cannot be written (an empty name, no such
            directory, a directory in the way, no permission, disk full).
    """
    write_all_atomic([(path, write)])


def write_all_atomic(files: Sequence[tuple[str | os.PathLike[str], Writer]]) -> None:
    """Write several files all or none, as :func:`write_atomic` writes one: every
    temporary file is written first, then each is renamed into place. A failure
    (or Ctrl-C) before the renames leaves nothing behind. Devices and FIFOs are
    written straight into, after the temporaries.

    Raises:
        InputError: naming the path that cannot be written.
    """
    stage = Stage()
    direct: list[tuple[str, Writer]] = []
    try:
        for path, write in files:
            label = os.fspath(path)
            target, through = resolve_output(label)
            if through:
                direct.append((label, write))
            else:
                _write_temporary(label, target, write, stage)
        for label, write in direct:
            _write_through(label, write)
        if _stage is not None:
            _stage.pending.extend(stage.pending)
            stage.pending.clear()
        else:
            stage.commit()
    finally:
        stage.discard()


def resolve_output(label: str) -> tuple[Path, bool]:
    """Where an output named ``label`` goes: the path to replace (a symbolic link's
    target), and whether to write straight into it instead (a device or a FIFO).

    Raises:
        InputError: for an empty name, a directory, or what is not a regular file,
            a character device or a FIFO.
    """
    if not label:
        raise InputError("''", "the file name is empty")
    from pathlib import Path  # imported here: see the top of the module

    target = Path(label)
    try:
        st = os.stat(target)  # follows symbolic links
    except FileNotFoundError:
        if os.path.islink(target):  # a dangling link: create the file it names
            return Path(os.path.realpath(target)), False
        if label.endswith(os.sep):
            raise InputError(label, "is a directory; expected a file name") from None
        return target, False
    except OSError as exc:
        raise InputError(label, f"cannot be written: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(label, "is a directory; expected a file name")
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return target, True
    if not stat.S_ISREG(st.st_mode):
        kind = "a block device" if stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise InputError(label, f"is {kind}; expected a regular file")
    return (Path(os.path.realpath(target)) if os.path.islink(target) else target), False


def _write_through(label: str, write: Writer) -> None:
    """Write into a device or FIFO as it is, without a rename: ``write`` fills an
    anonymous temporary file (it may seek), then its bytes are copied in."""
    import shutil  # imported here: see the top of the module
    import tempfile

    try:
        with tempfile.TemporaryFile() as spool:
            write(spool)
            spool.seek(0)
            fd = _open_through(label)
            with os.fdopen(fd, "wb") as fh:
                shutil.copyfileobj(spool, fh)
    except OSError as exc:
        raise InputError(label, f"cannot be written: {exc.strerror or exc}") from None


def _open_through(label: str) -> int:
    """Open a device or FIFO for writing; a FIFO waits up to :data:`FIFO_WAIT` seconds
    for a reader (``O_NONBLOCK``: ENXIO while none), then writes block as usual."""
    deadline = time.monotonic() + FIFO_WAIT
    while True:
        try:
            fd = os.open(label, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            if time.monotonic() >= deadline:
                raise InputError(
                    label,
                    f"is a FIFO that no process reads within {FIFO_WAIT} s; start its reader first",
                ) from None
            time.sleep(0.05)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    return fd


def _write_temporary(label: str, target: Path, write: Writer, stage: Stage) -> None:
    """Call ``write(fh)`` on a new temporary file beside ``target``, adding it to
    ``stage`` as soon as it exists so that it is removed on a failure."""
    tmp = temporary_beside(target)
    # Known to the stage before it exists: a Ctrl-C just after it is created (the
    # moment a watcher sees it appear) still finds it to remove.
    stage.pending.append((label, tmp, target))
    try:
        fd = create_new(tmp)
    except OSError as exc:
        stage.pending.pop()  # not created: nothing of ours is there
        if isinstance(exc, FileNotFoundError):
            raise InputError(
                label, f"cannot be written: directory {str(target.parent)!r} does not exist"
            ) from None
        raise InputError(label, f"cannot be written: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        # made 0o600; a saved file is not a secret
        os.chmod(tmp, _new_file_mode(target))
    except OSError as exc:
        raise InputError(label, f"cannot be written: {exc.strerror or exc}") from None


def temporary_beside(target: Path) -> Path:
    """A fresh name for a temporary file beside ``target``: hidden, random, ``.tmp``.

    Unlike ``tempfile.mkstemp``, the name is known before the file exists, so that
    whoever will remove it can record it first (:func:`create_new` then makes it)."""
    return target.with_name(f".{target.name}.{os.urandom(6).hex()}.tmp")


def create_new(path: Path) -> int:
    """Create ``path``, which must not exist, for writing (mode 0o600, as mkstemp)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def _new_file_mode(target: Path) -> int:
    """The mode of the file ``target`` replaces, or ``0o666 & ~umask`` for a new file."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
