"""Attention problems on every mask option, shared by the tests of the lean passes
(tests/engine/test_online.py, tests/engine/test_grad_block.py): random Q, K, V and
each option with its edges (rows that see no key, key blocks smaller than a mask's
run, packed documents)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import AttentionSpec, build_spec

FLOAT32_RUN: dict[str, Any] = {
    "dtype": "float32",
    "accumulate": "float32",
    "softmax_dtype": "float32",
    "logits_dtype": "float32",
}
"""``--dtype float32`` (its defaults): the engine computes in float32 directly."""

DOCUMENTS = (5, 8, 3, 11, 2)
"""Packed sequences' lengths: boundaries at 5, 13, 16, 27, inside key blocks of 7 and 16."""


def documents(lengths: tuple[int, ...]) -> NDArray[np.bool_]:
    """A block-diagonal "may attend" mask: each token sees its own document only."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    return doc[:, None] == doc[None, :]  # type: ignore[no-any-return]


def make_spec(
    data_seed: int,
    /,
    *,
    B: int = 2,
    H: int = 2,
    G: int = 2,
    L: int = 13,
    S: int = 30,
    E: int = 4,
    Ev: int = 3,
    mask: str = "none",
    spread: float = 1.0,
    float32: bool = False,
    **options: Any,
) -> AttentionSpec:
    """Random Q (B, H, L, E) times ``spread``, K and V (B, G, S, ·), and a mask:
    ``bool`` (True attends, every fourth row hidden from every key), ``bool-masked``
    (the same with True hiding), ``keys`` (one row of keys per batch item, broadcast),
    ``documents`` (packed sequences, L = S), ``float`` (additive, some −inf)."""
    rng = np.random.default_rng(data_seed)
    q = rng.normal(size=(B, H, L, E)) * spread
    k, v = rng.normal(size=(B, G, S, E)), rng.normal(size=(B, G, S, Ev))
    m: NDArray[Any] | None = None
    if mask in ("bool", "bool-masked"):
        m = rng.random((B, H, L, S)) > 0.4
        m[:, :, ::4] = False
        if mask == "bool-masked":
            m = ~m
            options["mask_true_means"] = "masked"
    elif mask == "keys":  # (B, 1, 1, S): a padding mask broadcast over heads and rows
        m = rng.random((B, 1, 1, S)) > 0.3
    elif mask == "documents":
        m = documents(DOCUMENTS)
        assert m.shape == (L, S)
    elif mask == "float":
        m = rng.normal(size=(L, S))
        m[rng.random((L, S)) < 0.25] = -math.inf
    if float32:
        options.update(FLOAT32_RUN)
    return build_spec(q, k, v, mask=m, options=Options(**options))


CASES: dict[str, dict[str, Any]] = {
    "no-mask": {},
    "causal-upper-left-L<S": {"L": 13, "S": 30, "causal": True},
    "causal-upper-left-L>S": {"L": 30, "S": 13, "causal": True},
    "causal-lower-right-L<S": {"L": 13, "S": 30, "causal": True, "causal_align": "lower-right"},
    # the first L − S rows see no key at all
    "causal-lower-right-L>S": {"L": 30, "S": 13, "causal": True, "causal_align": "lower-right"},
    "window-left": {"L": 20, "S": 30, "window": (9, 0)},
    "window-right": {"L": 20, "S": 30, "window": (0, 11)},
    "window-both-lower-right": {"L": 11, "S": 30, "window": (5, 3), "causal_align": "lower-right"},
    "window-beyond-keys": {"L": 30, "S": 10, "window": (2, 2)},
    "key-padding-with-0": {"key_lengths": (0, 19)},
    "key-padding-one-length": {"key_lengths": (23,)},
    "bool-mask": {"mask": "bool"},
    "bool-mask-true-means-masked": {"mask": "bool-masked"},
    "bool-key-mask-broadcast": {"mask": "keys", "causal": True},
    "documents": {"L": 29, "S": 29, "mask": "documents"},
    "documents-causal": {"L": 29, "S": 29, "mask": "documents", "causal": True},
    "causal-window-padding": {
        "L": 17,
        "S": 30,
        "causal": True,
        "causal_align": "lower-right",
        "window": (10, 2),
        "key_lengths": (30, 12),
    },
    "everything-and-a-mask": {
        "L": 17,
        "S": 30,
        "causal": True,
        "window": (12, 0),
        "key_lengths": (25, 30),
        "mask": "bool",
    },
    "grouped-query": {"H": 4, "G": 2, "causal": True},
    "one-query": {"L": 1, "S": 30},
    "one-query-causal-lower-right": {
        "L": 1,
        "S": 30,
        "causal": True,
        "causal_align": "lower-right",
    },
    "keys-fewer-than-a-key-block": {"L": 9, "S": 5, "causal": True},
    "float32": {"float32": True},
    "float32-causal-padding": {"float32": True, "causal": True, "key_lengths": (0, 21)},
    "float32-documents": {"float32": True, "L": 29, "S": 29, "mask": "documents"},
    # logits ~ ±30: weights flush in float16 (counted again key block by key block) and
    # exp(logit) overflows float16 (logits above 11.09) in several key blocks
    "float16-flushes": {"spread": 12.0, "causal": True, "window": (20, 0)},
    "float32-float16-flushes": {"spread": 12.0, "float32": True, "key_lengths": (30, 17)},
    "nothing-flushes": {"spread": 0.1, "mask": "bool"},
    # KV-cache steps (--query-offset): each item's queries at its own cache position
    "kv-cache-causal-padding": {
        "L": 5,
        "S": 30,
        "causal": True,
        "query_offset": (25, 7),
        "key_lengths": (30, 12),
    },
    "kv-cache-window-query-lengths": {
        "L": 13,
        "S": 30,
        "causal": True,
        "window": (6, 0),
        "query_offset": (17, 3),
        "key_lengths": (30, 16),
        "query_lengths": (13, 5),
    },
    # packed documents (--cu-seqlens): block-diagonal, causal within each document
    "cu-seqlens-causal": {
        "B": 1,
        "L": 29,
        "S": 29,
        "causal": True,
        "cu_seqlens": (0, 5, 13, 16, 27, 29),
    },
    "cu-seqlens-k-window": {
        "B": 1,
        "L": 13,
        "S": 30,
        "causal": True,
        "causal_align": "lower-right",
        "window": (4, 0),
        "cu_seqlens": (0, 5, 5, 13),
        "cu_seqlens_k": (0, 9, 12, 30),
    },
    "kv-cache-past-the-keys-one-query-length": {
        "L": 13,
        "S": 30,
        "causal": True,
        "query_offset": (22,),
        "query_lengths": (9,),
    },
    # each item's own diagonal (FlashAttention's seqused_k): item 1 has more queries
    # than keys, so its offset is negative and its first rows see no key
    "per-item-lower-right": {
        "L": 13,
        "S": 30,
        "causal": True,
        "causal_align": "lower-right-per-item",
        "key_lengths": (30, 8),
        "query_lengths": (13, 11),
    },
    "negative-query-offset-window": {
        "L": 13,
        "S": 30,
        "window": (3, 1),
        "query_offset": (-4, 6),
    },
    # chunked attention (Llama 4): chunks of 8 positions, across key blocks
    "chunks-causal": {"L": 30, "S": 30, "causal": True, "attention_chunk": 8},
    "chunks-kv-cache": {
        "L": 9,
        "S": 30,
        "causal": True,
        "attention_chunk": 7,
        "query_offset": (21, 3),
        "key_lengths": (30, 12),
    },
    "chunks-cu-seqlens-seqused-k": {
        "B": 1,
        "L": 13,
        "S": 30,
        "causal": True,
        "causal_align": "lower-right",
        "attention_chunk": 4,
        "cu_seqlens": (0, 5, 5, 13),
        "cu_seqlens_k": (0, 9, 12, 30),
        "key_lengths": (7, 3, 15),
    },
    "cu-seqlens-query-offsets": {
        "B": 1,
        "L": 13,
        "S": 30,
        "causal": True,
        "cu_seqlens": (0, 5, 6, 13),
        "cu_seqlens_k": (0, 9, 12, 30),
        "query_offset": (4, 2, -1),
    },
}


def random_qkv(
    seed: int, B: int, H: int, L: int, S: int, E: int, Ev: int
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Standard normal Q (B, H, L, E), K (B, H, S, E) and V (B, H, S, Ev), seeded."""
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(B, H, L, E)),
        rng.normal(size=(B, H, S, E)),
        rng.normal(size=(B, H, S, Ev)),
    )


def causal_over_keys(
    q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], start: int, stop: int
) -> tuple[NDArray[Any], NDArray[Any]]:
    """Causal attention (upper-left, scale 1/√E with E = 4) over keys start:stop alone,
    a float64 loop per row: a split-KV kernel's partial output and LSE (−inf for a row
    that sees no key of the range)."""
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -math.inf)
    for b, h, i in np.ndindex(*q.shape[:-1]):
        logits = [q[b, h, i] @ k[b, h, j] / 2.0 for j in range(start, min(stop, i + 1))]
        if not logits:
            continue
        m = max(logits)
        w = [math.exp(x - m) for x in logits]
        lse[b, h, i] = m + math.log(sum(w))
        out[b, h, i] = sum(wj * v[b, h, start + j] for j, wj in enumerate(w)) / sum(w)
    return out, lse
