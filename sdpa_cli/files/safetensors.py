"""``.safetensors`` files: the JSON header parsed with its limits, each tensor's entry
checked against the file, then read into memory (BF16, F8_E4M3 and F8_E5M2 as
``ml_dtypes`` arrays).

The file is ``N`` (8 bytes, little-endian), ``N`` bytes of JSON, then the data buffer;
the JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets into the buffer) and ``__metadata__`` to free text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from sdpa_cli.errors import InputError
from sdpa_cli.files.checks import check_shape, pick_member, reading
from sdpa_cli.files.opening import Input, opened
from sdpa_cli.text import printable, shown

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
CORRUPT = "has a corrupt .safetensors header"


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """A safetensors file has no magic bytes: a plausible header length, then ``{``."""
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= min(size - 8, MAX_SAFETENSORS_HEADER) and head[8:9] == b"{"


def read_safetensors_header(path: Path | Input, label: str) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and where its data buffer starts.

    The file is ``N`` (8 bytes, little-endian), ``N`` bytes of JSON, then the data.
    """
    with opened(path, label) as inp:
        raw = _header_bytes(inp, label)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_names(label))
    except UnicodeDecodeError:
        raise InputError(label, f"{CORRUPT}: it is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            label, f"{CORRUPT}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise InputError(label, f"{CORRUPT}: it is nested too deeply") from None
    if not isinstance(header, dict):
        raise InputError(label, f"{CORRUPT}: expected a JSON object, got {_json_type(header)}")
    return header, 8 + len(raw)


def _unique_names(label: str) -> Any:
    """A JSON object hook refusing a name given twice (json keeps the last)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        data = dict(pairs)
        if len(data) != len(pairs):
            names = [k for k, _ in pairs]
            twice = next(k for k in names if names.count(k) > 1)
            raise InputError(label, f"{CORRUPT}: it names {printable(twice)!r} twice")
        return data

    return unique


def _header_bytes(inp: Input, label: str) -> bytes:
    """The ``N`` bytes of JSON after the 8-byte length ``N``, once ``N`` is checked
    against the limit and the file's size."""
    with reading(label):
        size = inp.size
        fh = inp.fh
        fh.seek(0)
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
        if len(raw) < n:
            raise inp.changed(8 + n)
        return raw


def _tensor_names(header: dict[str, Any]) -> list[str]:
    """The tensors a header lists, in name order (``__metadata__`` is free text)."""
    return sorted(k for k in header if k != "__metadata__")


def safetensors_members(path: Path | Input, label: str) -> list[str]:
    """The names of a file's tensors, in name order, as :func:`load_safetensors` names
    them, once the header is checked.

    Raises:
        InputError: a corrupt header, or one listing no tensors.
    """
    with opened(path, label) as inp:
        header, start = read_safetensors_header(inp, label)
        _check_layout(header, inp.size - start, label)
    names = _tensor_names(header)
    if not names:
        raise InputError(label, "holds no tensors")
    return names


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
            label, f"has a corrupt .safetensors header: dtype must be a string, got {shown(code)}"
        )
    if code.startswith("C"):  # C64: numpy's complex64
        raise InputError(label, f"has complex dtype {printable(code)}; expected real numbers")
    if code not in SAFETENSORS_DTYPES:
        raise InputError(
            label,
            f"has unsupported dtype {shown(code)} (supported: {', '.join(SAFETENSORS_DTYPES)})",
        )
    name = SAFETENSORS_DTYPES[code]
    if name[0].isalpha():
        dt: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return dt
    return np.dtype(name)


def load_safetensors(path: Path | Input, member: str | None, label: str) -> NDArray[Any]:
    """One tensor of a safetensors file, read into memory after checking its header
    entry against the file's size (from ``fstat`` on the opened file) and the memory;
    ``label`` already ends in ``:member`` when one was given. bfloat16 and float8
    tensors come back as ``ml_dtypes`` arrays. Never memory-mapped: a file truncated
    under the run is an error naming it, not a SIGBUS.
    """
    file_label = label.removesuffix(f":{member}") if member is not None else label
    with opened(path, label) as inp:
        header, start = read_safetensors_header(inp, label)
        buffer = inp.size - start
        _check_layout(header, buffer, file_label)
        member, member_label = pick_member(label, _tensor_names(header), member, "tensor")
        entry = header[member]
        dtype, shape = _entry_dtype_and_shape(entry, member_label)
        count = math.prod(shape)  # Python ints: no overflow, whatever the header claims
        begin = _entry_begin(entry, buffer, count * dtype.itemsize, member_label)
        if count == 0:
            return np.zeros(shape, dtype=dtype)
        data = inp.read_exactly(start + begin, count * dtype.itemsize)
    return data.view(dtype).reshape(shape)


def _check_layout(header: dict[str, Any], buffer: int, label: str) -> None:
    """Every tensor's bytes checked against the others, as the format's own loader
    checks them: sorted by offset they tile the ``buffer``-byte data buffer from its
    first byte to its last, no two overlapping, no byte unclaimed. An entry that is
    wrong in itself (its dtype, shape or size) is left to reading it, which names it;
    then only overlaps are judged, its bytes being unknown.

    Raises:
        InputError: naming the file and the tensors that overlap, or the hole.
    """
    spans = []
    whole = True
    for name in _tensor_names(header):
        entry = header[name]
        try:
            dtype, shape = _entry_dtype_and_shape(entry, label)
            begin = _entry_begin(entry, buffer, math.prod(shape) * dtype.itemsize, label)
        except InputError:
            whole = False
            continue
        spans.append((begin, int(entry["data_offsets"][1]), name))
    spans.sort(key=lambda s: (s[0], s[1]))
    at, before = 0, None
    for begin, end, name in spans:
        if begin < at:
            raise InputError(
                label,
                f"{CORRUPT}: tensors {printable(str(before))!r} and {printable(name)!r} share bytes "
                f"(data_offsets reach {at} and start at {begin}); the format lets no two overlap",
            )
        if begin > at and whole:
            after = (
                f"after {printable(str(before))!r}"
                if before is not None
                else "before the first tensor"
            )
            raise InputError(
                label,
                f"{CORRUPT}: {begin - at} bytes of its data buffer {after} belong to no tensor; "
                "the format allows no hole",
            )
        at, before = max(at, end), name
    if at != buffer and whole:
        raise InputError(
            label,
            f"{CORRUPT}: its last {buffer - at} bytes belong to no tensor; the format allows no hole",
        )


def _entry_dtype_and_shape(entry: Any, label: str) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and shape a header entry declares, each checked."""
    if not isinstance(entry, dict):
        raise InputError(
            label,
            f"{CORRUPT}: expected an object with dtype, shape and data_offsets, got {_json_type(entry)}",
        )
    missing = [f for f in ("dtype", "shape", "data_offsets") if f not in entry]
    if missing:
        raise InputError(label, f"{CORRUPT}: the entry has no {', '.join(missing)}")
    dtype = _safetensors_dtype(entry["dtype"], label)
    shape = entry["shape"]
    if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise InputError(
            label,
            f"{CORRUPT}: shape {shown(shape)} is not a list of non-negative integers",
        )
    check_shape(tuple(shape), label)
    return dtype, tuple(shape)


def _entry_begin(entry: dict[str, Any], buffer: int, needed: int, label: str) -> int:
    """Where an entry's data starts in the ``buffer``-byte data buffer, once its
    ``data_offsets`` are checked against the buffer and the ``needed`` bytes of its
    shape and dtype."""
    offsets = entry["data_offsets"]
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(x) for x in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise InputError(
            label,
            f"{CORRUPT}: data_offsets {shown(offsets)} are not [begin, end] with 0 <= begin <= end",
        )
    begin, end = offsets
    if end > buffer:
        raise InputError(
            label,
            f"is truncated: its data_offsets [{begin}, {end}] run past the {buffer}-byte data buffer",
        )
    if end - begin != needed:
        raise InputError(
            label,
            f"{CORRUPT}: shape {list(entry['shape'])} of {entry['dtype']} is {needed} bytes but data_offsets [{begin}, {end}] hold {end - begin}",
        )
    return int(begin)
