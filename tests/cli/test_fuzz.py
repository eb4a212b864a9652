"""Fuzzing the command line: valid inputs, mutated byte by byte and structurally.

Every input format and the option values are mutated, and the real command line runs on
the result (through CliRunner, in process, so an example takes milliseconds). Whatever
the mutation, a run must end with exit 0 (or 1, a failed ``check``) or 2 with one
``sdpa: error:`` line on stderr: never a traceback, never an internal error (3), and
never a ``--save`` or ``--report`` file left by a failed run.

``make test`` runs a bounded, derandomized set of examples (about 200 in all, a few
seconds, no database). ``make fuzz`` sets ``SDPA_FUZZ=1``: each test then runs
``SDPA_FUZZ_EXAMPLES`` fresh random examples (default 1000; ``make fuzz`` runs rounds of
500 until its 10 minutes are spent, each test stopping at its next example once they
are: ``SDPA_FUZZ_UNTIL``) under a 10-second deadline that catches hangs.
Failing examples are kept in hypothesis' database under ``.hypothesis/`` (git-ignored)
and replayed first next time.
"""

from __future__ import annotations

import ast
import io
import json
import math
import os
import re
import struct
import time
import zipfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import Result
from clirunner import invoke
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from numpy.typing import NDArray

from sdpa_cli.engine.options import OPTION_NAMES
from sdpa_cli.errors import SdpaError
from sdpa_cli.files.loaders import Source, load_array

FUZZING = os.environ.get("SDPA_FUZZ") == "1"
FUZZ_EXAMPLES = int(os.environ.get("SDPA_FUZZ_EXAMPLES", "1000"))
FUZZ_UNTIL = float(os.environ.get("SDPA_FUZZ_UNTIL", "0"))
"""The time (seconds since the epoch) ``make fuzz``'s budget ends: past it, each test
skips at its next example, so a round stops within seconds of the budget."""
SLOW_SLICES = 10_000
"""Empty inputs declaring more (batch, head) slices than this are left out: the engine
visits empty slices one by one (tests/cli/test_catalog.py pins that as an xfail)."""


def budget(examples: int) -> settings:
    """``examples`` derandomized examples in ``make test``; many random ones under SDPA_FUZZ=1."""
    quiet = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    if FUZZING:
        return settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=timedelta(seconds=10),
            suppress_health_check=quiet,
        )
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=quiet,
    )


# --- valid inputs ----------------------------------------------------------------------

RNG = np.random.default_rng(20240611)
TENSORS: dict[str, NDArray[Any]] = {
    "q": RNG.standard_normal((2, 3, 4)),
    "k": RNG.standard_normal((2, 5, 4)).astype(np.float32),
    "v": RNG.standard_normal((2, 5, 3)),
    "mask": RNG.random((3, 5)) > 0.3,
    "bias": RNG.standard_normal((3, 5)).astype(np.float16),
}
ROLES = ("q", "k", "v", "mask", "bias")


def npy_bytes(a: NDArray[Any]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


SAFETENSORS_CODES = {"<f8": "F64", "<f4": "F32", "<f2": "F16", "|b1": "BOOL"}


def safetensors_bytes(arrays: dict[str, NDArray[Any]], header_extra: dict[str, Any]) -> bytes:
    """The safetensors layout, written by hand: N, N bytes of JSON header, the data."""
    header: dict[str, Any] = dict(header_extra)
    data = b""
    for name, a in arrays.items():
        raw = np.ascontiguousarray(a).tobytes()
        code = SAFETENSORS_CODES[a.dtype.str]
        header[name] = {
            "dtype": code,
            "shape": list(a.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    return safetensors_file(json.dumps(header).encode(), data)


def safetensors_file(header: bytes, data: bytes) -> bytes:
    header += b" " * (-len(header) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(header)) + header + data


def text_bytes(data: Any, fmt: str) -> bytes:
    if fmt == "json":
        return json.dumps(data).encode()
    return yaml.safe_dump(data, default_flow_style=None).encode()


@pytest.fixture(scope="module")
def fuzzdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The valid q.npy, k.npy, v.npy, mask.npy, bias.npy every example starts from."""
    d = tmp_path_factory.mktemp("fuzz")
    for name, a in TENSORS.items():
        (d / f"{name}.npy").write_bytes(npy_bytes(a))
    return d


# --- running the command line -----------------------------------------------------------

OUTPUTS = ("out.npz", "report.json", "report.xml")


def run(d: Path, args: Sequence[str], codes: frozenset[int] = frozenset({0, 2})) -> Result:
    """``sdpa ARGS`` in ``d``: exit in ``codes``, no traceback; an exit 2 is one error
    line and leaves no output file behind (nor a temporary one)."""
    if FUZZ_UNTIL and time.time() > FUZZ_UNTIL:  # make fuzz's budget: stop within an example
        pytest.skip("the fuzz budget is spent")
    for name in OUTPUTS:
        (d / name).unlink(missing_ok=True)
    result = invoke(*args)
    if currently_in_test_context():
        event(f"{args[0]}: exit {result.exit_code}")
    text = result.stdout + result.stderr
    assert result.exit_code in codes, (args, result.exit_code, result.stderr)
    assert "Traceback" not in text, (args, text)
    assert "internal error" not in result.stderr, (args, result.stderr)
    if result.exit_code == 2:
        lines = result.stderr.splitlines()
        if len(lines) == 2:  # a usage error: click's line naming the command's help
            assert re.fullmatch(r"Try 'sdpa[a-z ]* --help' for help\.", lines.pop()), lines
        assert len(lines) == 1, (args, result.stderr)
        assert lines[0].startswith("sdpa: error: "), (args, result.stderr)
        left = [p.name for p in d.iterdir() if p.name in OUTPUTS or p.name.endswith(".tmp")]
        assert not left, (args, left)
    elif args[0] != "check":
        assert result.stderr == "", (args, result.stderr)
    return result


@st.composite
def command(draw: st.DrawFn, d: Path) -> tuple[list[str], frozenset[int]]:
    """A command and its output options: compute (with --format, --save), explain, check
    (with --report, --junit); and the exit codes it may give."""
    name = draw(st.sampled_from(["compute", "compute", "compute", "explain", "check"]))
    extra: list[str] = []
    if name == "compute":
        extra += ["--format", draw(st.sampled_from(["table", "json", "yaml"]))]
        if draw(st.booleans()):
            extra += ["--save", str(d / "out.npz")]
    elif name == "explain":
        extra += ["--format", draw(st.sampled_from(["table", "json"]))]
    else:
        extra += ["--report", str(d / "report.json"), "--junit", str(d / "report.xml")]
    codes = frozenset({0, 1, 2}) if name == "check" else frozenset({0, 2})
    return [name, *extra], codes


def tensor_args(d: Path, role: str, path: str) -> list[str]:
    """Q K V (and --mask, --bias) with ``path`` in ``role`` and valid files elsewhere."""
    files = {r: str(d / f"{r}.npy") for r in ROLES}
    files[role] = path
    args = [files["q"], files["k"], files["v"]]
    if role in ("mask", "bias"):
        args += [f"--{role}", files[role]]
    return args


def slow_empty(shape: Sequence[int]) -> bool:
    """An empty array whose other axes make more slices than an example should visit."""
    return 0 in shape and math.prod(n for n in shape if n) > SLOW_SLICES


def screen(path: str) -> None:
    """Leave out an input that loads as an empty array of very many slices (see
    SLOW_SLICES); everything else, loadable or not, goes to the command line."""
    try:
        a = load_array(Source.parse(path))
    except SdpaError:
        return
    assume(not slow_empty(a.shape))


# --- mutations --------------------------------------------------------------------------

INTERESTING_BYTES = [
    b"\x00",
    b"\xff",
    b"\x7f",
    b"\x80",
    b"{",
    b"}",
    b"[",
    b"]",
    b"(",
    b")",
    b",",
    b":",
    b"'",
    b'"',
    b"-",
    b"9",
    b"0",
    b"\n",
    b"*",
    b"\x93NUMPY",
    b"PK\x03\x04",
    b"\xff" * 8,
]


@st.composite
def byte_mutations(draw: st.DrawFn, base: bytes, hot: int = 128) -> bytes:
    """``base`` with 1 to 4 edits: bit flips, byte writes, insertions (of bytes that
    mean something to some format), deletions, splices, a truncation. Positions favor
    the first ``hot`` bytes, where the headers are."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        size = len(data)
        pos = draw(st.integers(0, min(size, hot)) | st.integers(0, size))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "splice", "truncate"]))
        if op == "flip" and pos < size:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and pos < size:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(
                st.sampled_from(INTERESTING_BYTES) | st.binary(min_size=1, max_size=16)
            )
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == "splice":
            start = draw(st.integers(0, size))
            data[pos:pos] = data[start : start + draw(st.integers(1, 32))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


TOKENS = [
    "[",
    "]",
    "{",
    "}",
    ",",
    ": ",
    '"',
    "'",
    "-",
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    "null",
    "true",
    "~",
    ".nan",
    ".inf",
    "&a ",
    "*a",
    "<<: *a",
    "!!python/object/apply:os.system ['true'] ",
    "!!binary ",
    "!!int ",
    "!!timestamp ",
    "? ",
    "- ",
    "\t",
    "\n",
    "\n  ",
    "9" * 30,
    "9" * 5000,
    "[" * 60,
    "2001-13-45",
    "%YAML 1.1\n---\n",
    "---\n",
    "\ufeff",
    "\x00",
    "#",
]


@st.composite
def text_mutations(draw: st.DrawFn, base: bytes) -> bytes:
    """``base`` (JSON or YAML) with tokens of either language inserted or swapped in,
    then perhaps a few byte edits (invalid UTF-8 among them)."""
    text = base.decode()
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(text)))
        token = draw(st.sampled_from(TOKENS))
        cut = draw(st.integers(0, 3))
        text = text[:pos] + token + text[pos + cut :]
    data = text.encode()
    if draw(st.booleans()):
        data = draw(byte_mutations(data, hot=len(data)))
    return data


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 10)
    | st.sampled_from([2**31, 2**63, -(2**63), 2**128, 10**30, 10**400, -(10**400)])
    | st.floats()
    | st.sampled_from([1e308, -1e308, 5e-324, -0.0, 0.5, 1.5, -1e9])
    | st.text(max_size=8)
    | st.sampled_from(
        [
            "sqrt-dk",
            "dk",
            "none",
            "-inf",
            "finfo-min",
            "lower-right",
            "masked",
            "float16",
            "bfloat16",
            "float8_e5m2",
            "same",
            "1,2",
            "2",
            "0",
            "q.npy",
            "k.npy",
            "nope.npy",
            "mask.npy",
            "q.npy:x",
            ".",
            "",
        ]
    )
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
KEYS = st.sampled_from([*OPTION_NAMES, "q", "k", "v", "mask", "bias", "description"]) | st.text(
    max_size=6
)

Path_ = tuple[Any, ...]


def _paths(node: Any, at: Path_ = ()) -> list[Path_]:
    """Every path into nested dicts and lists, the root included."""
    found = [at]
    if isinstance(node, dict):
        for key, child in node.items():
            found += _paths(child, (*at, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            found += _paths(child, (*at, i))
    return found


def _get(node: Any, at: Path_) -> Any:
    for step in at:
        node = node[step]
    return node


@st.composite
def structural_mutations(draw: st.DrawFn, base: Any) -> Any:
    """``base`` (JSON-like data) with 1 to 3 edits at random places: a value replaced by
    junk of any type, deleted, wrapped in a list, unwrapped, an element duplicated,
    a key added (an option of the wrong type, a tensor, an unknown key)."""
    data = json.loads(json.dumps(base))  # a deep copy
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.sampled_from(_paths(data)))
        node = _get(data, at)
        op = draw(st.sampled_from(["replace", "delete", "wrap", "unwrap", "duplicate", "add"]))
        new: Any = node
        if op == "replace":
            new = draw(JUNK)
        elif op == "wrap":
            new = [node]
        elif op == "unwrap" and isinstance(node, list) and node:
            new = node[0]
        elif op == "unwrap" and isinstance(node, dict) and node:
            new = next(iter(node.values()))
        elif op == "duplicate" and isinstance(node, list) and node:
            i = draw(st.integers(0, len(node) - 1))
            new = [*node[: i + 1], node[i], *node[i + 1 :]]
        elif op == "add" and isinstance(node, dict):
            new = {**node, draw(KEYS): draw(JUNK)}
        if op == "delete" and at:
            parent = _get(data, at[:-1])
            del parent[at[-1]]
        elif not at:
            data = new
        else:
            _get(data, at[:-1])[at[-1]] = new
    return data


def duplicate_key(text: str, key: str, value: Any) -> str:
    """A JSON object's text with ``key`` given a second time, at its end."""
    end = text.rstrip().rfind("}")
    if end < 0:
        return text
    return f'{text[:end]}, "{key}": {json.dumps(value)}{text[end:]}'


# --- .npy -------------------------------------------------------------------------------


@budget(30)
@given(st.data())
def test_npy_byte_mutations(fuzzdir: Path, data: st.DataObject) -> None:
    role = data.draw(st.sampled_from([*ROLES, "expect"]))
    base = npy_bytes(TENSORS.get(role, TENSORS["q"]))
    if role != "expect" and data.draw(st.booleans()):  # big-endian or Fortran order
        a = TENSORS[role]
        base = npy_bytes(np.asfortranarray(a.astype(a.dtype.newbyteorder(">"))))
    path = fuzzdir / f"m_{role}.npy"
    path.write_bytes(data.draw(byte_mutations(base)))
    screen(str(path))
    if role == "expect":
        args = ["check", *tensor_args(fuzzdir, "q", str(fuzzdir / "q.npy"))]
        run(fuzzdir, [*args, "--expect-output", str(path)], frozenset({0, 1, 2}))
        return
    cmd, codes = data.draw(command(fuzzdir))
    run(fuzzdir, [*cmd, *tensor_args(fuzzdir, role, str(path))], codes)


DESCRS = [
    "'<f8'",
    "'>f8'",
    "'<f4'",
    "'<f2'",
    "'>f2'",
    "'|b1'",
    "'<i8'",
    "'>i2'",
    "'|u1'",
    "'<c16'",
    "'|O'",
    "'<U3'",
    "'|S2'",
    "'<M8[s]'",
    "'<m8[s]'",
    "'|V8'",
    "[('a', '<f8')]",
    "'<f16'",
    "'bogus'",
    "''",
    "1",
    "None",
]
SHAPE_TEXTS = ["(2, 3)", "[2, 3]", "(2.0, 3)", "None", "'x'", "(2, 3", "()", "(-1,)", "(1 << 70,)"]


@st.composite
def npy_headers(draw: st.DrawFn) -> bytes:
    """An .npy file whose header dict is rewritten: any dtype (pickles, complex, strings,
    structured, big-endian...), any shape (huge, negative, not a tuple), Fortran order
    or junk, keys missing or added, any version; then data of the declared size when
    that is small, or of some other size."""
    descr = draw(st.sampled_from(DESCRS))
    dims = st.integers(0, 6) | st.sampled_from([0, 1, 10**6, 2**31, 2**62, 2**64, -1])
    shape_ints = tuple(draw(st.lists(dims, max_size=4)))
    if 0 in shape_ints:  # an empty array: its other axes stay small (SLOW_SLICES)
        shape_ints = tuple(min(n, 6) for n in shape_ints)
    shape = draw(st.just(repr(shape_ints)) | st.sampled_from(SHAPE_TEXTS))
    fortran = draw(st.sampled_from(["False", "True", "'yes'", "1", "None"]))
    entries = {"descr": descr, "fortran_order": fortran, "shape": shape}
    if draw(st.integers(0, 9)) == 0:
        del entries[draw(st.sampled_from(sorted(entries)))]
    if draw(st.integers(0, 9)) == 0:
        entries["extra"] = "1"
    header = "{" + "".join(f"'{k}': {v}, " for k, v in entries.items()) + "}"
    version = draw(
        st.sampled_from([b"\x01\x00", b"\x01\x00", b"\x02\x00", b"\x03\x00", b"\x09\x00"])
    )
    length = 10 if version == b"\x01\x00" else 12
    text = header.encode("latin-1")
    text += b" " * (-(length + len(text) + 1) % 64) + b"\n"
    size_field = struct.pack("<H" if length == 10 else "<I", len(text))
    try:
        count = math.prod(shape_ints) * np.dtype(ast.literal_eval(descr)).itemsize
    except Exception:
        count = 64
    if 0 <= count <= 4096 and draw(st.integers(0, 4)):
        body = draw(st.binary(min_size=count, max_size=count))
    else:
        body = draw(st.binary(max_size=256))
    return b"\x93NUMPY" + version + size_field + text + body


@budget(30)
@given(st.data())
def test_npy_header_rewrites(fuzzdir: Path, data: st.DataObject) -> None:
    role = data.draw(st.sampled_from(ROLES))
    path = fuzzdir / f"h_{role}.npy"
    path.write_bytes(data.draw(npy_headers()))
    screen(str(path))
    cmd, codes = data.draw(command(fuzzdir))
    run(fuzzdir, [*cmd, *tensor_args(fuzzdir, role, str(path))], codes)


# --- .npz -------------------------------------------------------------------------------


def zip_bytes(members: dict[str, bytes], method: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        for name, raw in members.items():
            zf.writestr(name, raw)
    return buf.getvalue()


ZIP_METHODS = [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]


@budget(20)
@given(st.data())
def test_npz_mutations(fuzzdir: Path, data: st.DataObject) -> None:
    role = data.draw(st.sampled_from(ROLES))
    method = data.draw(st.sampled_from(ZIP_METHODS))
    other = npy_bytes(TENSORS["v"])
    if data.draw(st.booleans()):  # a member's .npy header rewritten, the archive intact
        content = zip_bytes({f"{role}.npy": data.draw(npy_headers()), "other.npy": other}, method)
    else:
        base = zip_bytes({f"{role}.npy": npy_bytes(TENSORS[role]), "other.npy": other}, method)
        content = data.draw(byte_mutations(base, hot=4096))
    path = fuzzdir / f"z_{role}.npz"
    path.write_bytes(content)
    member = data.draw(st.sampled_from([f":{role}", ":other", ":nope", ""]))
    screen(f"{path}{member}")
    cmd, codes = data.draw(command(fuzzdir))
    run(fuzzdir, [*cmd, *tensor_args(fuzzdir, role, f"{path}{member}")], codes)


# --- .safetensors -----------------------------------------------------------------------


@budget(25)
@given(st.data())
def test_safetensors_mutations(fuzzdir: Path, data: st.DataObject) -> None:
    role = data.draw(st.sampled_from(ROLES))
    arrays = {role: TENSORS[role]}
    if data.draw(st.booleans()):
        arrays["other"] = TENSORS["v"]
    meta = data.draw(st.sampled_from([{}, {"__metadata__": {"format": "pt"}}]))
    base = safetensors_bytes(arrays, meta)
    if data.draw(st.booleans()):  # the JSON header edited as data, the buffer kept
        n = struct.unpack("<Q", base[:8])[0]
        header = json.loads(base[8 : 8 + n])
        edited = json.dumps(data.draw(structural_mutations(header))).encode()
        content = safetensors_file(edited, base[8 + n :])
        if data.draw(st.integers(0, 3)) == 0:
            content = data.draw(byte_mutations(content))
    else:
        content = data.draw(byte_mutations(base))
    path = fuzzdir / f"s_{role}.safetensors"
    path.write_bytes(content)
    member = data.draw(st.sampled_from([f":{role}", "", ":other"]))
    screen(f"{path}{member}")
    cmd, codes = data.draw(command(fuzzdir))
    run(fuzzdir, [*cmd, *tensor_args(fuzzdir, role, f"{path}{member}")], codes)


# --- .json and .yaml tensors ------------------------------------------------------------


@budget(25)
@given(st.data())
def test_text_tensor_mutations(fuzzdir: Path, data: st.DataObject) -> None:
    role = data.draw(st.sampled_from(ROLES))
    fmt = data.draw(st.sampled_from(["json", "yaml"]))
    value = TENSORS[role].tolist()
    how = data.draw(st.sampled_from(["structure", "tokens", "bytes"]))
    if how == "structure":
        content = text_bytes(data.draw(structural_mutations(value)), fmt)
    elif how == "tokens":
        content = data.draw(text_mutations(text_bytes(value, fmt)))
    else:
        content = data.draw(byte_mutations(text_bytes(value, fmt), hot=1 << 16))
    path = fuzzdir / f"t_{role}.{fmt}"
    path.write_bytes(content)
    cmd, codes = data.draw(command(fuzzdir))
    run(fuzzdir, [*cmd, *tensor_args(fuzzdir, role, str(path))], codes)


# --- case files -------------------------------------------------------------------------

CASES: list[dict[str, Any]] = [
    {
        "description": "inline",
        "q": TENSORS["q"].tolist(),
        "k": TENSORS["k"].tolist(),
        "v": TENSORS["v"].tolist(),
        "causal": True,
        "scale": "sqrt-dk",
    },
    {
        "q": "q.npy",
        "k": "k.npy",
        "v": "v.npy",
        "mask": "mask.npy",
        "bias": TENSORS["bias"].tolist(),
        "window": [1, 2],
        "key_lengths": 4,
        "dropout": 0.25,
        "seed": 3,
    },
    {
        "q": [[1.0, 0.5]],
        "k": [[1.0, 0.0], [0.0, 1.0], [2.0, -1.0]],
        "v": [[10, 0], [0, 8], [1, 1]],
        "softcap": 5.0,
        "alibi": True,
        "mask_value": -1e9,
        "dtype": "float16",
        "temperature": 0.5,
    },
]


@budget(35)
@given(st.data())
def test_case_file_mutations(fuzzdir: Path, data: st.DataObject) -> None:
    base = data.draw(st.sampled_from(CASES))
    fmt = data.draw(st.sampled_from(["json", "yaml"]))
    how = data.draw(st.sampled_from(["structure", "structure", "tokens", "duplicate"]))
    if how == "structure":
        content = text_bytes(data.draw(structural_mutations(base)), fmt)
    elif how == "tokens":
        content = data.draw(text_mutations(text_bytes(base, fmt)))
    else:
        fmt = "json"
        text = duplicate_key(json.dumps(base), data.draw(KEYS), data.draw(JUNK))
        content = text.encode()
    path = fuzzdir / f"case.{fmt}"
    path.write_bytes(content)
    cmd, codes = data.draw(command(fuzzdir))
    run(fuzzdir, [*cmd, str(path)], codes)


# --- option values ----------------------------------------------------------------------

FLAG_VALUES = {
    "--scale": ["sqrt-dk", "dk", "none", "0", "-1", "nan", "inf", "1e308", "1e-320", "0.5"],
    "--temperature": ["0", "-1", "nan", "inf", "1e-320", "1e308", "2"],
    "--softcap": ["0", "nan", "inf", "1e-300", "30"],
    "--window": ["0", "1", "1,2", "-1", "1,2,3", "a", "", ",", "99999999999999999999"],
    "--key-lengths": ["0", "5", "6", "1,2", "1,2,3", "-1", "", "1,,2", "99999999999999999999"],
    "--mask-value": ["-inf", "finfo-min", "-1e9", "0", "5", "nan", "-1e999", "x"],
    "--dropout": ["0", "0.5", "1", "-0.1", "nan", "0.999999"],
    "--seed": ["0", "-1", "1.5", "340282366920938463463374607431768211456", "x"],
    "--heads": ["1", "2", "3", "0", "-2", "x"],
    "--dtype": ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float12"],
    "--accumulate": ["float32", "float64", "same", "float16", "x"],
    "--softmax-dtype": ["float32", "same", "bfloat16"],
    "--logits-dtype": ["same", "float32", "float16"],
    "--causal-align": ["upper-left", "lower-right", "x"],
    "--mask-true-means": ["attend", "masked", "x"],
    "--saturation": ["0.5", "1.5", "0", "nan", "x"],
    "--uniform": ["0.5", "0", "1", "nan"],
    "--head-fraction": ["0.5", "2", "-1"],
    "--max-findings": ["0", "-1", "5", "x"],
}
SWITCHES = ["--causal", "--alibi", "--prescale", "--no-causal"]
COMPUTE_FLAGS = {
    "--stages": ["raw,weights", "output", "bogus", "", ",", "dropped,capped"],
    "--rows": ["0", "1:3", "5", ":", "2:1", "x", "-1"],
    "--keys": ["0", "1:3", "9", ":", "x"],
    "--head": ["0", "1", "2", "-1", "x"],
    "--batch": ["0", "1"],
    "--max-rows": ["1", "0", "x"],
    "--max-slices": ["1", "2", "0"],
    "--precision": ["0", "12", "13"],
}
CHECK_FLAGS = {
    "--rtol": ["0", "1e-3", "-1", "nan", "inf", "x"],
    "--atol": ["0", "1e-5", "-1"],
    "--fudge": ["1", "2", "0", "nan"],
    "--fail-on": ["none", "nonfinite,overflow", "bogus", "", "saturated"],
    "--tolerance": ["dtype", "measured", "x"],
    "--reference": ["float32", "float64", "x"],
}


def flag_values(table: dict[str, list[str]]) -> st.SearchStrategy[list[str]]:
    pairs = st.sampled_from(sorted(table)).flatmap(
        lambda flag: st.tuples(st.just(flag), st.sampled_from(table[flag]) | st.text(max_size=6))
    )
    return st.lists(pairs, max_size=4).map(lambda ps: [x for p in ps for x in p])


@budget(35)
@given(st.data())
def test_option_values(fuzzdir: Path, data: st.DataObject) -> None:
    cmd, codes = data.draw(command(fuzzdir))
    flags = data.draw(flag_values(FLAG_VALUES))
    flags += data.draw(st.lists(st.sampled_from(SWITCHES), max_size=2))
    if cmd[0] == "compute":
        flags += data.draw(flag_values(COMPUTE_FLAGS))
    elif cmd[0] == "check":
        flags += data.draw(flag_values(CHECK_FLAGS))
    inputs = data.draw(
        st.sampled_from(
            [
                tensor_args(fuzzdir, "q", str(fuzzdir / "q.npy")),
                tensor_args(fuzzdir, "mask", str(fuzzdir / "mask.npy")),
                tensor_args(fuzzdir, "bias", str(fuzzdir / "bias.npy")),
            ]
        )
    )
    run(fuzzdir, [*cmd, *inputs, *flags], codes)


# --- check --manifest -------------------------------------------------------------------

MANIFEST: dict[str, Any] = {
    "defaults": {"causal": True, "rtol": 1e-3, "atol": 1e-3},
    "cases": [{"name": "layer0", "q": "q.npy", "k": "k.npy", "v": "v.npy", "mask": "mask.npy"}],
}


@budget(15)
@given(st.data())
def test_manifest_mutations(fuzzdir: Path, data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(["json", "yaml"]))
    path = fuzzdir / f"manifest.{fmt}"
    path.write_bytes(text_bytes(data.draw(structural_mutations(MANIFEST)), fmt))
    result = invoke("check", "--manifest", str(path), "--jobs", "1")
    text = result.stdout + result.stderr
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.stderr)
    assert "Traceback" not in text
    assert "internal error" not in text
    if result.exit_code == 2:  # one line per case that could not be checked
        lines = result.stderr.splitlines()
        assert 1 <= len(lines) <= len(MANIFEST["cases"]), result.stderr
        assert all(line.startswith("sdpa: error: ") for line in lines), result.stderr


# The strategies themselves: a mutation must be able to leave a valid input valid
# (otherwise the fuzz would only ever test error paths).


def test_unmutated_inputs_run_clean(fuzzdir: Path) -> None:
    for role in ROLES:
        run(fuzzdir, ["compute", *tensor_args(fuzzdir, role, str(fuzzdir / f"{role}.npy"))])
    for n, case in enumerate(CASES):
        for fmt in ("json", "yaml"):
            path = fuzzdir / f"valid{n}.{fmt}"
            path.write_bytes(text_bytes(case, fmt))
            assert run(fuzzdir, ["compute", str(path)]).exit_code == 0
    st_path = fuzzdir / "valid.safetensors"
    st_path.write_bytes(safetensors_bytes({"q": TENSORS["q"]}, {}))
    assert run(fuzzdir, ["compute", *tensor_args(fuzzdir, "q", str(st_path))]).exit_code == 0
    manifest = fuzzdir / "valid_manifest.yaml"
    manifest.write_bytes(text_bytes(MANIFEST, "yaml"))
    assert invoke("check", "--manifest", str(manifest)).exit_code in (0, 1)
