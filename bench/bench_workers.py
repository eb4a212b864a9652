#!/usr/bin/env python3
"""PyTorch's side of the benchmark, one measurement per fresh process.

    bench_workers.py kernel Q K V --reference float32 [--causal]
    bench_workers.py grad Q K V DOUT [--causal]

kernel: loads q, k, v, converts them to the reference precision, calls
F.scaled_dot_product_attention once as a warm-up, then times one call: the kernel
alone. grad: q, k, v in float64 with requires_grad, dO given; one forward + backward
as a warm-up, then times one forward + backward. Prints {"seconds": ...} as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_workers.py")
    parser.add_argument("what", choices=("kernel", "grad"))
    parser.add_argument("files", nargs="+")
    parser.add_argument("--reference", default="float64", choices=("float32", "float64"))
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, args.reference)
    arrays = [np.load(f) for f in args.files]
    if args.what == "kernel":
        q, k, v = (torch.from_numpy(x).to(dtype) for x in arrays[:3])
        del arrays
        F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)  # warm-up
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        seconds = time.perf_counter() - start
    else:
        q, k, v = (torch.from_numpy(x).to(torch.float64).requires_grad_() for x in arrays[:3])
        dout = torch.from_numpy(arrays[3]).to(torch.float64)
        del arrays
        out: Any = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        out.backward(dout)  # warm-up
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        out.backward(dout)
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
