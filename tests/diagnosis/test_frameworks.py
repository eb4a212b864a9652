"""``compute --frameworks``' comparison: each framework's answer, and its disagreements
by kind, against values computed here by hand (and PyTorch where importable)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from attention_cases import random_qkv
from numpy.typing import NDArray

from sdpa_cli.diagnosis.frameworks import compare_frameworks, frameworks_payload, options_as
from sdpa_cli.engine.conventions import CONVENTIONS
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.names import FRAMEWORKS

F64 = NDArray[np.float64]


def spec_of(L: int, S: int, mask: NDArray[Any] | None = None, **raw: Any) -> AttentionSpec:
    q, k, v = random_qkv(3, 1, 2, L, S, 4, 3)
    return build_spec(q, k, v, mask=mask, options=parse_options(raw))


def test_a_plain_square_case_all_five_agree() -> None:
    c = compare_frameworks(spec_of(5, 5, causal=True))
    assert c.agree
    assert c.verdict == "all five agree"
    assert [a.convention.name for a in c.answers] == list(FRAMEWORKS)
    # A finite mask value takes the per-stage path: the same numbers to rounding.
    assert all(a.rows == 0 and a.max_diff < 1e-15 for a in c.answers)


def test_an_empty_row_splits_zeros_from_the_mean_of_v() -> None:
    mask = np.ones((4, 4), dtype=np.bool_)
    mask[2] = False
    spec = spec_of(4, 4, mask=mask)
    c = compare_frameworks(spec)
    [d] = c.disagreements
    assert d.kind == "empty"
    assert dict(d.groups) == {"zeros": ("torch", "flash", "onnx"), "mean of V": ("jax", "hf")}
    assert d.rows == ((0, 0, 2), (0, 1, 2))
    mean_v = np.asarray(spec.v, dtype=np.float64).mean(axis=-2)  # (1, 2, Ev)
    assert d.max_diff == pytest.approx(np.abs(mean_v).max(), rel=1e-12)
    assert c.verdict == "the five disagree on 2 of 8 rows: rows with no visible key"
    rows = {a.convention.name: a.rows for a in c.answers}
    assert rows == {"torch": 0, "flash": 0, "jax": 2, "onnx": 0, "hf": 2}


def test_l_ne_s_causal_splits_by_alignment_with_torch_as_reference() -> None:
    torch = pytest.importorskip("torch")
    from torch.nn.attention.bias import causal_lower_right

    spec = spec_of(3, 6, causal=True)
    c = compare_frameworks(spec)
    [d] = c.disagreements
    assert d.kind == "alignment"
    assert dict(d.groups) == {
        "upper-left": ("torch", "jax"),
        "lower-right": ("flash", "onnx", "hf"),
    }
    q, k, v = (torch.from_numpy(np.asarray(a)) for a in (spec.q, spec.k, spec.v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    upper = sdpa(q, k, v, is_causal=True).numpy()
    lower = sdpa(q, k, v, attn_mask=causal_lower_right(3, 6)).numpy()
    answers = {a.convention.name: a for a in c.answers}
    np.testing.assert_allclose(answers["torch"].output, upper, atol=1e-12)
    np.testing.assert_allclose(answers["flash"].output, lower, atol=1e-12)
    assert d.max_diff == pytest.approx(np.abs(upper - lower).max(), rel=1e-12)
    assert len(d.rows) == 6  # every row of both heads moves


def test_window_off_by_one_is_hf_against_the_rest() -> None:
    c = compare_frameworks(spec_of(6, 6, causal=True, window="2,0"))
    [d] = c.disagreements
    assert d.kind == "window"
    assert dict(d.groups) == {
        "query left out": ("torch", "flash", "jax", "onnx"),
        "counts the query": ("hf",),
    }
    # Rows 0, 1 see every key before them either way; from row 2 on hf sees one fewer
    # (keys i − 1 .. i, not i − 2 .. i). L = S: the alignment changes nothing.
    assert {r[-1] for r in d.rows} == {2, 3, 4, 5}


def test_options_as_reads_the_window_as_typed_under_each_framework() -> None:
    given = parse_options({"framework": "hf", "window": "3,0", "causal": True})
    assert given.window == (2, 0)
    back = {n: options_as(given, CONVENTIONS[n]).window for n in FRAMEWORKS}
    assert back == {"torch": (3, 0), "flash": (3, 0), "jax": (3, 0), "onnx": (3, 0), "hf": (2, 0)}
    flash = options_as(given, CONVENTIONS["flash"])
    assert (flash.causal_align, flash.mask_value, flash.framework) == (
        "lower-right-per-item",
        -np.inf,
        "flash",
    )


def test_payload_names_every_answer_and_disagreement() -> None:
    mask = np.ones((4, 4), dtype=np.bool_)
    mask[0] = False
    payload = frameworks_payload(compare_frameworks(spec_of(4, 4, mask=mask)))
    assert payload["agree"] is False
    assert payload["rows"] == 8
    assert [a["as"] for a in payload["answers"]] == list(FRAMEWORKS)
    assert payload["answers"][2]["empty_row"] == "mean of V"
    [d] = payload["disagreements"]
    assert d["kind"] == "empty"
    assert d["rows"] == [[0, 0, 0], [0, 1, 0]]


def test_each_frameworks_output_side_by_side_is_the_float64_loops_under_its_conventions() -> None:
    """The rows the frameworks differ on, each framework's output for them: PyTorch's
    upper-left diagonal, FlashAttention's lower-right, Hugging Face's window counting
    the query, each equal to the float64 loop with those options."""
    from reference import attention

    q, k, v = random_qkv(5, 1, 1, 3, 6, 4, 2)
    spec = build_spec(q, k, v, options=parse_options({"causal": True, "window": "2,0"}))
    c = compare_frameworks(spec)
    expected = {
        "torch": attention(q, k, v, causal=True, window=(2, 0)).output,
        "flash": attention(q, k, v, causal=True, causal_align="lower-right", window=(2, 0)).output,
        "hf": attention(q, k, v, causal=True, causal_align="lower-right", window=(1, 0)).output,
    }
    shown = c.side_by_side()
    assert [row for row, _ in shown] == c.differing()
    assert len(shown) == 3  # every query row moves
    for row, out in shown:
        assert set(out) == set(FRAMEWORKS)
        for name, want in expected.items():
            np.testing.assert_allclose(out[name], want[row], rtol=1e-12, atol=1e-15)
    payload = frameworks_payload(c)
    assert payload["outputs_rows"] == 3
    assert [o["row"] for o in payload["outputs"]] == [list(r) for r in c.differing()]
    assert payload["outputs"][0]["by_framework"]["hf"] == pytest.approx(
        expected["hf"][c.differing()[0]].tolist()
    )


def test_frameworks_that_agree_have_no_rows_side_by_side() -> None:
    c = compare_frameworks(spec_of(5, 5, causal=True))
    assert c.side_by_side() == []
    assert frameworks_payload(c)["outputs"] == []
