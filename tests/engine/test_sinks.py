"""Attention sinks (gpt-oss): against HF's eager attention, torch autograd and a loop."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from numpy.typing import NDArray

from sdpa_cli.engine.block import attend_block, block_lse
from sdpa_cli.engine.grad import backward
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.errors import SpecError

F64 = NDArray[np.float64]

torch = pytest.importorskip("torch")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

B, H, G, L, S, E = 2, 4, 2, 3, 5, 8


def _inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, E))
    k = rng.standard_normal((B, G, S, E))
    v = rng.standard_normal((B, G, S, E))
    sinks = rng.standard_normal(H) * 2
    return q, k, v, sinks


def _ours(
    q: F64, k: F64, v: F64, sinks: F64, causal: bool = False
) -> tuple[AttentionSpec, F64, F64]:
    spec = build_spec(q, k, v, sinks=sinks, options=Options(causal=causal))
    out = np.zeros((B, H, L, E))
    lse = np.zeros((B, H, L))
    for b in range(B):
        for h in range(H):
            blk = attend_block(spec, (b, h), slice(0, L))
            out[b, h], lse[b, h] = blk.output, block_lse(blk)
    return spec, out, lse


def _hf(q: F64, k: F64, v: F64, sinks: F64, causal: bool = False) -> F64:
    module = SimpleNamespace(sinks=torch.tensor(sinks), num_key_value_groups=H // G, training=False)
    mask = None
    if causal:
        mask = torch.zeros(1, 1, L, S, dtype=torch.float64)
        mask[..., torch.triu(torch.ones(L, S, dtype=torch.bool), 1)] = -math.inf
    out, _ = gpt_oss.eager_attention_forward(
        module,
        torch.tensor(q),
        torch.tensor(k),
        torch.tensor(v),
        mask,
        scaling=1 / math.sqrt(E),
        dropout=0.0,
    )
    got: F64 = out.transpose(1, 2).numpy()  # HF returns (B, L, H, E)
    return got


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_match_hf_gpt_oss_eager_attention(causal: bool) -> None:
    q, k, v, sinks = _inputs()
    _, out, _ = _ours(q, k, v, sinks, causal)
    np.testing.assert_allclose(out, _hf(q, k, v, sinks, causal), rtol=0, atol=1e-9)


def test_sinks_match_a_float64_loop_and_lse() -> None:
    q, k, v, sinks = _inputs(1)
    _, out, lse = _ours(q, k, v, sinks)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                s = [float(q[b, h, i] @ k[b, h // 2, j]) / math.sqrt(E) for j in range(S)]
                total = sum(math.exp(x) for x in s) + math.exp(sinks[h])
                w = [math.exp(x) / total for x in s]
                o = sum(w[j] * v[b, h // 2, j] for j in range(S))
                np.testing.assert_allclose(out[b, h, i], o, rtol=0, atol=1e-9)
                assert lse[b, h, i] == pytest.approx(math.log(total), abs=1e-9)


def test_rows_sum_to_one_minus_the_sink_weight() -> None:
    q, k, v, sinks = _inputs(2)
    spec = build_spec(q, k, v, sinks=sinks)
    blk = attend_block(spec, (0, 1), slice(0, L))
    assert blk.sink is not None
    np.testing.assert_allclose(blk.weights.sum(axis=1) + blk.sink, 1.0, atol=1e-12)


def test_sinks_gradients_match_torch_autograd() -> None:
    q, k, v, sinks = _inputs(3)
    rng = np.random.default_rng(9)
    dout = rng.standard_normal((B, H, L, E))
    spec = build_spec(q, k, v, sinks=sinks, options=Options(causal=True))
    grads = backward(spec, dout)
    tq, tk, tv, ts = (torch.tensor(a, requires_grad=True) for a in (q, k, v, sinks))
    module = SimpleNamespace(sinks=ts, num_key_value_groups=H // G, training=False)
    mask = torch.zeros(1, 1, L, S, dtype=torch.float64)
    mask[..., torch.triu(torch.ones(L, S, dtype=torch.bool), 1)] = -math.inf
    out, _ = gpt_oss.eager_attention_forward(
        module, tq, tk, tv, mask, scaling=1 / math.sqrt(E), dropout=0.0
    )
    (out.transpose(1, 2) * torch.tensor(dout)).sum().backward()
    for ours, theirs in ((grads.dq, tq), (grads.dk, tk), (grads.dv, tv), (grads.dsinks, ts)):
        assert ours is not None
        assert theirs.grad is not None
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=0, atol=1e-9)


def test_one_sink_broadcasts_over_heads() -> None:
    q, k, v, _ = _inputs(4)
    one = np.array([0.7])
    _, out, _ = _ours(q, k, v, one)
    np.testing.assert_allclose(out, _hf(q, k, v, np.full(H, 0.7)), rtol=0, atol=1e-9)


def test_sinks_of_the_wrong_shape_are_refused() -> None:
    q, k, v, _ = _inputs()
    with pytest.raises(SpecError) as err:
        build_spec(q, k, v, sinks=np.zeros(3))
    assert str(err.value) == "--sinks: shape (3,), expected (H,) = (4,) or (1,)"
