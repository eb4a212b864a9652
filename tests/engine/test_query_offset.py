"""KV-cache steps: ``--query-offset`` and ``--query-lengths`` against independent references.

Query i of batch item b sits at position N_b + i (N_b: the cache length before the
new tokens). Checked in float64 at 1e-9 against

1. the float64 loop of ``tests/reference.py`` (per item offset, ALiBi from N_b + i,
   absent rows past ``query_lengths``);
2. ONNX's reference implementation of ``Attention``: opset 23 with ``past_key`` and
   ``past_value`` (one cache length per call, so each item is run on its own with its
   own cache, unpadded), and opset 24's ``nonpad_kv_seqlen`` (per item, batched);
3. PyTorch's SDPA with an explicit per-item boolean mask;

and the lean pass against the per-stage path (through ``trace``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from attention_cases import random_qkv
from numpy.typing import NDArray
from onnx_reference import onnx_attention
from reference import attention

from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError

F64 = NDArray[np.float64]
B, H, L, S, E = 3, 2, 4, 11, 5
TOL = 1e-9


def inputs(seed: int = 0) -> tuple[F64, F64, F64]:
    return random_qkv(seed, B, H, L, S, E, 3)


CASES: dict[str, dict[str, Any]] = {
    "causal-per-item": {"causal": True, "query_offset": (7, 0, 3), "key_lengths": (11, 4, 7)},
    "causal-one-offset": {"causal": True, "query_offset": (5,)},
    "causal-past-the-keys": {"causal": True, "query_offset": (9, 20, 1)},
    "window": {"window": (2, 0), "query_offset": (7, 0, 3), "key_lengths": (11, 4, 7)},
    "window-both-sides": {"window": (1, 2), "query_offset": (6, 2, 0)},
    "alibi": {"alibi": True, "causal": True, "query_offset": (7, 0, 3), "key_lengths": (11, 4, 7)},
    "alibi-alone": {"alibi": True, "query_offset": (2,)},
    "query-lengths": {
        "causal": True,
        "query_offset": (7, 0, 3),
        "key_lengths": (11, 4, 7),
        "query_lengths": (4, 1, 0),
    },
    "query-lengths-alone": {"query_lengths": (2,)},
    "query-lengths-finite-mask-value": {
        "causal": True,
        "query_offset": (7, 0, 3),
        "query_lengths": (3, 2, 1),
        "mask_value": -1e9,
    },
}


def spec_of(case: dict[str, Any], seed: int = 0) -> AttentionSpec:
    q, k, v = inputs(seed)
    return build_spec(q, k, v, options=Options(**case))


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_stage_equals_the_float64_loop(case: dict[str, Any]) -> None:
    q, k, v = inputs()
    want = attention(q, k, v, **case)
    got = trace(spec_of(case), stages=("masked", "weights", "output"))
    assert got.weights is not None
    assert got.output is not None
    assert got.visible is not None
    np.testing.assert_allclose(got.weights, want.weights, rtol=0, atol=TOL)
    np.testing.assert_allclose(got.output, want.output, rtol=0, atol=TOL)
    np.testing.assert_array_equal(got.visible, want.visible)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_lean_trace_equals_the_per_stage_trace(case: dict[str, Any]) -> None:
    spec = spec_of(case)
    lean = trace(spec, stages=("output",), summarize=("output",), rows=3)
    staged = trace(spec, stages=("weights", "output"), rows=3)
    assert lean.output is not None
    assert staged.output is not None
    np.testing.assert_allclose(lean.output, staged.output, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(lean.stats.n_visible, staged.stats.n_visible)
    np.testing.assert_allclose(lean.stats.entropy, staged.stats.entropy, atol=1e-12)


def test_absent_rows_give_zeros_whatever_the_mask_value_and_are_not_findings() -> None:
    from sdpa_cli.diagnosis.rules import diagnose

    case = CASES["query-lengths-finite-mask-value"]
    got = trace(spec_of(case), stages=("weights", "output"))
    assert got.output is not None
    assert got.weights is not None
    for b, n in enumerate(case["query_lengths"]):
        assert not got.output[b, :, n:].any()
        assert not got.weights[b, :, n:].any()
        assert got.output[b, :, :n].any()
    kinds = {f.kind for f in diagnose(got.stats).findings}
    assert "fully_masked" not in kinds
    assert "mask_suspect" not in kinds


def test_a_row_with_no_key_before_its_query_length_is_still_a_finding() -> None:
    from sdpa_cli.diagnosis.rules import diagnose

    # item 1 has no valid key at all: its present rows are fully masked
    case = {
        "causal": True,
        "query_offset": (2,),
        "key_lengths": (11, 0, 5),
        "query_lengths": (4, 2, 0),
    }
    found = diagnose(trace(spec_of(case)).stats).findings
    masked = [f for f in found if f.kind == "fully_masked"]
    assert sorted(f.index[:3] for f in masked if f.index is not None) == [
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]


# --- PyTorch's SDPA with an explicit per-item mask ---------------------------------------


@pytest.mark.parametrize(
    "name", ["causal-per-item", "window", "causal-past-the-keys", "query-lengths"]
)
def test_torch_sdpa_with_the_per_item_mask_agrees(name: str) -> None:
    torch = pytest.importorskip("torch")
    case = CASES[name]
    q, k, v = inputs()
    offsets = case["query_offset"] * (B if len(case["query_offset"]) == 1 else 1)
    lengths = case.get("key_lengths", (S,) * B)
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    allowed = np.zeros((B, 1, L, S), dtype=np.bool_)
    for b in range(B):
        pos = offsets[b] + i
        ok = j < lengths[b]
        if case.get("causal"):
            ok = ok & (j <= pos)
        if "window" in case:
            left, right = case["window"]
            ok = ok & (j - pos >= -left) & (j - pos <= right)
        allowed[b, 0] = ok
    out = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(allowed)
    ).numpy()
    got = trace(spec_of(case), stages=("output",)).output
    assert got is not None
    present = np.ones((B, H, L), dtype=np.bool_)
    for b, n in enumerate(case.get("query_lengths", (L,) * B)):
        present[b, :, n:] = False
    seen = present & allowed.any(axis=-1)  # PyTorch ≥ 2.5 gives zeros for the others
    np.testing.assert_allclose(got[seen], out[seen], rtol=0, atol=TOL)


# --- ONNX's reference Attention --------------------------------------------------------


def test_onnx_attention_23_with_a_past_cache_per_item_agrees() -> None:
    """Each item on its own through ONNX with its own cache (past_key of length N_b),
    against the whole batch at once, keys padded, with per-item offsets and lengths."""
    q, k, v = inputs(1)
    offsets = (7, 0, 3)
    got = trace(
        build_spec(
            q,
            k,
            v,
            options=Options(
                causal=True, query_offset=offsets, key_lengths=tuple(n + L for n in offsets)
            ),
        ),
        stages=("output",),
    ).output
    assert got is not None
    for b, n in enumerate(offsets):
        keys = slice(n, n + L)  # the new tokens' keys and values; the cache before them
        arrays = {
            "Q": q[b : b + 1],
            "K": k[b : b + 1, :, keys],
            "V": v[b : b + 1, :, keys],
            "past_key": k[b : b + 1, :, :n],
            "past_value": v[b : b + 1, :, :n],
        }
        want = onnx_attention(23, arrays, is_causal=1)
        np.testing.assert_allclose(got[b], want[0], rtol=0, atol=TOL, err_msg=f"item {b}")


def test_onnx_attention_24_nonpad_kv_seqlen_agrees() -> None:
    """ONNX 24's external cache: per item, nonpad_kv_seqlen[b] valid keys and the
    queries the last L of them (offset nonpad − L): --key-lengths and --query-offset."""
    q, k, v = inputs(2)
    lengths = (11, 5, 8)
    options = Options(causal=True, key_lengths=lengths, query_offset=tuple(n - L for n in lengths))
    got = trace(build_spec(q, k, v, options=options), stages=("output",)).output
    assert got is not None
    arrays = {"Q": q, "K": k, "V": v, "nonpad_kv_seqlen": np.array(lengths, dtype=np.int64)}
    want = onnx_attention(24, arrays, is_causal=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"causal": True, "query_offset": (1, 2)},
            "--query-offset: 2 offsets given but the batch axis has 3 items",
        ),
        (
            {"query_offset": (1,)},
            "--query-offset: places the queries for --causal, --window, --attention-chunk or --alibi",
        ),
        (
            {"causal": True, "causal_align": "lower-right", "query_offset": (1,)},
            "--query-offset: replaces --causal-align lower-right",
        ),
        ({"query_lengths": (5,)}, "--query-lengths: 5 exceeds the number of queries, L = 4"),
        ({"query_lengths": (1, 2)}, "--query-lengths: 2 lengths given"),
    ],
)
def test_bad_options_are_one_line_naming_the_flag(options: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as err:
        spec_of(options)
    assert str(err.value).startswith(message)
