"""sdpa against ``torch.nn.functional.scaled_dot_product_attention`` in float64.

PyTorch is a reference for these tests only, never a dependency: the module skips
when it cannot be imported. The math backend is pinned, the one whose behaviour on
rows with no visible key is documented (zeros, since PyTorch 2.5). Dropout is not
compared: PyTorch draws its keep-mask from its own generator.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace

torch = pytest.importorskip("torch")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

F64 = NDArray[np.float64]


def normal(seed: int, *shape: int) -> F64:
    return np.random.default_rng(seed).normal(size=shape)


def torch_sdpa(q: F64, k: F64, v: F64, attn_mask: Any = None, **kwargs: Any) -> F64:
    """PyTorch's attention output, math backend, float64."""
    as_tensor = torch.from_numpy
    if isinstance(attn_mask, np.ndarray):
        attn_mask = as_tensor(attn_mask)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            as_tensor(q), as_tensor(k), as_tensor(v), attn_mask=attn_mask, **kwargs
        )
    return out.numpy()  # type: ignore[no-any-return]


def ours(q: F64, k: F64, v: F64, *, mask: NDArray[Any] | None = None, **options: Any) -> F64:
    out = trace(build_spec(q, k, v, mask=mask, options=Options(**options))).output
    assert out is not None
    return out


def assert_close(a: F64, b: F64) -> None:
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


def qkv(L: int = 4, S: int = 6, lead: tuple[int, ...] = (2, 3)) -> tuple[F64, F64, F64]:
    return normal(1, *lead, L, 8), normal(2, *lead, S, 8), normal(3, *lead, S, 5)


def test_plain_attention_matches_pytorch() -> None:
    q, k, v = qkv()
    assert_close(ours(q, k, v), torch_sdpa(q, k, v))


@pytest.mark.parametrize(
    ("ours_scale", "torch_scale"),
    [("sqrt-dk", 1 / math.sqrt(8)), ("dk", 1 / 8), ("none", 1.0), (0.3, 0.3)],
)
def test_scale_values_match_pytorch(ours_scale: str | float, torch_scale: float) -> None:
    q, k, v = qkv()
    assert_close(ours(q, k, v, scale=ours_scale), torch_sdpa(q, k, v, scale=torch_scale))


def test_temperature_is_pytorch_scale_divided_by_it() -> None:
    q, k, v = qkv()
    got = ours(q, k, v, scale=0.5, temperature=2.5)
    assert_close(got, torch_sdpa(q, k, v, scale=0.5 / 2.5))


@pytest.mark.parametrize(("L", "S"), [(4, 4), (3, 6), (6, 3)])
def test_causal_upper_left_matches_is_causal(L: int, S: int) -> None:
    q, k, v = qkv(L, S)
    assert_close(ours(q, k, v, causal=True), torch_sdpa(q, k, v, is_causal=True))


@pytest.mark.parametrize(("L", "S"), [(3, 6), (6, 3), (5, 5)])
def test_causal_lower_right_matches_causal_lower_right(L: int, S: int) -> None:
    """With L > S the first L − S rows see no key: PyTorch warns of NaNs, returns zeros."""
    q, k, v = qkv(L, S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "will produce NaNs ... when seq_len_q > seq_len_kv"
        bias = causal_lower_right(L, S)
    want = torch_sdpa(q, k, v, attn_mask=bias)
    assert np.all(np.isfinite(want))
    got = ours(q, k, v, causal=True, causal_align="lower-right")
    assert_close(got, want)
    if L > S:
        assert np.all(got[..., : L - S, :] == 0.0)


@pytest.mark.parametrize("G", [1, 2, 3, 6])
def test_grouped_query_attention_matches_enable_gqa(G: int) -> None:
    q, k, v = normal(4, 2, 6, 4, 8), normal(5, 2, G, 5, 8), normal(6, 2, G, 5, 3)
    assert_close(ours(q, k, v, causal=True), torch_sdpa(q, k, v, is_causal=True, enable_gqa=True))


MASK_SHAPES = {
    "full": (2, 3, 4, 6),
    "L-S": (4, 6),
    "keys-only": (6,),
    "per-batch": (2, 1, 4, 6),
    "per-head-keys": (1, 3, 1, 6),
    "rows-only": (4, 1),
}


@pytest.mark.parametrize("shape", MASK_SHAPES.values(), ids=MASK_SHAPES.keys())
def test_boolean_masks_match_pytorch(shape: tuple[int, ...]) -> None:
    q, k, v = qkv()
    mask = np.random.default_rng(7).random(shape) > 0.3
    assert_close(ours(q, k, v, mask=mask), torch_sdpa(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("shape", MASK_SHAPES.values(), ids=MASK_SHAPES.keys())
def test_float_masks_match_pytorch(shape: tuple[int, ...]) -> None:
    q, k, v = qkv()
    mask = np.random.default_rng(8).normal(size=shape) * 4
    mask[np.random.default_rng(9).random(shape) < 0.2] = -math.inf
    assert_close(ours(q, k, v, mask=mask), torch_sdpa(q, k, v, attn_mask=mask))


def test_broadcast_leading_axes_match_pytorch() -> None:
    q, k, v = normal(10, 2, 1, 4, 8), normal(11, 3, 6, 8), normal(12, 1, 6, 5)
    want = torch_sdpa(q, k, v)
    assert want.shape == (2, 3, 4, 5)
    assert_close(ours(q, k, v), want)


def test_query_with_one_head_broadcasts_over_kv_heads_like_pytorch() -> None:
    q, k, v = normal(13, 2, 1, 4, 8), normal(14, 2, 4, 6, 8), normal(15, 2, 4, 6, 5)
    assert_close(ours(q, k, v), torch_sdpa(q, k, v))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_are_zero_in_both(kind: str) -> None:
    """PyTorch ≥ 2.5's math backend returns 0 for a row with no visible key, as sdpa does."""
    q, k, v = qkv()
    allowed = np.ones((2, 3, 4, 6), dtype=bool)
    allowed[0, 1, 2] = False
    allowed[1, :, 0] = False
    mask: NDArray[Any] = allowed if kind == "bool" else np.where(allowed, 0.0, -math.inf)
    want = torch_sdpa(q, k, v, attn_mask=mask)
    assert np.all(want[0, 1, 2] == 0.0)
    assert np.all(want[1, :, 0] == 0.0)
    assert_close(ours(q, k, v, mask=mask), want)


def test_additive_minus_1e9_row_is_a_shift_in_both() -> None:
    """A float mask of −1e9 over a whole row is added, so the row is not hidden at all.

    (sdpa's --mask-value −1e9 instead *replaces* the logits of hidden keys, which makes
    a hidden row uniform; PyTorch's boolean masks give zeros there.)
    """
    q, k, v = qkv()
    mask = np.zeros((4, 6))
    mask[1] = -1e9
    want = torch_sdpa(q, k, v, attn_mask=mask)
    assert_close(ours(q, k, v, mask=mask), want)
    np.testing.assert_allclose(want[..., 1, :], torch_sdpa(q, k, v)[..., 1, :], atol=1e-6)
