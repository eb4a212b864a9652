"""The reference where the tensors live: ``assert_attention_close`` on a device's
tensors, torch backend beside numpy, and the verdicts of a device's own kernels.

    python bench/bench_device.py [--device cuda] [--json FILE] [--numpy-shape B,H,L,E]

What it prints (and writes as JSON with ``--json``):

1. Time: ``assert_attention_close(q, k, v, output=out)`` on the device's float16
   tensors at (2, 16, 4096, 128), causal and not, computed by torch on the device
   (the default for torch tensors) and by numpy on the host (``backend="numpy"``:
   the tensors copied over, the reference on the host's cores); beside them, the
   device's own fused kernel for the same call.
2. Memory: the device memory the torch check took beyond its inputs.
3. Verdicts: every fused kernel the device has (flash, memory-efficient, cuDNN, math)
   in float16 and bfloat16, causal and not, judged on both backends (each must pass,
   and both must say the same); and three slips (no causal mask, no scale, K's heads
   swapped), each of which must fail, with the same checks failing on both.

Runs on the CPU too (``--device cpu``: torch's CPU threads; fewer kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from sdpa_cli import assert_attention_close

KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def timed(fn: Any, device: str, repeat: int = 3) -> float:
    """The median wall time of ``fn()`` (device synchronised), after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def tensors(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0) -> list[Any]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(3)]


def time_figures(
    device: str, shape: tuple[int, ...], numpy_shape: tuple[int, ...]
) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for causal in (False, True):
        q, k, v = tensors(shape, torch.float16, device)
        out = sdpa(q, k, v, is_causal=causal)
        kernel = timed(
            lambda q=q, k=k, v=v, c=causal: sdpa(q, k, v, is_causal=c), device, repeat=10
        )
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        mine = timed(
            lambda q=q, k=k, v=v, o=out, c=causal: assert_attention_close(
                q, k, v, output=o, causal=c
            ),
            device,
        )
        extra = None
        if device.startswith("cuda"):
            extra = (torch.cuda.max_memory_allocated() - base) / 2**20
        # the reference's pass alone (no export: the findings only), the rest judging
        alone = timed(
            lambda q=q, k=k, v=v, c=causal: assert_attention_close(q, k, v, causal=c), device
        )
        report = assert_attention_close(q, k, v, output=out, causal=causal)
        name = f"{'causal' if causal else 'full'} {tuple(shape)} float16"
        found[name] = {
            "torch_backend_s": mine,
            "fused_kernel_s": kernel,
            "ratio": mine / kernel,
            "reference_pass_s": alone,
            "device_extra_MiB": extra,
            "backend": f"{report.backend} ({report.device})",
        }
        print(
            f"{name}: torch backend {mine:.3f} s (the reference's pass alone {alone:.3f} s), "
            f"fused kernel {kernel * 1e3:.2f} ms, device memory beyond the inputs {extra} MiB",
            flush=True,
        )
    # numpy on the host, on a shape it finishes in reasonable time
    q, k, v = tensors(numpy_shape, torch.float16, device)
    out = sdpa(q, k, v, is_causal=True)
    t0 = time.perf_counter()
    assert_attention_close(q, k, v, output=out, causal=True, backend="numpy")
    host = time.perf_counter() - t0
    dev = timed(lambda: assert_attention_close(q, k, v, output=out, causal=True), device)
    name = f"causal {tuple(numpy_shape)} float16, numpy on the host vs torch on {device}"
    found[name] = {"numpy_s": host, "torch_s": dev, "speedup": host / dev}
    print(f"{name}: numpy {host:.2f} s, torch {dev:.3f} s ({host / dev:.0f}x)", flush=True)
    return found


def verdicts(device: str) -> dict[str, Any]:
    """Each kernel's export judged on both backends; slips must fail on both."""
    found: dict[str, Any] = {}
    shape = (2, 8, 512, 64)
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            q, k, v = tensors(shape, dtype, device, seed=3)
            exports: dict[str, Any] = {}
            for name, kernel in KERNELS.items():
                try:
                    with sdpa_kernel(kernel):
                        exports[name] = sdpa(q, k, v, is_causal=causal)
                except RuntimeError:
                    continue  # not on this device
            exports["slip: no causal mask" if causal else "slip: causal mask added"] = sdpa(
                q, k, v, is_causal=not causal
            )
            exports["slip: no scale"] = sdpa(q, k, v, is_causal=causal, scale=1.0)
            exports["slip: K's heads swapped"] = sdpa(q, k.flip(1), v, is_causal=causal)
            for name, out in exports.items():
                results = {}
                for backend in ("numpy", "torch"):
                    try:
                        assert_attention_close(q, k, v, output=out, causal=causal, backend=backend)
                        results[backend] = ("pass", [])
                    except AssertionError as e:
                        failed = [
                            line.split()[1].rstrip(":")
                            for line in str(e).splitlines()
                            if line.strip().startswith("FAIL")
                        ]
                        results[backend] = ("fail", failed)
                want = "fail" if name.startswith("slip") else "pass"
                key = f"{str(dtype).removeprefix('torch.')} {'causal' if causal else 'full'} {name}"
                agree = results["numpy"] == results["torch"]
                right = results["torch"][0] == want
                found[key] = {
                    "numpy": results["numpy"],
                    "torch": results["torch"],
                    "agree": agree,
                    "right": right,
                }
                print(
                    f"{key}: numpy {results['numpy']}, torch {results['torch']}"
                    f"{'' if agree and right else '   <-- MISMATCH'}",
                    flush=True,
                )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="2,16,4096,128")
    parser.add_argument("--numpy-shape", default="1,4,2048,128")
    parser.add_argument("--json")
    parser.add_argument("--skip-time", action="store_true")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    numpy_shape = tuple(int(x) for x in args.numpy_shape.split(","))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    figures: dict[str, Any] = {"device": name, "torch": torch.__version__}
    if not args.skip_time:
        figures["time"] = time_figures(args.device, shape, numpy_shape)
    figures["verdicts"] = verdicts(args.device)
    bad = [k for k, v in figures["verdicts"].items() if not (v["agree"] and v["right"])]
    print(
        f"verdicts: {len(figures['verdicts']) - len(bad)} of {len(figures['verdicts'])} "
        "right and the same on both backends",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
