"""Regenerate the split-KV partials of samples/check (q, k, v; causal) in float64.

    python samples/check/partials/generate.py

Two key shards, 0:8 and 8:16, each with its output (float16, as a kernel returns it)
and its logsumexp (float32), listed in partials.yaml.
"""

from pathlib import Path

import numpy as np

here = Path(__file__).parent
q, k, v = (np.load(here.parent / f"{n}.npy").astype(np.float64) for n in "qkv")
logits = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
L, S = logits.shape[-2:]
logits[..., np.triu(np.ones((L, S), dtype=bool), k=1)] = -np.inf  # causal
for start, stop in ((0, 8), (8, 16)):
    part = logits[..., start:stop]
    m = part.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    total = np.exp(part - m).sum(axis=-1)
    with np.errstate(divide="ignore"):
        lse = np.log(total) + m[..., 0]
    with np.errstate(invalid="ignore"):
        out = (np.exp(part - m) @ v[..., start:stop, :]) / total[..., None]
    np.save(here / f"out_{start}_{stop}.npy", np.nan_to_num(out).astype(np.float16))
    np.save(here / f"lse_{start}_{stop}.npy", lse.astype(np.float32))
