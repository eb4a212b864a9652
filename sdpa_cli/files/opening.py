"""Every input is opened here, once per reader, and checked on the opened descriptor.

A path is opened with ``O_NONBLOCK`` (a FIFO without a writer does not hang the open),
then ``fstat`` on that descriptor (no stat-then-open race) says what it is:

- a regular file is read from the descriptor, in bounded reads, its size the one
  ``fstat`` gave; a read that comes up short says the file changed while being read;
- a FIFO (``<(...)``, ``/dev/stdin`` fed by a pipe, ``mkfifo``) is read once, whole,
  into memory within the caps, and remembered for the run: a later read of the same
  name (the format sniffed, then the data read) sees the same bytes, never a drained
  pipe; a named FIFO (``mkfifo``) that receives nothing within :data:`FIFO_WAIT`
  seconds is refused (no writer: a read would wait forever), an anonymous pipe is
  read as long as its writer writes;
- a directory, a character or block device (``/dev/zero``) or a socket is refused
  with one line: ``is a character device, not a regular file``.

``-`` is standard input, read like a FIFO (:func:`claim_stdin` keeps it to one input
of a command). Knows nothing of formats beyond telling binary heads from text.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import io
import os
import select
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.errors import InputError
from sdpa_cli.files import limits
from sdpa_cli.files.checks import reading
from sdpa_cli.files.writers import FIFO_WAIT

STDIN = "-"
"""The name standard input goes by on the command line."""
STDIN_LABEL = "<stdin>"
"""How standard input is named in messages."""
READ_CHUNK = 1 << 24
"""Bytes read at a time (16 MiB): a read this size is never one huge allocation."""
STREAM_TEXT_CAP = 64 << 20
"""The most a FIFO or standard input that does not start like a binary tensor file
may hold: the largest text cap (:data:`~sdpa_cli.files.structured.TEXT_CAPS`)."""
_BINARY_HEADS = (b"\x93NUMPY", b"PK\x03\x04", b"PK\x05\x06")
"""``.npy`` and zip archives (``.npz``, torch.save's): read from a stream up to the memory."""

_KINDS = (
    (stat.S_ISDIR, "is a directory, not a regular file"),
    (stat.S_ISCHR, "is a character device, not a regular file"),
    (stat.S_ISBLK, "is a block device, not a regular file"),
    (stat.S_ISSOCK, "is a socket, not a regular file"),
)

_streams: dict[tuple[str, int, int], bytearray] = {}
"""FIFOs read this run, by name, device and inode: a FIFO can be read only once."""
_stdin: list[Any] = [None, None, None]
"""The standard input stream read this run, its bytes, and the input it feeds."""


@dataclass
class Input:
    """An opened input: a regular file's descriptor, or a stream's bytes.

    Attributes:
        fh: the file, at its start (a ``BytesIO`` over a stream's bytes).
        size: its size in bytes, from ``fstat`` on the opened descriptor.
        label: how messages name it.
        path: the path opened (its extension names a format).
        stream: the bytes of a FIFO or standard input, read whole; None for a file.
    """

    fh: IO[bytes]
    size: int
    label: str
    path: Path
    stream: bytearray | None = None

    def head(self, n: int) -> bytes:
        """The first ``n`` bytes (fewer for a shorter file), leaving the file at its start."""
        self.fh.seek(0)
        data = self.fh.read(n)
        self.fh.seek(0)
        return data

    def read_exactly(self, offset: int, nbytes: int) -> NDArray[np.uint8]:
        """``nbytes`` bytes from ``offset`` as a uint8 array: a view of a stream's bytes,
        or read from a file into an array allocated once the memory is known to hold it.

        Raises:
            InputError: the memory cannot hold them, or the file ends early (it changed
                while being read).
        """
        if self.stream is not None:
            if offset + nbytes > len(self.stream):
                raise self.changed(offset + nbytes)
            view = np.frombuffer(self.stream, dtype=np.uint8, count=nbytes, offset=offset)
            view.flags.writeable = False  # shared by every read of the stream this run
            return view
        check_fits(nbytes, self.label)
        try:
            buf = np.empty(nbytes, dtype=np.uint8)
        except MemoryError:
            raise InputError(self.label, f"does not fit in memory ({_gib(nbytes)} GiB)") from None
        into = buf.data
        got = 0
        with reading(self.label):
            self.fh.seek(offset)
            while got < nbytes:
                n = self.fh.readinto(into[got : got + READ_CHUNK])  # type: ignore[attr-defined]
                if not n:
                    raise self.changed(offset + nbytes)
                got += n
        return buf

    def read_all(self, cap: int, what: str) -> bytes | bytearray:
        """The whole input, refused above ``cap`` bytes (``what`` follows "is N bytes"
        in the refusal: what the input is, the cap's reason, what to use instead)."""
        if self.size > cap:
            raise InputError(self.label, f"is {self.size} bytes {what}")
        if self.stream is not None:
            return self.stream
        with reading(self.label):
            self.fh.seek(0)
            data = self.fh.read(cap + 1)
        if len(data) != self.size:
            raise self.changed(self.size, len(data))
        return data

    def changed(self, expected: int, now: int | None = None) -> InputError:
        """The file ended before ``expected`` bytes: it changed under the run."""
        if now is None:
            try:
                now = os.fstat(self.fh.fileno()).st_size
            except (OSError, ValueError, io.UnsupportedOperation):
                now = self.size
        return InputError(
            self.label, f"changed while being read (now {now} bytes, expected {expected})"
        )


def _gib(n: int) -> str:
    return f"{n / 2.0**30:.1f}"


def check_fits(nbytes: int, label: str, doing: str = "to be read") -> None:
    """Refuse, before allocating, ``nbytes`` that the machine's memory cannot hold
    (``doing``: what they are for, as the message says it)."""
    available = limits.available_memory()
    if available is not None and nbytes > available:
        raise InputError(
            label,
            f"needs {_gib(nbytes)} GiB of memory {doing}, but {_gib(available)} GiB is available",
        )


def is_stdin(path: Path | str) -> bool:
    """Whether ``path`` names standard input (``-``)."""
    return str(path) == STDIN


def is_stream(text: str) -> bool:
    """Whether ``text`` names standard input or a FIFO (``<(...)``, ``/dev/stdin``)."""
    if is_stdin(text):
        return True
    try:
        return stat.S_ISFIFO(os.stat(text).st_mode)
    except (OSError, ValueError):
        return False


def claim_stdin(consumer: str) -> None:
    """Standard input feeds ``consumer`` (``q``, ``case file``); a second input reading
    it is refused: it can be read only once.

    Raises:
        InputError: another input of this command already reads standard input.
    """
    stream = sys.stdin
    if _stdin[0] is stream and _stdin[2] not in (None, consumer):
        raise InputError(
            STDIN, f"standard input already feeds {_stdin[2]}; only one input may be -"
        )
    if _stdin[0] is not stream:
        _stdin[:] = [stream, None, None]
    _stdin[2] = consumer


@contextlib.contextmanager
def open_input(path: Path, label: str) -> Iterator[Input]:
    """``path`` opened for reading and checked on its descriptor (see the module).

    Raises:
        InputError: naming ``label``: missing, unreadable, not a regular file or FIFO,
            a stream above its cap.
    """
    if is_stdin(path):
        data = _read_stdin(label)
        yield Input(io.BytesIO(data), len(data), label, Path(path), data)
        return
    key = _stream_key(path)
    if key in _streams:
        data = _streams[key]
        yield Input(io.BytesIO(data), len(data), label, Path(path), data)
        return
    with reading(label):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # opening a socket
                raise InputError(label, "is a socket, not a regular file") from None
            raise
        try:
            info = os.fstat(fd)
            for test, problem in _KINDS:
                if test(info.st_mode):
                    raise InputError(label, problem)
            # blocking again: a pipe's writer may be slower than its reader
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        fh = os.fdopen(fd, "rb")
    with fh:
        if stat.S_ISFIFO(info.st_mode):
            if info.st_dev != _pipe_device():
                _await_writer(fd, label)
            with reading(label):
                data = _read_stream(fh, label)
            _streams[key] = data
            yield Input(io.BytesIO(data), len(data), label, Path(path), data)
        else:
            yield Input(fh, info.st_size, label, Path(path))


def _stream_key(path: Path) -> tuple[str, int, int]:
    """What names a FIFO read before: its name, device and inode (``/dev/fd/63`` of
    another ``<(...)`` is another pipe). A stat only: it never blocks."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return str(path), -1, -1
    return str(path), info.st_dev, info.st_ino


@functools.cache
def _pipe_device() -> int:
    """The device of anonymous pipes (Linux's pipefs): ``<(...)``, ``cmd | sdpa ... -``."""
    read_end, write_end = os.pipe()
    try:
        return os.fstat(read_end).st_dev
    finally:
        os.close(read_end)
        os.close(write_end)


def _await_writer(fd: int, label: str) -> None:
    """Wait up to :data:`FIFO_WAIT` seconds for a named FIFO's first bytes (or its writer
    to come and go). An anonymous pipe has had its writer since it was made; a named one
    (``mkfifo``) may have none, and a read would wait for one forever."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(FIFO_WAIT * 1000):
        raise InputError(
            label,
            f"is a FIFO that no process wrote to within {FIFO_WAIT} s; start its writer first",
        )


@contextlib.contextmanager
def opened(source: Path | Input, label: str) -> Iterator[Input]:
    """``source`` as an :class:`Input`: opened here, or already open (then left open)."""
    if isinstance(source, Input):
        yield source
    else:
        with open_input(source, label) as inp:
            yield inp


def _read_stdin(label: str) -> bytearray:
    """Standard input, read whole once this run; a terminal is refused (nothing piped)."""
    stream = sys.stdin
    if _stdin[0] is stream and _stdin[1] is not None:
        return _stdin[1]  # type: ignore[no-any-return]
    if stream is None:
        raise InputError(label, "standard input is closed")
    if stream.isatty():
        raise InputError(label, "standard input is a terminal; pipe a file into sdpa")
    with reading(label):
        data = _read_stream(getattr(stream, "buffer", stream), label)
    _stdin[:] = [stream, data, _stdin[2] if _stdin[0] is stream else None]
    return data


def _read_stream(fh: Any, label: str) -> bytearray:
    """A stream read to its end: text up to :data:`STREAM_TEXT_CAP`, a binary tensor
    file (see :func:`_stream_cap`) up to the memory available."""
    data = bytearray()  # grown in place: no second copy of the whole stream at the end
    cap: int | None = None
    while True:
        chunk = fh.read(8 - len(data) if cap is None else READ_CHUNK)
        if isinstance(chunk, str):
            raise InputError(label, "is text, not bytes")
        if not chunk:
            return data
        data += chunk
        if cap is None and len(data) >= 8:
            cap = _stream_cap(bytes(data[:8]))
        if cap is not None and len(data) > cap:
            raise InputError(
                label,
                f"holds more than {cap >> 20} MiB, the most sdpa reads from a pipe in this "
                "format; save tensors this large with numpy.save and give the file",
            )


def _stream_cap(head: bytes) -> int:
    """The most a stream starting with ``head`` (8 bytes) may hold: the memory for a
    binary tensor file (the ``.npy`` or zip magic, a pickle's PROTO, or a NUL byte, as
    a safetensors header's length holds), :data:`STREAM_TEXT_CAP` for text."""
    binary = head.startswith(_BINARY_HEADS) or head[:1] == b"\x80" or b"\x00" in head
    if not binary:
        return STREAM_TEXT_CAP
    available = limits.available_memory()
    return available if available is not None else 1 << 40
