#!/usr/bin/env python3
"""`sdpa grad` beside PyTorch's float64 autograd: `bench.py --only grad`, kept for its name.

    .venv/bin/python bench/bench_grad.py [--quick] [bench.py's options]
    make bench-grad

The grad figures of bench.py: `sdpa grad` ÷ torch's float64 forward + backward on
(1, 8, 4096, 64), and the peak RSS of `sdpa grad --dout` at every length.
"""

from __future__ import annotations

import sys

from bench import main

if __name__ == "__main__":
    sys.exit(main(["--only", "grad", *sys.argv[1:]]))
