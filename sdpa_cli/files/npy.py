"""``.npy`` and ``.npz`` files, read with their safety checks: the magic bytes, the
header (never unpickled), the declared size against the bytes that follow (and the
memory) before the data is read in (never memory-mapped), and for an
archive member, the size it expands to against the memory available (a zip bomb)."""

from __future__ import annotations

import contextlib
import math
import re
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.errors import InputError
from sdpa_cli.files import limits
from sdpa_cli.files.checks import check_dtype, check_shape, pick_member, reading
from sdpa_cli.files.opening import Input, opened
from sdpa_cli.text import one_line, printable

NPY_MAGIC = b"\x93NUMPY"
NPY_VERSIONS = ((1, 0), (2, 0), (3, 0))
"""The header versions numpy writes (2.0 and 3.0 share a reader)."""
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
"""A zip archive's first bytes: a local file header, or the end record of an empty archive."""

_LZMA_ERRORS: tuple[type[Exception], ...] = ()
# imported here, in a guard: lzma is optional; a Python built without it reads no such members
with contextlib.suppress(ImportError):
    import lzma

    _LZMA_ERRORS = (lzma.LZMAError,)
_DECOMPRESS_ERRORS: tuple[type[Exception], ...] = (zlib.error, *_LZMA_ERRORS)
"""A damaged compressed stream."""
_ARCHIVE_ERRORS: tuple[type[Exception], ...] = (
    zipfile.BadZipFile,
    *_DECOMPRESS_ERRORS,
    NotImplementedError,
    RuntimeError,
    OSError,
    EOFError,
)
"""What reading a damaged, encrypted or exotic archive member raises: not a header's fault."""


def _numpy_header(
    fh: IO[bytes], version: tuple[int, int]
) -> tuple[tuple[int, ...], np.dtype[Any], bool]:
    """The shape, dtype and Fortran order in the header after the magic bytes of ``version``."""
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
    return shape, dtype, bool(fortran)


def _corrupt_header(label: str, exc: Exception) -> InputError:
    """A header numpy's parser refused (ValueError, SyntaxError, TokenError...), in its
    words less the memory addresses they may quote (``<ast.Name object at 0x7f…>``), so
    the message is the same on every run."""
    problem = one_line(re.sub(r" at 0x[0-9a-fA-F]+", "", str(exc)))
    return InputError(label, f"has a corrupt .npy header ({type(exc).__name__}: {problem})")


def _read_npy_header(inp: Input) -> tuple[tuple[int, ...], np.dtype[Any], bool, int]:
    """The shape, dtype and order a ``.npy`` header declares, and where its data starts."""
    try:
        with reading(inp.label):
            fh = inp.fh
            fh.seek(0)
            version = np.lib.format.read_magic(fh)
            if version not in NPY_VERSIONS:
                raise InputError(inp.label, f"unsupported .npy version {version}")
            shape, dtype, fortran = _numpy_header(fh, version)
            return shape, dtype, fortran, fh.tell()
    except InputError:
        raise
    except Exception as exc:  # numpy's header parser raises ValueError, SyntaxError, TokenError...
        raise _corrupt_header(inp.label, exc) from None


def load_npy(path: Path | Input, label: str) -> NDArray[Any]:
    """Read the header, check the declared size against the file's (from ``fstat`` on
    the opened file) and the memory, then read the data into memory: never
    memory-mapped, so a file truncated under the run is an error, not a SIGBUS."""
    with opened(path, label) as inp:
        shape, dtype, fortran, offset = _read_npy_header(inp)
        check_dtype(dtype, label)
        check_shape(shape, label)
        count = math.prod(shape)  # Python ints: no overflow, whatever the header claims
        needed = count * dtype.itemsize
        available = inp.size - offset
        if needed > available:
            raise InputError(
                label,
                f"is truncated: its header declares {shape} {dtype} ({needed} bytes) but {available} bytes follow",
            )
        if count == 0:
            return np.zeros(shape, dtype=dtype)
        data = inp.read_exactly(offset, needed).view(dtype)
    if fortran:
        return data.reshape(shape[::-1]).transpose()
    return data.reshape(shape)


def _arrays(zf: zipfile.ZipFile, label: str) -> dict[str, zipfile.ZipInfo]:
    """An archive's members by the name of the array each holds (``q.npy`` → ``q``).

    Raises:
        InputError: two members holding arrays of one name (numpy would read the
            last, silently): refused, as a key given twice is in JSON and YAML.
    """
    arrays: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        name = info.filename.removesuffix(".npy")
        if name in arrays:
            raise InputError(
                label,
                f"holds two arrays named {printable(name)!r} ({printable(arrays[name].filename)!r} "
                f"and {printable(info.filename)!r}); an archive names each array once",
            )
        arrays[name] = info
    return arrays


def _not_an_archive(label: str, exc: zipfile.BadZipFile) -> InputError:
    return InputError(label, f"is not a valid .npz archive ({one_line(exc)})")


def npz_members(path: Path | Input, label: str) -> list[str]:
    """The names of an archive's arrays, sorted, as :func:`load_npz` names them.

    Raises:
        InputError: a broken archive, or one holding no arrays.
    """
    try:
        with reading(label), opened(path, label) as inp, zipfile.ZipFile(inp.fh) as zf:
            names = sorted(_arrays(zf, label))
    except zipfile.BadZipFile as exc:
        raise _not_an_archive(label, exc) from None
    if not names:
        raise InputError(label, "holds no arrays")
    return names


def load_npz(path: Path | Input, member: str | None, label: str) -> NDArray[Any]:
    """One member of an archive; ``label`` already ends in ``:member`` when one was given."""
    member_label = label
    file_label = label.removesuffix(f":{member}") if member is not None else label
    try:
        with opened(path, label) as inp, zipfile.ZipFile(inp.fh) as zf:
            infos = _arrays(zf, file_label)
            member, member_label = pick_member(label, sorted(infos), member, "array")
            _check_npz_member(zf, infos[member], member_label)
            with zf.open(infos[member]) as fh:  # read_array reads the header again
                return np.lib.format.read_array(fh, allow_pickle=False)
    except InputError:
        raise
    except MemoryError:
        raise InputError(
            member_label, "does not fit in memory once decompressed; save it with np.save"
        ) from None
    except zipfile.BadZipFile as exc:
        raise _not_an_archive(label, exc) from None
    except _DECOMPRESS_ERRORS as exc:
        raise InputError(
            member_label, f"is corrupt: it does not decompress ({one_line(exc)})"
        ) from None
    except NotImplementedError as exc:  # a compression method zipfile does not know
        raise InputError(member_label, f"cannot be read: {one_line(exc)}") from None
    except RuntimeError as exc:  # zipfile's word for a password-protected member
        problem = "is encrypted" if "encrypted" in str(exc) else f"cannot be read: {one_line(exc)}"
        raise InputError(member_label, problem) from None
    except (ValueError, OSError, EOFError, zipfile.LargeZipFile) as exc:
        raise InputError(label, f"cannot be read as .npz ({one_line(exc)})") from None


def _check_npz_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, label: str) -> None:
    """Read a member's header and check what it declares against the sizes in the
    archive, before a byte of its data is decompressed."""
    with zf.open(info) as fh:
        try:
            shape, dtype, _ = _numpy_header(fh, np.lib.format.read_magic(fh))
        except _ARCHIVE_ERRORS:
            raise
        except Exception as exc:  # ValueError, SyntaxError, TokenError...
            raise _corrupt_header(label, exc) from None
    check_dtype(dtype, label)
    check_shape(shape, label)
    count = math.prod(shape)  # Python ints: no overflow, whatever the header claims
    declared = count * dtype.itemsize
    if declared > info.file_size:
        raise InputError(
            label,
            f"is truncated: declares {shape} {dtype} ({declared} bytes) in a {info.file_size}-byte member",
        )
    _check_expansion(label, shape, dtype, declared, info.compress_size)


def _check_expansion(
    label: str, shape: tuple[int, ...], dtype: np.dtype[Any], declared: int, stored: int
) -> None:
    """Refuse, before allocating, a compressed member that would not fit in memory once
    read (a zip bomb)."""
    available = limits.available_memory()
    if available is not None and declared > available:
        gib = 2.0**30
        raise InputError(
            label,
            f"expands to {declared / gib:.1f} GiB ({shape} {dtype}) from {stored} bytes stored, "
            f"but {available / gib:.1f} GiB of memory is available; save it with np.save "
            "(uncompressed) instead",
        )
