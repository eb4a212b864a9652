"""Regenerate samples/diff: four runs of one toy model for sdpa diff, each as a capture
writes it (a manifest naming each attention call by its module, the tensors of every
call in one .safetensors file).

    python samples/diff/generate.py

The model: 3 layers over a residual stream of 8 positions; each layer normalises it,
projects Q, K and V (batch 1, 2 heads, d_k 8), turns Q and K by a rotary embedding,
attends causally, and adds the output, projected back. The runs share the weights:

- float32: the model in float32;
- bfloat16: the model in bfloat16 (weights, activations and outputs rounded to it;
  attention computed in float32 from bfloat16 inputs, as kernels do);
- rotary_bug: bfloat16, the rotary embedding turned the wrong way in layer 1;
- kernel_bug: bfloat16, layer 1's attention scaled by 1/d_k where 1/√d_k was asked.
"""

import json
from pathlib import Path

import ml_dtypes
import numpy as np

here = Path(__file__).parent
rng = np.random.default_rng(36)
H, L, E, D, LAYERS = 2, 8, 8, 16, 3
EMBEDDING = rng.standard_normal((L, D)).astype(np.float32)
WEIGHTS = [
    {
        name: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
        for name, shape in (
            ("q", (D, H * E)),
            ("k", (D, H * E)),
            ("v", (D, H * E)),
            ("o", (H * E, D)),
        )
    }
    for _ in range(LAYERS)
]
RUNS = {
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "rotary_bug": ("bfloat16", "rotary"),
    "kernel_bug": ("bfloat16", "kernel"),
}
BUGGY_LAYER = 1


def rounded(x: np.ndarray, fmt: str) -> np.ndarray:
    """``x`` rounded to the run's format (kept in float32 to compute with)."""
    if fmt == "float32":
        return x.astype(np.float32)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def rotary(x: np.ndarray, sign: float) -> np.ndarray:
    """Hugging Face's rotary embedding of (1, H, L, E): each half-pair turned by
    position × 10000^(−2i/E); ``sign`` −1 turns it the wrong way."""
    angles = np.arange(L)[:, None] * 10000.0 ** (-np.arange(E // 2) * 2 / E)[None, :]
    cos = np.cos(np.concatenate([angles, angles], axis=-1))
    sin = sign * np.sin(np.concatenate([angles, angles], axis=-1))
    half = np.concatenate([-x[..., E // 2 :], x[..., : E // 2]], axis=-1)
    return (x * cos + half * sin).astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal attention in float32."""
    s = np.einsum("BHLE,BHSE->BHLS", q, k) * np.float32(scale)
    s = np.where(np.tril(np.ones((L, L), dtype=bool)), s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("BHLS,BHSE->BHLE", w, v).astype(np.float32)


def heads(x: np.ndarray) -> np.ndarray:
    """(L, H·E) → (1, H, L, E)."""
    return x.reshape(L, H, E).transpose(1, 0, 2)[None]


def run(fmt: str, bug: str | None) -> dict[str, np.ndarray]:
    """Every layer's Q, K, V and attention output, in the run's format."""
    tensors = {}
    x = rounded(EMBEDDING, fmt)
    for layer, w in enumerate(WEIGHTS):
        h = rounded(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6), fmt)
        q, k, v = (rounded(heads(h @ rounded(w[n], fmt)), fmt) for n in "qkv")
        sign = -1.0 if bug == "rotary" and layer == BUGGY_LAYER else 1.0
        q, k = rounded(rotary(q, sign), fmt), rounded(rotary(k, sign), fmt)
        scale = 1 / E if bug == "kernel" and layer == BUGGY_LAYER else 1 / np.sqrt(E)
        out = rounded(attention(q, k, v, scale), fmt)
        for name, value in zip(("q", "k", "v", "output"), (q, k, v, out), strict=True):
            tensors[f"model.layers.{layer}.{name}"] = value
        merged = out[0].transpose(1, 0, 2).reshape(L, H * E)
        x = rounded(x + rounded(merged @ rounded(w["o"], fmt), fmt), fmt)
    return tensors


def save(path: Path, tensors: dict[str, np.ndarray], fmt: str) -> None:
    """A safetensors file: the JSON header, then each tensor's bytes (F32 or BF16)."""
    code, dtype = ("F32", np.float32) if fmt == "float32" else ("BF16", ml_dtypes.bfloat16)
    header, data, offset = {}, [], 0
    for name, value in tensors.items():
        raw = value.astype(dtype).tobytes()
        header[name] = {
            "dtype": code,
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        data.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(data))


for name, (fmt, bug) in RUNS.items():
    save(here / f"{name}.safetensors", run(fmt, bug), fmt)
    lines = [
        "# Four runs of one toy model for sdpa diff (float32, bfloat16, a rotary bug, a",
        f"# kernel bug); this one: {name}. python samples/diff/generate.py regenerates them.",
        "defaults:",
        "  causal: true",
        "cases:",
    ]
    for layer in range(LAYERS):
        call = f"model.layers.{layer}"
        lines += [f"  - name: {call}.self_attn"]
        lines += [f"    {key}: {name}.safetensors:{call}.{key}" for key in ("q", "k", "v")]
        lines += [f"    expect-output: {name}.safetensors:{call}.output"]
    (here / f"{name}.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
