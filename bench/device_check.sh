#!/usr/bin/env bash
# The GPU checks of the torch backend, as one short run on a machine with a CUDA device
# and a python3 that holds torch (sdpa's own dependencies beside it): the backend tests
# on the device, bench_device.py (time, memory, the device's kernels' verdicts), and
# `sdpa check` from files with --device cuda beside numpy on the host's cores.
#   bash bench/device_check.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/device-check}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, numpy, os; print('torch', torch.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name(), os.cpu_count(), 'cores')"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_backends.py 2>&1 | tail -4
timeout 200 python3 bench/bench_device.py --numpy-shape 1,4,4096,128 --json "$out/device.json" 2>&1 | tee "$out/device.log"
python3 - "$out" <<'PY'
import subprocess, sys, time, json
from pathlib import Path
import numpy as np, torch
out = Path(sys.argv[1]); d = Path("/tmp/files"); d.mkdir(exist_ok=True)
found = {}
for shape, runs in (((1, 8, 8192, 128), ("torch", "numpy")), ((1, 8, 16384, 64), ("profile",))):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).half() for _ in range(3))
    o = torch.nn.functional.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda()).cpu()
    for name, t in zip("qkvo", (q, k, v, o)):
        np.save(d / f"{name}.npy", t.numpy())
    files = [str(d / f"{n}.npy") for n in "qkv"] + ["--expect-output", str(d / "o.npy"), "--format", "json"]
    for label in runs:
        flags = ["--backend", "numpy"] if label == "numpy" else ["--backend", "torch", "--device", "cuda"]
        pre = ["-m", "cProfile", "-s", "tottime"] if label == "profile" else []
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, *pre, "-m", "sdpa_cli", "check", *files, *flags], capture_output=True, text=True, timeout=140)
        except subprocess.TimeoutExpired as e:
            print(label, shape, "killed after 140 s", flush=True)
            continue
        dt = time.perf_counter() - t0
        text = r.stdout
        cut = text.index("{") if "{" in text else 0
        try:
            doc, end = json.JSONDecoder().raw_decode(text[cut:])
        except ValueError:
            doc, end = {"cases": [{}]}, 0
        if label == "profile":
            print("\n".join(text[cut + end:].splitlines()[:35]))
        case = doc["cases"][0]
        close = [c["summary"] for c in case.get("checks", []) if c["name"] == "output.close"]
        key = f"sdpa check {shape} float16, {label}"
        found[key] = {"s": dt, "rc": r.returncode, "backend": case.get("backend"), "device": case.get("device"), "close": close}
        print(key, f"{dt:.2f} s rc={r.returncode}", case.get("backend"), case.get("device"), close, r.stderr[-300:], flush=True)
(out / "cli.json").write_text(json.dumps(found, indent=2))
PY
