"""The process's streams and signals, set up once at the entry of ``sdpa``.

- SIGTERM and SIGHUP raise :class:`Terminated` in the main thread, so that they end
  the run through the same clean-up path as Ctrl-C (temporaries removed, worker
  processes ended) and exit 128 + the signal's number (143, 129; Ctrl-C 130).
- A broken pipe on stdout (``sdpa ... | head -1``) is not a failure: :class:`PipeClosed`,
  exit 0 or the verdict the command reached before printing (:func:`decided`), stdout
  sent to /dev/null so that Python's last flush is quiet.
- stdout that cannot be written (a full disk, an I/O error) or closed (``>&-``) is
  :class:`StdoutFailed`: one line on stderr, exit 2, as any output that cannot be written.
- Text that the streams' encoding cannot carry (``PYTHONIOENCODING=ascii``) is written
  with plain-ASCII replacements (``√`` → ``sqrt``, box lines → ``-|+``), never a crash.
- ``COLUMNS`` that is not a number, or below :data:`MIN_COLUMNS`, is ignored.

Imports only the standard library: ``sdpa --help`` stays fast.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import os
import signal
import sys
from types import FrameType
from typing import Any, TextIO

MIN_COLUMNS = 20
"""Below this a table has no room for a column: ``COLUMNS`` is then ignored."""

STREAM_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG, errno.EBADF, errno.ENXIO}
)
"""What a failing stdout raises (and no file sdpa reads gets as far as the top)."""

ASCII_FALLBACKS = {
    "√": "sqrt",
    "·": "*",
    "×": "x",
    "−": "-",
    "–": "-",
    "—": "--",
    "…": "...",
    "≥": ">=",
    "≤": "<=",
    "≠": "!=",
    "≈": "~",
    "±": "+/-",
    "→": "->",
    "←": "<-",
    "⊙": "*",
    "∞": "inf",
    "Σ": "sum",
    "ᵀ": "^T",
    "²": "^2",
    "•": "*",
    "█": "#",
    "▁": "_",  # the grid's key, low to high
    "▂": ".",
    "▃": ":",
    "▄": "-",
    "▅": "=",
    "▆": "+",
    "▇": "*",
    "↳": "->",
    "÷": "/",
    "‹": "<",
    "›": ">",
    "▏": "|",
    "✓": "ok",
    "✗": "x",
    "“": '"',
    "”": '"',
    "‘": "'",
    "’": "'",
}


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived. A BaseException, as KeyboardInterrupt: no ``except
    Exception`` swallows it, and click does not turn it into its own Abort."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class PipeClosed(Exception):
    """The reader of stdout went away (EPIPE)."""


class StdoutFailed(Exception):
    """stdout cannot be written (ENOSPC, EIO, ...)."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(f"stdout: cannot be written: {exc.strerror or exc}")


def _ascii_fallback(exc: UnicodeError) -> tuple[str, int]:
    """A codecs error handler: each character the encoding lacks → an ASCII stand-in."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    text = exc.object[exc.start : exc.end]
    return "".join(ASCII_FALLBACKS.get(c, _box(c)) for c in text), exc.end


def _box(c: str) -> str:
    """Box-drawing characters → ``-``, ``|`` or ``+``; anything else → ``?``."""
    if "\u2500" <= c <= "\u257f":
        return "-" if c in "─━═╌┄" else "|" if c in "│┃║╎┆" else "+"
    return "?"


codecs.register_error("sdpa-ascii", _ascii_fallback)

HANDLED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals that end a run as Ctrl-C does."""

_previous: dict[int, Any] = {}
_received: list[int] = []
"""The signals received in this run (the first raised :class:`Terminated`)."""


def set_up() -> None:
    """Signals, encodings and ``COLUMNS``, once, at the entry of a run."""
    columns = os.environ.get("COLUMNS")
    if columns is not None and not (columns.isdigit() and int(columns) >= MIN_COLUMNS):
        del os.environ["COLUMNS"]  # as unset: the terminal's width, or 80 in a pipe
    for stream in (sys.stdout, sys.stderr):
        _degrade_to_ascii(stream)
    _received.clear()
    _verdict.clear()
    for signum in HANDLED:
        with contextlib.suppress(ValueError):  # not the main thread: leave as is
            _previous[signum] = signal.signal(signum, _terminate)


def tear_down() -> None:
    """Give SIGTERM and SIGHUP back their handlers from before :func:`set_up` (``sdpa``
    run in-process, as by the tests)."""
    while _previous:
        signum, handler = _previous.popitem()
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signum, handler)


def _degrade_to_ascii(stream: TextIO) -> None:
    """Have ``stream`` write ASCII stand-ins for what its encoding cannot carry."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        "√─".encode(encoding)
    except (UnicodeError, LookupError):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="sdpa-ascii")  # type: ignore[attr-defined]


def _terminate(signum: int, frame: FrameType | None) -> None:
    """The handler of SIGTERM and SIGHUP: the first raises :class:`Terminated`; a
    second ends the process at once, by the signal's default action (as a second
    Ctrl-C does in many tools: the clean-up of the first may be what hangs)."""
    if _received:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received.append(signum)
    raise Terminated(signum)


def as_stream_error(exc: OSError) -> Exception | None:
    """The stream failure an OSError that reached the top stands for, or None."""
    if exc.errno == errno.EPIPE:
        return PipeClosed()
    if exc.errno in STREAM_ERRNOS and exc.filename is None:
        return StdoutFailed(exc)
    return None


def flush_stdout() -> None:
    """Deliver what stdout holds; a failure becomes :class:`PipeClosed` or
    :class:`StdoutFailed`."""
    try:
        sys.stdout.flush()
    except OSError as exc:
        raise as_stream_error(exc) or StdoutFailed(exc) from None
    except ValueError:  # closed (a test runner's stream): nothing to deliver
        pass


_verdict: list[int] = []


def decided(code: int) -> int:
    """Record the exit code a command has decided before it prints (``check``'s 1):
    a reader that goes away early (``| head``) does not turn it into 0."""
    _verdict[:] = [int(code)]
    return int(code)


def verdict() -> int:
    """The exit code recorded by :func:`decided`, or 0."""
    return _verdict[0] if _verdict else 0


def check_stdout() -> None:
    """Refuse to start with no stdout (``>&-``): the results would go nowhere, and the
    result files are written only once stdout has them."""
    if sys.stdout is None:
        raise StdoutFailed(OSError(errno.EBADF, "it is closed (>&-); use >/dev/null"))


def silence(fd: int) -> None:
    """Point ``fd`` (1 or 2) at /dev/null, so that what is left in its buffer, and
    Python's flush at exit, go nowhere quietly (Python's advice for a broken pipe)."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


def stream_fd(stream: TextIO) -> int | None:
    """The descriptor of ``stream`` when it is the process's own (not a test runner's)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    return fd if fd in (1, 2) else None
