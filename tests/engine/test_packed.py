"""Packed variable-length sequences: ``--cu-seqlens`` and ``--cu-seqlens-k`` against
independent references, at 1e-9 in float64.

FlashAttention's varlen convention: document d holds queries cu_q[d] .. cu_q[d+1] and
keys cu_k[d] .. cu_k[d+1], and sees its own keys only; a causal mask and window apply
within each document, aligned by ``--causal-align`` on the document's own lengths
(lower-right: FlashAttention's). Checked against

1. per-document loops: each document sliced out, run through the float64 loop of
   ``tests/reference.py`` and through PyTorch's SDPA, the outputs concatenated;
2. PyTorch's SDPA over the packed tokens with the block-diagonal boolean mask;

and the block skipping: a block computes no key of a document none of its rows is in.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.engine.block import common_keys, key_range
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError

F64 = NDArray[np.float64]
H, E, EV = 2, 4, 3
TOL = 1e-9

CASES: dict[str, dict[str, Any]] = {
    "plain": {"cu_seqlens": (0, 5, 12, 20)},
    "causal": {"cu_seqlens": (0, 5, 12, 20), "causal": True},
    "causal-window": {"cu_seqlens": (0, 5, 12, 20), "causal": True, "window": (2, 0)},
    "window-both-sides": {"cu_seqlens": (0, 1, 9, 20), "window": (1, 2)},
    "alibi-causal": {"cu_seqlens": (0, 6, 20), "causal": True, "alibi": True},
    "keys-differ-lower-right": {
        "cu_seqlens": (0, 3, 5, 9),
        "cu_seqlens_k": (0, 7, 9, 20),
        "causal": True,
        "causal_align": "lower-right",
    },
    "keys-differ-upper-left-window": {
        "cu_seqlens": (0, 3, 3, 9),
        "cu_seqlens_k": (0, 7, 9, 20),
        "causal": True,
        "window": (3, 0),
    },
    "empty-key-document": {"cu_seqlens": (0, 4, 9), "cu_seqlens_k": (0, 0, 20)},
}


def lengths(case: dict[str, Any]) -> tuple[int, int]:
    cu_q = case["cu_seqlens"]
    return cu_q[-1], case.get("cu_seqlens_k", cu_q)[-1]


def inputs(L: int, S: int, seed: int = 0) -> tuple[F64, F64, F64]:
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(1, H, L, E)),
        rng.normal(size=(1, H, S, E)),
        rng.normal(size=(1, H, S, EV)),
    )


def spec_of(case: dict[str, Any], seed: int = 0) -> AttentionSpec:
    return build_spec(*inputs(*lengths(case), seed), options=Options(**case))


def engine_output(case: dict[str, Any], **overrides: Any) -> F64:
    spec = spec_of({**case, **overrides})
    out = trace(spec, stages=("output",)).output
    assert out is not None
    return out


def per_document(case: dict[str, Any], run: Any) -> F64:
    """Each document sliced out and run alone; the outputs concatenated along L."""
    L, S = lengths(case)
    q, k, v = inputs(L, S)
    cu_q = case["cu_seqlens"]
    cu_k = case.get("cu_seqlens_k", cu_q)
    out = np.zeros((1, H, L, EV))
    opts = {n: case[n] for n in ("causal", "causal_align", "window", "alibi") if n in case}
    for d in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[d], cu_q[d + 1]), slice(cu_k[d], cu_k[d + 1])
        if rows.stop > rows.start and keys.stop > keys.start:
            out[:, :, rows] = run(q[:, :, rows], k[:, :, keys], v[:, :, keys], opts)
    return out


def loop(q: F64, k: F64, v: F64, opts: dict[str, Any]) -> F64:
    return attention(q, k, v, **opts).output


@pytest.mark.parametrize("name", list(CASES))
def test_per_document_float64_loop_agrees(name: str) -> None:
    case = CASES[name]
    np.testing.assert_allclose(engine_output(case), per_document(case, loop), rtol=0, atol=TOL)


def torch_sdpa(q: F64, k: F64, v: F64, opts: dict[str, Any]) -> F64:
    torch = pytest.importorskip("torch")
    L, S = q.shape[-2], k.shape[-2]
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    offset = S - L if opts.get("causal_align") == "lower-right" else 0
    ok = np.ones((L, S), dtype=np.bool_)
    if opts.get("causal"):
        ok &= j <= i + offset
    if "window" in opts:
        left, right = opts["window"]
        ok &= (j - i - offset >= -left) & (j - i - offset <= right)
    out = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(ok)
    ).numpy()
    seen = np.asarray(ok.any(axis=-1), dtype=np.bool_)
    return np.asarray(np.where(seen[:, None], out, 0.0), dtype=np.float64)


@pytest.mark.parametrize("name", [n for n in CASES if "alibi" not in CASES[n]])
def test_per_document_torch_sdpa_agrees(name: str) -> None:
    case = CASES[name]
    np.testing.assert_allclose(
        engine_output(case), per_document(case, torch_sdpa), rtol=0, atol=TOL
    )


def block_diagonal(case: dict[str, Any]) -> NDArray[np.bool_]:
    """The equivalent "may attend" mask over the packed tokens, built by hand."""
    L, S = lengths(case)
    cu_q = case["cu_seqlens"]
    cu_k = case.get("cu_seqlens_k", cu_q)
    allowed = np.zeros((L, S), dtype=np.bool_)
    for d in range(len(cu_q) - 1):
        L_d, S_d = cu_q[d + 1] - cu_q[d], cu_k[d + 1] - cu_k[d]
        i, j = np.arange(L_d)[:, None], np.arange(S_d)[None, :]
        offset = S_d - L_d if case.get("causal_align") == "lower-right" else 0
        ok = np.ones((L_d, S_d), dtype=np.bool_)
        if case.get("causal"):
            ok &= j <= i + offset
        if "window" in case:
            left, right = case["window"]
            ok &= (j - i - offset >= -left) & (j - i - offset <= right)
        allowed[cu_q[d] : cu_q[d + 1], cu_k[d] : cu_k[d + 1]] = ok
    return allowed


@pytest.mark.parametrize("name", [n for n in CASES if "alibi" not in CASES[n]])
def test_torch_sdpa_with_the_block_diagonal_mask_agrees(name: str) -> None:
    torch = pytest.importorskip("torch")
    case = CASES[name]
    allowed = block_diagonal(case)
    q, k, v = inputs(*lengths(case))
    out = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(allowed)
    ).numpy()
    seen = np.broadcast_to(allowed.any(axis=-1), out.shape[:-1])
    got = engine_output(case)
    np.testing.assert_allclose(got[seen], out[seen], rtol=0, atol=TOL)
    assert not got[~seen].any()


@pytest.mark.parametrize("name", list(CASES))
def test_the_visible_keys_are_the_block_diagonal_mask(name: str) -> None:
    case = CASES[name]
    visible = trace(spec_of(case), stages=("weights",)).weights
    assert visible is not None
    hidden = ~block_diagonal(case)
    assert not np.broadcast_to(visible, (1, H, *hidden.shape))[..., hidden].any()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("step", [1, 3, 8])
def test_a_block_computes_only_its_documents_keys(name: str, step: int) -> None:
    case = CASES[name]
    spec = spec_of(case)
    allowed = block_diagonal(case)
    for i0 in range(0, spec.L, step):
        rows = slice(i0, min(i0 + step, spec.L))
        keys = key_range(spec, (0, 0), rows)
        seen = np.flatnonzero(allowed[rows].any(axis=0))
        if seen.size:
            assert keys.start == seen[0]  # from its documents' first key seen
            assert keys.stop == seen[-1] + 1  # to their last, no wider
        else:
            assert keys.stop == keys.start
        common = common_keys(spec, (0, 0), rows)
        assert allowed[rows, common].all()


def test_a_block_skips_other_documents_keys() -> None:
    spec = spec_of(CASES["causal"])
    assert key_range(spec, (0, 0), slice(12, 20)) == slice(12, 20)
    assert key_range(spec, (0, 0), slice(6, 8)) == slice(5, 8)
    assert common_keys(spec, (0, 0), slice(4, 6)) == slice(0, 0)  # two documents


def test_the_same_documents_for_keys_are_the_default() -> None:
    case = CASES["causal"]
    same = engine_output(case, cu_seqlens_k=case["cu_seqlens"])
    np.testing.assert_array_equal(engine_output(case), same)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cu_seqlens": (1, 5, 20)}, "--cu-seqlens: must start at 0, got 1"),
        ({"cu_seqlens": (0, 12, 5, 20)}, "--cu-seqlens: must not decrease, got 5 after 12"),
        ({"cu_seqlens": (0, 5, 12)}, "--cu-seqlens: ends at 12, but the queries number L = 20"),
        (
            {"cu_seqlens": (0, 5, 20), "cu_seqlens_k": (0, 5, 19)},
            "--cu-seqlens-k: ends at 19, but the keys number S = 20",
        ),
        (
            {"cu_seqlens": (0, 5, 20), "cu_seqlens_k": (0, 20)},
            "--cu-seqlens-k: 1 documents, but --cu-seqlens has 2",
        ),
        ({"cu_seqlens_k": (0, 20)}, "--cu-seqlens-k: needs --cu-seqlens"),
        (
            {"cu_seqlens": (0, 5, 20), "query_lengths": (4,)},
            "--query-lengths: is per batch item; packed documents (--cu-seqlens) have none",
        ),
        (
            {"cu_seqlens": (0, 5, 20), "key_lengths": (4, 3, 2)},
            "--key-lengths: 3 values given but --cu-seqlens packs 2 documents",
        ),
        (
            {"cu_seqlens": (0, 5, 20), "key_lengths": (4, 16)},
            "--key-lengths: 16 exceeds document 1's 15 keys",
        ),
    ],
)
def test_bad_cu_seqlens_are_one_line_naming_the_flag(options: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as err:
        build_spec(*inputs(20, 20), options=Options(**options))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_cu_seqlens_refuse_a_batch() -> None:
    q, k, v = (np.concatenate([a, a]) for a in inputs(20, 20))
    with pytest.raises(SpecError, match="--cu-seqlens: packs documents along one sequence"):
        build_spec(q, k, v, options=Options(cu_seqlens=(0, 5, 20)))


def test_cu_seqlens_without_keys_need_l_equal_s() -> None:
    with pytest.raises(SpecError, match="L = 9 and S = 20 differ"):
        build_spec(*inputs(9, 20), options=Options(cu_seqlens=(0, 4, 9)))
