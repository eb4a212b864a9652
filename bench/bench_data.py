"""Inputs for the benchmark: q, k, v, exported outputs, dO, and a manifest of many cases.

q, k, v (and dO) are seeded standard normal numbers; an export is PyTorch's SDPA in
the reference precision of its dtype (float32 for a float16 export, float64 for a
float32 one), cast to the export's dtype, or the naive numpy version where torch is
absent. Files are written under a temporary name and renamed, so a directory kept
with --keep is reused by the next run without regenerating anything.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Shape = tuple[int, int, int, int]
Array = npt.NDArray[Any]

# The reference precision of each export dtype: sdpa check's and torch's alike.
REFERENCE = {"float16": "float32", "float32": "float64"}
SHORT = {"float16": "f16", "float32": "f32", "float64": "f64"}
EXPORT_ROW_BLOCK = 2048  # query rows at a time when the naive version computes an export
SEED = 20240601


def shape_tag(shape: Shape) -> str:
    return "x".join(map(str, shape))


def naive_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool,
    dtype: npt.DTypeLike,
    out: Array | None = None,
    row_block: int | None = None,
) -> Array:
    """softmax(Q·Kᵀ/√E [+ −inf above the diagonal]) · V in `dtype`, one (batch, head) at a time.

    Whole L×S score matrices by default; `row_block` query rows at a time (the same
    arithmetic, row by row) bounds the memory when computing a large export.
    """
    dt = np.dtype(dtype)
    *lead, length, embed = q.shape
    keys = k.shape[-2]
    scale = 1.0 / math.sqrt(embed)
    if out is None:
        out = np.empty((*lead, length, v.shape[-1]), dtype=dt)
    block = length if row_block is None else row_block
    cols = np.arange(keys)[None, :]
    for idx in np.ndindex(*lead):
        qh = np.asarray(q[idx], dtype=dt)
        kt = np.asarray(k[idx], dtype=dt).T
        vh = np.asarray(v[idx], dtype=dt)
        for start in range(0, length, block):
            stop = min(start + block, length)
            scores = qh[start:stop] @ kt
            scores *= scale  # in place: stays in dt
            if causal:
                scores[cols > np.arange(start, stop)[:, None]] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            out[idx][start:stop] = scores @ vh
    return out


def torch_export(q: Array, k: Array, v: Array, *, causal: bool, reference: str, out: Array) -> None:
    """PyTorch's SDPA in `reference` precision, one (batch, head) at a time, into `out`."""
    import torch
    import torch.nn.functional as F

    for idx in np.ndindex(*q.shape[:-2]):
        tq, tk, tv = (
            torch.from_numpy(np.ascontiguousarray(x[idx], dtype=reference))[None] for x in (q, k, v)
        )
        out[idx] = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)[0].numpy()


def _write_npy(path: Path, fill: Callable[[Array], None], shape: Shape, dtype: str) -> Path:
    """Write `path` (a .npy file) unless it exists, by `fill`ing a memmap under a
    temporary name, then renaming it."""
    if path.exists():
        return path
    tmp = path.with_name(path.name + ".tmp.npy")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
    fill(out)
    out.flush()
    del out
    os.replace(tmp, path)
    return path


def _filled_with(values: Array) -> Callable[[Array], None]:
    def fill(out: Array) -> None:
        out[...] = values

    return fill


class Datasets:
    """Input sets under `root`, one directory per (shape, dtype, seed), made on demand."""

    def __init__(self, root: Path, have_torch: bool, progress: Callable[[str], None]) -> None:
        self.root = root
        self.have_torch = have_torch
        self.progress = progress

    def inputs(self, shape: Shape, dtype: str, seed: int = 0) -> list[Path]:
        """q.npy, k.npy, v.npy."""
        data = self._dir(shape, dtype, seed)
        rng = np.random.default_rng([SEED, *shape, seed])
        paths = []
        if seed == 0 and not all((data / f"{name}.npy").exists() for name in "qkv"):
            self.progress(f"generating q, k, v {shape} {dtype} ...")
        for name in "qkv":
            path = data / f"{name}.npy"
            if not path.exists():
                values = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
                _write_npy(path, _filled_with(values), shape, dtype)
            paths.append(path)
        return paths

    def export(self, shape: Shape, dtype: str, causal: bool, seed: int = 0) -> Path:
        """out.npy (out-causal.npy): the attention output in `dtype`."""
        q_path, k_path, v_path = self.inputs(shape, dtype, seed)
        path = q_path.with_name("out-causal.npy" if causal else "out.npy")
        if path.exists():
            return path
        reference = REFERENCE[dtype]
        how = f"torch {reference}" if self.have_torch else f"naive numpy {reference}"
        if seed == 0:
            self.progress(f"exporting {shape} {dtype}{' causal' if causal else ''} with {how} ...")
        q, k, v = (np.load(p, mmap_mode="r") for p in (q_path, k_path, v_path))

        def fill(out: Array) -> None:
            if self.have_torch:
                torch_export(q, k, v, causal=causal, reference=reference, out=out)
            else:
                naive_attention(
                    q, k, v, causal=causal, dtype=reference, out=out, row_block=EXPORT_ROW_BLOCK
                )

        return _write_npy(path, fill, (*shape[:-1], v.shape[-1]), dtype)

    def dout(self, shape: Shape, dtype: str, seed: int = 0) -> Path:
        """dout.npy: the output's gradient, standard normal, shaped like the output."""
        path = self._dir(shape, dtype, seed) / "dout.npy"
        if not path.exists():
            self.progress(f"generating dO {shape} {dtype} ...")
            rng = np.random.default_rng([SEED, *shape, seed, 1])
            values = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
            _write_npy(path, _filled_with(values), shape, dtype)
        return path

    def gradients(self, shape: Shape, dtype: str) -> list[Path]:
        """dq.npy, dk.npy, dv.npy: a backward kernel's export of ``inputs`` and ``dout``
        (seed 0), as sdpa's float64 backward pass gives it, rounded to ``dtype``."""
        data = self._dir(shape, dtype, 0)
        paths = [data / f"{name}.npy" for name in ("dq", "dk", "dv")]
        if all(path.exists() for path in paths):
            return paths
        from sdpa_cli.engine.grad import backward, make_dout
        from sdpa_cli.engine.options import parse_options
        from sdpa_cli.engine.spec import build_spec

        self.progress(f"exporting dQ, dK, dV {shape} {dtype} ...")
        q, k, v = (np.load(p, mmap_mode="r") for p in self.inputs(shape, dtype))
        dout = np.load(self.dout(shape, dtype), mmap_mode="r")
        spec = build_spec(q, k, v, options=parse_options({}))
        grads = backward(spec, make_dout(spec, dout, 0, "dout"))
        for path, values in zip(paths, (grads.dq, grads.dk, grads.dv), strict=True):
            _write_npy(path, _filled_with(np.asarray(values).astype(dtype)), shape, dtype)
        return paths

    def manifest(self, count: int, shape: Shape, dtype: str) -> Path:
        """A manifest of `count` cases, each its own q, k, v and exported output."""
        path = self.root / f"manifest-{count}-{shape_tag(shape)}-{dtype}.yaml"
        if path.exists():
            return path
        self.progress(f"generating a manifest of {count} cases {shape} {dtype} ...")
        lines = [f"# sdpa benchmark: {count} cases {shape} {dtype}", "cases:"]
        for n in range(1, count + 1):
            q, k, v = self.inputs(shape, dtype, seed=n)
            out = self.export(shape, dtype, causal=False, seed=n)
            lines += [f"  - name: case{n}", f"    q: {q}", f"    k: {k}", f"    v: {v}"]
            lines.append(f"    expect-output: {out}")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
        return path

    def _dir(self, shape: Shape, dtype: str, seed: int) -> Path:
        data = self.root / f"{shape_tag(shape)}-{dtype}-{seed}"
        data.mkdir(parents=True, exist_ok=True)
        return data


def size_mib(paths: list[Path]) -> float:
    return sum(p.stat().st_size for p in paths) / (1024.0 * 1024.0)
