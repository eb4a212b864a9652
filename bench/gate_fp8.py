"""FP8 exports for the verdict benchmark: FlashAttention-3's FP8 forward, emulated.

FlashAttention-3's FP8 kernel (hopper) takes e4m3 Q, K, V and float32 descales
``(batch, nheads_kv)``, the real values being ``q_fp8 · q_descale`` and so on. Written
here in numpy float32 as the kernel computes it, key block by key block with an online
softmax (no sdpa code):

    S = Q_fp8 · K_fp8ᵀ (float32)          m ← max(m, rowmax S)      (raw units)
    c = scale · log2(e) · q_descale · k_descale                      (float32)
    P = exp2(S·c − m·c)                    ℓ ← ℓ · exp2((m_old − m)·c) + Σ P   (unrounded)
    acc ← acc · exp2((m_old − m)·c) + e4m3(P) · V_fp8                (P rounded per key
                                                                      block, against the
                                                                      running max)
    O = acc · (1/ℓ · v_descale), stored in bfloat16;  LSE = (m·c + log2 ℓ) · ln 2

A faithful export must pass `sdpa check q k v --dtype float8_e4m3fn --q-descale ...
--expect-output out --expect-lse lse`, and each bug below must fail it: a descale left
out (Q's), K's descale applied twice, K's descale applied to V in place of V's, per-head
descales read for the wrong heads (a group's query heads reading Q's descales tiled
instead of repeated; K's and V's rolled by one head), the scale's 1/√E missing.

Q, K and V are drawn as real values with a gain per (batch, kv head) and quantized as an
FP8 recipe does (descale = amax / 448, per tensor or per (batch, kv head)); they are
saved as float32 .npy holding the e4m3 values exactly (a .npy has no float8), the
descales as numbers (per tensor) or float32 (B, G) files.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import gate_kernels as gk
import ml_dtypes
import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]
E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK_N = 128  # keys per block of the online softmax, as FlashAttention-3's FP8 tiles

Q_DESCALE_LEFT_OUT = "q-descale-left-out"  # the kernel computes with q_descale = 1
K_DESCALE_TWICE = "k-descale-twice"  # scores × k_descale once more
K_DESCALE_FOR_V = "k-descale-for-v"  # the output × k_descale in place of v_descale
Q_DESCALE_TILED = "q-descale-tiled"  # query head h reads q_descale[b, h % G], not h // (H/G)
KV_DESCALE_ROLLED = "kv-descale-rolled"  # kv head g reads K's and V's descales of g + 1
SCALE_MISSING = "scale-missing"  # softmax_scale 1 in place of 1/√E

BUGS = (
    Q_DESCALE_LEFT_OUT,
    K_DESCALE_TWICE,
    K_DESCALE_FOR_V,
    Q_DESCALE_TILED,
    KV_DESCALE_ROLLED,
    SCALE_MISSING,
)
PER_HEAD_BUGS = (Q_DESCALE_TILED, KV_DESCALE_ROLLED)  # they need descales that differ by head
# What the hint that names each says (bench_gate reads gate_kernels.HINT_NAMES).
gk.HINT_NAMES.update(
    {
        Q_DESCALE_LEFT_OUT: "q_descale left out",
        K_DESCALE_TWICE: "k_descale applied twice",
        K_DESCALE_FOR_V: "k_descale in place of v_descale",
        Q_DESCALE_TILED: "q_descale tiled over the query heads",
        KV_DESCALE_ROLLED: "descales of the next kv head",
        SCALE_MISSING: "--scale none",
    }
)


@dataclass(frozen=True)
class Shape:
    """Q (B, H, L, E), K and V (B, G, S, E); descales per tensor or per (B, G)."""

    batch: int
    heads: int
    kv_heads: int
    length: int
    keys: int
    embed: int
    causal: bool
    per_head: bool


CASES = {
    "full-per-tensor": Shape(1, 4, 4, 256, 384, 64, causal=False, per_head=False),
    "causal-per-head": Shape(2, 2, 2, 256, 256, 64, causal=True, per_head=True),
    "gqa-causal-per-head": Shape(2, 4, 2, 192, 320, 128, causal=True, per_head=True),
    "gqa-per-tensor": Shape(1, 8, 2, 128, 512, 64, causal=False, per_head=False),
}
SEEDS = 2


def quantize(real: NDArray[np.float64], per_head: bool) -> tuple[F32, F32]:
    """Real values (B, N, T, E) → their e4m3 values (as float32) and the float32
    descales (B, N), amax / 448 per tensor or per (batch, head)."""
    axes = (2, 3) if per_head else (0, 1, 2, 3)
    amax = np.max(np.abs(real), axis=axes, keepdims=True)
    descale = np.broadcast_to(amax / E4M3_MAX, (*real.shape[:2], 1, 1)).astype(np.float32)
    values = (real / descale).astype(E4M3).astype(np.float32)
    return values, np.ascontiguousarray(descale[..., 0, 0])


def inputs(shape: Shape, seed: int) -> dict[str, F32]:
    """Q, K, V as e4m3 values and their descales (B, G); Q's per (batch, kv head), its
    group's query heads quantized together."""
    rng = np.random.default_rng(seed)
    b, h, g, n, s, e = (
        shape.batch,
        shape.heads,
        shape.kv_heads,
        shape.length,
        shape.keys,
        shape.embed,
    )
    group = h // g
    # a gain per (batch, kv head), growing with the head (the per-head descales differ by
    # half or more from head to head) and V's above K's (K's descale is not V's)
    ramp = 1.0 + 0.5 * np.arange(g)
    gains = {
        x: rng.uniform(low, high, (b, g)) * ramp
        for x, (low, high) in (("q", (0.8, 1.2)), ("k", (0.5, 0.7)), ("v", (1.2, 1.6)))
    }
    q_real = rng.standard_normal((b, g, group * n, e)) * gains["q"][..., None, None]
    k_real = rng.standard_normal((b, g, s, e)) * gains["k"][..., None, None]
    v_real = rng.standard_normal((b, g, s, e)) * gains["v"][..., None, None]
    q8, qd = quantize(q_real, shape.per_head)
    k8, kd = quantize(k_real, shape.per_head)
    v8, vd = quantize(v_real, shape.per_head)
    q8 = q8.reshape(b, h, n, e)  # each kv head's group of query heads, quantized together
    return {"q": q8, "k": k8, "v": v8, "q_descale": qd, "k_descale": kd, "v_descale": vd}


def fa3_fp8_forward(
    arrays: dict[str, F32], scale: float, causal: bool, bug: str | None = None
) -> tuple[F32, F32]:
    """FlashAttention-3's FP8 forward (the module's docstring), with `bug` put in: the
    output (B, H, L, E) in bfloat16 (held in float32) and the LSE (B, H, L), float32."""
    q8, k8, v8 = arrays["q"], arrays["k"], arrays["v"]
    qd, kd, vd = arrays["q_descale"], arrays["k_descale"], arrays["v_descale"]
    b_, h_, n, _ = q8.shape
    g_, _s = k8.shape[1], k8.shape[2]
    group = h_ // g_
    f = np.float32
    out = np.zeros((b_, h_, n, v8.shape[-1]), np.float32)
    lse = np.zeros((b_, h_, n), np.float32)
    if bug == SCALE_MISSING:
        scale = 1.0
    for b in range(b_):
        for h in range(h_):
            g = h // group
            kv = (g + 1) % g_ if bug == KV_DESCALE_ROLLED else g
            q_desc = qd[b, h % g_] if bug == Q_DESCALE_TILED else qd[b, g]
            q_desc = f(1.0) if bug == Q_DESCALE_LEFT_OUT else q_desc
            k_desc = kd[b, kv] * kd[b, kv] if bug == K_DESCALE_TWICE else kd[b, kv]
            v_desc = kd[b, kv] if bug == K_DESCALE_FOR_V else vd[b, kv]
            c = f(f(scale * math.log2(math.e)) * f(q_desc)) * f(k_desc)
            o, m, ell = _one_head(q8[b, h], k8[b, g], v8[b, g], f(c), causal)
            inv = np.where(ell > 0, f(1) / np.where(ell > 0, ell, f(1)), f(0)).astype(f)
            o = o * (inv * f(v_desc))[:, None]
            out[b, h] = o.astype(ml_dtypes.bfloat16).astype(np.float32)
            with np.errstate(divide="ignore"):
                lse[b, h] = (m * c + np.log2(ell)) * f(math.log(2.0))
    return out, lse


def _one_head(q: F32, k: F32, v: F32, c: np.float32, causal: bool) -> tuple[F32, F32, F32]:
    """One (batch, head): the unnormalised output, the row max (raw units) and ℓ."""
    n, s = q.shape[0], k.shape[0]
    m = np.full(n, -np.inf, np.float32)
    ell = np.zeros(n, np.float32)
    acc = np.zeros((n, v.shape[-1]), np.float32)
    rows = np.arange(n)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        for n0 in range(0, s, BLOCK_N):
            n1 = min(n0 + BLOCK_N, s)
            x = q @ k[n0:n1].T  # float32, as the FP8 tensor cores accumulate
            if causal:  # the diagonal at the bottom right (FlashAttention's), S ≥ L
                x = np.where(np.arange(n0, n1)[None, :] <= rows + s - n, x, -np.inf)
            new = np.maximum(m, x.max(axis=1))
            shift = np.where(new == -np.inf, np.float32(0), new * c).astype(np.float32)
            p = np.exp2(x * c - shift[:, None]).astype(np.float32)
            alpha = np.exp2(np.where(m == -np.inf, -np.inf, m * c - shift)).astype(np.float32)
            ell = ell * alpha + p.sum(axis=1, dtype=np.float32)
            p8 = p.astype(E4M3).astype(np.float32)  # P in e4m3 against the running max
            acc = acc * alpha[:, None] + p8 @ v[n0:n1]
            m = new
    return acc, m, ell


def _run(name: str, seed: int, bug: str | None) -> gk.Export:
    shape = CASES[name]
    arrays = inputs(shape, seed)
    scale = shape.embed**-0.5
    out, lse = fa3_fp8_forward(arrays, scale, shape.causal, bug)
    flags = ["--dtype", "float8_e4m3fn"]
    if shape.causal:
        flags += ["--causal", "--causal-align", "lower-right"]
    saved: dict[str, Any] = {n: arrays[n] for n in "qkv"}
    for n in ("q_descale", "k_descale", "v_descale"):
        if shape.per_head:
            saved[n] = arrays[n]
        else:  # one number: its float32 value, written so that it reads back exactly
            flags += [f"--{n.replace('_', '-')}", repr(float(arrays[n][0, 0]))]
    saved.update(out=out, lse=lse)
    visible = None
    if shape.causal:
        visible = gk.causal_visible(shape.length, shape.keys, "lower-right")
    descale = tuple(np.asarray(arrays[n], np.float64) for n in gk.DESCALE_ARRAYS)
    return gk.Export(
        "fa3-fp8",
        "float8_e4m3fn",
        f"{name}-seed{seed}",
        saved,
        tuple(flags),
        gk.Reference(scale, visible=visible, descale=descale),  # type: ignore[arg-type]
        bug,
    )


def cases(seed: int = 29) -> list[gk.Case]:
    """Every FP8 case: each shape with two seeds, its bugs (the per-head ones where the
    descales differ by head; Q's tiled ones under grouped-query attention)."""
    found = []
    for name, shape in CASES.items():
        bugs = [b for b in BUGS if b not in PER_HEAD_BUGS or shape.per_head]
        if shape.heads == shape.kv_heads:
            bugs = [b for b in bugs if b != Q_DESCALE_TILED]  # h % G = h // 1: no slip
        for i in range(SEEDS):
            run = functools.partial(_run, name, seed + i)
            key = f"{name}-seed{seed + i}"
            found.append(gk.Case("fa3-fp8", "float8_e4m3fn", key, run, tuple(bugs), inject=False))
    return found
