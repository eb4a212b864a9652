"""Q, K and V as stacks of matrices ``(..., rows, dim)``, as the engine reads them: a
1-D tensor one row, ``--heads`` splitting a model dimension into heads, ``--layout
bshd`` moving the head axis before L; and FlashAttention's ``qv`` term folded in.

The ``qv`` term (absorbed MLA: DeepSeek's latent attention with W_UK absorbed into the
queries) adds ``qv · vᵀ`` to the scores, ``qv`` shaped as Q with V's width Ev. It is the
product of the wider rows ``[q | qv] · [k | v]ᵀ``: :func:`with_qv` concatenates them,
so every stage, both engine paths and the findings read it with nothing of their own,
and ``--scale sqrt-dk`` is 1/√(E + Ev), FlashAttention's default with ``qv``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.options import Options
from sdpa_cli.errors import SpecError
from sdpa_cli.text import shown


def split_heads(
    a: NDArray[Any], n: int, name: str, label: str, option: str = "--heads"
) -> NDArray[Any]:
    """(..., L, D) → (..., n, L, D/n), as a view."""
    D = a.shape[-1]
    if D % n:
        raise SpecError(
            option, f"{name}'s last axis ({D}, from {label}) is not divisible by {shown(n)}"
        )
    parts = a.reshape(*a.shape[:-1], n, D // n)
    return np.moveaxis(parts, -2, -3)


def kv_width_error(E: int, Dk: int, heads: int, kv_heads: int | None, label: str) -> None:
    """K's heads are not as wide as Q's after the split: say how many K/V heads K's
    model dimension holds at Q's head width, when it holds a whole number of them."""
    if kv_heads is not None:
        raise SpecError(
            "--kv-heads",
            f"K's last axis ({Dk}, from {label}) holds {kv_heads} heads of {Dk // kv_heads}, "
            f"but Q's heads are {E} wide; K should hold {kv_heads}·{E} = {kv_heads * E}",
        )
    G = Dk // E if E and Dk % E == 0 else 0
    if G and heads % G == 0:
        raise SpecError(
            label,
            f"K's last axis ({Dk}) is not {heads} heads of Q's width {E}, but {G} of them: "
            f"give --kv-heads {G} (grouped-query attention)",
        )


def from_bshd(a: NDArray[Any]) -> NDArray[Any]:
    """(..., L, H, E) → (..., H, L, E), as a view; a tensor of fewer than three axes
    has no head axis and is read as it is."""
    return np.swapaxes(a, -3, -2) if a.ndim >= 3 else a


def matrices(
    q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], opts: Options, labels: Mapping[str, str]
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """Q, K and V as stacks of matrices: a 1-D tensor is one row (one query, one key,
    one value); with ``--heads`` the model dimension splits into heads (K and V into
    ``--kv-heads`` of them); under ``--layout bshd`` the head axis moves before L."""
    q, k, v = (a.reshape(1, -1) if a.ndim == 1 else a for a in (q, k, v))
    for n, a in (("Q", q), ("K", k), ("V", v)):
        if a.ndim == 0:
            raise SpecError(
                labels[n.lower()], f"{n} is a scalar; expected a matrix ({n}: (..., rows, dim))"
            )
    heads, kv_heads = opts.heads, opts.kv_heads
    if kv_heads is not None and heads is None:
        raise SpecError(
            "--kv-heads",
            "needs --heads: it splits K and V of (..., S, d_model_kv) into G heads, "
            "as --heads splits Q",
        )
    if opts.layout == "bshd" and heads is not None:
        raise SpecError(
            "--layout",
            "bshd reads (B, L, H, E) tensors, --heads splits (..., L, d_model) ones; give one",
        )
    if opts.layout == "bshd":
        return from_bshd(q), from_bshd(k), from_bshd(v)
    if heads is not None:
        G = heads if kv_heads is None else kv_heads
        if heads % G:
            raise SpecError(
                "--kv-heads",
                f"{G} key/value heads do not divide the {heads} query heads (--heads)",
            )
        q = split_heads(q, heads, "Q", labels["q"])
        k = split_heads(k, G, "K", labels["k"], "--heads" if kv_heads is None else "--kv-heads")
        v = split_heads(v, G, "V", labels["v"], "--heads" if kv_heads is None else "--kv-heads")
        E, Ek = q.shape[-1], k.shape[-1]
        if Ek != E:
            kv_width_error(E, Ek * G, heads, kv_heads, labels["k"])
    return q, k, v


def with_qv(
    q: NDArray[Any],
    k: NDArray[Any],
    v: NDArray[Any],
    qv: NDArray[Any],
    opts: Options,
    label: str,
) -> tuple[NDArray[Any], NDArray[Any]]:
    """Q and K widened by the ``qv`` term: ``[q | qv]`` and ``[k | v]``, so that their
    product is ``q · kᵀ + qv · vᵀ``. ``qv`` is read as Q is (layout, heads) and must
    be Q's shape with V's width; K and V must share their leading axes."""
    qv = qv.reshape(1, -1) if qv.ndim == 1 else qv
    if opts.layout == "bshd":
        qv = from_bshd(qv)
    elif opts.heads is not None:
        qv = split_heads(qv, opts.heads, "QV", label)
    want = (*q.shape[:-1], v.shape[-1])
    if qv.shape != want:
        raise SpecError(label, f"qv has shape {qv.shape}, expected Q's with V's width: {want}")
    if k.shape[:-1] != v.shape[:-1]:
        raise SpecError(
            label, f"qv needs K and V of the same leading axes, got {k.shape} and {v.shape}"
        )
    wide_q = np.concatenate([q, qv.astype(np.result_type(q, qv), copy=False)], axis=-1)
    return wide_q, np.concatenate([k, v.astype(np.result_type(k, v), copy=False)], axis=-1)
