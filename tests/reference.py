"""An independent float64 oracle: attention written out element by element.

Nothing here comes from ``sdpa_cli``. Every stage is computed per (lead index, i, j)
with Python floats, ``math.exp`` and ``math.tanh``, straight from the formulas:

    raw     = Σ_e Q[i, e] · K[j, e]
    scaled  = raw · scale / temperature
    capped  = C · tanh(scaled / C)                          (softcap C)
    biased  = capped + bias[i, j] − slope_h · |i + S − L − j|  (ALiBi)
    masked  = biased + float mask[i, j], or the mask value where key j is hidden
    weights = exp(masked − row max) / Σ, all zero for a row with no visible key
    output  = Σ_j weights[i, j] · V[j, :]

``visible`` is what the findings count as visible: a float mask's value ≤ −1e4 (a
sentinel, as models build masks) hides its key there too, while it is still added.

Leading axes broadcast as in PyTorch (right-aligned, size 1 stretches); the last
leading axis is the head axis, and K/V with G heads serve Q's H heads by
h → h // (H / G). Numpy is used only to hold arrays and to list their elements.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]


def paper_alibi_slopes(n: int) -> list[float]:
    """ALiBi head slopes as written in the paper's reference code (Press et al., 2022)."""

    def get_slopes_power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest) + paper_alibi_slopes(2 * closest)[0::2][: n - closest]


@dataclass(frozen=True)
class Stages:
    """Every stage as whole arrays; a stage an option does not bring equals the one before."""

    raw: F64
    scaled: F64
    capped: F64
    biased: F64
    masked: F64
    visible: NDArray[np.bool_]
    weights: F64
    output: F64


def _lead_shape(leads: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Broadcast the leading shapes of Q, K and V (in that order), GQA on the head axis."""
    n = max(len(s) for s in leads)
    padded = [(1,) * (n - len(s)) + s for s in leads]
    shape = []
    for axis in range(n):
        sizes = {s[axis] for s in padded} - {1}
        q_size = padded[0][axis]
        if axis == n - 1 and len(sizes) == 2 and q_size > 1:
            (kv_size,) = sizes - {q_size}
            assert q_size % kv_size == 0, "K/V heads must divide Q heads"
            shape.append(q_size)
        else:
            assert len(sizes) <= 1, f"leading axes do not broadcast: {leads}"
            shape.append(max(sizes, default=1))
    return tuple(shape)


def _slice(a: NDArray[Any], lead: tuple[int, ...], index: tuple[int, ...]) -> Any:
    """The trailing 2-D slice of ``a`` at ``index`` of the broadcast lead, as nested lists."""
    a = a.reshape((1,) * (len(lead) + 2 - a.ndim) + a.shape)
    if a.ndim > len(lead) + 2:  # leading axes of size 1 beyond the lead
        assert all(d == 1 for d in a.shape[: a.ndim - len(lead) - 2])
        a = a.reshape(a.shape[a.ndim - len(lead) - 2 :])
    at = []
    for m, d, full in zip(index, a.shape[:-2], lead, strict=True):
        # Size 1 stretches; a smaller head axis is a GQA group: full/d query heads per kv head.
        at.append(0 if d == 1 else m // (full // d))
    return a[tuple(at)].tolist()


def attention(
    q: NDArray[Any],
    k: NDArray[Any],
    v: NDArray[Any],
    *,
    bias: NDArray[Any] | None = None,
    mask: NDArray[Any] | None = None,
    scale: str | float = "sqrt-dk",
    temperature: float = 1.0,
    softcap: float | None = None,
    alibi: bool = False,
    causal: bool = False,
    causal_align: str = "upper-left",
    mask_true_means: str = "attend",
    key_lengths: tuple[int, ...] | None = None,
    window: tuple[int, int] | None = None,
    mask_value: float = -math.inf,
    query_offset: tuple[int, ...] | None = None,
    query_lengths: tuple[int, ...] | None = None,
) -> Stages:
    """Every stage of attention by loops; keyword names follow ``sdpa_cli.engine.spec.Options``."""
    q, k, v = (a.reshape(1, -1) if a.ndim == 1 else a for a in (q, k, v))
    lead = _lead_shape([q.shape[:-2], k.shape[:-2], v.shape[:-2]])
    L, E = q.shape[-2:]
    S, Ev = k.shape[-2], v.shape[-1]
    H = lead[-1] if lead else 1
    factor = {"sqrt-dk": 1 / math.sqrt(E) if E else 1.0, "dk": 1 / E if E else 1.0, "none": 1.0}
    c = factor[scale] if isinstance(scale, str) else float(scale)
    slopes = paper_alibi_slopes(H)
    offset = S - L if causal_align == "lower-right" else 0
    mask_is_bool = mask is not None and mask.dtype == np.bool_

    stages = {name: np.zeros((*lead, L, S)) for name in ("raw", "scaled", "capped", "biased")}
    stages["masked"] = np.zeros((*lead, L, S))
    stages["weights"] = np.zeros((*lead, L, S))
    visible_all = np.zeros((*lead, L, S), dtype=np.bool_)
    output = np.zeros((*lead, L, Ev))

    for index in itertools.product(*(range(n) for n in lead)):
        qs, ks, vs = (_slice(a, lead, index) for a in (q, k, v))
        # bias and mask slices are (L or 1, S or 1): a size-1 axis stretches.
        bs = None if bias is None else _slice(bias, lead, index)
        ms = None if mask is None else _slice(mask, lead, index)
        h = index[-1] if lead else 0
        b = index[-2] if len(lead) >= 2 else 0
        # A KV-cache step: query i of item b sits at position query_offset[b] + i.
        off = offset if query_offset is None else query_offset[b if len(query_offset) > 1 else 0]
        alibi_off = S - L if query_offset is None else off
        n_queries = (
            L if query_lengths is None else query_lengths[b if len(query_lengths) > 1 else 0]
        )
        for i in range(L):
            row: list[float] = []
            for j in range(S):
                raw = sum(qs[i][e] * ks[j][e] for e in range(E))
                scaled = raw * c / temperature
                capped = softcap * math.tanh(scaled / softcap) if softcap is not None else scaled
                biased = capped
                if bs is not None:
                    biased += bs[i if len(bs) > 1 else 0][j if len(bs[0]) > 1 else 0]
                if alibi:
                    biased += -slopes[h] * abs(i + alibi_off - j)

                visible = True
                if causal:
                    visible &= j <= i + off
                if window is not None:
                    visible &= -window[0] <= j - i - off <= window[1]
                if key_lengths is not None:
                    visible &= j < key_lengths[b if len(key_lengths) > 1 else 0]
                logit = biased
                if ms is not None:
                    m = ms[i if len(ms) > 1 else 0][j if len(ms[0]) > 1 else 0]
                    if mask_is_bool:
                        visible &= (not m) if mask_true_means == "masked" else bool(m)
                    else:
                        logit += m
                if not visible:
                    logit = mask_value
                if i >= n_queries:  # an absent query row: no key, zeros whatever the mask value
                    visible, logit = False, -math.inf
                if ms is not None and not mask_is_bool and m <= -1e4:
                    visible = False  # a sentinel: hidden for the findings, added as given

                for name, x in (("raw", raw), ("scaled", scaled), ("capped", capped)):
                    stages[name][(*index, i, j)] = x
                stages["biased"][(*index, i, j)] = biased
                stages["masked"][(*index, i, j)] = logit
                visible_all[(*index, i, j)] = visible
                row.append(logit)

            top = max(row, default=-math.inf)
            if top == -math.inf:  # no visible key: all-zero weights, zero output
                weights = [0.0] * S
            else:
                exps = [math.exp(x - top) for x in row]
                total = sum(exps)
                weights = [x / total for x in exps]
            for j in range(S):
                stages["weights"][(*index, i, j)] = weights[j]
            for col in range(Ev):
                output[(*index, i, col)] = sum(weights[j] * vs[j][col] for j in range(S))

    return Stages(visible=visible_all, output=output, **stages)


def mix(weights: F64, v: F64) -> F64:
    """weights (..., L, S) times values (..., S, Ev), same leading shape, by loops."""
    *lead, L, S = weights.shape
    Ev = v.shape[-1]
    out = np.zeros((*lead, L, Ev))
    for index in itertools.product(*(range(n) for n in lead)):
        w, vs = weights[index].tolist(), v[index].tolist()
        for i in range(L):
            for col in range(Ev):
                out[(*index, i, col)] = sum(w[i][j] * vs[j][col] for j in range(S))
    return out
