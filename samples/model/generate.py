"""Regenerate samples/model: three attention calls of a toy model, as a capture writes
them (a manifest and one .safetensors per call, holding q, k, v and the output).

    python samples/model/generate.py

Each call: float16, (batch 1, 4 heads, 8 queries, d_k 8), causal, seeded. The
output is what a float16 kernel returns (float32 arithmetic, rounded to float16).
Heads with a known behaviour:

- layer 1, head 0: an attention sink (every query weighs key 0 most);
- layer 1, head 2: dead (Q = 0: every visible key weighs the same);
- layer 2, head 3: saturated (each query copies its own key);
- layer 2, head 1: its exported output was computed with scale 1/d_k, not 1/√d_k.
"""

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

here = Path(__file__).parent
rng = np.random.default_rng(18)
B, H, L, E = 1, 4, 8, 8


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Causal attention in float32 from the float16 inputs, rounded to float16."""
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    s = np.einsum("BHLE,BHSE->BHLS", q, k) * scale[None, :, None, None]
    s = np.where(np.tril(np.ones((L, L), dtype=bool)), s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("BHLS,BHSE->BHLE", w, v).astype(np.float16)


def call(layer: int) -> dict[str, np.ndarray]:
    q, k, v = (rng.standard_normal((B, H, L, E)) for _ in range(3))
    scale = np.full(H, 1 / np.sqrt(E), dtype=np.float32)
    if layer == 1:
        k[0, 0, 0] = 4 * q[0, 0].mean(axis=0) / np.linalg.norm(q[0, 0].mean(axis=0))
        q[0, 0] += 3 * k[0, 0, 0] / 4
        q[0, 2] = 0.0
    if layer == 2:
        k[0, 3] = 5 * np.eye(L, E)
        q[0, 3] = 5 * np.eye(L, E)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    out = attention(q16, k16, v16, scale)
    if layer == 2:
        scale[1] = 1 / E  # the bug: 1/d_k in head 1
        out[0, 1] = attention(q16, k16, v16, scale)[0, 1]
    return {"q": q16, "k": k16, "v": v16, "out": out}


lines = [
    "# Three attention calls of a toy model, as a capture writes them:",
    "# python samples/model/generate.py regenerates the .safetensors files.",
    "defaults:",
    "  causal: true",
    "cases:",
]
for layer in range(3):
    name = f"model.layers.{layer}.self_attn"
    save_file(call(layer), str(here / f"{name}.safetensors"))
    lines += [f"  - name: {name}"]
    lines += [f"    {key}: {name}.safetensors:{key}" for key in ("q", "k", "v")]
    lines += [f"    expect-output: {name}.safetensors:out"]
(here / "manifest.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
