#!/usr/bin/env python3
"""Benchmark `sdpa grad` beside PyTorch's float64 autograd through its SDPA kernel.

A report, not a test. `sdpa grad` runs as a whole process (forward and gradient
findings included, tables to /dev/null); torch as forward + backward of its SDPA kernel
alone, in float64 (the precision sdpa's backward pass runs in), in a fresh process.

    .venv/bin/python bench/bench_grad.py           # (1, 8, 4096, 64) and (1, 8, 8192, 64)
    .venv/bin/python bench/bench_grad.py --quick   # small shapes
    make bench-grad

Target: peak RSS of `sdpa grad` ≤ the inputs (float32 .npy) + the float64 gradients,
dO and dQ/dK/dV accumulators (8 × 4 × B·H·L·E bytes) + 256 MiB: memory does not grow with
L·S, the blocked engine's promise. Time is reported, with no target: autograd keeps the
(L, S) weights, sdpa recomputes them block by block.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import run_process

SHAPES = ((1, 8, 4096, 64), (1, 8, 8192, 64))
QUICK = ((1, 2, 1024, 64), (1, 2, 2048, 64))
HEADROOM_MIB = 256.0
MIB = 1024.0 * 1024.0

TORCH = """
import sys, time, numpy as np, torch
torch.set_num_threads({threads})
q, k, v = (torch.tensor(np.load(f"{{sys.argv[1]}}/{{n}}.npy"), dtype=torch.float64,
           requires_grad=True) for n in "qkv")
t = time.perf_counter()
o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal={causal})
o.backward(torch.ones_like(o))
print(time.perf_counter() - t)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes")
    args = parser.parse_args()
    sdpa = str(Path(sys.executable).with_name("sdpa"))
    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:
        threads = 0
    rows = []
    for shape in QUICK if args.quick else SHAPES:
        with tempfile.TemporaryDirectory(prefix="sdpa-bench-grad-") as tmp:
            rng = np.random.default_rng(0)
            for n in "qkv":
                np.save(f"{tmp}/{n}.npy", rng.standard_normal(shape).astype(np.float32))
            inputs = sum(Path(f"{tmp}/{n}.npy").stat().st_size for n in "qkv") / MIB
            limit = inputs + 8 * 4 * np.prod(shape) / MIB + HEADROOM_MIB
            for causal in (False, True):
                cmd = [sdpa, "grad", *(f"{tmp}/{n}.npy" for n in "qkv")]
                proc = run_process([*cmd, "--causal"] if causal else cmd)
                ok = proc.returncode == 0
                torch_s = "-"
                if threads:
                    code = TORCH.format(threads=threads, causal=causal)
                    t = run_process([sys.executable, "-c", code, tmp])
                    torch_s = f"{float(t.stdout.split()[-1]):.2f}" if t.returncode == 0 else "err"
                rows.append(
                    (
                        f"{shape} {'causal' if causal else 'full'}",
                        f"{proc.wall_s:.2f}" if ok else f"exit {proc.returncode}",
                        torch_s,
                        f"{proc.maxrss_mib:.0f}",
                        f"{limit:.0f}",
                        "ok" if ok and proc.maxrss_mib <= limit else "MISSED",
                    )
                )
                print(" · ".join(rows[-1]), file=sys.stderr, flush=True)
    headers = ("case", "sdpa grad s", "torch f64 s", "peak RSS MiB", "limit MiB", "memory")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
