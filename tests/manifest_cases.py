"""A small manifest for the tests of manifest runs (shards, merging, a Dask cluster):
tiny q/k/v and exports computed by the float64 loop reference, and cases that pass,
fail and cannot be read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from reference import attention

CASES = """\
defaults:
  q: q.npy
  k: k.npy
  v: v.npy
cases:
  - name: good
    expect-output: out.npy
  - name: bad
    expect-output: out_bad.npy
  - name: nan-key
    k: k_nan.npy
  - name: loose
    expect-output: out_bad.npy
    rtol: 0.1
    atol: 0.1
  - name: causal-wrong
    causal: true
    expect-output: out.npy
"""
BROKEN = """\
  - name: broken
    q: missing.npy
"""


def write_arrays(d: Path) -> None:
    """``q.npy``, ``k.npy``, ``v.npy``, ``k_nan.npy`` (a NaN among the keys), ``out.npy``
    (the output) and ``out_bad.npy`` (off by 0.01 at one element) in ``d``."""
    rng = np.random.default_rng(20240612)
    q = rng.standard_normal((2, 3, 4))
    k = rng.standard_normal((2, 5, 4))
    v = rng.standard_normal((2, 5, 3))
    for name, arr in {"q": q, "k": k, "v": v}.items():
        np.save(d / f"{name}.npy", arr)
    k_nan = k.copy()
    k_nan[1, 4, 3] = np.nan
    np.save(d / "k_nan.npy", k_nan)
    out = attention(q, k, v).output
    np.save(d / "out.npy", out)
    bad = out.copy()
    bad[1, 2, 1] += 0.01
    np.save(d / "out_bad.npy", bad)


def write_manifest(d: Path, *, broken: bool = True, name: str = "m.yaml") -> Path:
    """The arrays and a manifest of 5 cases (2 pass; 3 fail: a mismatch, a finding of
    the inputs, a wrong option), and a 6th that cannot be read when ``broken``; the
    manifest's absolute path."""
    write_arrays(d)
    path = d / name
    path.write_text(CASES + (BROKEN if broken else ""))
    return path


def write_shards(count: int, *args: str, manifest: str = "m.yaml") -> list[str]:
    """The report files of shards 1..count of ``manifest`` (run with ``args``), in the
    working directory: ``s1-of-2.json``, ..."""
    from clirunner import invoke  # imported here: the manifest alone needs no runner

    paths = []
    for i in range(1, count + 1):
        path = f"s{i}-of-{count}.json"
        invoke(
            "check",
            "--manifest",
            manifest,
            "--jobs",
            "1",
            "--shard",
            f"{i}/{count}",
            "--report",
            path,
            *args,
        )
        paths.append(path)
    return paths
