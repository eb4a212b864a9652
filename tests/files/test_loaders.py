"""Tests of sdpa_cli.files.loaders: every input format, the safety checks, case files, atomic writes."""

from __future__ import annotations

import json
import os
import stat
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest
from numpy.typing import NDArray

from sdpa_cli.engine.options import OPTION_NAMES
from sdpa_cli.errors import InputError
from sdpa_cli.files.cases import load_case
from sdpa_cli.files.loaders import Source, load_array
from sdpa_cli.files.structured import nested_to_array
from sdpa_cli.files.writers import write_atomic


def write_text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def save_npy(path: Path, arr: NDArray[Any], *, allow_pickle: bool = False) -> Path:
    """``np.save`` to exactly ``path`` (whatever its extension)."""
    with path.open("wb") as fh:
        np.save(fh, arr, allow_pickle=allow_pickle)
    return path


def input_error(source: str | Path, **kwargs: Any) -> InputError:
    """The InputError that loading ``source`` raises."""
    with pytest.raises(InputError) as info:
        load_array(str(source), **kwargs)
    return info.value


# --- each format loads the right values and dtype ------------------------------------


def test_npy_loads_into_memory_with_values_and_dtype(tmp_path: Path) -> None:
    expected = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    arr = load_array(str(save_npy(tmp_path / "q.npy", expected)))
    assert not isinstance(arr, np.memmap)  # a truncated file must not SIGBUS
    assert arr.base is None or not isinstance(arr.base, np.memmap)
    assert arr.dtype == np.float32
    np.testing.assert_array_equal(arr, expected)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16, np.float16, np.bool_])
def test_npy_keeps_its_dtype(tmp_path: Path, dtype: type[np.generic]) -> None:
    expected = (np.arange(6).reshape(2, 3) % 3).astype(dtype)
    arr = load_array(str(save_npy(tmp_path / "a.npy", expected)))
    assert arr.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(arr, expected)


def test_npy_scalar_and_empty(tmp_path: Path) -> None:
    scalar = load_array(str(save_npy(tmp_path / "s.npy", np.array(2.5))))
    assert scalar.shape == ()
    assert float(scalar) == 2.5
    empty = load_array(str(save_npy(tmp_path / "e.npy", np.zeros((0, 3), np.float32))))
    assert empty.shape == (0, 3)
    assert empty.dtype == np.float32


def test_big_endian_npy_loads_right_values(tmp_path: Path) -> None:
    values = np.array([[1.5, -2.25, 1e300], [0.0, 3.0, -7.5]])
    arr = load_array(str(save_npy(tmp_path / "be.npy", values.astype(">f8"))))
    assert arr.dtype == np.dtype(">f8")
    np.testing.assert_array_equal(arr, values)
    ints = load_array(str(save_npy(tmp_path / "bei.npy", np.array([1, -2, 70000], ">i4"))))
    assert ints.tolist() == [1, -2, 70000]


def test_fortran_order_npy_loads_right_values(tmp_path: Path) -> None:
    values = np.arange(12.0).reshape(3, 4)
    fortran = np.asfortranarray(values)
    assert fortran.flags.f_contiguous
    assert not fortran.flags.c_contiguous
    arr = load_array(str(save_npy(tmp_path / "f.npy", fortran)))
    assert arr.shape == (3, 4)
    np.testing.assert_array_equal(arr, values)
    assert arr[1, 2] == 6.0
    assert arr.flags.f_contiguous


def test_json_ints_stay_ints(tmp_path: Path) -> None:
    arr = load_array(str(write_text(tmp_path / "a.json", "[[1, 2, 3], [4, 5, 6]]")))
    assert arr.dtype.kind == "i"
    assert arr.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_json_floats(tmp_path: Path) -> None:
    arr = load_array(str(write_text(tmp_path / "a.json", "[[1, 2.5], [-3e-2, 4]]")))
    assert arr.dtype == np.float64
    np.testing.assert_array_equal(arr, [[1.0, 2.5], [-0.03, 4.0]])


def test_json_booleans_become_a_bool_array(tmp_path: Path) -> None:
    arr = load_array(str(write_text(tmp_path / "m.json", "[[true, false], [false, true]]")))
    assert arr.dtype == np.bool_
    np.testing.assert_array_equal(arr, np.eye(2, dtype=bool))


def test_json_mixing_booleans_and_numbers_is_refused(tmp_path: Path) -> None:
    err = input_error(write_text(tmp_path / "m.json", "[[true, 1]]"), name="mask")
    assert str(err).startswith(str(tmp_path / "m.json"))
    assert "mask mixes booleans and numbers" in str(err)


def test_json_non_finite_literals(tmp_path: Path) -> None:
    arr = load_array(str(write_text(tmp_path / "a.json", "[NaN, Infinity, -Infinity, 1]")))
    assert np.isnan(arr[0])
    assert arr[1:].tolist() == [np.inf, -np.inf, 1.0]


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_values_and_dtypes(tmp_path: Path, suffix: str) -> None:
    ints = load_array(str(write_text(tmp_path / f"i{suffix}", "- [1, 2]\n- [3, 4]\n")))
    assert ints.dtype.kind == "i"
    assert ints.tolist() == [[1, 2], [3, 4]]
    floats = load_array(str(write_text(tmp_path / f"f{suffix}", "[[0.5, -.inf], [2, 1.0e+3]]")))
    assert floats.dtype == np.float64
    assert floats.tolist() == [[0.5, -np.inf], [2.0, 1000.0]]
    bools = load_array(str(write_text(tmp_path / f"b{suffix}", "[[true, false]]")))
    assert bools.dtype == np.bool_
    assert bools.tolist() == [[True, False]]


def test_text_scalar_is_zero_dimensional(tmp_path: Path) -> None:
    arr = load_array(str(write_text(tmp_path / "s.json", "3.5")))
    assert arr.shape == ()
    assert float(arr) == 3.5


def test_text_empty_list_is_float(tmp_path: Path) -> None:
    arr = load_array(str(write_text(tmp_path / "e.json", "[[], []]")))
    assert arr.shape == (2, 0)
    assert arr.dtype == np.float64


# --- npz -----------------------------------------------------------------------------


def test_npz_member_selection(tmp_path: Path) -> None:
    q = np.arange(6.0).reshape(2, 3)
    k = np.arange(4, dtype=np.int16).reshape(2, 2)
    np.savez(tmp_path / "t.npz", q=q, k=k)
    got_q = load_array(f"{tmp_path / 't.npz'}:q")
    got_k = load_array(f"{tmp_path / 't.npz'}:k")
    np.testing.assert_array_equal(got_q, q)
    assert got_k.dtype == np.int16
    np.testing.assert_array_equal(got_k, k)


def test_compressed_npz(tmp_path: Path) -> None:
    v = np.linspace(-1, 1, 10).reshape(2, 5)
    np.savez_compressed(tmp_path / "c.npz", v=v)
    np.testing.assert_array_equal(load_array(f"{tmp_path / 'c.npz'}:v"), v)


def test_one_array_npz_needs_no_name(tmp_path: Path) -> None:
    only = np.array([[1.0, 2.0]])
    np.savez(tmp_path / "one.npz", only=only)
    np.testing.assert_array_equal(load_array(str(tmp_path / "one.npz")), only)


def test_npz_missing_name_lists_the_names(tmp_path: Path) -> None:
    np.savez(tmp_path / "t.npz", q=np.zeros(2), k=np.zeros(2))
    label = f"{tmp_path / 't.npz'}:v"
    err = input_error(label)
    assert err.where == label
    assert "'v'" in err.problem
    assert "names: k, q" in err.problem


def test_npz_with_several_arrays_needs_a_name(tmp_path: Path) -> None:
    np.savez(tmp_path / "t.npz", q=np.zeros(2), k=np.zeros(2))
    err = input_error(tmp_path / "t.npz")
    assert err.where == str(tmp_path / "t.npz")
    assert "holds 2 arrays" in err.problem
    assert "k, q" in err.problem


def test_npz_with_no_arrays_says_so(tmp_path: Path) -> None:
    np.savez(tmp_path / "none.npz")
    err = input_error(tmp_path / "none.npz")
    assert err.problem == "holds no arrays"


def test_npz_object_member_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "o.npz", a=np.array([1, "x"], dtype=object))
    err = input_error(f"{tmp_path / 'o.npz'}:a")
    assert err.where == f"{tmp_path / 'o.npz'}:a"
    assert "pickle" in err.problem


def test_npz_member_errors_name_the_member_once(tmp_path: Path) -> None:
    np.savez(tmp_path / "one.npz", a=np.ones(2, dtype=np.complex64))
    implicit = input_error(tmp_path / "one.npz")
    assert implicit.where == f"{tmp_path / 'one.npz'}:a"
    explicit = input_error(f"{tmp_path / 'one.npz'}:a")
    assert explicit.where == f"{tmp_path / 'one.npz'}:a"
    assert "complex" in explicit.problem


def test_npz_corrupt_member_header_refused(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "t.npz", "w") as zf:
        zf.writestr("a.npy", b"\x93NUMPY\x01\x00\x10\x00{'descr': garbage")
    err = input_error(f"{tmp_path / 't.npz'}:a")
    assert err.where == f"{tmp_path / 't.npz'}:a"
    assert "corrupt" in err.problem


def test_npz_truncated_member_refused(tmp_path: Path) -> None:
    member = tmp_path / "member.npy"
    with member.open("wb") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": "<f8", "fortran_order": False, "shape": (100_000, 100_000)}
        )
        fh.write(b"\0" * 16)
    with zipfile.ZipFile(tmp_path / "t.npz", "w") as zf:
        zf.write(member, "a.npy")
    err = input_error(tmp_path / "t.npz")
    assert "truncated" in err.problem


def test_npz_name_with_relative_base(tmp_path: Path) -> None:
    src = Source.parse("data/t.npz:q", base=tmp_path)
    assert src.path == tmp_path / "data" / "t.npz"
    assert src.member == "q"


# --- safety ----------------------------------------------------------------------------


def test_pickled_object_npy_refused_without_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.mkdir, (str(marker),))

    obj = np.empty(2, dtype=object)
    obj[0], obj[1] = Payload(), 1
    path = save_npy(tmp_path / "evil.npy", obj, allow_pickle=True)
    # The file really is a pickle that would run os.mkdir if unpickled.
    assert b"mkdir" in path.read_bytes()
    err = input_error(path)
    assert err.where == str(path)
    assert "pickle" in err.problem
    assert not marker.exists()
    # The payload is live: unpickling it does run os.mkdir.
    np.load(path, allow_pickle=True)
    assert marker.is_dir()


def test_truncated_npy_refused_before_allocating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "huge.npy"
    with path.open("wb") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": "<f8", "fortran_order": False, "shape": (10**7, 10**7)}
        )
        fh.write(b"\0" * 64)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the loader read the data of a truncated file")

    monkeypatch.setattr(np, "load", forbidden)
    monkeypatch.setattr(np, "memmap", forbidden)
    monkeypatch.setattr(np, "zeros", forbidden)
    monkeypatch.setattr(np, "empty", forbidden)
    err = input_error(path)
    assert err.where == str(path)
    assert "truncated" in err.problem
    assert "(10000000, 10000000)" in err.problem
    assert str(8 * 10**14) in err.problem  # the declared bytes
    assert "64 bytes follow" in err.problem


def test_npy_with_corrupt_header_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': garbage")
    err = input_error(path)
    assert err.where == str(path)
    assert "header" in err.problem


def test_npy_corrupt_header_message_has_no_memory_address(tmp_path: Path) -> None:
    """Regression: numpy's parser words a bare name in the header as ``malformed node or
    string on line 1: <ast.Name object at 0x7f…>``, an address that changes every run."""
    header = b"{'descr': garbage, 'fortran_order': False, 'shape': (2,), }"
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    path = tmp_path / "bad.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
    err = input_error(path)
    assert err.where == str(path)
    assert err.problem.startswith("has a corrupt .npy header (")
    assert "<ast.Name object>" in err.problem  # the object named, its address dropped
    assert "0x" not in err.problem


@pytest.mark.parametrize(
    ("arr", "word"),
    [
        (np.ones(3, dtype=np.complex128), "complex"),
        (np.array(["a", "b"]), "string"),
        (np.array([b"a"]), "bytes"),
        (np.zeros(2, dtype=[("a", "f8"), ("b", "i4")]), "structured"),
        (np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime"),
    ],
)
def test_non_real_dtypes_refused(tmp_path: Path, arr: NDArray[Any], word: str) -> None:
    path = save_npy(tmp_path / "x.npy", arr)
    err = input_error(path)
    assert err.where == str(path)
    assert word in err.problem
    assert str(arr.dtype) in err.problem


def test_yaml_alias_refused(tmp_path: Path) -> None:
    path = write_text(tmp_path / "a.yaml", "- &row [1, 2]\n- *row\n")
    err = input_error(path)
    assert err.where == str(path)
    assert "alias" in err.problem
    assert "line 2" in err.problem


def test_yaml_billion_laughs_refused_quickly(tmp_path: Path) -> None:
    lines = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, 12):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]")
    err = input_error(write_text(tmp_path / "lol.yaml", "\n".join(lines)))
    assert "alias" in err.problem


@pytest.mark.parametrize(
    "text",
    [
        "!!python/object/apply:os.mkdir ['{marker}']\n",
        "- !!python/object:pathlib.Path {{}}\n",
        "- !!python/name:os.system\n",
    ],
)
def test_yaml_python_tags_refused(tmp_path: Path, text: str) -> None:
    marker = tmp_path / "pwned"
    path = write_text(tmp_path / "t.yaml", text.format(marker=marker))
    err = input_error(path)
    assert err.where == str(path)
    assert "python/" in err.problem
    assert "invalid YAML" in err.problem
    assert not marker.exists()


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    text = "[[1, 2],\n [3, x]]"
    with pytest.raises(json.JSONDecodeError) as reference:
        json.loads(text)
    path = write_text(tmp_path / "bad.json", text)
    err = input_error(path)
    assert err.where == str(path)
    assert "invalid JSON" in err.problem
    # The 'x' sits on line 2, column 6 (1-based), as json itself reports.
    assert (reference.value.lineno, reference.value.colno) == (2, 6)
    assert "line 2 column 6" in err.problem


def test_invalid_yaml_reports_the_line(tmp_path: Path) -> None:
    path = write_text(tmp_path / "bad.yaml", "- [1, 2]\n- [3, 4\n- [5, 6]\n")
    err = input_error(path)
    assert err.where == str(path)
    assert err.problem.startswith("invalid YAML at line ")


def test_non_utf8_text_refused(tmp_path: Path) -> None:
    path = tmp_path / "latin.json"
    path.write_bytes(b"[1, 2] \xff\xfe")
    err = input_error(path)
    assert "UTF-8" in err.problem


def test_deep_nesting_refused(tmp_path: Path) -> None:
    path = write_text(tmp_path / "deep.json", "[" * 40 + "1" + "]" * 40)
    err = input_error(path)
    assert "nested more than" in err.problem


@pytest.mark.parametrize(
    ("text", "path_in_message", "words"),
    [
        ("[[1, 2], [3]]", "q[1]", "expected 2 entries, got 1"),
        ("[[[1], [2]], [[3], 4]]", "q[1][1]", "ragged"),
        ("[[1, 2], [3, [4]]]", "q[1][1]", "ragged"),
        ("[[1, 2], [3, 4, 5]]", "q[1]", "expected 2 entries, got 3"),
        ('[[1, 2], [3, "x"]]', "q[1][1]", "expected a number, got str 'x'"),
        ("[[1, 2], [3, null]]", "q[1][1]", "expected a number"),
        ('[[1, {"a": 1}]]', "q[0][1]", "expected a number"),
    ],
)
def test_ragged_and_non_numeric_lists_name_the_path(
    tmp_path: Path, text: str, path_in_message: str, words: str
) -> None:
    path = write_text(tmp_path / "q.json", text)
    err = input_error(path, name="q")
    assert err.where == str(path)
    assert err.problem.startswith(f"{path_in_message}: ")
    assert words in err.problem


def test_mapping_is_not_a_tensor(tmp_path: Path) -> None:
    err = input_error(write_text(tmp_path / "m.json", '{"a": [1, 2]}'), name="k")
    assert "k is a mapping" in err.problem


def test_nested_to_array_names_the_tensor() -> None:
    with pytest.raises(InputError, match=r"^case\.yaml: v\[0\]\[2\]: expected a number"):
        nested_to_array([[1, 2, "three"]], "case.yaml", "v")


# --- extension vs content, missing and odd files -------------------------------------------


def test_npy_named_json_is_read_by_sniffing(tmp_path: Path) -> None:
    values = np.arange(6.0).reshape(2, 3)
    arr = load_array(str(save_npy(tmp_path / "actually_npy.json", values)))
    np.testing.assert_array_equal(arr, values)


def test_npz_named_npy_is_read_by_sniffing(tmp_path: Path) -> None:
    values = np.arange(4.0)
    with (tmp_path / "actually_npz.npy").open("wb") as fh:
        np.savez(fh, a=values)
    np.testing.assert_array_equal(load_array(str(tmp_path / "actually_npz.npy")), values)


def test_json_named_npy_is_refused(tmp_path: Path) -> None:
    path = write_text(tmp_path / "q.npy", "[[1, 2], [3, 4]]")
    err = input_error(path)
    assert err.where == str(path)
    assert "is not a .npy file" in err.problem


def test_text_named_npz_is_refused(tmp_path: Path) -> None:
    path = write_text(tmp_path / "q.npz", "[[1, 2]]")
    err = input_error(path)
    assert "is not a .npz file" in err.problem


def test_unknown_extension_refused(tmp_path: Path) -> None:
    path = write_text(tmp_path / "q.txt", "[[1, 2]]")
    err = input_error(path)
    assert err.where == str(path)
    assert "unknown format '.txt'" in err.problem


def test_missing_file(tmp_path: Path) -> None:
    err = input_error(tmp_path / "nope.npy")
    assert str(err) == f"{tmp_path / 'nope.npy'}: no such file"


def test_directory(tmp_path: Path) -> None:
    (tmp_path / "dir.npy").mkdir()
    err = input_error(tmp_path / "dir.npy")
    assert err.where == str(tmp_path / "dir.npy")
    assert "directory" in err.problem


@pytest.mark.parametrize("name", ["e.npy", "e.npz", "e.json", "e.yaml"])
def test_empty_file(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"")
    err = input_error(tmp_path / name)
    assert str(err) == f"{tmp_path / name}: is empty"


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_npy(tmp_path / "secret.npy", np.zeros(2))

    def denied(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "open", denied)  # root reads any file: chmod 000 would not do
    err = input_error(path)
    assert str(err) == f"{path}: permission denied"


def test_label_is_the_text_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    err = input_error("missing/q.npy")
    assert str(err) == "missing/q.npy: no such file"


# --- case files --------------------------------------------------------------------------


def test_case_inline_tensors_and_options(tmp_path: Path) -> None:
    path = write_text(
        tmp_path / "case.yaml",
        "description: a tiny case\n"
        "q: [[1, 0], [0, 1]]\n"
        "k: [[1, 0], [0, 1], [1, 1]]\n"
        "v: [[1.5], [2.5], [3.5]]\n"
        "mask: [[true, true, false], [true, true, true]]\n"
        "causal: true\n"
        "causal-align: lower-right\n"
        "mask_value: -1.0e+9\n",
    )
    case = load_case(str(path), OPTION_NAMES)
    assert case.description == "a tiny case"
    assert case.tensors["q"].tolist() == [[1, 0], [0, 1]]
    assert case.tensors["q"].dtype.kind == "i"
    assert case.tensors["v"].dtype == np.float64
    assert case.tensors["mask"].dtype == np.bool_
    assert case.options == {"causal": True, "causal_align": "lower-right", "mask_value": -1e9}
    assert case.where["causal_align"] == f"{path}: causal-align"
    assert case.sources["q"] == f"{path}: q"


def test_case_json_with_underscored_options(tmp_path: Path) -> None:
    data = {
        "q": [[1.0, 2.0]],
        "k": [[3.0, 4.0]],
        "v": [[5.0]],
        "key_lengths": [1],
        "mask_true_means": "masked",
    }
    path = write_text(tmp_path / "case.json", json.dumps(data))
    case = load_case(str(path), OPTION_NAMES)
    assert case.options == {"key_lengths": [1], "mask_true_means": "masked"}
    assert case.description is None
    assert case.tensors["k"].tolist() == [[3.0, 4.0]]


def test_case_paths_are_relative_to_the_case_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cases" / "data").mkdir(parents=True)
    q = np.arange(6.0).reshape(2, 3)
    k = np.arange(12.0).reshape(4, 3) / 10
    v = np.arange(8, dtype=np.int32).reshape(4, 2)
    save_npy(tmp_path / "cases" / "data" / "q.npy", q)
    np.savez(tmp_path / "cases" / "data" / "kv.npz", k=k, v=v)
    write_text(
        tmp_path / "cases" / "case.yaml",
        "q: data/q.npy\nk: data/kv.npz:k\nv: data/kv.npz:v\n",
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    case = load_case("../cases/case.yaml", OPTION_NAMES)
    np.testing.assert_array_equal(case.tensors["q"], q)
    np.testing.assert_array_equal(case.tensors["k"], k)
    np.testing.assert_array_equal(case.tensors["v"], v)
    assert case.tensors["v"].dtype == np.int32
    assert case.sources["k"].endswith("kv.npz:k")


def test_case_missing_referenced_file_names_it(tmp_path: Path) -> None:
    path = write_text(tmp_path / "case.yaml", "q: gone.npy\nk: [[1]]\nv: [[1]]\n")
    with pytest.raises(InputError) as info:
        load_case(str(path), OPTION_NAMES)
    assert info.value.where == str(tmp_path / "gone.npy")
    assert info.value.problem == "no such file"


def test_case_missing_q(tmp_path: Path) -> None:
    path = write_text(tmp_path / "case.yaml", "k: [[1]]\nv: [[1]]\n")
    with pytest.raises(InputError) as info:
        load_case(str(path), OPTION_NAMES)
    assert info.value.where == str(path)
    assert "missing q" in info.value.problem


def test_case_unknown_key(tmp_path: Path) -> None:
    path = write_text(tmp_path / "case.yaml", "q: [[1]]\nk: [[1]]\nv: [[1]]\ncasual: true\n")
    with pytest.raises(InputError) as info:
        load_case(str(path), OPTION_NAMES)
    assert info.value.where == str(path)
    assert "unknown key 'casual'" in info.value.problem
    assert "causal" in info.value.problem  # the known keys are listed


def test_case_ragged_inline_tensor_names_the_path(tmp_path: Path) -> None:
    path = write_text(tmp_path / "case.yaml", "q: [[1, 2], [3]]\nk: [[1, 2]]\nv: [[1]]\n")
    with pytest.raises(InputError) as info:
        load_case(str(path), OPTION_NAMES)
    assert info.value.where == str(path)
    assert info.value.problem.startswith("q[1]: ")


@pytest.mark.parametrize("text", ["[1, 2, 3]\n", "just a string\n"])
def test_case_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    path = write_text(tmp_path / "case.yaml", text)
    with pytest.raises(InputError, match="mapping"):
        load_case(str(path), OPTION_NAMES)


def test_case_that_is_really_npy_refused(tmp_path: Path) -> None:
    path = save_npy(tmp_path / "case.json", np.zeros(2))
    with pytest.raises(InputError, match="case file"):
        load_case(str(path), OPTION_NAMES)


# --- write_atomic --------------------------------------------------------------------------


def test_write_atomic_writes_the_file(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"

    def write(fh: BinaryIO) -> None:
        fh.write(b"payload")

    write_atomic(target, write)
    assert target.read_bytes() == b"payload"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_write_atomic_gives_a_new_file_the_usual_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "out.bin", lambda fh: fh.write(b"x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.bin").stat().st_mode) == 0o644


def test_write_atomic_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    target.chmod(0o640)
    write_atomic(target, lambda fh: fh.write(b"new"))
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_write_atomic_leaves_nothing_when_the_writer_raises(tmp_path: Path) -> None:
    def write(fh: BinaryIO) -> None:
        fh.write(b"partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_atomic(tmp_path / "out.npz", write)
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_leaves_an_existing_file_untouched_when_the_writer_raises(
    tmp_path: Path,
) -> None:
    target = tmp_path / "out.npz"
    target.write_bytes(b"precious")

    def write(fh: BinaryIO) -> None:
        fh.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, write)
    assert target.read_bytes() == b"precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out.npz"]


def test_write_atomic_into_a_missing_directory(tmp_path: Path) -> None:
    target = tmp_path / "nodir" / "out.npz"
    with pytest.raises(InputError) as info:
        write_atomic(target, lambda fh: fh.write(b"x"))
    assert info.value.where == str(target)
    assert "does not exist" in info.value.problem
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_onto_a_directory(tmp_path: Path) -> None:
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(InputError) as info:
        write_atomic(tmp_path / "d.npz", lambda fh: fh.write(b"x"))
    assert "directory" in info.value.problem
    assert [p.name for p in tmp_path.iterdir()] == ["d.npz"]
    assert list((tmp_path / "d.npz").iterdir()) == []
