"""Regenerate samples/fp8: an FP8 kernel's export, as FlashAttention-3 writes it.

    python samples/fp8/generate.py

Q (1, 4, 64, 32), K and V (1, 2, 256, 32): e4m3 values (F8_E4M3 in qkv.safetensors)
quantized per (batch, kv head), their float32 descales (1, 2) in descales.safetensors;
the kernel is FlashAttention-3's FP8 forward as bench/gate_fp8.py emulates it (key blocks
of 128 with an online softmax, P rounded to e4m3 against the running max, causal at the
bottom right). out.safetensors is its bfloat16 output and lse; out_k_descale_twice.safetensors
the same kernel with K's descale applied twice.
"""

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[1] / "bench"))  # a checkout's bench/gate_fp8.py
import gate_fp8  # noqa: E402

DTYPES = {"float8_e4m3fn": "F8_E4M3", "bfloat16": "BF16", "float32": "F32"}


def save(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file: its JSON header (dtype, shape, offsets), then the bytes."""
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": DTYPES[a.dtype.name],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


shape = gate_fp8.Shape(1, 4, 2, 64, 256, 32, causal=True, per_head=True)
arrays = gate_fp8.inputs(shape, seed=2026)
save(here / "qkv.safetensors", {n: arrays[n].astype(ml_dtypes.float8_e4m3fn) for n in "qkv"})
save(here / "descales.safetensors", {n: arrays[n] for n in gate_fp8.gk.DESCALE_ARRAYS})
for name, bug in (("out", None), ("out_k_descale_twice", gate_fp8.K_DESCALE_TWICE)):
    out, lse = gate_fp8.fa3_fp8_forward(arrays, shape.embed**-0.5, shape.causal, bug)
    save(here / f"{name}.safetensors", {"out": out.astype(ml_dtypes.bfloat16), "lse": lse})
