"""Paths → numpy arrays, for every input format, with the safety checks at the door.

Formats: ``.npy`` (memory-mapped, never unpickled), ``.npz`` (``file.npz:name`` picks
an array), ``.safetensors`` (memory-mapped; ``file.safetensors:name`` picks a tensor;
BF16, F8_E4M3 and F8_E5M2 as ``ml_dtypes`` arrays, upcast block by block like the
rest), ``.json`` and ``.yaml``/``.yml`` (nested
lists of numbers; YAML through the safe loader, aliases refused). The format is sniffed
from the file's first bytes (``\\x93NUMPY``, ``PK``, a safetensors header length followed
by ``{``) before the extension is trusted. Every error is an
:class:`~sdpa_cli.errors.InputError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import yaml
from numpy.typing import NDArray

from sdpa_cli.errors import InputError
from sdpa_cli.text import printable

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
"""A zip archive's first bytes: a local file header, or the end record of an empty archive."""
TEXT_SUFFIXES = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}
MAX_TEXT_BYTES = 256 << 20
"""Text inputs above this size are refused: nested lists of that size do not fit in memory."""
MAX_DEPTH = 32
"""Nesting deeper than any tensor sdpa handles (numpy allows 64 axes)."""
SAFETENSORS_SUFFIX = ".safetensors"
MAX_SAFETENSORS_HEADER = 100 << 20
"""The safetensors library's own cap on the JSON header: a longer one is corrupt or hostile."""
SAFETENSORS_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
}
"""safetensors dtype → numpy dtype (names without ``<`` are ``ml_dtypes`` types)."""
MEMBER_SUFFIXES = (".npz", SAFETENSORS_SUFFIX)
"""Formats that hold several arrays, one picked with ``file:name``."""


@dataclass(frozen=True)
class Source:
    """Where an array comes from: ``path`` and, for ``.npz`` and ``.safetensors``, a
    member ``name``."""

    path: Path
    member: str | None
    label: str

    @classmethod
    def parse(cls, text: str, base: Path | None = None) -> Source:
        """``file``, ``file.npz:name`` or ``file.safetensors:name``, relative to ``base``
        when given."""
        member = None
        path_text = text
        head, sep, tail = text.rpartition(":")
        if sep and head.lower().endswith(MEMBER_SUFFIXES) and not Path(text).exists():
            path_text, member = head, tail
        path = Path(path_text).expanduser()
        if base is not None and not path.is_absolute():
            path = base / path
        label = text if base is None else str(path) + (f":{member}" if member else "")
        return cls(path=path, member=member, label=printable(label))


@contextlib.contextmanager
def _reading(label: str) -> Iterator[None]:
    """Errors of the file system, as one line naming the file."""
    try:
        yield
    except FileNotFoundError:
        raise InputError(label, "no such file") from None
    except PermissionError:
        raise InputError(label, "permission denied") from None
    except OSError as exc:
        raise InputError(label, f"cannot be read: {exc.strerror or exc}") from None
    except ValueError as exc:  # os.stat and open refuse a path holding a NUL
        if "null" not in str(exc):
            raise
        raise InputError(label, "is not a usable file name: it holds a NUL character") from None


def _sniff(path: Path, label: str) -> str:
    """The format of ``path``: ``npy``, ``npz``, ``safetensors``, ``json`` or ``yaml``."""
    with _reading(label):
        if path.is_dir():
            raise InputError(label, "is a directory, not a tensor file")
        with path.open("rb") as fh:
            head = fh.read(9)
        size = path.stat().st_size
    if not head:
        raise InputError(label, "is empty")
    suffix = path.suffix.lower()
    if head.startswith(NPY_MAGIC):
        return "npy"
    if head.startswith(ZIP_MAGIC):
        return "npz"
    if suffix == SAFETENSORS_SUFFIX or _looks_like_safetensors(head, size):
        return "safetensors"
    if suffix == ".npy":
        raise InputError(label, "is not a .npy file (it does not start with the NUMPY magic bytes)")
    if suffix == ".npz":
        raise InputError(label, "is not a .npz file (it is not a zip archive)")
    if suffix in TEXT_SUFFIXES:
        return TEXT_SUFFIXES[suffix]
    raise InputError(
        label,
        f"unknown format {suffix or '(no extension)'!r}; expected .npy, .npz, .safetensors, .json, .yaml or .yml",
    )


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    """A safetensors file has no magic bytes: a plausible header length, then ``{``."""
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= min(size - 8, MAX_SAFETENSORS_HEADER) and head[8:9] == b"{"


def _check_dtype(dtype: np.dtype[Any], label: str) -> None:
    if dtype.hasobject:
        raise InputError(label, "holds Python objects (a pickle); sdpa never unpickles")
    if dtype.names is not None:
        raise InputError(label, f"has a structured dtype {dtype}; expected a plain numeric array")
    if dtype.kind not in "biuf":
        kinds = {
            "c": "complex",
            "U": "string",
            "S": "bytes",
            "M": "datetime",
            "m": "timedelta",
            "V": "raw bytes",
        }
        raise InputError(
            label, f"has {kinds.get(dtype.kind, str(dtype))} dtype {dtype}; expected real numbers"
        )


MAX_DIM = int(np.iinfo(np.intp).max)
"""The longest axis numpy can index."""


def _check_shape(shape: tuple[int, ...], label: str) -> None:
    """A header's shape: at most MAX_DEPTH axes, each 0..MAX_DIM (numpy's header parser
    lets (-1,) and (2**64, 0) through)."""
    if len(shape) > MAX_DEPTH:
        raise InputError(label, f"has {len(shape)} axes; sdpa reads up to {MAX_DEPTH}")
    bad = [n for n in shape if not 0 <= n <= MAX_DIM]
    if bad:
        raise InputError(
            label,
            f"has a corrupt header: shape {shape!r:.60} has an axis of {bad[0]}; "
            f"expected 0 to {MAX_DIM}",
        )


def _load_npy(path: Path, label: str) -> NDArray[Any]:
    """Read the header, check the declared size against the file, then memory-map."""
    try:
        with path.open("rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                raise InputError(label, f"unsupported .npy version {version}")
            offset = fh.tell()
    except InputError:
        raise
    except Exception as exc:  # numpy's header parser raises ValueError, SyntaxError, TokenError...
        raise InputError(
            label, f"has a corrupt .npy header ({type(exc).__name__}: {_one_line(exc)})"
        ) from None
    _check_dtype(dtype, label)
    _check_shape(shape, label)
    count = 1
    for n in shape:
        count *= int(n)
    needed = count * dtype.itemsize
    available = path.stat().st_size - offset
    if needed > available:
        raise InputError(
            label,
            f"is truncated: its header declares {shape} {dtype} ({needed} bytes) but {available} bytes follow",
        )
    if count == 0:
        return np.zeros(shape, dtype=dtype)
    del fortran
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)  # type: ignore[no-any-return]
    except (ValueError, OSError) as exc:
        raise InputError(label, f"cannot be read as .npy ({_one_line(exc)})") from None


def _pick_member(label: str, names: list[str], member: str | None, noun: str) -> tuple[str, str]:
    """The member of a file holding several (``file:name``), or its only one; and the
    label naming it (``label`` already ends in ``:member`` when one was given)."""
    if not names:
        raise InputError(label, f"holds no {noun}s")
    listed = ", ".join(printable(n) for n in names)
    if member is None:
        if len(names) != 1:
            raise InputError(
                label,
                f"holds {len(names)} {noun}s; pick one with {label}:NAME (names: {listed})",
            )
        return names[0], f"{label}:{printable(names[0])}"
    if member not in names:
        raise InputError(label, f"has no {noun} {member!r} (names: {listed})")
    return member, label


_LZMA_ERRORS: tuple[type[Exception], ...] = ()
with contextlib.suppress(ImportError):  # Python built without lzma: no such members either
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


def _load_npz(path: Path, member: str | None, label: str) -> NDArray[Any]:
    """One member of an archive; ``label`` already ends in ``:member`` when one was given."""
    member_label = label
    try:
        with zipfile.ZipFile(path) as zf:
            infos = {i.filename.removesuffix(".npy"): i for i in zf.infolist()}
            member, member_label = _pick_member(label, sorted(infos), member, "array")
            with zf.open(infos[member]) as fh:
                try:
                    version = np.lib.format.read_magic(fh)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
                except _ARCHIVE_ERRORS:
                    raise
                except Exception as exc:  # ValueError, SyntaxError, TokenError...
                    raise InputError(
                        member_label,
                        f"has a corrupt .npy header ({type(exc).__name__}: {_one_line(exc)})",
                    ) from None
                _check_dtype(dtype, member_label)
                _check_shape(shape, member_label)
                count = math.prod(shape)  # Python ints: no overflow, whatever the header claims
                declared = count * dtype.itemsize
                if declared > infos[member].file_size:
                    raise InputError(
                        member_label,
                        f"is truncated: declares {shape} {dtype} ({declared} bytes) in a {infos[member].file_size}-byte member",
                    )
                _check_expansion(member_label, shape, dtype, declared, infos[member].compress_size)
            with zf.open(infos[member]) as fh:  # read_array reads the header again
                return np.lib.format.read_array(fh, allow_pickle=False)
    except InputError:
        raise
    except MemoryError:
        raise InputError(
            member_label, "does not fit in memory once decompressed; save it with np.save"
        ) from None
    except zipfile.BadZipFile as exc:
        raise InputError(label, f"is not a valid .npz archive ({_one_line(exc)})") from None
    except _DECOMPRESS_ERRORS as exc:
        raise InputError(
            member_label, f"is corrupt: it does not decompress ({_one_line(exc)})"
        ) from None
    except NotImplementedError as exc:  # a compression method zipfile does not know
        raise InputError(member_label, f"cannot be read: {_one_line(exc)}") from None
    except RuntimeError as exc:  # zipfile's word for a password-protected member
        problem = "is encrypted" if "encrypted" in str(exc) else f"cannot be read: {_one_line(exc)}"
        raise InputError(member_label, problem) from None
    except (ValueError, OSError, EOFError, zipfile.LargeZipFile) as exc:
        raise InputError(label, f"cannot be read as .npz ({_one_line(exc)})") from None


def _check_expansion(
    label: str, shape: tuple[int, ...], dtype: np.dtype[Any], declared: int, stored: int
) -> None:
    """Refuse, before allocating, a compressed member that would not fit in memory once
    read (a zip bomb): unlike ``.npy`` and ``.safetensors``, it cannot be memory-mapped."""
    from sdpa_cli.engine.block import available_memory  # one reading of /proc/meminfo for all

    available = available_memory()
    if available is not None and declared > available:
        gib = 2.0**30
        raise InputError(
            label,
            f"expands to {declared / gib:.1f} GiB ({shape} {dtype}) from {stored} bytes stored, "
            f"but {available / gib:.1f} GiB of memory is available; save it with np.save "
            "(memory-mapped) instead",
        )


def _read_safetensors_header(path: Path, label: str) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and where its data buffer starts.

    The file is ``N`` (8 bytes, little-endian), ``N`` bytes of JSON, then the data.
    """
    with _reading(label):
        size = path.stat().st_size
        with path.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise InputError(
                    label,
                    f"is too short for a .safetensors file ({size} bytes; expected 8 or more)",
                )
            n = int.from_bytes(prefix, "little")
            if n > MAX_SAFETENSORS_HEADER:
                raise InputError(
                    label,
                    f"declares a {n}-byte .safetensors header; the limit is {MAX_SAFETENSORS_HEADER >> 20} MiB",
                )
            if n > size - 8:
                raise InputError(
                    label,
                    f"is truncated: its .safetensors header declares {n} bytes but {size - 8} bytes follow",
                )
            raw = fh.read(n)
    corrupt = "has a corrupt .safetensors header"
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InputError(label, f"{corrupt}: it is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            label, f"{corrupt}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise InputError(label, f"{corrupt}: it is nested too deeply") from None
    if not isinstance(header, dict):
        raise InputError(label, f"{corrupt}: expected a JSON object, got {_json_type(header)}")
    return header, 8 + n


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return "null" if value is None else "a number"


def _is_count(x: Any) -> bool:
    """A non-negative JSON integer (``true`` is not one)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _safetensors_dtype(code: Any, label: str) -> np.dtype[Any]:
    """The numpy dtype of a safetensors dtype code; complex and unknown codes refused."""
    if not isinstance(code, str):
        raise InputError(
            label, f"has a corrupt .safetensors header: dtype must be a string, got {code!r:.40}"
        )
    if code.startswith("C"):  # C64: numpy's complex64
        raise InputError(label, f"has complex dtype {printable(code)}; expected real numbers")
    if code not in SAFETENSORS_DTYPES:
        raise InputError(
            label,
            f"has unsupported dtype {code!r:.40} (supported: {', '.join(SAFETENSORS_DTYPES)})",
        )
    name = SAFETENSORS_DTYPES[code]
    if name[0].isalpha():
        import ml_dtypes

        dt: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return dt
    return np.dtype(name)


def _load_safetensors(path: Path, member: str | None, label: str) -> NDArray[Any]:
    """One tensor of a safetensors file, memory-mapped read-only, after checking its
    header entry against the file; ``label`` already ends in ``:member`` when one was given.
    bfloat16 and float8 tensors come back as ``ml_dtypes`` arrays.
    """
    header, start = _read_safetensors_header(path, label)
    names = sorted(k for k in header if k != "__metadata__")
    member, member_label = _pick_member(label, names, member, "tensor")

    entry = header[member]
    corrupt = "has a corrupt .safetensors header"
    if not isinstance(entry, dict):
        raise InputError(
            member_label,
            f"{corrupt}: expected an object with dtype, shape and data_offsets, got {_json_type(entry)}",
        )
    missing = [f for f in ("dtype", "shape", "data_offsets") if f not in entry]
    if missing:
        raise InputError(member_label, f"{corrupt}: the entry has no {', '.join(missing)}")
    dtype = _safetensors_dtype(entry["dtype"], member_label)
    shape = entry["shape"]
    if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise InputError(
            member_label,
            f"{corrupt}: shape {shape!r:.60} is not a list of non-negative integers",
        )
    _check_shape(tuple(shape), member_label)
    offsets = entry["data_offsets"]
    buffer = path.stat().st_size - start
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(x) for x in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise InputError(
            member_label,
            f"{corrupt}: data_offsets {offsets!r:.60} are not [begin, end] with 0 <= begin <= end",
        )
    begin, end = offsets
    if end > buffer:
        raise InputError(
            member_label,
            f"is truncated: its data_offsets [{begin}, {end}] run past the {buffer}-byte data buffer",
        )
    count = math.prod(shape)  # Python ints: no overflow, whatever the header claims
    needed = count * dtype.itemsize
    if end - begin != needed:
        raise InputError(
            member_label,
            f"{corrupt}: shape {shape} of {entry['dtype']} is {needed} bytes but data_offsets [{begin}, {end}] hold {end - begin}",
        )
    if count == 0:
        return np.zeros(shape, dtype=dtype)
    with _reading(label):
        return np.memmap(path, dtype=dtype, mode="r", offset=start + begin, shape=tuple(shape))


def _read_text(path: Path, label: str) -> str:
    with _reading(label):
        if path.is_dir():
            raise InputError(label, "is a directory, not a file")
        size = path.stat().st_size
        if size > MAX_TEXT_BYTES:
            raise InputError(label, f"is {size} bytes of text; tensors this large belong in .npy")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError(label, "is not UTF-8 text") from None


def parse_text(path: Path, fmt: str, label: str) -> Any:
    """The data of a JSON or YAML file (YAML through the safe loader, no aliases)."""
    text = _read_text(path, label)
    if fmt == "json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(
                label, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
        except RecursionError:
            raise InputError(label, "is nested too deeply") from None
        except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits()
            raise InputError(label, f"invalid JSON: {_value_problem(exc)}") from None
    try:
        return yaml.load(text, Loader=_SafeNoAliasLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise InputError(label, f"invalid YAML{where}: {_one_line(exc.problem or exc)}") from None
    except yaml.reader.ReaderError as exc:  # its str() takes two lines
        char = exc.character
        what = f"byte #x{char[0]:02x}" if isinstance(char, bytes) else f"character #x{char:04x}"
        raise InputError(
            label, f"invalid YAML at character {exc.position + 1}: {what}: {exc.reason}"
        ) from None
    except yaml.YAMLError as exc:
        raise InputError(label, f"invalid YAML: {_one_line(exc)}") from None
    except RecursionError:
        raise InputError(label, "is nested too deeply") from None
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, OverflowError) as exc:
        # The safe loader's constructors, on a value they cannot build: a 5000-digit
        # integer, a date 2024-13-45, a tagged scalar such as !!bool x or !!timestamp 1.
        raise InputError(label, f"invalid YAML: {_value_problem(exc)}") from None


def _one_line(problem: object, limit: int = 200) -> str:
    """A parser's message on one short line (PyYAML's may take several; numpy's quote
    a header of up to 10,000 characters)."""
    text = " ".join(str(problem).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value_problem(exc: Exception) -> str:
    """What a value the parser could not construct is, in words."""
    text = str(exc)
    if "integer string conversion" in text:
        import sys

        return f"an integer has more than {sys.get_int_max_str_digits()} digits"
    return f"a value cannot be read as its type ({type(exc).__name__}: {_one_line(text)})"


class _SafeNoAliasLoader(yaml.SafeLoader):
    """The safe loader, refusing aliases: a few lines of them can expand to gigabytes."""

    def fetch_alias(self) -> None:
        raise yaml.constructor.ConstructorError(
            None, None, "YAML aliases (*name) are not accepted", self.get_mark()
        )


_FLOAT_LIMIT = 2**1024 - 2**970
"""Integers this large or larger round past float64's largest number: float() overflows."""


def nested_to_array(data: Any, label: str, name: str = "value") -> NDArray[Any]:
    """Nested lists of numbers (or booleans) → an array; names the first bad element.

    Raises:
        InputError: ``q[3][1]: expected a number, got 'x'``, ragged rows, too deep.
    """
    if isinstance(data, Mapping):
        raise InputError(
            label, f"{name} is a mapping; expected a number or nested lists of numbers"
        )
    shape: list[int] = []
    probe = data
    while isinstance(probe, list):
        if len(shape) >= MAX_DEPTH:
            raise InputError(label, f"{name} is nested more than {MAX_DEPTH} levels deep")
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    has_bool = False
    has_number = False

    def walk(node: Any, depth: int, path: str) -> None:
        nonlocal has_bool, has_number
        if depth == len(shape):
            if isinstance(node, bool):
                has_bool = True
            elif isinstance(node, float):
                has_number = True
            elif isinstance(node, int):
                if not -_FLOAT_LIMIT < node < _FLOAT_LIMIT:
                    raise InputError(
                        label,
                        f"{path}: {len(str(abs(node)))}-digit integer is too large for a float",
                    )
                has_number = True
            elif isinstance(node, list):
                raise InputError(label, f"{path}: rows are ragged: expected a number, got a list")
            else:
                raise InputError(
                    label, f"{path}: expected a number, got {type(node).__name__} {node!r:.40}"
                )
            return
        if not isinstance(node, list):
            raise InputError(
                label,
                f"{path}: rows are ragged: expected a list of {shape[depth]}, got {node!r:.40}",
            )
        if len(node) != shape[depth]:
            raise InputError(
                label, f"{path}: rows are ragged: expected {shape[depth]} entries, got {len(node)}"
            )
        for i, child in enumerate(node):
            walk(child, depth + 1, f"{path}[{i}]")

    walk(data, 0, name)
    if has_bool and has_number:
        raise InputError(label, f"{name} mixes booleans and numbers")
    if has_bool:
        return np.array(data, dtype=np.bool_)
    arr = np.array(data, dtype=np.float64) if shape and 0 in shape else np.array(data)
    if arr.dtype.kind not in "biuf":
        arr = arr.astype(np.float64)
    return arr


def load_array(source: str | Source, *, name: str = "value") -> NDArray[Any]:
    """Load one array from ``path``, ``path.npz:name`` or ``path.safetensors:name``.

    ``.npy`` and ``.safetensors`` files come back memory-mapped and uncast (bfloat16
    and float8 as ``ml_dtypes`` arrays); text files as int, float or bool
    arrays. Shapes and dtypes are judged later, by the spec.

    Raises:
        InputError: naming the file and the problem.
    """
    src = source if isinstance(source, Source) else Source.parse(source)
    fmt = _sniff(src.path, src.label)
    if fmt == "npy":
        return _load_npy(src.path, src.label)
    if fmt == "npz":
        return _load_npz(src.path, src.member, src.label)
    if fmt == "safetensors":
        return _load_safetensors(src.path, src.member, src.label)
    data = parse_text(src.path, fmt, src.label)
    return nested_to_array(data, src.label, name)


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
    import tempfile

    temps: list[tuple[str, Path]] = []
    try:
        for path, write in files:
            target, label = Path(path), os.fspath(path)
            if target.is_dir():
                raise InputError(label, "is a directory; expected a file name")
            try:
                fd, tmp = tempfile.mkstemp(
                    prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
                )
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
        for label, written in temps:
            try:
                os.replace(written, label)
            except OSError as exc:
                raise InputError(label, f"cannot be written: {exc.strerror or exc}") from None
    finally:
        for _, leftover in temps:
            leftover.unlink(missing_ok=True)


def _new_file_mode(target: Path) -> int:
    """The mode of the file ``target`` replaces, or ``0o666 & ~umask`` for a new file."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


TENSOR_KEYS = ("q", "k", "v", "bias", "mask")
TEXT_KEYS = ("description",)


@dataclass(frozen=True)
class Case:
    """A case file: tensors, options and a description, all keyed by name.

    Attributes:
        tensors: ``q``, ``k``, ``v`` and optionally ``bias``, ``mask``, as arrays.
        sources: tensor name → where it came from (``case.yaml: q`` or a path).
        options: option name (underscored) → the value as written.
        where: option name → ``case.yaml: name``, for messages.
    """

    path: Path
    tensors: dict[str, NDArray[Any]]
    sources: dict[str, str]
    options: dict[str, Any]
    where: dict[str, str]
    description: str | None


def is_case_file(text: str) -> bool:
    """Whether a single positional argument should be read as a case file."""
    return Path(text).suffix.lower() in TEXT_SUFFIXES


def load_case(path_text: str, option_names: tuple[str, ...]) -> Case:
    """Read a YAML or JSON case file holding ``q``, ``k``, ``v`` and options.

    Tensor entries are inline nested lists or paths relative to the case file.
    """
    src = Source.parse(path_text)
    fmt = _sniff(src.path, src.label)
    if fmt not in ("json", "yaml"):
        raise InputError(
            src.label,
            "a single input must be a case file (.yaml or .json); give Q K V as three files",
        )
    data = parse_text(src.path, fmt, src.label)
    if not isinstance(data, dict):
        raise InputError(
            src.label,
            "a case file must be a mapping with q, k and v (and options); give Q K V as three files otherwise",
        )
    known = set(TENSOR_KEYS) | set(TEXT_KEYS) | set(option_names)
    tensors: dict[str, NDArray[Any]] = {}
    sources: dict[str, str] = {}
    options: dict[str, Any] = {}
    where: dict[str, str] = {}
    description = None
    base = src.path.parent
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in known:
            raise InputError(
                src.label, f"unknown key {raw_key!r:.60} (known: {', '.join(sorted(known))})"
            )
        if key in TENSOR_KEYS:
            if isinstance(value, str):
                ref = Source.parse(value, base)
                tensors[key] = load_array(ref, name=key)
                sources[key] = ref.label
            else:
                tensors[key] = nested_to_array(value, src.label, key)
                sources[key] = f"{src.label}: {key}"
        elif key == "description":
            description = str(value)
        else:
            options[key] = value
            where[key] = f"{src.label}: {raw_key}"
    missing = [k for k in ("q", "k", "v") if k not in tensors]
    if missing:
        raise InputError(src.label, f"a case file needs q, k and v; missing {', '.join(missing)}")
    return Case(src.path, tensors, sources, options, where, description)
