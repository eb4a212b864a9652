"""The catalog of bad and edge inputs: every format, every command, the options.

Each bad input runs through the real command line (CliRunner; a few end to end in a
subprocess) and must give exit 2 and exactly one line on stderr,
``sdpa: error: <file or option>: <problem>``, naming the file or option and saying what
is wrong (the key words are asserted), with no traceback. Every failing run is given
output files that already exist (``--save``, ``--report``, ``--junit``,
``--export-svg``), and a failing run must leave them, and the directory, as they were.
Nothing is ever executed: hostile pickles and YAML tags would create a directory named
``PWNED``, which must never appear.

The edge inputs that are fine (big-endian, Fortran order, mismatched extensions,
zero-length axes) must give the right answer. Tests marked ``xfail(strict=True)`` pin
known bugs outside the loaders; their reason says where and what to fix.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
from click.testing import Result
from clirunner import CLEAN_ENV, assert_one_error_line, invoke, strict_json
from numpy.typing import NDArray

from sdpa_cli.errors import ExitCode

H, L, S, E, EV = 2, 3, 5, 4, 3
QKV = ("q.npy", "k.npy", "v.npy")
MARKER = "PWNED"
"""What a hostile pickle or YAML tag would create if it were ever executed."""

Maker = Callable[[Path], None]


# --- writing the bad files ---------------------------------------------------------------


def nothing(d: Path) -> None:
    """No file beyond q.npy, k.npy and v.npy."""


def both(*makers: Maker) -> Maker:
    def make(d: Path) -> None:
        for m in makers:
            m(d)

    return make


def raw(name: str, data: bytes | str) -> Maker:
    """A file holding exactly ``data``."""

    def make(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data.encode() if isinstance(data, str) else data)

    return make


def npy_bytes(a: NDArray[Any], *, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=allow_pickle)
    return buf.getvalue()


def npy(name: str, a: NDArray[Any], *, allow_pickle: bool = False) -> Maker:
    """``np.save`` to exactly ``name``, whatever its extension."""
    return raw(name, npy_bytes(a, allow_pickle=allow_pickle))


def random(shape: tuple[int, ...], dtype: Any = np.float64, seed: int = 1) -> NDArray[Any]:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def header(name: str, shape: Any, descr: str = "<f8", data: bytes = b"") -> Maker:
    """An .npy header declaring ``shape``, followed by ``data`` only."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": descr, "fortran_order": False, "shape": shape}
    )
    return raw(name, buf.getvalue() + data)


def npz(name: str, members: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> Maker:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        for member, data in members.items():
            zf.writestr(member, data)
    return raw(name, buf.getvalue())


def lying_zip(member: str, data: bytes, claimed_size: int) -> bytes:
    """A zip whose one deflated member claims (ZIP64) to expand to ``claimed_size``
    bytes: the shape of a zip bomb without the gigabytes."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    packed = comp.compress(data) + comp.flush()
    crc, name = zlib.crc32(data), member.encode()
    local = struct.pack(
        "<4sHHHHHIIIHH", b"PK\x03\x04", 45, 0, 8, 0, 0, crc, len(packed), len(data), len(name), 0
    )
    extra = struct.pack("<HHQ", 1, 8, claimed_size)  # ZIP64: the uncompressed size
    central = struct.pack(
        "<4sHHHHHHIIIHHHHHII",
        b"PK\x01\x02",
        45,
        45,
        0,
        8,
        0,
        0,
        crc,
        len(packed),
        0xFFFFFFFF,
        len(name),
        len(extra),
        0,
        0,
        0,
        0,
        0,
    )
    body = local + name + packed
    directory = central + name + extra
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(directory), len(body), 0)
    return body + directory + end


def zip_bomb(name: str) -> Maker:
    """An .npz whose member declares (10**6, 10**6) float64 and claims 8 TB uncompressed."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<f8", "fortran_order": False, "shape": (10**6, 10**6)}
    )
    return raw(name, lying_zip("q.npy", buf.getvalue(), 8 * 10**12 + 128))


def cut(make: Maker, whole: str, name: str, size: int) -> Maker:
    """The first ``size`` bytes of the file ``make`` writes as ``whole``."""

    def write(d: Path) -> None:
        make(d)
        (d / name).write_bytes((d / whole).read_bytes()[:size])

    return write


def encrypted(make: Maker, plain: str, name: str) -> Maker:
    """The zip ``make`` writes as ``plain``, its member flagged as encrypted (bit 0)."""

    def write(d: Path) -> None:
        make(d)
        data = bytearray((d / plain).read_bytes())
        data[6] |= 1
        data[data.find(b"PK\x01\x02") + 8] |= 1
        (d / name).write_bytes(bytes(data))

    return write


def damaged(make: Maker, whole: str, name: str) -> Maker:
    """The archive ``make`` writes as ``whole``, with bytes flipped mid-stream (its
    CRC is not reached: the decompressor fails first)."""

    def write(d: Path) -> None:
        make(d)
        data = bytearray((d / whole).read_bytes())
        middle = len(data) // 2
        data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
        (d / name).write_bytes(bytes(data))

    return write


def safetensors(name: str, header_: Any, data: bytes = b"", length: int | None = None) -> Maker:
    """A safetensors file: its header (JSON, or raw bytes) and data buffer."""
    text = header_ if isinstance(header_, bytes) else json.dumps(header_).encode()
    n = len(text) if length is None else length
    return raw(name, struct.pack("<Q", n) + text + data)


def tensor(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def sparse(name: str, size: int) -> Maker:
    """A file of ``size`` bytes that takes no disk space (its size is all that is read)."""

    def make(d: Path) -> None:
        with (d / name).open("wb") as fh:
            fh.write(b"[")
            fh.truncate(size)

    return make


def directory(name: str) -> Maker:
    def make(d: Path) -> None:
        (d / name).mkdir()

    return make


class Pwn:
    """Unpickling this makes a directory: proof that a pickle was executed."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (MARKER,))


def pickled(name: str) -> Maker:
    return npy(name, np.array([Pwn(), 1.0], dtype=object), allow_pickle=True)


CASE = "q: q.npy\nk: k.npy\nv: v.npy\n"
"""A valid case file's tensors, to which a case adds one bad line."""


# --- the catalog -------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    """One bad input: the command line, what the error line names first, the key words
    of its problem, and the files it needs."""

    id: str
    args: tuple[str, ...]
    where: str
    words: tuple[str, ...]
    make: Maker = nothing
    pattern: str | None = None


def bad(
    id: str,
    args: Sequence[str],
    where: str,
    *words: str,
    make: Maker = nothing,
    pattern: str | None = None,
) -> Bad:
    return Bad(id, tuple(args), where, words, make, pattern)


def compute(*args: str) -> tuple[str, ...]:
    return ("compute", *args)


def with_q(path: str, *rest: str) -> tuple[str, ...]:
    return ("compute", path, "k.npy", "v.npy", *rest)


BIG = (1, 1, 200_000, 1)
"""Q, K and V of 200,000 rows: 1.6 MB each, and 320 GB per score-shaped stage."""

CATALOG: list[Bad] = [
    # paths: missing, empty, directories
    bad("missing-file", with_q("nope.npy"), "nope.npy", "no such file"),
    bad(
        "missing-in-case-file",
        compute("case.yaml"),
        "data/missing.npy",
        "no such file",
        make=raw("case.yaml", "q: data/missing.npy\nk: k.npy\nv: v.npy\n"),
    ),
    bad("empty-npy", with_q("empty.npy"), "empty.npy", "is empty", make=raw("empty.npy", b"")),
    bad(
        "empty-case-file",
        compute("empty.yaml"),
        "empty.yaml",
        "is empty",
        make=raw("empty.yaml", b""),
    ),
    bad("directory-as-q", with_q("adir"), "adir", "is a directory", make=directory("adir")),
    bad(
        "directory-as-case-file",
        compute("dir.json"),
        "dir.json",
        "is a directory",
        make=directory("dir.json"),
    ),
    # content that does not match the extension (sniffed)
    bad(
        "npy-holding-json",
        with_q("text.npy"),
        "text.npy",
        "not a .npy file",
        "NUMPY magic",
        make=raw("text.npy", "[[1, 2, 3, 4]]"),
    ),
    bad(
        "npz-holding-text",
        with_q("text.npz"),
        "text.npz",
        "not a .npz file",
        "not a zip archive",
        make=raw("text.npz", "hello"),
    ),
    bad(
        "unknown-extension",
        with_q("q.txt"),
        "q.txt",
        "unknown format '.txt'",
        make=raw("q.txt", "[[1]]"),
    ),
    bad(
        "safetensors-too-short",
        with_q("short.safetensors"),
        "short.safetensors",
        "too short",
        "3 bytes",
        make=raw("short.safetensors", b"abc"),
    ),
    # pickles and object arrays: refused, never unpickled
    bad(
        "pickled-npy",
        with_q("evil.npy"),
        "evil.npy",
        "pickle",
        "never unpickles",
        make=pickled("evil.npy"),
    ),
    bad(
        "pickled-npz-member",
        with_q("evil.npz"),
        "evil.npz:q",
        "pickle",
        "never unpickles",
        make=npz(
            "evil.npz", {"q.npy": npy_bytes(np.array([Pwn()], dtype=object), allow_pickle=True)}
        ),
    ),
    bad(
        "pickled-expected-output",
        ("check", *QKV, "--expect-output", "evil.npy"),
        "evil.npy",
        "pickle",
        make=pickled("evil.npy"),
    ),
    # truncated files and headers that lie about the size (checked before allocating)
    bad(
        "truncated-npy",
        with_q("cut.npy"),
        "cut.npy",
        "truncated",
        "(2, 3, 4)",
        "192 bytes",
        "185 bytes follow",
        make=raw("cut.npy", npy_bytes(random((H, L, E)))[:-7]),
    ),
    bad(
        "header-declares-8-terabytes",
        with_q("lie.npy"),
        "lie.npy",
        "truncated",
        "(1000000, 1000000)",
        "8000000000000 bytes",
        "32 bytes follow",
        make=header("lie.npy", (10**6, 10**6), data=b"\0" * 32),
    ),
    bad(
        "header-cut-short",
        with_q("head.npy"),
        "head.npy",
        "corrupt .npy header",
        make=raw("head.npy", npy_bytes(random((H, L, E)))[:20]),
    ),
    bad(
        "negative-axis",
        with_q("neg.npy"),
        "neg.npy",
        "corrupt header",
        "axis of -1",
        make=header("neg.npy", (-1, 4), data=b"\0" * 64),
    ),
    bad(
        "axis-beyond-intp",
        with_q("wide.npy"),
        "wide.npy",
        "axis of 18446744073709551616",
        make=header("wide.npy", (2**64, 0)),
    ),
    bad(
        "forty-axes",
        with_q("axes.npy"),
        "axes.npy",
        "40 axes",
        "up to 32",
        make=header("axes.npy", (1,) * 40, data=b"\0" * 8),
    ),
    # dtypes that are not real numbers
    bad(
        "complex-dtype",
        with_q("c.npy"),
        "c.npy",
        "complex dtype complex128",
        make=npy("c.npy", np.zeros((H, L, E), complex)),
    ),
    bad(
        "string-dtype",
        with_q("u.npy"),
        "u.npy",
        "string dtype <U3",
        make=npy("u.npy", np.full((H, L, E), "abc")),
    ),
    bad(
        "structured-dtype",
        with_q("rec.npy"),
        "rec.npy",
        "structured dtype",
        make=npy("rec.npy", np.zeros((H, L), [("a", "<f8"), ("b", "<f8")])),
    ),
    bad(
        "datetime-dtype",
        with_q("dt.npy"),
        "dt.npy",
        "datetime dtype datetime64[s]",
        make=npy("dt.npy", np.zeros((H, L, E), "M8[s]")),
    ),
    bad(
        "timedelta-mask",
        (*compute(*QKV), "--mask", "td.npy"),
        "td.npy",
        "timedelta dtype",
        make=npy("td.npy", np.zeros((L, S), "m8[s]")),
    ),
    # .npz: zip bombs, corrupt archives, missing keys
    bad(
        "npz-member-expands-to-terabytes",
        with_q("bomb.npz"),
        "bomb.npz:q",
        "expands to 7450.6 GiB",
        "(1000000, 1000000) float64",
        "bytes stored",
        "memory is available",
        make=zip_bomb("bomb.npz"),
    ),
    bad(
        "npz-corrupt-archive",
        with_q("corrupt.npz"),
        "corrupt.npz",
        "not a valid .npz archive",
        make=raw("corrupt.npz", b"PK\x03\x04" + b"\xde\xad\xbe\xef" * 20),
    ),
    bad(
        "npz-truncated-archive",
        with_q("half.npz:q"),
        "half.npz:q",
        "not a valid .npz archive",
        make=cut(
            npz("whole.npz", {"q.npy": npy_bytes(random((H, L, E)))}), "whole.npz", "half.npz", 150
        ),
    ),
    bad(
        "npz-missing-key-lists-the-keys",
        with_q("two.npz:c"),
        "two.npz:c",
        "has no array 'c'",
        "names: a, b",
        make=npz(
            "two.npz",
            {"a.npy": npy_bytes(random((H, L, E))), "b.npy": npy_bytes(random((H, L, E)))},
        ),
    ),
    bad(
        "npz-no-key-for-two-arrays",
        with_q("two.npz"),
        "two.npz",
        "holds 2 arrays",
        "two.npz:NAME",
        "names: a, b",
        make=npz(
            "two.npz",
            {"a.npy": npy_bytes(random((H, L, E))), "b.npy": npy_bytes(random((H, L, E)))},
        ),
    ),
    bad(
        "npz-encrypted-member",
        with_q("locked.npz"),
        "locked.npz:q",
        "is encrypted",
        make=encrypted(
            npz("plain.npz", {"q.npy": npy_bytes(random((H, L, E)))}, zipfile.ZIP_STORED),
            "plain.npz",
            "locked.npz",
        ),
    ),
    bad(
        "npz-damaged-lzma-stream",
        with_q("lz.npz"),
        "lz.npz:q",
        "is corrupt: it does not decompress",
        make=damaged(
            npz("ok.npz", {"q.npy": npy_bytes(random((H, 300, E)))}, zipfile.ZIP_LZMA),
            "ok.npz",
            "lz.npz",
        ),
    ),
    # .safetensors: headers checked against the file before anything is mapped
    bad(
        "safetensors-offsets-past-the-end",
        with_q("st.safetensors"),
        "st.safetensors:q",
        "truncated",
        "data_offsets [0, 192000000]",
        "192-byte data buffer",
        make=safetensors(
            "st.safetensors", {"q": tensor("F64", [2_000_000, 3, 4], 0, 192_000_000)}, b"\0" * 192
        ),
    ),
    bad(
        "safetensors-header-length-absurd",
        with_q("st.safetensors"),
        "st.safetensors",
        "18446744073709551615-byte",
        "limit is 100 MiB",
        make=safetensors("st.safetensors", b"{}", length=2**64 - 1),
    ),
    bad(
        "safetensors-complex",
        with_q("st.safetensors"),
        "st.safetensors:q",
        "complex dtype C64",
        make=safetensors("st.safetensors", {"q": tensor("C64", [2, 3, 4], 0, 192)}, b"\0" * 192),
    ),
    bad(
        "safetensors-missing-tensor-lists-the-names",
        with_q("st.safetensors:z"),
        "st.safetensors:z",
        "has no tensor 'z'",
        "names: k, q",
        make=safetensors(
            "st.safetensors",
            {"q": tensor("F64", [2, 3, 4], 0, 192), "k": tensor("F64", [2, 3, 4], 192, 384)},
            b"\0" * 384,
        ),
    ),
    bad(
        "safetensors-header-not-json",
        with_q("st.safetensors"),
        "st.safetensors",
        "corrupt .safetensors header",
        "invalid JSON at line 1 column",
        make=safetensors("st.safetensors", b'{"q": {"dtype": "F64",, }', b"\0" * 8),
    ),
    bad(
        "safetensors-size-disagrees-with-shape",
        with_q("st.safetensors"),
        "st.safetensors:q",
        "shape [2, 3, 4] of F64 is 192 bytes",
        "data_offsets [0, 100] hold 100",
        make=safetensors("st.safetensors", {"q": tensor("F64", [2, 3, 4], 0, 100)}, b"\0" * 192),
    ),
    # JSON
    bad(
        "json-syntax-error-has-line-and-column",
        with_q("bad.json"),
        "bad.json",
        "invalid JSON",
        "Expecting value",
        make=raw("bad.json", "[[1, 2, 3, 4],\n [5, 6, , 8]]"),
        pattern=r"at line 2 column 9\b",
    ),
    bad(
        "json-ragged-names-the-path",
        with_q("ragged.json"),
        "ragged.json",
        "q[3][1]: rows are ragged",
        "expected 4 entries, got 3",
        make=raw("ragged.json", json.dumps([[[1, 2, 3, 4]] * 2] * 3 + [[[1, 2, 3, 4], [1, 2, 3]]])),
    ),
    bad(
        "json-non-numeric-names-the-path",
        with_q("words.json"),
        "words.json",
        "q[1][2]: expected a number, got str 'x'",
        make=raw("words.json", json.dumps([[1, 2, 3, 4], [1, 2, "x", 4]])),
    ),
    bad(
        "json-null-in-mask",
        (*compute(*QKV), "--mask", "m.json"),
        "m.json",
        "mask[0][1]: expected a number, got NoneType None",
        make=raw("m.json", json.dumps([[True, None, True, True, True]] * L)),
    ),
    bad(
        "json-booleans-mixed-with-numbers",
        with_q("mixed.json"),
        "mixed.json",
        "q mixes booleans and numbers",
        make=raw("mixed.json", "[[true, 1, 2, 3]]"),
    ),
    bad(
        "json-nested-100000-deep",
        with_q("deep.json"),
        "deep.json",
        "nested too deeply",
        make=raw("deep.json", "[" * 100_000 + "]" * 100_000),
    ),
    bad(
        "json-nested-40-deep",
        with_q("deep40.json"),
        "deep40.json",
        "nested more than 32 levels deep",
        make=raw("deep40.json", "[" * 40 + "1" + "]" * 40),
    ),
    bad(
        "json-huge-text",
        with_q("huge.json"),
        "huge.json",
        "bytes of text",
        "belong in .npy",
        make=sparse("huge.json", (256 << 20) + 1),
    ),
    bad(
        "json-5000-digit-integer",
        with_q("digits.json"),
        "digits.json",
        "invalid JSON",
        "more than 4300 digits",
        make=raw("digits.json", "[[1" + "0" * 5000 + "]]"),
    ),
    bad(
        "json-integer-beyond-float64",
        with_q("big.json"),
        "big.json",
        "q[0][1]: 401-digit integer is too large for a float",
        make=raw("big.json", "[[1, 1" + "0" * 400 + ", 2, 3]]"),
    ),
    bad(
        "json-not-utf8",
        with_q("latin.json"),
        "latin.json",
        "not UTF-8",
        make=raw("latin.json", b"[[1, 2]] \xe9"),
    ),
    # YAML: the safe loader, no aliases
    bad(
        "yaml-python-tag-is-not-run",
        compute("tag.yaml"),
        "tag.yaml",
        "invalid YAML at line 1 column 4",
        "could not determine a constructor",
        "python/object/apply:os.mkdir",
        make=raw(
            "tag.yaml", f"q: !!python/object/apply:os.mkdir ['{MARKER}']\nk: k.npy\nv: v.npy\n"
        ),
    ),
    bad(
        "yaml-alias-bomb",
        compute("bomb.yaml"),
        "bomb.yaml",
        "aliases (*name) are not accepted",
        make=raw(
            "bomb.yaml",
            "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
            + "".join(
                f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
                for p, c in zip("abcdefgh", "bcdefghi", strict=True)
            )
            + CASE,
        ),
    ),
    bad(
        "yaml-merge-key-alias",
        compute("merge.yaml"),
        "merge.yaml",
        "aliases",
        make=raw("merge.yaml", "base: &b {causal: true}\n<<: *b\n" + CASE),
    ),
    bad(
        "yaml-impossible-date",
        compute("date.yaml"),
        "date.yaml",
        "invalid YAML",
        "month must be in 1..12",
        make=raw("date.yaml", CASE + "description: 2024-13-45\n"),
    ),
    bad(
        "yaml-bad-tagged-scalar",
        compute("tagged.yaml"),
        "tagged.yaml",
        "invalid YAML",
        "cannot be read as its type",
        make=raw("tagged.yaml", CASE + "causal: !!bool maybe\n"),
    ),
    bad(
        "yaml-nul-character",
        with_q("nul.yaml"),
        "nul.yaml",
        "invalid YAML at character 1",
        "#x0000",
        make=raw("nul.yaml", "\0- [1, 2, 3, 4]\n"),
    ),
    bad(
        "yaml-two-documents",
        compute("two.yaml"),
        "two.yaml",
        "invalid YAML at line 4 column 1",
        "another document",
        make=raw("two.yaml", CASE + "---\nq: 1\n"),
    ),
    # case files: scalars, wrong types, missing and unknown keys
    bad(
        "file-name-with-a-newline-stays-one-line",
        compute("newline.yaml"),
        "a\\nb.npy",
        "no such file",
        make=raw("newline.yaml", 'q: "a\\nb.npy"\nk: k.npy\nv: v.npy\n'),
    ),
    bad(
        "file-name-with-a-nul",
        compute("nul.json"),
        "\\x00",
        "not a usable file name",
        "NUL character",
        make=raw("nul.json", '{"q": "\\u0000", "k": "k.npy", "v": "v.npy"}'),
    ),
    bad(
        "config-key-with-a-newline-stays-one-line",
        compute(*QKV),
        "sdpa.yaml: bad\\nkey",
        "unknown setting",
        make=raw("sdpa.yaml", '"bad\\nkey": 1\n'),
    ),
    bad(
        "scalar-where-a-matrix-is-expected",
        compute("scalar.yaml"),
        "scalar.yaml: q",
        "Q is a scalar",
        "expected a matrix",
        make=raw("scalar.yaml", "q: 3\nk: k.npy\nv: v.npy\n"),
    ),
    bad(
        "case-file-is-a-list",
        compute("list.yaml"),
        "list.yaml",
        "must be a mapping with q, k and v",
        make=raw("list.yaml", "- 1\n- 2\n"),
    ),
    bad(
        "case-file-missing-v",
        compute("nov.yaml"),
        "nov.yaml",
        "needs q, k and v; missing v",
        make=raw("nov.yaml", "q: q.npy\nk: k.npy\n"),
    ),
    bad(
        "case-file-unknown-key",
        compute("unknown.json"),
        "unknown.json",
        "unknown key 'casual'",
        "known: ",
        make=raw("unknown.json", '{"q": "q.npy", "k": "k.npy", "v": "v.npy", "casual": true}'),
    ),
    bad(
        "case-file-option-of-the-wrong-type",
        compute("window.yaml"),
        "window.yaml: window",
        "expected an integer, got {'left': 1}",
        make=raw("window.yaml", CASE + "window: {left: 1}\n"),
    ),
    bad(
        "case-file-nan-temperature",
        compute("nan.yaml"),
        "nan.yaml: temperature",
        "expected a number, got NaN",
        make=raw("nan.yaml", CASE + "temperature: .nan\n"),
    ),
    bad(
        "case-file-seed-beyond-128-bits",
        compute("seed.yaml"),
        "seed.yaml: seed",
        f"must be ≤ {2**128 - 1}",
        make=raw("seed.yaml", CASE + f"dropout: 0.5\nseed: {2**130}\n"),
    ),
    bad(
        "case-file-400-digit-temperature",
        compute("temp.json"),
        "temp.json: temperature",
        "must be a positive finite number",
        "...",
        make=raw(
            "temp.json",
            '{"q": "q.npy", "k": "k.npy", "v": "v.npy", "temperature": 1' + "0" * 400 + "}",
        ),
    ),
    # shapes: every mismatch says what was expected and what came
    bad(
        "shape-key-dim",
        compute("q.npy", "k5.npy", "v.npy"),
        "k5.npy",
        "should equal Q's key dim E = 4",
        "(Q (2, 3, 4))",
        "but got K (2, 5, 5)",
        make=npy("k5.npy", random((H, S, 5))),
    ),
    bad(
        "shape-value-rows",
        compute("q.npy", "k.npy", "v6.npy"),
        "v6.npy",
        "as many rows as K has keys, S = 5",
        "but got V (2, 6, 3)",
        make=npy("v6.npy", random((H, 6, EV))),
    ),
    bad(
        "shape-kv-heads-differ",
        compute("q.npy", "k.npy", "v3h.npy"),
        "v3h.npy",
        "K has 2 heads but V has 3",
        make=npy("v3h.npy", random((3, S, EV))),
    ),
    bad(
        "gqa-heads-do-not-divide",
        compute("q4.npy", "k3.npy", "v3.npy"),
        "k3.npy",
        "grouped-query attention",
        "Q has 4 heads",
        "K/V have 3",
        make=both(
            npy("q4.npy", random((1, 4, L, E))),
            npy("k3.npy", random((1, 3, S, E))),
            npy("v3.npy", random((1, 3, S, EV))),
        ),
    ),
    bad(
        "batch-axes-do-not-broadcast",
        compute("qb.npy", "kb.npy", "vb.npy"),
        "kb.npy",
        "leading axes",
        "(2, 2, 3, 4)",
        "(3, 2, 5, 4)",
        "do not broadcast",
        make=both(
            npy("qb.npy", random((2, H, L, E))),
            npy("kb.npy", random((3, H, S, E))),
            npy("vb.npy", random((3, H, S, EV))),
        ),
    ),
    bad(
        "bias-does-not-broadcast",
        (*compute(*QKV), "--bias", "bias.npy"),
        "bias.npy",
        "bias of shape (3, 4)",
        "scores' shape (2, 3, 5)",
        make=npy("bias.npy", random((L, 4))),
    ),
    bad(
        "mask-does-not-broadcast",
        (*compute(*QKV), "--mask", "mask.json"),
        "mask.json",
        "mask of shape (4, 5)",
        "scores' shape (2, 3, 5)",
        make=raw("mask.json", json.dumps([[True] * S] * 4)),
    ),
    bad(
        "heads-do-not-divide",
        (*compute(*QKV), "--heads", "3"),
        "--heads",
        "Q's last axis (4",
        "not divisible by 3",
    ),
    # option values: NaN, inf, negative, out of range
    bad("temperature-nan", (*compute(*QKV), "--temperature", "nan"), "--temperature", "NaN"),
    bad(
        "softcap-inf", (*compute(*QKV), "--softcap", "inf"), "--softcap", "positive finite", "'inf'"
    ),
    bad(
        "scale-negative",
        (*compute(*QKV), "--scale", "-2"),
        "--scale",
        "sqrt-dk, dk, none or a positive number",
        "'-2'",
    ),
    bad("dropout-negative", (*compute(*QKV), "--dropout", "-0.1"), "--dropout", "[0, 1)", "'-0.1'"),
    bad(
        "seed-beyond-128-bits",
        (*compute(*QKV), "--dropout", "0.1", "--seed", str(2**128)),
        "--seed",
        "must be ≤",
    ),
    bad(
        "key-lengths-beyond-S",
        (*compute(*QKV), "--key-lengths", "6"),
        "--key-lengths",
        "6 exceeds the number of keys, S = 5",
    ),
    bad("window-negative", (*compute(*QKV), "--window", "-1"), "--window", "must be ≥ 0, got -1"),
    bad(
        "mask-value-positive",
        (*compute(*QKV), "--mask-value", "1e9"),
        "--mask-value",
        "must be negative",
    ),
    bad("mask-value-nan", (*compute(*QKV), "--mask-value", "nan"), "--mask-value", "NaN"),
    bad(
        "rows-out-of-range",
        (*compute(*QKV), "--rows", "7"),
        "--rows",
        "'7' is outside the 3 query rows",
    ),
    bad("check-rtol-nan", ("check", *QKV, "--rtol", "nan"), "--rtol", "NaN"),
    bad(
        "check-atol-negative",
        ("check", *QKV, "--atol", "-1e-5"),
        "--atol",
        "finite number ≥ 0",
        "-1e-5",
    ),
    bad(
        "check-expected-output-of-the-wrong-shape",
        ("check", *QKV, "--expect-output", "out.npy"),
        "out.npy",
        "has shape (2, 3, 7)",
        "the computation's output is (2, 3, 3)",
        make=npy("out.npy", random((H, L, 7))),
    ),
    bad(
        "check-fail-on-unknown-kind",
        ("check", *QKV, "--fail-on", "bogus"),
        "--fail-on",
        "unknown finding kind 'bogus'",
        "choose from",
    ),
    bad(
        "check-manifest-without-cases",
        ("check", "--manifest", "m.yaml"),
        "m.yaml",
        "list of cases under 'cases'",
        make=raw("m.yaml", "cases: 3\n"),
    ),
    bad(
        "explain-query-out-of-range",
        ("explain", *QKV, "--query", "9"),
        "--query",
        "9 is outside the 3 query rows",
    ),
    bad(
        "explain-head-out-of-range",
        ("explain", *QKV, "--head", "5"),
        "--head",
        "5 is out of range",
        "2 heads",
    ),
    bad(
        "check-truncated-npy",
        ("check", "cut.npy", "k.npy", "v.npy"),
        "cut.npy",
        "truncated",
        "185 bytes follow",
        make=raw("cut.npy", npy_bytes(random((H, L, E)))[:-7]),
    ),
    bad(
        "check-npz-bomb",
        ("check", "bomb.npz", "k.npy", "v.npy"),
        "bomb.npz:q",
        "expands to 7450.6 GiB",
        make=zip_bomb("bomb.npz"),
    ),
    bad(
        "check-case-file-alias",
        ("check", "alias.yaml"),
        "alias.yaml",
        "aliases (*name) are not accepted",
        make=raw("alias.yaml", "x: &x q.npy\nq: *x\nk: k.npy\nv: v.npy\n"),
    ),
    bad(
        "check-mask-does-not-broadcast",
        ("check", *QKV, "--mask", "mask.npy"),
        "mask.npy",
        "mask of shape (4, 5)",
        "scores' shape (2, 3, 5)",
        make=npy("mask.npy", np.ones((4, S), bool)),
    ),
    bad(
        "check-expected-weights-ragged",
        ("check", *QKV, "--expect-weights", "w.json"),
        "w.json",
        "weights[0][1]: rows are ragged",
        "expected 5 entries, got 4",
        make=raw("w.json", json.dumps([[[0.2] * 5, [0.25] * 4, [0.2] * 5]] * H)),
    ),
    bad(
        "check-expected-lse-missing-tensor",
        ("check", *QKV, "--expect-lse", "lse.safetensors:lse"),
        "lse.safetensors:lse",
        "has no tensor 'lse'",
        "names: out",
        make=safetensors("lse.safetensors", {"out": tensor("F64", [H, L], 0, 48)}, b"\0" * 48),
    ),
    bad(
        "check-manifest-python-tag",
        ("check", "--manifest", "m.yaml"),
        "m.yaml",
        "could not determine a constructor",
        make=raw("m.yaml", f"cases:\n  - q: !!python/object/apply:os.mkdir ['{MARKER}']\n"),
    ),
    bad(
        "check-manifest-unknown-key",
        ("check", "--manifest", "m.json"),
        "m.json: defaults: rtoll",
        "unknown key",
        make=raw(
            "m.json",
            '{"defaults": {"rtoll": 1}, "cases": [{"q": "q.npy", "k": "k.npy", "v": "v.npy"}]}',
        ),
    ),
    bad(
        "explain-json-syntax-error",
        ("explain", "case.json"),
        "case.json",
        "invalid JSON at line 1 column 16",
        make=raw("case.json", '{"q": "q.npy", ]'),
    ),
    bad(
        "explain-gqa-heads-do-not-divide",
        ("explain", "q4.npy", "k3.npy", "v3.npy"),
        "k3.npy",
        "Q has 4 heads",
        "K/V have 3",
        make=both(
            npy("q4.npy", random((1, 4, L, E))),
            npy("k3.npy", random((1, 3, S, E))),
            npy("v3.npy", random((1, 3, S, EV))),
        ),
    ),
    bad(
        "explain-npz-missing-key",
        ("explain", "two.npz:c", "k.npy", "v.npy"),
        "two.npz:c",
        "names: a, b",
        make=npz(
            "two.npz",
            {"a.npy": npy_bytes(random((H, L, E))), "b.npy": npy_bytes(random((H, L, E)))},
        ),
    ),
    bad(
        "explain-keys-out-of-range",
        ("explain", *QKV, "--keys", "9"),
        "--keys",
        "'9' is outside the 5 keys",
    ),
    bad(
        "explain-export-into-a-missing-directory",
        ("explain", *QKV, "--export-svg", "nodir/x.svg"),
        "nodir/x.svg",
        "directory 'nodir' does not exist",
    ),
    bad(
        "explain-of-a-pickle",
        ("explain", "evil.npy", "k.npy", "v.npy"),
        "evil.npy",
        "pickle",
        make=pickled("evil.npy"),
    ),
    bad(
        "save-into-a-missing-directory",
        (*compute(*QKV), "--save", "nodir/out.npz"),
        "nodir/out.npz",
        "cannot be written",
        "directory 'nodir' does not exist",
    ),
    # sizes that would not fit on the disk: refused before anything is computed, saying
    # how much they need (a document streams, so memory no longer refuses it)
    bad(
        "save-beyond-the-disk",
        ("compute", "bq.npy", "bk.npy", "bv.npy", "--format", "json", "--save", "out.npz"),
        "out.npz",
        "of disk while it is written",
        "4 stages of (1, 1, 200000, 200000) in float64",
        "is free on its disk",
        "slice the inputs",
        make=both(
            npy("bq.npy", np.zeros(BIG)), npy("bk.npy", np.zeros(BIG)), npy("bv.npy", np.zeros(BIG))
        ),
        pattern=r"needs [\d.]+ GiB of disk while it is written \(.*\), but [\d.]+ GiB is free",
    ),
]


OUTPUTS: dict[str, dict[str, tuple[str]]] = {
    "compute": {"keep.npz": ("--save",)},
    "explain": {"keep.svg": ("--export-svg",)},
    "check": {"keep.json": ("--report",), "keep.xml": ("--junit",)},
}
"""Output files a failing run must neither create nor clobber, per command."""


@pytest.fixture
def base(workdir: Path) -> Path:
    """q.npy (H, L, E), k.npy (H, S, E), v.npy (H, S, Ev) in the working directory."""
    for name, shape in (("q", (H, L, E)), ("k", (H, S, E)), ("v", (H, S, EV))):
        np.save(workdir / f"{name}.npy", random(shape, seed=ord(name)))
    return workdir


def run_guarded(d: Path, args: Sequence[str], code: int = ExitCode.BAD_INPUT) -> tuple[Result, str]:
    """Run ``sdpa ARGS`` with output files that already exist: the run fails with one
    error line, and every file in ``d`` is as it was (nothing created or clobbered)."""
    command, *rest = args
    guards: list[str] = []
    for name, (flag,) in OUTPUTS[command].items():
        (d / name).write_bytes(f"KEEP {name}".encode())
        guards += [flag, name]
    before = {p.name: p.read_bytes() if p.is_file() else None for p in d.iterdir()}
    result = invoke(command, *guards, *rest)  # a --save in the case comes last and wins
    line = assert_one_error_line(result, code)
    after = {p.name: p.read_bytes() if p.is_file() else None for p in d.iterdir()}
    assert after == before, sorted(set(after) ^ set(before))
    assert not (d / MARKER).exists(), "a pickle or a YAML tag was executed"
    return result, line


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CATALOG])
def test_catalog(base: Path, case: Bad) -> None:
    case.make(base)
    _, line = run_guarded(base, case.args)
    head = f"sdpa: error: {case.where}: "
    assert line.startswith(head), line
    problem = line[len(head) :]
    for word in case.words:
        assert word in problem, (word, line)
    if case.pattern is not None:
        assert re.search(case.pattern, problem), (case.pattern, line)


def test_catalog_is_large_and_distinct() -> None:
    assert len(CATALOG) >= 45
    assert len({c.id for c in CATALOG}) == len(CATALOG)
    commands = {c.args[0] for c in CATALOG}
    assert commands == {"compute", "explain", "check"}
    for suffix in (".npy", ".npz", ".safetensors", ".json", ".yaml"):
        assert any(suffix in " ".join(c.args) for c in CATALOG), suffix


def test_a_failed_run_creates_no_output_file(base: Path) -> None:
    """The outputs are new files this time: none of them appears."""
    for args in (
        ("compute", *QKV, "--dropout", "2", "--save", "new.npz"),
        ("explain", *QKV, "--dropout", "2", "--export-svg", "new.svg", "--export-html", "new.html"),
        ("check", *QKV, "--dropout", "2", "--report", "new.json", "--junit", "new.xml"),
    ):
        assert_one_error_line(invoke(*args))
        assert sorted(p.name for p in base.iterdir()) == sorted(QKV), args


def test_npz_bomb_of_honest_size_is_refused_before_reading(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 MiB of zeros stored in 64 KiB, on a machine with 16 MiB free: refused from the
    sizes in the archive, before a byte is decompressed."""
    import sdpa_cli.files.limits

    monkeypatch.setattr(sdpa_cli.files.limits, "available_memory", lambda: 16 << 20)
    buf = io.BytesIO()
    np.save(buf, np.zeros((2, 4096, 1024)))
    npz("bomb.npz", {"q.npy": buf.getvalue()})(base)
    assert (base / "bomb.npz").stat().st_size < 1 << 20
    _, line = run_guarded(base, with_q("bomb.npz"))
    assert line.startswith("sdpa: error: bomb.npz:q: expands to 0.1 GiB ((2, 4096, 1024) float64)")
    assert "but 0.0 GiB of memory is available" in line


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_a_document_streams_where_its_stages_fit_only_as_arrays(
    base: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """(1, 1, 512, 512) scores, four score-shaped stages: 8 MiB as float64 arrays, about
    90 bytes a number as a JSON document built whole (350 as YAML), far over 16 MiB. The
    document is written block by block, so with 16 MiB free it is written, not refused,
    and it is the document the whole trace gives."""
    import sdpa_cli.files.limits

    x = np.random.default_rng(0).normal(size=(512, 8))
    for name in ("mq", "mk", "mv"):
        np.save(base / f"{name}.npy", x)
    files = ("mq.npy", "mk.npy", "mv.npy")
    whole = invoke("compute", *files, "--format", fmt)
    assert whole.exit_code == 0, whole.stderr
    monkeypatch.setattr(sdpa_cli.files.limits, "available_memory", lambda: 16 << 20)
    streamed = invoke("compute", *files, "--format", fmt)
    assert streamed.exit_code == 0, streamed.stderr
    assert streamed.stdout == whole.stdout
    assert len(streamed.stdout) > 4 * 512 * 512 * 10


# --- edge inputs that are fine: converted, and the same answer -----------------------------


def answer(*args: str) -> dict[str, Any]:
    """``sdpa compute ARGS --format json``: exit 0, nothing on stderr, the payload."""
    result = invoke("compute", *args, "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    data = strict_json(result.stdout)
    assert isinstance(data, dict)
    return data


def _big_endian_fortran(d: Path) -> tuple[str, ...]:
    for name in ("q", "k", "v"):
        a = np.load(d / f"{name}.npy")
        np.save(d / f"{name}_bf.npy", np.asfortranarray(a.astype(">f8")))
    assert not np.load(d / "q_bf.npy").flags.c_contiguous
    return ("q_bf.npy", "k_bf.npy", "v_bf.npy")


def _npy_named_json(d: Path) -> tuple[str, ...]:
    (d / "q_npy.json").write_bytes((d / "q.npy").read_bytes())
    return ("q_npy.json", "k.npy", "v.npy")


def _as_text(d: Path) -> tuple[str, ...]:
    (d / "q.json").write_text(json.dumps(np.load(d / "q.npy").tolist()))
    (d / "k.yaml").write_text(json.dumps(np.load(d / "k.npy").tolist()))  # JSON is YAML
    return ("q.json", "k.yaml", "v.npy")


def _archives(d: Path) -> tuple[str, ...]:
    q, k = np.load(d / "q.npy"), np.load(d / "k.npy")
    npz("qk.npz", {"q.npy": npy_bytes(q), "k.npy": npy_bytes(k)}, zipfile.ZIP_LZMA)(d)
    v = np.load(d / "v.npy")
    safetensors("v.safetensors", {"v": tensor("F64", list(v.shape), 0, v.nbytes)}, v.tobytes())(d)
    return ("qk.npz:q", "qk.npz:k", "v.safetensors")


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(_big_endian_fortran, id="big-endian-fortran-order"),
        pytest.param(_npy_named_json, id="npy-content-named-json"),
        pytest.param(_as_text, id="json-and-yaml-text"),
        pytest.param(_archives, id="lzma-npz-and-safetensors"),
    ],
)
def test_converted_inputs_give_the_native_answer(
    base: Path, variant: Callable[[Path], tuple[str, ...]]
) -> None:
    native = answer(*QKV)
    converted = answer(*variant(base))
    for stage in ("raw", "weights", "output"):
        np.testing.assert_array_equal(np.array(converted[stage]), np.array(native[stage]))


def test_zero_queries_is_an_empty_answer(base: Path) -> None:
    np.save(base / "q0.npy", np.zeros((H, 0, E)))
    data = answer("q0.npy", "k.npy", "v.npy")
    assert data["shapes"]["output"] == [H, 0, EV]
    assert data["output"] == [[], []]
    assert data["weights"] == [[], []]
    assert data["findings"] == []
    for command in ("explain", "check"):
        result = invoke(command, "q0.npy", "k.npy", "v.npy")
        assert result.exit_code == 0, result.stderr
        assert result.stderr == ""


def test_zero_keys_gives_zero_outputs(base: Path) -> None:
    """S = 0: no key to attend to, so every row is fully masked: zero weights (none)
    and zero outputs, as PyTorch's safe softmax and FlashAttention return."""
    np.save(base / "k0.npy", np.zeros((H, 0, E)))
    np.save(base / "v0.npy", np.zeros((H, 0, EV)))
    data = answer("q.npy", "k0.npy", "v0.npy")
    assert data["shapes"]["weights"] == [H, L, 0]
    assert np.array(data["output"]).shape == (H, L, EV)
    assert not np.array(data["output"]).any()
    result = invoke("explain", "q.npy", "k0.npy", "v0.npy", "--no-color")
    assert result.exit_code == 0
    assert "every output row is zero" in " ".join(result.stdout.split())
    assert invoke("check", "q.npy", "k0.npy", "v0.npy").exit_code == 0


def test_zero_keys_finding_says_every_row_is_fully_masked(base: Path) -> None:
    np.save(base / "k0.npy", np.zeros((H, 0, E)))
    np.save(base / "v0.npy", np.zeros((H, 0, EV)))
    data = answer("q.npy", "k0.npy", "v0.npy")
    assert data["finding_counts"].get("fully_masked", 0) > 0


class Hung(BaseException):
    """Raised by the alarm: a BaseException, so that no handler of the CLI catches it."""


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail with Hung if the block runs longer than ``seconds`` (main thread, Unix)."""

    def alarm(signum: int, frame: FrameType | None) -> None:
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.xfail(
    strict=True,
    raises=Hung,
    reason="sdpa_cli/engine/block.py:trace (sweep → visit → stats.measure) walks every (batch, "
    "head) slice one by one, ~0.2 ms each even when it is empty: a 128-byte .npy declaring "
    "K (100000, 0, 4) takes ~20 s, (10**6, 0, 4) minutes; fix: short-circuit L = 0 / S = 0 "
    "(no scores: zero outputs and row stats set in one vectorized step), or refuse in "
    "_check_fits when slices × per-slice cost is absurd",
)
@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_empty_keys_with_many_heads_do_not_hang(base: Path) -> None:
    header("k0.npy", (100_000, 0, E))(base)
    header("v0.npy", (100_000, 0, EV))(base)
    np.save(base / "q1.npy", random((L, E)))
    with within(3.0):
        result = invoke("compute", "q1.npy", "k0.npy", "v0.npy", "--jobs", "1")
    assert result.exit_code in (0, 2)


def test_empty_keys_with_absurd_heads_are_refused(base: Path) -> None:
    header("k0.npy", (2**40, 0, E))(base)
    header("v0.npy", (2**40, 0, EV))(base)
    np.save(base / "q1.npy", random((L, E)))
    line = assert_one_error_line(invoke("compute", "q1.npy", "k0.npy", "v0.npy"))
    assert "GiB" in line


# --- internal errors and interruptions ---------------------------------------------------

TARGETS = {
    "compute": ("sdpa_cli.api.compute", "trace"),
    "explain": ("sdpa_cli.api.explain", "trace"),
    "check": ("sdpa_cli.api.judge", "run_checks"),
}


def break_core(monkeypatch: pytest.MonkeyPatch, command: str, exc: BaseException) -> None:
    """Make the core function ``command`` calls raise ``exc``."""
    import importlib

    module, name = TARGETS[command]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise exc

    monkeypatch.setattr(importlib.import_module(module), name, broken)


@pytest.mark.parametrize("command", sorted(TARGETS))
def test_internal_error_is_one_line_exit_3(
    base: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    break_core(monkeypatch, command, RuntimeError("boom"))
    _, line = run_guarded(base, (command, *QKV), code=ExitCode.INTERNAL)
    assert line.startswith("sdpa: error: internal error: RuntimeError: boom")
    assert "please report it" in line
    assert "--debug" in line
    debug = invoke("--debug", command, *QKV)
    assert debug.exit_code == ExitCode.INTERNAL
    assert "Traceback (most recent call last)" in debug.stderr
    assert "raise exc" in debug.stderr
    assert debug.stderr.splitlines()[-1].startswith("sdpa: error: internal error: RuntimeError")


@pytest.mark.parametrize("command", sorted(TARGETS))
def test_keyboard_interrupt_exits_130(
    base: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    break_core(monkeypatch, command, KeyboardInterrupt())
    guards: list[str] = []
    for name, (flag,) in OUTPUTS[command].items():
        (base / name).write_bytes(b"KEEP")
        guards += [flag, name]
    result = invoke(command, *guards, *QKV)
    assert result.exit_code == ExitCode.INTERRUPTED
    assert result.stdout == ""
    assert "Traceback" not in result.output
    assert result.stderr.lstrip("\n") == "sdpa: error: interrupted\n"  # after click's ^C newline
    assert all((base / name).read_bytes() == b"KEEP" for name in OUTPUTS[command])


# --- end to end: the installed entry point -----------------------------------------------


def sdpa_argv() -> list[str]:
    beside = Path(sys.executable).parent / "sdpa"
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "sdpa_cli"]


def process_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env.update(COLUMNS="100")
    return env


@pytest.mark.e2e
def test_e2e_hostile_files_are_refused_and_never_run(base: Path) -> None:
    pickled("evil.npy")(base)
    raw("tag.yaml", f"q: !!python/object/apply:os.mkdir ['{MARKER}']\nk: k.npy\nv: v.npy\n")(base)
    for args in (["evil.npy", "k.npy", "v.npy"], ["tag.yaml"]):
        proc = subprocess.run(
            [*sdpa_argv(), "compute", *args, "--save", "out.npz"],
            cwd=base,
            capture_output=True,
            text=True,
            env=process_env(),
            timeout=60,
        )
        assert proc.returncode == 2
        assert proc.stdout == ""
        assert proc.stderr.count("\n") == 1
        assert proc.stderr.startswith(f"sdpa: error: {args[0]}: ")
        assert not (base / MARKER).exists()
        assert not (base / "out.npz").exists()


@pytest.mark.e2e
def test_e2e_sigint_exits_130_and_leaves_no_file(workdir: Path) -> None:
    """A real Ctrl-C during a long run (about 4 s, 550 MB to save): exit 130, one line,
    and neither the --save file nor a temporary file is left."""
    rng = np.random.default_rng(0)
    for name in "qkv":
        np.save(workdir / f"{name}.npy", rng.standard_normal((1, 4, 2048, 64)).astype(np.float32))
    proc = subprocess.Popen(
        [*sdpa_argv(), "compute", *QKV, "--save", "out.npz", "--stages", "output"],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=process_env(),
    )
    # Wait until it is computing (its memory grows past 300 MB) or saving (a temporary
    # file appears), then interrupt it.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        saving = any(p.name.endswith(".tmp") for p in workdir.iterdir())
        if saving or _rss(proc.pid) > 300 << 20:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert err.lstrip("\n") == "sdpa: error: interrupted\n"
    assert "Traceback" not in err
    assert sorted(p.name for p in workdir.iterdir()) == sorted(QKV)


def _rss(pid: int) -> int:
    """Resident memory of a process, in bytes (0 when unknown)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.mark.e2e
def test_e2e_a_successful_run_keeps_stderr_empty(base: Path) -> None:
    proc = subprocess.run(
        [*sdpa_argv(), "compute", *QKV, "--scale", "1e308"],
        cwd=base,
        capture_output=True,
        text=True,
        env=process_env(),
        timeout=60,
    )
    assert proc.returncode == 0
    assert proc.stderr == ""


def test_save_refusal_needs_no_memory(base: Path) -> None:
    """The 200,000-row inputs of the catalog are refused in a moment: nothing was computed.
    (Without --save the JSON document streams: it is refused only when stdout is a file
    on a disk too small, tests/test_stream.py.)"""
    for name in ("bq", "bk", "bv"):
        np.save(base / f"{name}.npy", np.zeros(BIG))
    start = time.monotonic()
    line = assert_one_error_line(
        invoke("compute", "bq.npy", "bk.npy", "bv.npy", "--format", "json", "--save", "out.npz")
    )
    assert time.monotonic() - start < 10
    found = re.search(r"needs ([\d.]+) GiB", line)
    assert found is not None, line
    assert float(found.group(1)) > 1000  # 200,000² scores: 4 stages in float64, one twice
