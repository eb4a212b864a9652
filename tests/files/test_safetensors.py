"""Tests of ``.safetensors`` input: values, member selection, memory mapping, the checks.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets"}}``, optionally ``"__metadata__"``), then the
data buffer. The package's own writer and reader (``safetensors.numpy``) are the
independent witnesses where they can be (they have no bfloat16); the other files are
built here by hand, byte by byte, so those tests run without the package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from clirunner import assert_one_error_line, invoke, strict_json
from numpy.typing import NDArray

from sdpa_cli.errors import InputError
from sdpa_cli.files.loaders import Source, load_array

QKV = ("f.safetensors:q", "f.safetensors:k", "f.safetensors:v")


def write_safetensors(
    path: Path, tensors: dict[str, tuple[str, NDArray[Any]]], metadata: dict[str, str] | None = None
) -> Path:
    """A safetensors file from ``{name: (dtype code, array)}``, written by hand."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    data = b""
    for name, (code, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": code,
            "shape": list(arr.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    return write_raw(path, json.dumps(header).encode(), data)


def write_raw(path: Path, header: bytes, data: bytes = b"") -> Path:
    """``len(header)`` as 8 little-endian bytes, the header, then ``data``."""
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return path


def entry(dtype: Any = "F32", shape: Any = (2,), offsets: Any = (0, 8)) -> bytes:
    """A header holding one tensor ``t`` with the given fields."""
    fields = {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}
    return json.dumps({"t": fields}).encode()


def qkv_arrays(dtype: Any = np.float32) -> dict[str, NDArray[Any]]:
    rng = np.random.default_rng(7)
    return {n: rng.standard_normal((2, 3, 4)).astype(dtype) for n in "qkv"}


# --- values: the package writes, sdpa reads what the package reads -------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.bool_])
def test_files_written_by_the_package_load_as_the_package_reads_them(
    tmp_path: Path, dtype: type[np.generic]
) -> None:
    st = pytest.importorskip("safetensors.numpy")
    arr = (np.arange(24).reshape(2, 3, 4) % 5 - 2).astype(dtype)
    path = tmp_path / "t.safetensors"
    st.save_file({"t": arr}, str(path))
    expected = st.load_file(str(path))["t"]
    got = load_array(str(path))
    assert got.dtype == expected.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, expected)


def test_metadata_is_not_a_tensor(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "t.safetensors"
    st.save_file({"only": np.ones((2, 2), np.float32)}, str(path), metadata={"format": "np"})
    np.testing.assert_array_equal(load_array(str(path)), np.ones((2, 2)))


def test_tensors_come_back_in_memory_not_memory_mapped(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "t.safetensors", {"t": ("F32", np.ones((3, 4), "<f4"))})
    got = load_array(str(path))
    assert not isinstance(got, np.memmap)  # a truncated file must not SIGBUS
    np.testing.assert_array_equal(got, np.ones((3, 4)))


def test_scalar_and_empty_tensors(tmp_path: Path) -> None:
    path = write_safetensors(
        tmp_path / "t.safetensors",
        {"s": ("F64", np.array(2.5)), "e": ("F16", np.zeros((0, 3), np.float16))},
    )
    scalar = load_array(f"{path}:s")
    assert scalar.shape == ()
    assert float(scalar) == 2.5
    empty = load_array(f"{path}:e")
    assert empty.shape == (0, 3)
    assert empty.dtype == np.float16


# --- bfloat16 and float8: built by hand, read as ml_dtypes arrays -------------------------


def test_bfloat16_is_read_as_bfloat16(tmp_path: Path) -> None:
    """The values as written, NaN and inf included."""
    bf16 = np.array([[1.0, -2.5, 3.0e38], [1e-40, np.inf, np.nan]]).astype(ml_dtypes.bfloat16)
    path = write_safetensors(tmp_path / "b.safetensors", {"b": ("BF16", bf16)})
    got = load_array(str(path))
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), bf16.astype(np.float32))


@pytest.mark.parametrize(
    ("code", "dtype"),
    [("F8_E4M3", ml_dtypes.float8_e4m3fn), ("F8_E5M2", ml_dtypes.float8_e5m2)],
)
def test_float8_is_read_as_float8(tmp_path: Path, code: str, dtype: type[np.generic]) -> None:
    every_value = np.arange(256, dtype=np.uint8).view(dtype)
    path = write_safetensors(tmp_path / "f8.safetensors", {"x": (code, every_value)})
    got = load_array(str(path))
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.astype(np.float64), every_value.astype(np.float64))


# --- which tensor ----------------------------------------------------------------------


def test_file_colon_name_picks_a_tensor(tmp_path: Path) -> None:
    q, k = np.arange(6.0).reshape(2, 3), np.arange(4, dtype=np.int16).reshape(2, 2)
    path = write_safetensors(tmp_path / "t.safetensors", {"q": ("F64", q), "k": ("I16", k)})
    np.testing.assert_array_equal(load_array(f"{path}:q"), q)
    got_k = load_array(f"{path}:k")
    assert got_k.dtype == np.int16
    np.testing.assert_array_equal(got_k, k)


def test_source_parse_splits_the_name_off_a_safetensors_path() -> None:
    src = Source.parse("model.safetensors:layers.0.q")
    assert (src.path, src.member) == (Path("model.safetensors"), "layers.0.q")


def test_one_tensor_needs_no_name(tmp_path: Path) -> None:
    only = np.array([[1.0, 2.0]], np.float32)
    path = write_safetensors(tmp_path / "one.safetensors", {"only": ("F32", only)})
    np.testing.assert_array_equal(load_array(str(path)), only)


def test_content_is_sniffed_whatever_the_extension(tmp_path: Path) -> None:
    arr = np.arange(4.0)
    path = write_safetensors(tmp_path / "weights.bin", {"w": ("F64", arr)})
    np.testing.assert_array_equal(load_array(str(path)), arr)


def test_several_tensors_need_a_name(workdir: Path) -> None:
    write_safetensors(workdir / "f.safetensors", {n: ("F32", a) for n, a in qkv_arrays().items()})
    line = assert_one_error_line(invoke("compute", "f.safetensors", *QKV[1:]))
    assert line == (
        "sdpa: error: f.safetensors: holds 3 tensors; pick one with f.safetensors:NAME"
        " (names: k, q, v)"
    )


def test_a_missing_name_lists_the_names(workdir: Path) -> None:
    write_safetensors(workdir / "f.safetensors", {n: ("F32", a) for n, a in qkv_arrays().items()})
    line = assert_one_error_line(invoke("compute", "f.safetensors:x", *QKV[1:]))
    assert line == "sdpa: error: f.safetensors:x: has no tensor 'x' (names: k, q, v)"


# --- every check says what is wrong in one line, before anything is allocated ----------

BAD_FILES: list[tuple[str, bytes, str]] = [
    (
        "too short",
        b"\x08\x00\x00",
        "is too short for a .safetensors file (3 bytes; expected 8 or more)",
    ),
    (
        "header past the end",
        (1000).to_bytes(8, "little") + b"{}",
        "is truncated: its .safetensors header declares 1000 bytes but 2 bytes follow",
    ),
    (
        "header over 100 MiB",
        (200 << 20).to_bytes(8, "little") + b"{}",
        "declares a 209715200-byte .safetensors header; the limit is 100 MiB",
    ),
    (
        "not JSON",
        (5).to_bytes(8, "little") + b"{oops",
        "has a corrupt .safetensors header: invalid JSON at line 1 column 2: Expecting property name enclosed in double quotes",
    ),
    (
        "not UTF-8",
        (3).to_bytes(8, "little") + b"{\xff}",
        "has a corrupt .safetensors header: it is not UTF-8",
    ),
    (
        "not an object",
        (2).to_bytes(8, "little") + b"[]",
        "has a corrupt .safetensors header: expected a JSON object, got an array",
    ),
    ("no tensors", (2).to_bytes(8, "little") + b"{}", "holds no tensors"),
]


@pytest.mark.parametrize(
    ("content", "problem"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_a_bad_file_is_one_error_line(workdir: Path, content: bytes, problem: str) -> None:
    (workdir / "bad.safetensors").write_bytes(content)
    result = invoke("compute", "bad.safetensors", "bad.safetensors", "bad.safetensors")
    assert assert_one_error_line(result) == f"sdpa: error: bad.safetensors: {problem}"


BAD_ENTRIES: list[tuple[str, bytes, str]] = [
    (
        "entry not an object",
        b'{"t": [1, 2]}',
        "has a corrupt .safetensors header: expected an object with dtype, shape and data_offsets, got an array",
    ),
    (
        "missing fields",
        b'{"t": {"dtype": "F32"}}',
        "has a corrupt .safetensors header: the entry has no shape, data_offsets",
    ),
    (
        "unknown dtype",
        entry(dtype="F4"),
        "has unsupported dtype 'F4' (supported: F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL)",
    ),
    ("complex dtype", entry(dtype="C64"), "has complex dtype C64; expected real numbers"),
    (
        "dtype not a string",
        entry(dtype=32),
        "has a corrupt .safetensors header: dtype must be a string, got 32",
    ),
    (
        "negative axis",
        entry(shape=(2, -1)),
        "has a corrupt .safetensors header: shape [2, -1] is not a list of non-negative integers",
    ),
    (
        "fractional axis",
        entry(shape=(2.5,)),
        "has a corrupt .safetensors header: shape [2.5] is not a list of non-negative integers",
    ),
    (
        "offsets backwards",
        entry(offsets=(8, 0)),
        "has a corrupt .safetensors header: data_offsets [8, 0] are not [begin, end] with 0 <= begin <= end",
    ),
    (
        "offsets past the buffer",
        entry(offsets=(0, 16)),
        "is truncated: its data_offsets [0, 16] run past the 8-byte data buffer",
    ),
    (
        "offsets disagree with the shape",
        entry(shape=(3,), offsets=(0, 8)),
        "has a corrupt .safetensors header: shape [3] of F32 is 12 bytes but data_offsets [0, 8] hold 8",
    ),
]


@pytest.mark.parametrize(
    ("header", "problem"), [c[1:] for c in BAD_ENTRIES], ids=[c[0] for c in BAD_ENTRIES]
)
def test_a_bad_entry_is_one_error_line_naming_the_tensor(
    workdir: Path, header: bytes, problem: str
) -> None:
    """The only tensor is picked by default, so the message names it: ``bad.safetensors:t``."""
    write_raw(workdir / "bad.safetensors", header, bytes(8))
    result = invoke("compute", "bad.safetensors", "bad.safetensors", "bad.safetensors")
    assert assert_one_error_line(result) == f"sdpa: error: bad.safetensors:t: {problem}"


def test_a_huge_declared_shape_is_refused_before_allocating(workdir: Path) -> None:
    """2^60 elements of float64 would be exabytes; the header check comes first."""
    write_raw(workdir / "big.safetensors", entry(dtype="F64", shape=(2**30, 2**30)), bytes(8))
    line = assert_one_error_line(invoke("compute", *["big.safetensors"] * 3))
    assert "shape [1073741824, 1073741824] of F64 is 9223372036854775808 bytes" in line


# --- sdpa compute on safetensors is sdpa compute on the same data -----------------------


def compute_json(*inputs: str) -> Any:
    result = invoke("compute", *inputs, "--format", "json")
    assert result.exit_code == 0, result.output
    return strict_json(result.stdout)


def test_compute_on_one_file_holding_q_k_v_equals_compute_on_npy(workdir: Path) -> None:
    arrays = qkv_arrays()
    write_safetensors(workdir / "f.safetensors", {n: ("F32", a) for n, a in arrays.items()})
    for name, arr in arrays.items():
        np.save(workdir / f"{name}.npy", arr)
    assert compute_json(*QKV) == compute_json("q.npy", "k.npy", "v.npy")


def test_compute_on_files_the_package_wrote_equals_compute_on_npy(workdir: Path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    arrays = qkv_arrays(np.float16)
    for name, arr in arrays.items():
        st.save_file({name: arr}, f"{name}.safetensors")
        np.save(workdir / f"{name}.npy", arr)
    got = compute_json("q.safetensors", "k.safetensors", "v.safetensors")
    assert got == compute_json("q.npy", "k.npy", "v.npy")


def test_compute_on_bfloat16_equals_compute_on_its_float32_values(workdir: Path) -> None:
    """Same values, same stages and findings; only the formats whose headroom is
    reported differ: a bfloat16 run is not a float32 one."""
    bf16 = qkv_arrays(ml_dtypes.bfloat16)
    write_safetensors(workdir / "f.safetensors", {n: ("BF16", a) for n, a in bf16.items()})
    for name, arr in bf16.items():
        np.save(workdir / f"{name}.npy", arr.astype(np.float32))
    as_bf16, as_f32 = compute_json(*QKV), compute_json("q.npy", "k.npy", "v.npy")
    bf16_headroom, f32_headroom = as_bf16.pop("headroom_bits"), as_f32.pop("headroom_bits")
    assert as_bf16 == as_f32
    assert "float32" in f32_headroom
    assert "float32" not in bf16_headroom
    assert bf16_headroom["bfloat16"] == f32_headroom["bfloat16"]


def test_a_tensor_named_twice_in_the_header_is_refused(tmp_path: Path) -> None:
    """json kept the last entry silently: which bytes are "q" depended on the writer."""
    field = '{"dtype": "F32", "shape": [2], "data_offsets": [%d, %d]}'
    header = ('{"q": ' + field % (0, 8) + ', "q": ' + field % (8, 16) + "}").encode()
    path = write_raw(tmp_path / "t.safetensors", header, b"\0" * 16)
    with pytest.raises(InputError) as info:
        load_array(str(path))
    assert info.value.problem == "has a corrupt .safetensors header: it names 'q' twice"
