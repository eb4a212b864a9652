"""``--layout bshd`` and ``--kv-heads``: tensors read as they are stored.

A (B, L, H, E) tensor under ``--layout bshd`` gives the numbers its transpose gives
under the default layout, read through a view; the output comes back (B, L, H, Ev) in
every document, file and check. ``--heads H --kv-heads G`` splits (…, L, d_model)
inputs as ONNX's 3-D Attention does: Q into H heads, K and V into G.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from clirunner import assert_one_error_line, invoke, strict_json
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.engine.grad import backward, make_dout
from sdpa_cli.engine.options import Options, parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import loaded_index, split_heads_of_output, trace
from sdpa_cli.errors import ExitCode, SpecError

F64 = NDArray[np.float64]


def normal(seed: int, *shape: int) -> F64:
    return np.random.default_rng(seed).standard_normal(shape)


def bshd(a: F64) -> F64:
    """(B, H, L, E) → (B, L, H, E), stored so (a copy, as a file holds it)."""
    return np.ascontiguousarray(np.swapaxes(a, 1, 2))


# B = 2, H = 4 query heads over G = 2 K/V heads, L = 5, S = 7, E = 8, Ev = 3.
Q, K, V = normal(1, 2, 4, 5, 8), normal(2, 2, 2, 7, 8), normal(3, 2, 2, 7, 3)


# --- the engine ---------------------------------------------------------------------------


def test_bshd_tensors_give_the_numbers_of_their_transpose() -> None:
    want = trace(build_spec(Q, K, V, options=Options(causal=True)), stages=("weights", "output"))
    spec = build_spec(bshd(Q), bshd(K), bshd(V), options=Options(causal=True, layout="bshd"))
    got = trace(spec, stages=("weights", "output"))
    assert spec.lead == (2, 4)
    assert spec.group == 2
    assert got.weights is not None
    assert want.weights is not None
    np.testing.assert_array_equal(got.weights, want.weights)
    assert got.merged_output is not None
    assert want.output is not None
    assert got.merged_output.shape == (2, 5, 4, 3)
    np.testing.assert_array_equal(got.merged_output, bshd(want.output))
    # And both are the float64 loop reference's.
    ref = attention(Q, K, V, causal=True)
    np.testing.assert_allclose(got.merged_output, bshd(ref.output), rtol=1e-12, atol=1e-12)


def test_bshd_is_read_through_a_view_not_a_copy() -> None:
    q, k, v = bshd(Q), bshd(K), bshd(V)
    spec = build_spec(q, k, v, options=Options(layout="bshd"))
    for name, given in (("q", q), ("k", k), ("v", v)):
        held = getattr(spec, name)
        assert np.shares_memory(held, given)
        assert held.shape == np.swapaxes(given, 1, 2).shape
        # Indices in messages point into the file as it is.
        np.testing.assert_array_equal(spec.as_loaded(name), given)


def test_bshd_three_axes_are_l_h_e_and_two_axes_have_no_head_axis() -> None:
    q3 = bshd(Q)[0]  # (L, H, E)
    k2 = K[0, 0]  # (S, E): shared by every head, as broadcasting reads it
    v2 = V[0, 0]
    spec = build_spec(q3, k2, v2, options=Options(layout="bshd"))
    assert spec.lead == (4,)
    assert spec.merged_output_shape == (5, 4, 3)
    got = trace(spec, stages=("output",)).merged_output
    want = attention(Q[0], k2, v2).output
    assert got is not None
    np.testing.assert_allclose(got, np.swapaxes(want, 0, 1), rtol=1e-12, atol=1e-12)


def test_bshd_output_split_back_for_check_and_grad() -> None:
    spec = build_spec(bshd(Q), bshd(K), bshd(V), options=Options(layout="bshd"))
    out = normal(9, *spec.merged_output_shape)
    split = split_heads_of_output(spec, out)
    assert split.shape == spec.output_shape
    np.testing.assert_array_equal(split, np.swapaxes(out, 1, 2))


def test_bshd_gradients_come_back_in_the_files_layout() -> None:
    dout = normal(5, 2, 4, 5, 3)  # (B, H, L, Ev)
    plain = build_spec(Q, K, V, options=Options(causal=True))
    want = backward(plain, make_dout(plain, dout, 0, "dout"))
    spec = build_spec(bshd(Q), bshd(K), bshd(V), options=Options(causal=True, layout="bshd"))
    got = backward(spec, make_dout(spec, bshd(dout), 0, "dout"))
    for name, given in (("dq", Q), ("dk", K), ("dv", V)):
        g, w = got.loaded(name), want.loaded(name)
        assert g is not None
        assert w is not None
        assert g.shape == bshd(given).shape
        np.testing.assert_allclose(g, bshd(w), rtol=1e-12, atol=1e-14)


def test_layout_bshd_and_heads_are_exclusive() -> None:
    with pytest.raises(SpecError) as info:
        build_spec(Q[0, 0], K[0, 0], V[0, 0], options=Options(layout="bshd", heads=2))
    assert info.value.where == "--layout"
    assert "give one" in info.value.problem


def test_layout_is_parsed_from_a_case_file_value() -> None:
    assert parse_options({"layout": "bshd"}).layout == "bshd"
    with pytest.raises(SpecError) as info:
        parse_options({"layout": "BLHD"}, {"layout": "case.yaml: layout"})
    assert str(info.value) == "case.yaml: layout: expected one of bhsd, bshd, got 'BLHD'"


# --- --kv-heads ------------------------------------------------------------------------------


def test_kv_heads_split_k_and_v_into_g_heads_as_an_explicit_split() -> None:
    """Q (B, L, H·E), K (B, S, G·E), V (B, S, G·Ev) with --heads H --kv-heads G is
    (B, H, L, E) over (B, G, S, E) with grouped-query attention, the output merged."""
    B, L, S, H, G, E, Ev = 2, 5, 7, 4, 2, 8, 3
    q, k, v = normal(1, B, L, H * E), normal(2, B, S, G * E), normal(3, B, S, G * Ev)
    spec = build_spec(q, k, v, options=Options(heads=H, kv_heads=G, causal=True))
    assert (spec.lead, spec.group, spec.E, spec.Ev) == ((B, H), H // G, E, Ev)
    got = trace(spec, stages=("output",)).merged_output
    assert got is not None
    assert got.shape == (B, L, H * Ev)

    def split(a: F64, n: int) -> F64:
        return np.swapaxes(a.reshape(B, a.shape[1], n, -1), 1, 2)

    want = attention(split(q, H), split(k, G), split(v, G), causal=True).output
    np.testing.assert_allclose(got, np.swapaxes(want, 1, 2).reshape(B, L, H * Ev), atol=1e-12)
    np.testing.assert_array_equal(spec.as_loaded("k"), k)


def test_kv_heads_without_heads_is_refused() -> None:
    with pytest.raises(SpecError) as info:
        build_spec(Q[0, 0], K[0, 0], V[0, 0], options=Options(kv_heads=2))
    assert info.value.where == "--kv-heads"
    assert "needs --heads" in info.value.problem


def test_kv_heads_must_divide_heads() -> None:
    with pytest.raises(SpecError) as info:
        build_spec(
            normal(1, 5, 32),
            normal(2, 7, 12),
            normal(3, 7, 12),
            options=Options(heads=8, kv_heads=3),
        )
    assert (
        str(info.value) == "--kv-heads: 3 key/value heads do not divide the 8 query heads (--heads)"
    )


def test_kv_heads_width_must_match_the_query_heads() -> None:
    with pytest.raises(SpecError) as info:
        build_spec(
            normal(1, 5, 32), normal(2, 7, 8), normal(3, 7, 8), options=Options(heads=8, kv_heads=4)
        )
    assert str(info.value) == (
        "--kv-heads: K's last axis (8, from K) holds 4 heads of 2, but Q's heads are 4 wide; "
        "K should hold 4·4 = 16"
    )


def test_heads_alone_on_a_narrower_k_suggests_kv_heads() -> None:
    with pytest.raises(SpecError) as info:
        build_spec(normal(1, 5, 32), normal(2, 7, 8), normal(3, 7, 8), options=Options(heads=8))
    assert info.value.where == "K"
    assert info.value.problem.endswith("give --kv-heads 2 (grouped-query attention)")


# --- the command line ----------------------------------------------------------------------


@pytest.fixture
def files(tmp_path: Path) -> Path:
    for name, a in (("q", Q), ("k", K), ("v", V)):
        np.save(tmp_path / f"{name}.npy", bshd(a).astype(np.float32))
    return tmp_path


def qkv(d: Path) -> list[str]:
    return [str(d / f"{n}.npy") for n in "qkv"]


def test_cli_json_and_save_return_the_output_in_the_layout_given(files: Path) -> None:
    result = invoke(
        "compute", *qkv(files), "--layout", "bshd", "--format", "json", "--stages", "weights,output"
    )
    assert result.exit_code == 0, result.output
    doc = strict_json(result.stdout)
    assert doc["options"]["layout"] == "bshd"
    assert doc["shapes"]["output"] == [2, 5, 4, 3]
    assert doc["shapes"]["q"] == [2, 5, 4, 8]
    assert np.asarray(doc["weights"]).shape == (2, 4, 5, 7)
    want = attention(*(a.astype(np.float32).astype(np.float64) for a in (Q, K, V))).output
    np.testing.assert_allclose(np.asarray(doc["output"]), bshd(want), atol=1e-12)
    # --save writes the same output, stage by stage.
    save = files / "trace.npz"
    assert invoke("compute", *qkv(files), "--layout", "bshd", "--save", str(save)).exit_code == 0
    with np.load(save) as npz:
        np.testing.assert_array_equal(npz["output"], np.asarray(doc["output"]))
        assert npz["weights"].shape == (2, 4, 5, 7)
    # YAML streams the same rows.
    yaml_doc = invoke(
        "compute", *qkv(files), "--layout", "bshd", "--format", "yaml", "--stages", "output"
    )
    assert np.asarray(yaml.safe_load(yaml_doc.stdout)["output"]).shape == (2, 5, 4, 3)


def test_cli_check_reads_a_bshd_export_and_names_mismatches_in_its_layout(files: Path) -> None:
    spec = build_spec(
        *(np.load(p) for p in qkv(files)), options=Options(layout="bshd", causal=True)
    )
    out = np.asarray(trace(spec, stages=("output",)).merged_output, dtype=np.float32)
    np.save(files / "out.npy", out)
    ok = invoke(
        "check",
        *qkv(files),
        "--layout",
        "bshd",
        "--causal",
        "--expect-output",
        str(files / "out.npy"),
    )
    assert ok.exit_code == 0, ok.output
    bad = out.copy()
    bad[1, 3, 2, 0] += 1.0  # batch 1, query 3, head 2, column 0
    np.save(files / "bad.npy", bad)
    failed = invoke(
        "check",
        *qkv(files),
        "--layout",
        "bshd",
        "--causal",
        "--expect-output",
        str(files / "bad.npy"),
        "--format",
        "json",
    )
    assert failed.exit_code == ExitCode.CHECK_FAILED
    (report,) = json.loads(failed.stdout)["cases"]
    close = next(c for c in report["checks"] if c["name"] == "output.close")
    assert close["index"] == [1, 3, 2, 0]


def test_cli_kv_heads_and_a_case_file_layout(files: Path, tmp_path: Path) -> None:
    case = tmp_path / "case.yaml"
    case.write_text("q: q.npy\nk: k.npy\nv: v.npy\nlayout: bshd\n")
    as_flag = invoke(
        "compute", *qkv(files), "--layout", "bshd", "--format", "json", "--stages", "output"
    )
    from_case = invoke("compute", str(case), "--format", "json", "--stages", "output")
    assert from_case.exit_code == 0, from_case.output
    assert strict_json(from_case.stdout)["output"] == strict_json(as_flag.stdout)["output"]
    err = assert_one_error_line(invoke("compute", *qkv(files), "--kv-heads", "2"))
    assert err.startswith("sdpa: error: --kv-heads: needs --heads")


def test_cli_every_command_takes_the_layout(files: Path) -> None:
    for command in ("compute", "explain", "grad"):
        result = invoke(command, *qkv(files), "--layout", "bshd", "--causal")
        assert result.exit_code == 0, (command, result.output)
        assert "layout     bshd" in result.stdout or "layout bshd" in result.stdout.replace(
            "  ", " "
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda: build_spec(Q, K, V),
        lambda: build_spec(bshd(Q), bshd(K), bshd(V), options=Options(layout="bshd")),
        lambda: build_spec(
            normal(1, 2, 5, 32),
            normal(2, 2, 7, 16),
            normal(3, 2, 7, 8),
            options=Options(heads=4, kv_heads=2),
        ),
        lambda: build_spec(Q[0, 0], K[0, 0], V[0, 0]),  # the leading 1s the spec adds
    ],
)
def test_loaded_index_finds_an_element_where_the_file_has_it(make: Any) -> None:
    spec = make()
    for name in ("q", "k", "v"):
        values = getattr(spec, name)
        labels = np.arange(values.size, dtype=np.float64).reshape(values.shape)
        loaded = spec.as_loaded(name, labels)
        for index in np.ndindex(*values.shape):
            assert loaded[loaded_index(spec, name, index)] == labels[index]
