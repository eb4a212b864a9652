"""``--as``: each framework's conventions against the framework itself.

For every framework installed, ``sdpa``'s output under ``--as NAME`` is compared with
the framework's own function on three cases that separate them: causal with L ≠ S,
a sliding window, and a row with no visible key. Float64 frameworks (PyTorch, ONNX's
reference) agree at 1e-9; JAX and Hugging Face run their softmax in float32, so they
agree to float32's rounding. A framework that is not installed is skipped.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from attention_cases import random_qkv
from numpy.typing import NDArray
from onnx_reference import onnx_attention

from sdpa_cli.engine.conventions import CONVENTIONS, FLOAT32_MAX, JAX_MASK_VALUE, convention
from sdpa_cli.engine.options import Options, parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError
from sdpa_cli.names import FRAMEWORKS

F64 = NDArray[np.float64]
B, H, L, S, E = 2, 2, 4, 7, 5
EV = E  # JAX takes V with K's head dim
TOL = 1e-9
F32_TOL = 2e-6


def qkv(seed: int = 0) -> tuple[F64, F64, F64]:
    return random_qkv(seed, B, H, L, S, E, EV)


def empty_row_mask() -> NDArray[np.bool_]:
    """Every key visible but row 1's (no visible key): the third case."""
    mask = np.ones((L, S), dtype=np.bool_)
    mask[1] = False
    return mask


def sdpa(framework: str, mask: NDArray[Any] | None = None, seed: int = 0, **raw: Any) -> F64:
    q, k, v = qkv(seed)
    options = parse_options({"framework": framework, **raw})
    spec = build_spec(q, k, v, mask=mask, options=options)
    out = trace(spec, stages=("output",)).output
    assert out is not None
    return out


# --- the table ------------------------------------------------------------------------


def test_table_names_each_framework_once_with_its_conventions() -> None:
    assert FRAMEWORKS == ("torch", "flash", "jax", "onnx", "hf")
    assert tuple(CONVENTIONS) == FRAMEWORKS
    aligns = {n: c.causal_align for n, c in CONVENTIONS.items()}
    assert aligns == {
        "torch": "upper-left",
        "flash": "lower-right-per-item",
        "jax": "upper-left",
        "onnx": "lower-right-per-item",
        "hf": "lower-right",
    }
    empty = {n: c.empty_row for n, c in CONVENTIONS.items()}
    assert empty == {
        "torch": "zeros",
        "flash": "zeros",
        "jax": "mean of V",
        "onnx": "zeros",
        "hf": "mean of V",
    }
    assert [n for n, c in CONVENTIONS.items() if c.window_counts_query] == ["hf"]


def test_jax_mask_value_is_its_large_negative() -> None:
    assert pytest.approx(-2.3819763e38, rel=1e-7) == JAX_MASK_VALUE
    assert float(np.finfo(np.float32).max) == FLOAT32_MAX  # written out, for a numpy-free module
    assert -0.7 * float(np.finfo(np.float32).max) == JAX_MASK_VALUE
    assert parse_options({"framework": "jax"}).mask_value == JAX_MASK_VALUE


def test_as_sets_defaults_that_flags_override() -> None:
    o = parse_options({"framework": "flash", "causal_align": "upper-left", "mask_value": "-1e9"})
    assert (o.causal_align, o.mask_value, o.framework) == ("upper-left", -1e9, "flash")
    o = parse_options({"framework": "hf"})
    assert (o.causal_align, o.mask_value_is_finfo_min) == ("lower-right", True)
    assert parse_options({}) == Options()


def test_as_hf_reads_the_window_as_sliding_window_counting_the_query() -> None:
    assert parse_options({"framework": "hf", "window": "4,0"}).window == (3, 0)
    assert parse_options({"framework": "flash", "window": "4,0"}).window == (4, 0)
    with pytest.raises(SpecError, match=r"--window: hf's sliding window counts the query"):
        parse_options({"framework": "hf", "window": "0,0"})


def test_as_with_query_offset_leaves_the_alignment_to_the_offset() -> None:
    o = parse_options({"framework": "flash", "causal": True, "query_offset": "3"})
    assert (o.causal_align, o.query_offset) == ("upper-left", (3,))


def test_unknown_framework_is_refused_with_the_flag_named() -> None:
    with pytest.raises(SpecError, match=r"^--as: expected one of torch, flash, jax, onnx, hf"):
        parse_options({"framework": "mlx"})
    assert convention("FLASH").name == "flash"


def test_as_gives_each_empty_row_its_framework_answer() -> None:
    """Zeros under −inf, the mean of V (every key, uniform) under a finite value."""
    _, _, v = qkv()
    for name in FRAMEWORKS:
        row = sdpa(name, mask=empty_row_mask())[:, :, 1]
        want = np.zeros_like(row) if CONVENTIONS[name].empty_row == "zeros" else v.mean(axis=-2)
        np.testing.assert_allclose(row, want, atol=TOL, err_msg=name)


# --- PyTorch --------------------------------------------------------------------------


def _torch_sdpa(attn_mask: Any = None, is_causal: bool = False) -> F64:
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(a) for a in qkv())
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal
    )
    return np.asarray(out.numpy(), dtype=np.float64)


def test_torch_causal_with_l_ne_s_is_upper_left() -> None:
    np.testing.assert_allclose(sdpa("torch", causal=True), _torch_sdpa(is_causal=True), atol=TOL)


def test_torch_empty_row_gives_zeros() -> None:
    torch = pytest.importorskip("torch")
    mask = empty_row_mask()
    want = _torch_sdpa(attn_mask=torch.from_numpy(mask))
    np.testing.assert_allclose(sdpa("torch", mask=mask), want, atol=TOL)
    assert not want[:, :, 1].any()


def test_flash_causal_is_torch_causal_lower_right() -> None:
    """FlashAttention ≥ 2.1's diagonal is PyTorch's ``causal_lower_right`` bias."""
    pytest.importorskip("torch")
    from torch.nn.attention.bias import causal_lower_right  # PyTorch ≥ 2.3

    want = _torch_sdpa(attn_mask=causal_lower_right(L, S))
    got = sdpa("flash", causal=True)
    np.testing.assert_allclose(got, want, atol=TOL)
    assert not np.allclose(got, sdpa("torch", causal=True), atol=1e-3)


def test_flash_window_and_empty_row_against_flash_attn() -> None:
    torch = pytest.importorskip("torch")
    flash_attn = pytest.importorskip("flash_attn")
    if not torch.cuda.is_available():
        pytest.skip("flash_attn runs on a GPU")
    q, k, v = (torch.from_numpy(a).transpose(1, 2).cuda().half() for a in qkv())
    out = flash_attn.flash_attn_func(q, k, v, causal=True, window_size=(2, 0))
    want = out.transpose(1, 2).float().cpu().numpy().astype(np.float64)
    np.testing.assert_allclose(sdpa("flash", causal=True, window="2,0"), want, atol=2e-3)


# --- JAX ------------------------------------------------------------------------------


def _jax(**kwargs: Any) -> F64:
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp  # after x64 is on

    q, k, v = (jnp.asarray(np.swapaxes(a, 1, 2)) for a in qkv())  # BTNH
    out = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    return np.swapaxes(np.asarray(out, dtype=np.float64), 1, 2)


def test_jax_causal_window_and_empty_row() -> None:
    """Upper-left ``tril``, FlashAttention's window counting, and the mean of V for a
    row with no visible key (its softmax runs in float32, hence the tolerance)."""
    got, want = sdpa("jax", causal=True), _jax(is_causal=True)
    np.testing.assert_allclose(got, want, atol=F32_TOL)
    got = sdpa("jax", causal=True, window="2,0")
    np.testing.assert_allclose(got, _jax(is_causal=True, local_window_size=(2, 0)), atol=F32_TOL)
    mask = empty_row_mask()
    want = _jax(mask=np.broadcast_to(mask, (B, H, L, S)))
    np.testing.assert_allclose(sdpa("jax", mask=mask), want, atol=F32_TOL)
    assert not np.allclose(want[:, :, 1], 0.0)


# --- ONNX -----------------------------------------------------------------------------


def _onnx(opset: int, past: bool, mask: NDArray[Any] | None = None, **attributes: Any) -> F64:
    q, k, v = qkv()
    arrays: dict[str, NDArray[Any]] = {"Q": q, "K": k, "V": v}
    if mask is not None:
        arrays["attn_mask"] = mask
    if past:  # the first S − L keys as the past cache, the last L as the new keys
        arrays |= {"K": k[:, :, S - L :], "V": v[:, :, S - L :]}
        arrays |= {"past_key": k[:, :, : S - L], "past_value": v[:, :, : S - L]}
    return onnx_attention(opset, arrays, **attributes)


def test_onnx_causal_sits_at_the_past_length() -> None:
    want = _onnx(23, past=True, is_causal=1)
    np.testing.assert_allclose(sdpa("onnx", causal=True), want, atol=TOL)


def test_onnx_window_leaves_the_query_out() -> None:
    want = _onnx(25, past=True, is_causal=1, left_window_size=2, right_window_size=0)
    np.testing.assert_allclose(sdpa("onnx", causal=True, window="2,0"), want, atol=TOL)


def test_onnx_empty_row_gives_zeros() -> None:
    mask = empty_row_mask()
    want = _onnx(23, past=False, mask=mask)
    np.testing.assert_allclose(sdpa("onnx", mask=mask), want, atol=TOL)
    assert not want[:, :, 1].any()


# --- Hugging Face ---------------------------------------------------------------------


def _hf(mask_function: Any, padding: NDArray[np.bool_] | None = None) -> F64:
    """``eager_attention_forward`` with ``masking_utils``' eager mask for a cache step:
    the L queries at positions S − L .. S − 1 (``q_offset``), float32 as models run."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch", reason="transformers' masks are torch tensors")
    pytest.importorskip("transformers")
    from transformers.masking_utils import eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    q, k, v = (torch.from_numpy(a).float() for a in qkv())
    mask = eager_mask(
        batch_size=B,
        q_length=L,
        kv_length=S,
        q_offset=S - L,
        mask_function=mask_function,
        attention_mask=None if padding is None else torch.from_numpy(padding),
        dtype=torch.float32,
    )
    module: Any = SimpleNamespace(num_key_value_groups=1, training=False)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=1 / math.sqrt(E))
    return np.swapaxes(out.numpy().astype(np.float64), 1, 2)  # BTNH → BNTH


def test_hf_causal_follows_the_cache_positions() -> None:
    pytest.importorskip("torch", reason="transformers' masks are torch tensors")
    pytest.importorskip("transformers")
    from transformers.masking_utils import causal_mask_function

    want = _hf(causal_mask_function)
    np.testing.assert_allclose(sdpa("hf", causal=True), want, atol=F32_TOL)


def test_hf_sliding_window_counts_the_query() -> None:
    pytest.importorskip("torch", reason="transformers' masks are torch tensors")
    pytest.importorskip("transformers")
    from transformers.masking_utils import sliding_window_causal_mask_function

    want = _hf(sliding_window_causal_mask_function(3))
    got = sdpa("hf", causal=True, window="3,0")
    np.testing.assert_allclose(got, want, atol=F32_TOL)
    # The same number read as FlashAttention's window_size sees one key more.
    assert not np.allclose(sdpa("flash", causal=True, window="3,0"), want, atol=1e-3)


def test_hf_left_padded_row_with_no_visible_key_is_the_mean_of_v() -> None:
    """Item 0 left-padded by 5: its first query (position 3) sees only padding."""
    pytest.importorskip("torch", reason="transformers' masks are torch tensors")
    pytest.importorskip("transformers")
    from transformers.masking_utils import causal_mask_function

    padding = np.ones((B, S), dtype=np.bool_)
    padding[0, :5] = False
    want = _hf(causal_mask_function, padding)
    mask = padding[:, None, None, :]
    got = sdpa("hf", mask=mask, causal=True)
    np.testing.assert_allclose(got, want, atol=F32_TOL)
    _, _, v = qkv()
    np.testing.assert_allclose(got[0, :, 0], v[0].mean(axis=-2), atol=TOL)
