"""Independent references for the backward pass: PyTorch autograd graphs in float64.

Nothing here imports torch: the test passes the module in (``pytest.importorskip``
hands it over), so the finite-difference tests run where torch is absent. Two kinds
of reference, both differentiated by autograd:

* :func:`torch_sdpa` — ``torch.nn.functional.scaled_dot_product_attention`` itself,
  math backend pinned, for every option it knows (``scale=``, boolean and float
  ``attn_mask`` (a bias with ``requires_grad`` gets its gradient), ``is_causal``,
  ``enable_gqa``);
* :func:`torch_graph` — attention written out as a torch graph, for what SDPA has no
  argument for: a softcap, dropout with a given keep-mask, and a *replacing* finite
  mask value (``masked_fill``, whose backward gives the replaced logits no gradient).

The boolean masks are built here from their definitions (visible when
j ≤ i + offset, −left ≤ j − i − offset ≤ right, j < n), not from ``sdpa_cli.engine.masks``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
Tensors = dict[str, Any]
"""Operand name (``q``, ``k``, ``v``, ``bias``) → a float64 leaf tensor."""
Reference = Callable[[Any, Tensors], Any]
"""(torch, tensors) → the output tensor, shaped like the engine's output."""


def offset_of(align: str, L: int, S: int) -> int:
    return S - L if align == "lower-right" else 0


def causal_visible(L: int, S: int, align: str = "upper-left") -> NDArray[np.bool_]:
    """(L, S): key j is visible to query i when j ≤ i + offset."""
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    return j <= i + offset_of(align, L, S)


def window_visible(
    L: int, S: int, left: int, right: int, align: str = "upper-left"
) -> NDArray[np.bool_]:
    """(L, S): key j is visible to query i when −left ≤ j − i − offset ≤ right."""
    d = np.arange(S)[None, :] - np.arange(L)[:, None] - offset_of(align, L, S)
    return (d >= -left) & (d <= right)


def padding_visible(lengths: tuple[int, ...], L: int, S: int) -> NDArray[np.bool_]:
    """(B, 1, L, S): the first ``lengths[b]`` keys of batch item b are visible."""
    n = np.array(lengths)[:, None, None, None]
    return np.broadcast_to(np.arange(S)[None, None, None, :] < n, (len(lengths), 1, L, S))


def torch_sdpa(torch: Any, t: Tensors, attn_mask: Any = None, **kwargs: Any) -> Any:
    """PyTorch's SDPA on ``t['q'], t['k'], t['v']``, math backend; a numpy
    ``attn_mask`` becomes a constant tensor."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if isinstance(attn_mask, np.ndarray):
        attn_mask = torch.from_numpy(np.ascontiguousarray(attn_mask))
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(
            t["q"], t["k"], t["v"], attn_mask=attn_mask, **kwargs
        )


def sdpa_reference(attn_mask: Any = None, **kwargs: Any) -> Reference:
    """A reference calling :func:`torch_sdpa` with a constant mask and these arguments."""

    def reference(torch: Any, t: Tensors) -> Any:
        return torch_sdpa(torch, t, attn_mask, **kwargs)

    return reference


def graph_reference(**kwargs: Any) -> Reference:
    """A reference calling :func:`torch_graph` with these arguments."""

    def reference(torch: Any, t: Tensors) -> Any:
        return torch_graph(torch, t, **kwargs)

    return reference


def torch_graph(
    torch: Any,
    t: Tensors,
    *,
    factor: float,
    softcap: float | None = None,
    group: int = 1,
    additive: F64 | None = None,
    visible: NDArray[np.bool_] | None = None,
    mask_value: float = -math.inf,
    keep: NDArray[np.bool_] | None = None,
    dropout: float = 0.0,
) -> Any:
    """Attention as a plain torch graph, in the engine's order of operations::

        s = Q Kᵀ · factor;  s = C tanh(s / C);  s += bias + additive
        s = masked_fill(s, ~visible, mask_value);  A = softmax(s)   (a row with no
        visible key under −inf: A = 0, as safe softmax);  P = A · keep / (1 − p);  O = P V

    ``group`` > 1 repeats each K/V head for its ``group`` query heads (GQA).
    """
    q, k, v = t["q"], t["k"], t["v"]
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    s = (q @ k.transpose(-1, -2)) * factor
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if "bias" in t:
        s = s + t["bias"]
    if additive is not None:
        s = s + torch.from_numpy(np.ascontiguousarray(additive))
    seen = None
    if visible is not None:
        vis = torch.from_numpy(np.ascontiguousarray(visible))
        s = s.masked_fill(~vis, mask_value)
        if mask_value == -math.inf:
            # softmax of an all −inf row is NaN, and NaN·0 would poison the backward:
            # such rows are given finite logits and their weights zeroed after.
            seen = vis.any(dim=-1, keepdim=True)
            s = torch.where(seen, s, torch.zeros_like(s))
    a = torch.softmax(s, dim=-1)
    if seen is not None:
        a = a * seen
    if keep is not None:
        a = a * torch.from_numpy(np.ascontiguousarray(keep)) / (1.0 - dropout)
    return a @ v


def torch_gradients(
    torch: Any, reference: Reference, arrays: Mapping[str, F64], dout: F64
) -> dict[str, F64]:
    """The gradients of Σ O ⊙ dO by autograd, named ``dq``, ``dk``, ``dv``, ``dbias``
    and shaped as ``arrays`` (the operands as loaded); ``dout`` in the engine's layout."""
    t = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in arrays.items()}
    out = reference(torch, t)
    assert out.numel() == dout.size, (tuple(out.shape), dout.shape)
    loss = (out.reshape(dout.shape) * torch.from_numpy(dout)).sum()
    loss.backward()
    grads: dict[str, F64] = {}
    for name, tensor in t.items():
        assert tensor.grad is not None, f"{name} got no gradient"
        grads["d" + name] = tensor.grad.numpy()
    return grads
