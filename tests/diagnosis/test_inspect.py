"""Tests of ``sdpa inspect``: the statistics against numpy, the headroom against the casts
themselves, every format, refused files and members, JSON, and the tables at 80 columns.

Expected values are computed independently: numpy's min/max/mean/std on the finite
values, and overflow/underflow by casting with numpy (float16) or ml_dtypes (bfloat16)
and looking at what came out.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from clirunner import ANSI, assert_one_error_line, invoke, strict_json
from numpy.typing import NDArray

from sdpa_cli.diagnosis.inspect import (
    CHUNK,
    FileReport,
    Headroom,
    TensorStats,
    _flat_blocks,
    inspect_array,
    inspect_file,
)
from sdpa_cli.engine.options import OPTION_NAMES
from sdpa_cli.errors import ExitCode, InputError
from sdpa_cli.files.cases import load_case
from sdpa_cli.files.loaders import load_array

F64 = NDArray[np.float64]
FP16_MAX = 65504.0


def write_safetensors(path: Path, tensors: dict[str, tuple[str, NDArray[Any]]]) -> Path:
    """A safetensors file from ``{name: (dtype code, array)}``, written by hand."""
    header: dict[str, Any] = {}
    data = b""
    for name, (code, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": code,
            "shape": list(arr.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


def expected(a: NDArray[Any]) -> dict[str, float]:
    """min, max, mean, std of the finite values, by numpy, in float64."""
    x = np.asarray(a, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    return {"min": x.min(), "max": x.max(), "mean": x.mean(), "std": x.std()}


def assert_stats(t: TensorStats, a: NDArray[Any], rel: float = 1e-12) -> None:
    want = expected(a)
    assert t.min == want["min"]
    assert t.max == want["max"]
    assert t.mean == pytest.approx(want["mean"], rel=rel, abs=1e-300)
    assert t.std == pytest.approx(want["std"], rel=rel)
    assert t.size == a.size
    assert t.shape == a.shape


def headroom(t: TensorStats, name: str) -> Headroom:
    return next(h for h in t.headroom if h.format == name)


def fp16_outcomes(x: F64) -> tuple[int, int, int]:
    """(overflow, flush, subnormal) of a float16 cast, read off numpy's own cast."""
    finite = x[np.isfinite(x)]
    with np.errstate(over="ignore"):
        cast = finite.astype(np.float16).astype(np.float64)
    tiny = float(np.finfo(np.float16).tiny)  # smallest normal
    overflow = int(np.count_nonzero(np.isinf(cast)))
    flush = int(np.count_nonzero((finite != 0) & (cast == 0)))
    subnormal = int(np.count_nonzero((cast != 0) & (np.abs(cast) < tiny)))
    return overflow, flush, subnormal


def bf16_outcomes(x: F64) -> tuple[int, int, int]:
    """(overflow, flush, subnormal) of a bfloat16 cast, read off ml_dtypes' cast."""
    finite = x[np.isfinite(x)]
    with np.errstate(over="ignore"):
        cast = finite.astype(ml_dtypes.bfloat16).astype(np.float64)
    normal = float(ml_dtypes.finfo(ml_dtypes.bfloat16).smallest_normal)  # type: ignore[no-untyped-call]
    overflow = int(np.count_nonzero(np.isinf(cast)))
    flush = int(np.count_nonzero((finite != 0) & (cast == 0)))
    subnormal = int(np.count_nonzero((cast != 0) & (np.abs(cast) < normal)))
    return overflow, flush, subnormal


def outcomes(h: Headroom) -> tuple[int, int, int]:
    return h.overflow, h.flush, h.subnormal


# --- statistics ----------------------------------------------------------------------------


def test_stats_match_numpy_on_a_small_array() -> None:
    a = np.random.default_rng(0).normal(3.0, 2.0, size=(4, 5, 6))
    t = inspect_array(a, "a")
    assert_stats(t, a)
    assert (t.finite, t.nan, t.posinf, t.neginf) == (a.size, 0, 0, 0)
    assert t.absmax == np.abs(a).max()
    assert t.absmin == np.abs(a).min()
    assert t.dtype == "float64"


def test_chunked_and_whole_agree_on_an_array_bigger_than_a_chunk() -> None:
    a = np.random.default_rng(1).normal(size=2 * CHUNK + 3).astype(np.float32)
    a[[5, CHUNK + 1]] = np.nan
    a[2 * CHUNK] = -np.inf
    chunked = inspect_array(a, "a")  # three blocks
    whole = inspect_array(a, "a", chunk=a.size)
    assert_stats(chunked, a)
    assert chunked.mean == pytest.approx(whole.mean, rel=1e-12, abs=1e-15)
    assert chunked.std == pytest.approx(whole.std, rel=1e-12)
    assert (chunked.min, chunked.max, chunked.nan, chunked.neginf) == (
        whole.min,
        whole.max,
        2,
        1,
    )
    assert chunked.headroom == whole.headroom


def test_tiny_chunks_keep_the_spread_of_a_large_offset() -> None:
    """Blocks merged pairwise: 1e9 + N(0, 1) keeps its std of about 1 to 1e-8 (E[x²] − E[x]²
    would lose it all: x² ≈ 1e18 is spaced 128 apart). The block means themselves are
    rounded to 1e9's spacing, 1.2e-7, which bounds the agreement."""
    a = 1e9 + np.random.default_rng(2).normal(size=10_007)
    t = inspect_array(a, "a", chunk=97)
    assert_stats(t, a, rel=1e-7)


def test_nan_and_inf_are_counted_and_left_out_of_the_statistics() -> None:
    a = np.array([1.0, np.nan, 2.0, np.inf, -np.inf, np.inf, 4.0, np.nan, np.nan])
    t = inspect_array(a, "a")
    assert (t.nan, t.posinf, t.neginf, t.inf, t.finite) == (3, 2, 1, 3, 3)
    assert (t.min, t.max, t.mean) == (1.0, 4.0, 7 / 3)
    assert t.std == pytest.approx(np.std([1.0, 2.0, 4.0]), rel=1e-15)
    assert t.absmax == 4.0


def test_one_value_has_std_zero_as_numpy_says() -> None:
    t = inspect_array(np.array([5.0]), "a")
    assert (t.min, t.max, t.mean, t.std) == (5.0, 5.0, 5.0, float(np.std([5.0])))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
def test_an_empty_array_is_empty_without_warnings(shape: tuple[int, ...]) -> None:
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        t = inspect_array(np.zeros(shape, dtype=np.float16), "e")
    assert (t.size, t.finite, t.nan, t.posinf, t.neginf) == (0, 0, 0, 0, 0)
    assert all(math.isnan(v) for v in (t.min, t.max, t.mean, t.std, t.absmax, t.absmin))
    assert all(math.isnan(h.bits) and outcomes(h) == (0, 0, 0) for h in t.headroom)
    assert t.shape == shape


def test_an_all_nan_array_has_no_statistics_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = inspect_array(np.full((2, 3), np.nan), "n")
    assert (t.nan, t.finite) == (6, 0)
    assert all(math.isnan(v) for v in (t.mean, t.std, t.absmax))


def test_zeros_have_infinite_headroom_and_no_smallest_magnitude() -> None:
    t = inspect_array(np.zeros(4), "z")
    assert all(math.isinf(h.bits) and h.bits > 0 for h in t.headroom)
    assert math.isnan(t.absmin)
    assert (t.min, t.max, t.std) == (0.0, 0.0, 0.0)


def test_integers_and_booleans_get_statistics_and_headroom() -> None:
    i = np.array([70_000, -3, 0, 65_504], dtype=np.int32)
    t = inspect_array(i, "i")
    assert_stats(t, i)
    assert t.dtype == "int32"
    assert headroom(t, "float16").overflow == 1
    assert headroom(t, "bfloat16").overflow == 0
    b = np.array([True, False, True, True])
    tb = inspect_array(b, "b")
    assert (tb.dtype, tb.min, tb.max, tb.mean) == ("bool", 0.0, 1.0, 0.75)
    assert tb.std == pytest.approx(np.std(b.astype(float)))
    assert headroom(tb, "float16").bits == pytest.approx(math.log2(FP16_MAX))


# --- headroom: what the cast does ----------------------------------------------------------


def test_values_beyond_float16_overflow_there_but_not_in_bfloat16() -> None:
    # 65519 rounds down to 65504; 65520 is the halfway point and rounds up to inf.
    a = np.array([7e4, -7e4, 65504.0, 65519.0, 65520.0, 1.0, np.inf])
    t = inspect_array(a, "a")
    fp16, bf16 = headroom(t, "float16"), headroom(t, "bfloat16")
    assert fp16.overflow == 3 == fp16_outcomes(a)[0]
    assert outcomes(bf16) == (0, 0, 0) == bf16_outcomes(a)
    assert fp16.bits == pytest.approx(math.log2(FP16_MAX / 7e4))
    assert fp16.bits < 0 < bf16.bits
    assert (fp16.max, t.absmax) == (FP16_MAX, 7e4)


def test_tiny_values_underflow_in_float16_but_not_in_bfloat16() -> None:
    # 1e-8 is below half float16's smallest subnormal (5.96e-8): it becomes 0;
    # 1e-6 and -3e-5 are below its smallest normal (6.1e-5): subnormal; 1e-4 is normal.
    a = np.array([1e-8, -1e-8, 1e-6, -3e-5, 1e-4, 0.0, 1.0])
    t = inspect_array(a, "a")
    fp16, bf16 = headroom(t, "float16"), headroom(t, "bfloat16")
    assert outcomes(fp16) == (0, 2, 2) == fp16_outcomes(a)
    assert outcomes(bf16) == (0, 0, 0) == bf16_outcomes(a)
    assert t.absmin == 1e-8


def test_bfloat16_underflow_is_counted_by_its_own_cast() -> None:
    # bfloat16's smallest normal is 1.18e-38, its smallest subnormal 9.2e-41.
    a = np.array([1e-39, 5e-40, 1e-45, 3e-38, 1.0])
    t = inspect_array(a, "a")
    assert outcomes(headroom(t, "bfloat16")) == bf16_outcomes(a) == (0, 1, 2)
    assert outcomes(headroom(t, "float16")) == fp16_outcomes(a) == (0, 4, 0)


def test_random_magnitudes_agree_with_the_casts() -> None:
    rng = np.random.default_rng(3)
    a = rng.choice([-1.0, 1.0], size=20_000) * 10.0 ** rng.uniform(-46, 40, size=20_000)
    t = inspect_array(a, "a", chunk=1_000)
    assert outcomes(headroom(t, "float16")) == fp16_outcomes(a)
    assert outcomes(headroom(t, "bfloat16")) == bf16_outcomes(a)


def test_a_few_subnormals_in_ordinary_data_are_counted_not_notable() -> None:
    # Regression: randn in float16 got the note "4 values are subnormal in float16":
    # 4 of 131 072 values near zero, each off by at most 3e-8.
    a = np.random.default_rng(0).standard_normal((2, 8, 128, 64)).astype(np.float16)
    fp16 = headroom(inspect_array(a, "a"), "float16")
    assert (fp16.subnormal, fp16.nonzero) == (4, 131_072)
    assert not fp16.subnormal_notable


def test_subnormals_are_notable_from_one_in_a_hundred_nonzero_values() -> None:
    """randn × 0.002 in float16: 2.4% of the values below the smallest normal 6.1e-5."""
    a = (np.random.default_rng(0).standard_normal((2, 8, 128, 64)) * 0.002).astype(np.float16)
    fp16 = headroom(inspect_array(a, "a"), "float16")
    assert (fp16.subnormal, fp16.nonzero) == (3157, 131_072)
    assert fp16.subnormal_notable
    # The boundary: 1 of 100 nonzero values is notable, 1 of 101 is not; zeros do not count.
    assert headroom(
        inspect_array(np.array([1e-6] + [1.0] * 99 + [0.0] * 50), "b"), "float16"
    ).subnormal_notable
    assert not headroom(
        inspect_array(np.array([1e-6] + [1.0] * 100), "c"), "float16"
    ).subnormal_notable


# --- formats -------------------------------------------------------------------------------


def test_npy_is_one_array_named_after_the_file(workdir: Path) -> None:
    a = np.random.default_rng(4).normal(size=(2, 3))
    np.save("q.npy", a)
    r = inspect_file("q.npy")
    assert (r.path, r.format, r.case) == ("q.npy", "npy", False)
    assert [t.name for t in r.tensors] == ["q"]
    assert_stats(r.tensors[0], a)


def test_big_endian_npy_is_read_and_labelled(workdir: Path) -> None:
    a = (np.arange(-6, 6).reshape(3, 4) * 1.5).astype(">f4")
    np.save("be.npy", a)
    t = inspect_file("be.npy").tensors[0]
    assert t.dtype == "float32 (big-endian)"
    assert_stats(t, a)


def test_fortran_npy_is_read_block_by_block_without_a_copy(workdir: Path) -> None:
    a = np.asfortranarray(np.random.default_rng(5).normal(size=(30, 40)))
    np.save("f.npy", a)
    t = inspect_file("f.npy").tensors[0]
    assert_stats(t, a)
    mapped = load_array("f.npy")
    assert (mapped.flags.f_contiguous, mapped.flags.c_contiguous) == (True, False)
    blocks = list(_flat_blocks(mapped, 100))
    assert len(blocks) == 12
    assert all(np.shares_memory(b, mapped) for b in blocks)


def test_npz_reports_every_member_in_name_order(workdir: Path) -> None:
    arrays: dict[str, NDArray[Any]] = {
        "v": np.arange(6.0).reshape(2, 3),
        "k": np.array([[1e5, 1.0]], dtype=np.float32),
        "mask": np.array([True, False]),
    }
    np.savez("c.npz", **arrays)  # type: ignore[arg-type]
    r = inspect_file("c.npz")
    assert r.format == "npz"
    assert [t.name for t in r.tensors] == ["k", "mask", "v"]
    for t in r.tensors:
        assert_stats(t, arrays[t.name])
    assert headroom(r.tensors[0], "float16").overflow == 1
    assert [t.name for t in inspect_file("c.npz:v").tensors] == ["v"]


def test_safetensors_written_by_the_package(workdir: Path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    arrays: dict[str, NDArray[Any]] = {
        "layers.0.q": np.random.default_rng(6).normal(size=(4, 8)).astype(np.float16),
        "layers.0.k": np.arange(12, dtype=np.int32).reshape(3, 4),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    st.save_file(arrays, "m.safetensors")
    r = inspect_file("m.safetensors")
    assert r.format == "safetensors"
    assert [t.name for t in r.tensors] == ["empty", "layers.0.k", "layers.0.q"]
    for t in r.tensors[1:]:
        assert_stats(t, arrays[t.name])
    assert (r.tensors[0].size, r.tensors[0].shape) == (0, (0, 3))
    picked = inspect_file("m.safetensors:layers.0.q")
    assert [(t.name, t.dtype) for t in picked.tensors] == [("layers.0.q", "float16")]


def test_safetensors_written_by_hand_with_bfloat16(workdir: Path) -> None:
    bf = np.array([[1.5, -2.0], [3e38, 1e-39]], dtype=ml_dtypes.bfloat16)
    f64 = np.array([7e4, 1e-8])
    write_safetensors(Path("h.safetensors"), {"b": ("BF16", bf), "f": ("F64", f64)})
    r = inspect_file("h.safetensors")
    b, f = r.tensors
    assert (b.name, b.dtype, f.dtype) == ("b", "bfloat16", "float64")
    assert_stats(b, bf)
    assert outcomes(headroom(b, "bfloat16")) == (0, 0, 1)  # 1e-39 is a bfloat16 subnormal
    assert headroom(b, "float16").overflow == 1  # 3e38
    assert outcomes(headroom(f, "float16")) == (1, 1, 0)


def test_json_nested_list(workdir: Path) -> None:
    Path("x.json").write_text("[[1, 2.5], [-3, 40000]]")
    r = inspect_file("x.json")
    (t,) = r.tensors
    assert (r.format, r.case, t.name, t.shape) == ("json", False, "x", (2, 2))
    assert_stats(t, np.array([[1, 2.5], [-3, 40000]]))


def test_yaml_case_file_reports_inline_and_referenced_tensors(workdir: Path) -> None:
    np.savez("kv.npz", k=np.ones((3, 2)), v=np.full((3, 2), -2.0))
    Path("case.yaml").write_text(
        "description: two files\nq: [[1, 2]]\nk: kv.npz:k\nv: kv.npz:v\ncausal: true\n"
    )
    r = inspect_file("case.yaml")
    assert (r.format, r.case) == ("yaml", True)
    assert [(t.name, t.source) for t in r.tensors] == [
        ("q", None),
        ("k", "kv.npz:k"),
        ("v", "kv.npz:v"),
    ]
    assert (r.tensors[0].mean, r.tensors[2].min) == (1.5, -2.0)


def test_samples_scorecard_case_file() -> None:
    r = inspect_file("samples/scorecard.yaml")
    assert [(t.name, t.shape) for t in r.tensors] == [("q", (2,)), ("k", (3, 2)), ("v", (3, 2))]
    v = r.tensors[2]
    assert (v.min, v.max) == (0.0, 10.0)
    assert v.mean == pytest.approx(10 / 3)


# --- refused files: the loader's words -----------------------------------------------------


def loader_error(call: Any, *args: Any) -> str:
    with pytest.raises(InputError) as info:
        call(*args)
    return str(info.value)


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("obj.npy", lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True)),
        ("c.npy", lambda p: np.save(p, np.array([1 + 2j]))),
        ("t.npy", lambda p: p.write_bytes(_npy_bytes()[:-8])),
        ("n.npy", lambda p: p.write_text("not numpy")),
        ("r.json", lambda p: p.write_text("[[1, 2], [3]]")),
        ("a.yaml", lambda p: p.write_text("- &x [1, 2]\n- *x\n")),
        ("e.safetensors", lambda p: p.write_bytes((2).to_bytes(8, "little") + b"{}")),
    ],
)
def test_a_refused_file_gives_the_loaders_error(workdir: Path, name: str, make: Any) -> None:
    make(Path(name))
    message = loader_error(inspect_file, name)
    if name.endswith("safetensors"):
        assert message == f"{name}: holds no tensors" == loader_error(load_array, name)
    else:
        assert message == loader_error(load_array, name)


def _npy_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.arange(10.0))
    return buf.getvalue()


def test_a_case_file_is_refused_as_compute_refuses_it(workdir: Path) -> None:
    Path("bad.yaml").write_text("q: [1]\nk: [1]\nv: [1]\nfrobnicate: 3\n")
    assert loader_error(inspect_file, "bad.yaml") == loader_error(
        load_case, "bad.yaml", OPTION_NAMES
    )


def test_a_refused_npz_member_is_a_row_and_the_others_are_read(workdir: Path) -> None:
    np.savez("m.npz", good=np.arange(4.0), obj=np.array([1, "x"], dtype=object))
    r = inspect_file("m.npz")
    good, obj = r.tensors
    assert (good.problem, good.mean) == (None, 1.5)
    assert obj.error == "m.npz:obj: holds Python objects (a pickle); sdpa never unpickles"
    assert obj.error == loader_error(load_array, "m.npz:obj")


def test_a_corrupt_safetensors_entry_is_a_row(workdir: Path) -> None:
    path = write_safetensors(Path("s.safetensors"), {"a": ("F32", np.ones(2, np.float32))})
    header = json.loads(path.read_bytes()[8:-8])
    header["z"] = {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + np.ones(2, np.float32).tobytes())
    a, z = inspect_file("s.safetensors").tensors
    assert (a.name, a.mean, a.problem) == ("a", 1.0, None)
    assert z.error == "s.safetensors:z: has complex dtype C64; expected real numbers"


# --- the command ---------------------------------------------------------------------------


def test_cli_table_at_80_columns_fits_and_has_no_escape_codes(workdir: Path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(7)
    st.save_file(
        {
            "model.layers.17.self_attn.q_proj.weight": (rng.normal(size=(64, 64)) * 1e5).astype(
                np.float32
            ),
            "model.layers.17.self_attn.k_proj.bias": (rng.normal(size=64) * 1e-7).astype(
                np.float32
            ),
        },
        "model.safetensors",
    )
    a = np.array([7e4, -1.234567e-5, np.nan, np.inf, -np.inf, 1e-8])
    np.save("mixed.npy", a)
    result = invoke("inspect", "model.safetensors", "mixed.npy", env={"COLUMNS": "80"})
    assert result.exit_code == ExitCode.OK, result.stderr
    assert result.stderr == ""
    assert ANSI not in result.stdout
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert all(line == line.rstrip() for line in lines)
    text = result.stdout
    assert "mixed.npy  .npy, 1 array" in text
    assert "max |x| = 7e4 > float16 max 65504: 1 value overflows to inf" in text
    assert "1 nonzero value flushes to zero in float16" in text
    assert "+1 -1" in text  # infinities by sign
    # Long names lose what all of them share (said once below), and a dtype every
    # tensor has is said there too, so that each tensor's shape stays on its line;
    # short names keep a column each. No header is cut.
    headers = [line.split() for line in lines if line.startswith(("tensor", "name "))]
    assert headers[0] == ["name", "shape", "min", "max", "mean", "std", "nan", "inf"]
    assert ["name", "shape", "dtype", "min", "max", "mean", "std", "nan", "inf"] in headers
    assert "name: model.layers.17.self_attn.‹name› · all float32" in text
    assert re.search(r"\nq_proj\.weight +64×64 +-3\.661e5 ", text)
    assert "-1.235e-5" in text  # four digits, short exponent


def test_cli_color_flag_forces_codes_into_a_pipe() -> None:
    result = invoke("inspect", "samples/cross.npz", "--color")
    assert result.exit_code == 0
    assert ANSI in result.stdout


def test_cli_samples_read_as_a_user_sees_them() -> None:
    result = invoke(
        "inspect", "samples/batched_q.npy", "samples/cross.npz", "samples/scorecard.yaml"
    )
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert "samples/cross.npz  .npz, 3 arrays" in text
    assert "samples/scorecard.yaml  YAML case file, 3 tensors" in text
    assert "2×4×6×8" in text  # batched_q's shape
    q = inspect_file("samples/batched_q.npy").tensors[0]
    assert f"{q.mean:.4g}" in text


def test_cli_json_parses_and_carries_the_values(workdir: Path) -> None:
    a = np.array([7e4, 1e-8, np.nan, np.inf, 2.0])
    np.save("a.npy", a)
    np.save("z.npy", np.zeros(3))
    np.save("e.npy", np.zeros((0, 2)))
    result = invoke("inspect", "a.npy", "z.npy", "e.npy", "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = strict_json(result.stdout)
    files = doc["files"]
    assert [f["path"] for f in files] == ["a.npy", "z.npy", "e.npy"]
    t = files[0]["tensors"][0]
    assert (t["name"], t["shape"], t["dtype"]) == ("a", [5], "float64")
    assert (t["nan"], t["posinf"], t["neginf"], t["finite"]) == (1, 1, 0, 3)
    assert t["mean"] == pytest.approx(expected(a)["mean"])
    assert t["headroom"]["float16"]["overflow"] == 1
    assert t["headroom"]["float16"]["flush"] == 1
    assert t["headroom"]["bfloat16"] == {
        "max": pytest.approx(3.3895313892515355e38),
        "bits": pytest.approx(math.log2(3.3895313892515355e38 / 7e4)),
        "overflow": 0,
        "flush": 0,
        "subnormal": 0,
        "subnormal_notable": False,
    }
    assert files[1]["tensors"][0]["headroom"]["float16"]["bits"] == "Infinity"
    empty = files[2]["tensors"][0]
    assert (empty["size"], empty["min"], empty["std"]) == (0, None, None)


def test_cli_json_of_finite_values_whose_mean_overflows(workdir: Path) -> None:
    """Regression: the mean of huge finite float64 values is inf, which standard JSON
    cannot hold; it was an internal error (exit 3), it is the string "Infinity"."""
    a = np.array([1e308, 1e308, -1e308, 1.5e308])
    np.save("big.npy", a)
    result = invoke("inspect", "big.npy", "--format", "json")
    assert result.exit_code == 0, result.stderr
    t = strict_json(result.stdout)["files"][0]["tensors"][0]
    with np.errstate(over="ignore"):
        mean = float(np.sum(a) / a.size)
    assert math.isinf(mean)
    assert t["mean"] == "Infinity"
    assert (t["min"], t["max"]) == (-1e308, 1.5e308)


def test_cli_missing_file_is_one_error_line(workdir: Path) -> None:
    line = assert_one_error_line(invoke("inspect", "missing.npy"))
    assert line == "sdpa: error: missing.npy: no such file"


def test_cli_pickled_npy_is_one_error_line_without_a_traceback(workdir: Path) -> None:
    np.save("obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    line = assert_one_error_line(invoke("inspect", "obj.npy"))
    assert line == "sdpa: error: obj.npy: holds Python objects (a pickle); sdpa never unpickles"


def test_cli_reads_every_file_and_exits_2_for_the_bad_ones(workdir: Path) -> None:
    np.save("good.npy", np.arange(3.0))
    np.savez("m.npz", ok=np.ones(2), obj=np.array([1, "x"], dtype=object))
    result = invoke("inspect", "missing.npy", "good.npy", "m.npz")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert "good.npy  .npy, 1 array" in result.stdout
    assert "obj: refused: holds Python objects" in result.stdout
    assert result.stderr.splitlines() == [
        "sdpa: error: missing.npy: no such file",
        "sdpa: error: m.npz:obj: holds Python objects (a pickle); sdpa never unpickles",
    ]
    assert "Traceback" not in result.output


def test_cli_json_lists_unreadable_files_with_their_error(workdir: Path) -> None:
    np.save("good.npy", np.arange(3.0))
    result = invoke("inspect", "nope.json", "good.npy", "--format", "json")
    assert result.exit_code == ExitCode.BAD_INPUT
    files = strict_json(result.stdout)["files"]
    assert files[0] == {"path": "nope.json", "tensors": [], "error": "nope.json: no such file"}
    assert files[1]["tensors"][0]["mean"] == 1.0
    assert result.stderr == "sdpa: error: nope.json: no such file\n"


def test_cli_needs_a_file() -> None:
    result = invoke("inspect")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stdout == ""


def test_cli_help_has_an_example() -> None:
    result = invoke("inspect", "--help")
    assert result.exit_code == 0
    for word in ("Example", "sdpa inspect", ".npz", ".safetensors", ".json", ".yaml", "--format"):
        assert word in result.stdout, word


def test_file_report_is_plain_data() -> None:
    r = inspect_file("samples/cross.npz")
    assert isinstance(r, FileReport)
    assert all(isinstance(t, TensorStats) for t in r.tensors)


@pytest.mark.parametrize("width", [60, 80, 100])
def test_tables_fit_the_width_without_folding_short_cells(workdir: Path, width: int) -> None:
    from io import StringIO

    from rich.console import Console

    from sdpa_cli.render.inspect import render_inspect

    long_name = "model.layers.17.self_attn.q_proj.weight"
    arrays: dict[str, NDArray[Any]] = {long_name: np.full((64, 64), -1.5e5, np.float32)}
    np.savez("m.npz", **arrays)  # type: ignore[arg-type]
    np.save("q.npy", np.random.default_rng(8).normal(size=(2, 4, 6, 8)))
    scorecard = str(Path(__file__).parents[2] / "samples" / "scorecard.yaml")
    reports = [inspect_file(p) for p in ("q.npy", "m.npz", scorecard)]
    console = Console(file=StringIO(), width=width, no_color=True, color_system=None)
    console.print(*render_inspect(reports, width))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert max(len(line.rstrip()) for line in text.splitlines()) <= width
    for word in ("float64", "float32", "int64", "2×4×6×8", "-1.5e5", "+15.0 bits"):
        assert word in text, word
    assert long_name in text.replace("\n", "").replace(" ", "")


# --- names from a hostile file ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_cli_shows_a_hostile_key_escaped_and_keeps_it_exact_in_json(
    workdir: Path, fmt: str
) -> None:
    key = "q\x1b]0;pwn\x07" if fmt == "npz" else "q\x1b[31m"
    shown = key.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
    big = np.array([1e5, 2.0])  # overflows float16: a note names the tensor too
    if fmt == "npz":
        np.savez("h.npz", **{key: big})  # type: ignore[arg-type]
    else:
        write_safetensors(Path("h.safetensors"), {key: ("F64", big)})
    table = invoke("inspect", f"h.{fmt}", env={"COLUMNS": "80"})
    assert table.exit_code == ExitCode.OK
    assert "\x1b" not in table.stdout
    assert "\x07" not in table.stdout
    assert table.stdout.count(shown) == 3  # the two tables and the overflow note
    assert f"{shown}: max |x| = 1e5 > float16 max 65504" in table.stdout
    # JSON is data: the exact key (json.dumps writes \u001b), which loads the tensor.
    document = invoke("inspect", f"h.{fmt}", "--format", "json")
    assert "\x1b" not in document.stdout
    (tensor,) = strict_json(document.stdout)["files"][0]["tensors"]
    assert (tensor["name"], tensor["max"]) == (key, 1e5)


def test_a_refused_member_with_a_hostile_key_is_named_escaped(workdir: Path) -> None:
    np.savez("m.npz", **{"o\x1b[2J": np.array([1, "x"], dtype=object)})  # type: ignore[arg-type]
    result = invoke("inspect", "m.npz")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert "\x1b" not in result.output
    assert result.stderr == (
        "sdpa: error: m.npz:o\\x1b[2J: holds Python objects (a pickle); sdpa never unpickles\n"
    )
    assert "o\\x1b[2J: refused: holds Python objects" in result.stdout
