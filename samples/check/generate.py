"""Regenerate the exports under samples/check with PyTorch's CPU kernel (needs torch).

    python samples/check/generate.py

q, k, v: float16, (batch 1, heads 2, 16 queries, d_k 8), seeded. The exports are what
a float16 kernel returns: PyTorch's fused CPU attention (its output and logsumexp),
once right (causal, scale 1/√8) and once with a bug (scale 1/8, as if the kernel
divided by d_k instead of √d_k).
"""

from pathlib import Path

import numpy as np
import torch

here = Path(__file__).parent
rng = np.random.default_rng(2026)
q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float16) for _ in range(3))
for name, a in zip("qkv", (q, k, v), strict=True):
    np.save(here / f"{name}.npy", a)

kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
out, lse = kernel(tq, tk, tv, 0.0, True)[:2]
np.save(here / "out.npy", out.numpy())
np.save(here / "lse.npy", lse.numpy())
wrong, _ = kernel(tq, tk, tv, 0.0, True, scale=1 / 8)[:2]
np.save(here / "out_scale_bug.npy", wrong.numpy())
