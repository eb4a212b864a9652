"""Inputs named by URL (``s3://bucket/q.npy``, ``file:///data/q.npy``, any protocol
fsspec knows): the file is copied to a temporary file, with a size limit, and read from
there by the same readers, with the same checks, as a local file
(:func:`~sdpa_cli.files.loaders.load_array`): a remote ``.npy`` is sniffed, its header
checked against its size and never unpickled, exactly like a local one.

The size fsspec reports is checked before a byte is copied, and the copy stops at the
limit whatever the server said. fsspec is an optional extra (``pip install
fsspec``), imported only when a URL is read.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from sdpa_cli.errors import InputError
from sdpa_cli.files import limits
from sdpa_cli.files.checks import reading
from sdpa_cli.text import one_line

URL_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
"""``scheme://``: a URL, not a path (a Windows drive, ``C:\\``, has no ``//``)."""
COPY_CHUNK = 1 << 20
"""Bytes copied at a time."""
MISSING_FSSPEC = "reading a URL needs fsspec: pip install fsspec"


def is_url(text: str) -> bool:
    """Whether ``text`` is a URL (``scheme://...``) to be read with fsspec."""
    return URL_PATTERN.match(text) is not None


def size_limit() -> int | None:
    """The most bytes a URL's file may hold: what the temporary folder's disk and the
    memory available can take (the array is read into memory, not memory-mapped), or
    None when neither is known."""
    known = [limits.available_memory()]
    with contextlib.suppress(OSError):
        known.append(shutil.disk_usage(tempfile.gettempdir()).free)
    sizes = [n for n in known if n is not None]
    return min(sizes) if sizes else None


def _too_large(label: str, size: int, limit: int) -> InputError:
    gib = 2.0**30
    return InputError(
        label,
        f"is {size} bytes ({size / gib:.1f} GiB) but {limit / gib:.1f} GiB can be read here "
        "(memory and temporary disk)",
    )


@contextlib.contextmanager
def fetched(url: str, label: str) -> Iterator[Path]:
    """The file at ``url``, copied to a temporary file (named with the URL's suffix, so
    formats are told apart as for a local file) that is removed afterwards.

    Raises:
        InputError: naming ``label``: no fsspec, an unknown protocol, a missing file or
            folder, a file over :func:`size_limit`, a failed transfer.
    """
    try:
        import fsspec  # type: ignore[import-untyped,unused-ignore]  # optional extra: dask
    except ImportError:
        raise InputError(label, MISSING_FSSPEC) from None
    limit = size_limit()
    suffix = PurePosixPath(urlsplit(url).path).suffix
    with tempfile.TemporaryDirectory(prefix="sdpa-url-") as folder:
        target = Path(folder) / f"input{suffix}"
        with reading(label), _backend_errors(label):
            fs, path = fsspec.core.url_to_fs(url)
            info = fs.info(path)
            if info.get("type") == "directory":
                raise InputError(label, "is a directory, not a tensor file")
            size = info.get("size")
            if isinstance(size, int) and limit is not None and size > limit:
                raise _too_large(label, size, limit)
            with fs.open(path, "rb") as src, target.open("wb") as dst:
                _copy(src, dst, label, limit)
        yield target


def _copy(src: Any, dst: Any, label: str, limit: int | None) -> None:
    """Copy ``src`` to ``dst`` a chunk at a time, stopping past ``limit`` bytes (a
    server may send more than it declared)."""
    copied = 0
    while chunk := src.read(COPY_CHUNK):
        copied += len(chunk)
        if limit is not None and copied > limit:
            raise _too_large(label, copied, limit)
        dst.write(chunk)


@contextlib.contextmanager
def _backend_errors(label: str) -> Iterator[None]:
    """What fsspec and its backends raise besides OSError (an unknown protocol, a
    missing backend package, a backend's own exception types), as one line naming the
    URL: a network or storage problem, never a bug in sdpa."""
    try:
        yield
    except (InputError, OSError):
        raise  # ours, and the file system's (worded by reading())
    except ImportError as exc:  # fsspec: "Install s3fs to access S3"
        raise InputError(label, f"cannot be read: {one_line(exc)}") from None
    except Exception as exc:
        raise InputError(label, f"cannot be read: {type(exc).__name__}: {one_line(exc)}") from None
