"""Per-item diagonals (negative ones included), chunked attention and chunked prefill
against FlashAttention's own reference rules (``tests/flash_reference.py``, written
step by step from its tests), at 1e-9 in float64, with no hand-built mask:

- ``--causal-align lower-right-per-item`` with ``--key-lengths``/``--query-lengths`` is
  FlashAttention's ``row + sk − sq`` from its padding masks (``seqused_k``,
  ``cache_seqlens``), negative when an item has more queries than keys;
- ``--attention-chunk C`` is its ``construct_chunk_mask``;
- ``--cu-seqlens`` with per-document ``--key-lengths`` is its varlen kernel with
  ``seqused_k``, and per-document ``--query-offset`` chunked prefill's cache offsets.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flash_reference import attention_ref, padding
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.engine.options import Options, parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError

F64 = NDArray[np.float64]
B, H, G, E, EV = 3, 4, 2, 5, 3
TOL = 1e-9


def flash_inputs(L: int, S: int, seed: int = 0) -> tuple[F64, F64, F64]:
    """FlashAttention's layout: Q (b, t, h, d), K and V (b, s, h_k, d)."""
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(B, L, H, E)),
        rng.normal(size=(B, S, G, E)),
        rng.normal(size=(B, S, G, EV)),
    )


def sdpa_output(q: F64, k: F64, v: F64, **options: Any) -> F64:
    """sdpa's output for FlashAttention's tensors, read in the ``bshd`` layout."""
    spec = build_spec(q, k, v, options=Options(layout="bshd", **options))
    out = trace(spec, stages=("output",)).output
    assert out is not None
    return np.swapaxes(out, 1, 2)  # (b, h, t, dv) → (b, t, h, dv)


PER_ITEM: dict[str, dict[str, Any]] = {
    # item 2: 3 keys for 6 queries, offset −3: its first three rows see no key
    "causal": {"L": 6, "S": 11, "keys": (11, 7, 3), "queries": (6, 2, 6), "causal": True},
    "causal-more-queries-than-keys": {
        "L": 9,
        "S": 5,
        "keys": (5, 5, 2),
        "queries": (9, 4, 9),
        "causal": True,
    },
    "window": {"L": 6, "S": 11, "keys": (11, 7, 3), "queries": (6, 2, 5), "window": (2, 1)},
    "causal-window": {
        "L": 8,
        "S": 12,
        "keys": (12, 9, 4),
        "queries": (8, 3, 6),
        "causal": True,
        "window": (3, 0),
    },
    "chunks": {"L": 7, "S": 20, "keys": (20, 13, 5), "queries": (7, 7, 3), "chunk": 4},
    "chunks-causal": {
        "L": 12,
        "S": 20,
        "keys": (20, 13, 5),
        "queries": (12, 7, 9),
        "causal": True,
        "chunk": 3,
    },
    "chunks-causal-window": {
        "L": 12,
        "S": 20,
        "keys": (20, 16, 12),
        "queries": (12, 12, 5),
        "causal": True,
        "window": (4, 0),
        "chunk": 5,
    },
}


@pytest.mark.parametrize("name", PER_ITEM)
def test_each_items_own_diagonal_is_flash_attentions(name: str) -> None:
    case = PER_ITEM[name]
    q, k, v = flash_inputs(case["L"], case["S"])
    causal, window = case.get("causal", False), case.get("window")
    want = attention_ref(
        q,
        k,
        v,
        padding(case["queries"], case["L"]),
        padding(case["keys"], case["S"]),
        causal=causal,
        window_size=window if window is not None else (-1, -1),
        attention_chunk=case.get("chunk", 0),
    )
    got = sdpa_output(
        q,
        k,
        v,
        causal=causal,
        window=window,
        attention_chunk=case.get("chunk"),
        causal_align="lower-right-per-item",
        key_lengths=case["keys"],
        query_lengths=case["queries"],
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_a_negative_offset_leaves_the_first_rows_without_keys() -> None:
    """Item 2 has 3 keys and 6 queries: offset −3, rows 0..2 see nothing (zeros)."""
    case = PER_ITEM["causal"]
    q, k, v = flash_inputs(case["L"], case["S"])
    got = sdpa_output(
        q,
        k,
        v,
        causal=True,
        causal_align="lower-right-per-item",
        key_lengths=case["keys"],
        query_lengths=case["queries"],
    )
    assert np.all(got[2, :3] == 0.0)
    assert np.all(got[2, 3:] != 0.0)


def test_negative_query_offsets_are_the_per_item_diagonals() -> None:
    """``--query-offset`` takes each item's offset itself, negative ones too."""
    case = PER_ITEM["causal-window"]
    q, k, v = flash_inputs(case["L"], case["S"])
    common = {"causal": True, "window": (3, 0), "key_lengths": case["keys"]}
    common["query_lengths"] = case["queries"]
    offsets = tuple(s - t for s, t in zip(case["keys"], case["queries"], strict=True))
    assert min(offsets) < 0
    by_offset = sdpa_output(q, k, v, query_offset=offsets, **common)
    by_alignment = sdpa_output(q, k, v, causal_align="lower-right-per-item", **common)
    np.testing.assert_array_equal(by_offset, by_alignment)


def test_negative_query_offsets_agree_with_the_float64_loop() -> None:
    q, k, v = (np.swapaxes(a, 1, 2) for a in flash_inputs(6, 9, seed=3))
    offsets = (-2, 0, -5)
    got = trace(
        build_spec(q, k, v, options=Options(causal=True, query_offset=offsets)),
        stages=("output",),
    ).output
    assert got is not None
    want = attention(q, k, v, causal=True, query_offset=offsets).output
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


# --- packed sequences: varlen with seqused_k, chunked prefill -----------------------------


def packed(
    q: F64, k: F64, v: F64, queries: tuple[int, ...], keys: tuple[int, ...]
) -> tuple[F64, F64, F64, tuple[int, ...], tuple[int, ...]]:
    """Each item's first ``queries[b]`` queries and ``keys[b]`` keys packed along one
    sequence, FlashAttention's varlen layout, with their cumulative lengths."""
    qp = np.concatenate([q[b, : queries[b]] for b in range(B)])[None]
    kp = np.concatenate([k[b, : keys[b]] for b in range(B)])[None]
    vp = np.concatenate([v[b, : keys[b]] for b in range(B)])[None]
    cu_q = tuple(int(n) for n in np.concatenate([[0], np.cumsum(queries)]))
    cu_k = tuple(int(n) for n in np.concatenate([[0], np.cumsum(keys)]))
    return qp, kp, vp, cu_q, cu_k


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("window", [None, (4, 0)])
def test_varlen_with_seqused_k_is_flash_attentions(
    chunk: int | None, window: tuple[int, int] | None
) -> None:
    """Documents of 6, 2 and 5 queries over 11, 9 and 4 keys, of which only 8, 9 and 2
    are used (``seqused_k``): each document's diagonal at its used keys less its
    queries, −3 for the last."""
    L, S = 6, 11
    queries, segments, used = (6, 2, 5), (11, 9, 4), (8, 9, 2)
    q, k, v = flash_inputs(L, S, seed=5)
    want = attention_ref(
        q,
        k,
        v,
        padding(queries, L),
        padding(used, S),
        causal=True,
        window_size=window if window is not None else (-1, -1),
        attention_chunk=chunk or 0,
    )
    qp, kp, vp, cu_q, cu_k = packed(q, k, v, queries, segments)
    got = sdpa_output(
        qp,
        kp,
        vp,
        causal=True,
        causal_align="lower-right",
        window=window,
        attention_chunk=chunk,
        cu_seqlens=cu_q,
        cu_seqlens_k=cu_k,
        key_lengths=used,
    )
    for b in range(B):
        rows = slice(cu_q[b], cu_q[b + 1])
        np.testing.assert_allclose(got[0, rows], want[b, : queries[b]], rtol=0, atol=TOL)


def test_chunked_prefill_packs_sequences_with_their_own_cache_offsets() -> None:
    """Three sequences each prefilling a chunk of new tokens after its own cache
    (4, 0 and 7 tokens): ``--query-offset`` per document places them, and each
    document agrees with the float64 loop run on that sequence alone."""
    rng = np.random.default_rng(7)
    new, cached = (3, 5, 2), (4, 0, 7)
    keys = tuple(n + c for n, c in zip(new, cached, strict=True))
    q = rng.normal(size=(1, H, sum(new), E))
    k = rng.normal(size=(1, G, sum(keys), E))
    v = rng.normal(size=(1, G, sum(keys), EV))
    cu_q = (0, 3, 8, 10)
    cu_k = (0, 7, 12, 21)
    spec = build_spec(
        q,
        k,
        v,
        options=Options(causal=True, cu_seqlens=cu_q, cu_seqlens_k=cu_k, query_offset=cached),
    )
    got = trace(spec, stages=("output",)).output
    assert got is not None
    for d in range(3):
        rows, cols = slice(cu_q[d], cu_q[d + 1]), slice(cu_k[d], cu_k[d + 1])
        qd = np.repeat(q[:, :, rows], 1, axis=1)
        kd, vd = (np.repeat(a[:, :, cols], H // G, axis=1) for a in (k, v))
        want = attention(qd, kd, vd, causal=True, query_offset=(cached[d],)).output
        np.testing.assert_allclose(got[:, :, rows], want, rtol=0, atol=TOL)


# --- what the options refuse ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"attention_chunk": "0"}, "--attention-chunk: must be ≥ 1, got 0"),
        ({"query_offset": "x"}, "--query-offset: expected an integer, got 'x'"),
        ({"causal_align": "lower"}, "--causal-align: expected one of upper-left, lower-right"),
    ],
)
def test_bad_values_are_one_line(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_options(raw)
    assert str(err.value).startswith(message)


def test_a_query_offset_with_the_per_item_alignment_is_refused() -> None:
    q, k, v = flash_inputs(4, 6)
    options = Options(
        layout="bshd", causal=True, causal_align="lower-right-per-item", query_offset=(1,)
    )
    with pytest.raises(SpecError, match="replaces --causal-align lower-right-per-item"):
        build_spec(q, k, v, options=options)


# --- what sdpa check says of a kernel that slips ---------------------------------------------


def hint_for(export_options: dict[str, Any], options: dict[str, Any]) -> tuple[str, str | None]:
    from sdpa_cli.check.records import Expected
    from sdpa_cli.check.run import run_checks

    q, k, v = (np.swapaxes(a, 1, 2) for a in flash_inputs(9, 16, seed=8))
    spec = build_spec(q, k, v, options=Options(**export_options))
    export = trace(spec, stages=("output",)).output
    assert export is not None
    report = run_checks(
        build_spec(q, k, v, options=Options(**options)), [Expected("output", export, "o.npy")]
    )
    close = next(c for c in report.checks if c.name == "output.close")
    return close.status, close.hint


def test_a_kernel_that_ignores_the_chunks_is_named() -> None:
    status, hint = hint_for({"causal": True}, {"causal": True, "attention_chunk": 4})
    assert status == "fail"
    assert hint is not None
    assert "no --attention-chunk" in hint


def test_a_kernel_with_each_items_own_diagonal_is_named() -> None:
    lengths = {"key_lengths": (16, 11, 9)}
    status, hint = hint_for(
        {"causal": True, "causal_align": "lower-right-per-item", **lengths},
        {"causal": True, "causal_align": "lower-right", **lengths},
    )
    assert status == "fail"
    assert hint is not None
    assert "--causal-align lower-right-per-item" in hint
