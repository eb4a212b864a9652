"""The model page's figures: a capture of LAYERS × HEADS at length L (default 32 × 32 at
4,096, head size 64, float16, causal), `sdpa report model` and `sdpa check --manifest`
each without and with --html side by side, the page's size, and the time headless
Chromium takes to open it.

Targets (issue 35): the page under about 10 MB, open in under 2 s, and making it at
most about 10% of the run that produced it.

    python bench/bench_pages.py [--layers 32] [--heads 32] [--length 4096] [--repeat 2]

The cases of the manifest all read one q, k, v (a page's cost does not depend on the
values, and 32 copies would be 3 GB); each layer's row is computed, pooled and drawn
as its own. Chromium is Debian's (make installs it), driven by Playwright; without
either, the open time is not measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PAGE_MB = 10.0
OPEN_S = 2.0
OVERHEAD = 0.10


def sdpa() -> str:
    beside = Path(sys.executable).parent / "sdpa"
    return str(beside) if beside.exists() else shutil.which("sdpa") or "sdpa"


def write_capture(folder: Path, layers: int, heads: int, length: int, dim: int) -> Path:
    """A manifest of ``layers`` causal self-attention calls, as a capture lays it out."""
    rng = np.random.default_rng(0)
    for name in "qkv":
        a = rng.standard_normal((1, heads, length, dim)).astype(np.float16)
        np.save(folder / f"{name}.npy", a)
    lines = ["defaults:", "  causal: true", "cases:"]
    calls = ["calls:"]
    for i in range(layers):
        name = f"model.layers.{i}.self_attn"
        lines += [f"  - name: {name}", "    q: q.npy", "    k: k.npy", "    v: v.npy"]
        calls += [f"  - name: {name}", f"    layer: {i}"]
    (folder / "manifest.yaml").write_text("\n".join(lines) + "\n")
    (folder / "calls.yaml").write_text("\n".join(calls) + "\n")
    return folder / "manifest.yaml"


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def open_times(page: Path, repeat: int) -> list[float] | str:
    """Seconds from asking Chromium for the page to its load event and its first
    head's pattern drawn, each in a fresh tab."""
    chromium = os.environ.get("SDPA_CHROMIUM") or shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "playwright not installed"
    if not chromium:
        return "chromium not installed"
    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        for _ in range(repeat):
            tab = browser.new_page()
            start = time.perf_counter()
            tab.goto(page.as_uri(), wait_until="load")
            tab.wait_for_function(
                "() => { const i = document.querySelector('#pattern img');"
                " return i && i.complete && i.naturalWidth > 0; }"
            )
            out.append(time.perf_counter() - start)
            tab.close()
        browser.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sdpa-pages-") as tmp:
        folder = Path(tmp)
        manifest = write_capture(folder, args.layers, args.heads, args.length, args.dim)
        page = folder / "model.html"
        plain = [sdpa(), "report", "model", str(manifest), "--format", "json"]
        paged = [*plain, "--html", str(page)]
        check = [sdpa(), "check", "--manifest", str(manifest), "--format", "json"]
        checked = [*check, "--html", str(folder / "check.html")]
        times: dict[int, list[float]] = {0: [], 1: [], 2: [], 3: []}
        commands = [plain, paged, check, checked]
        for i in range(args.repeat):  # alternated, so that drift falls on every one
            order = range(4) if i % 2 == 0 else range(3, -1, -1)
            for n in order:
                cmd = commands[n]
                print(f"  {' '.join(cmd[1:3])} {'--html' if n % 2 else ''} ({i + 1})")
                times[n].append(timed(cmd))
        size_mb = page.stat().st_size / 1e6
        opened = open_times(page, 3)
    base, made = statistics.median(times[0]), statistics.median(times[1])
    checking, checked_page = statistics.median(times[2]), statistics.median(times[3])
    overhead = made / base - 1
    check_overhead = checked_page / checking - 1
    print(
        f"\nreport model of {args.layers} layers × {args.heads} heads, L = {args.length}, "
        f"head size {args.dim}, float16, causal; medians of {args.repeat}"
    )
    rows = [
        ("report model (JSON)", f"{base:.1f} s", "-"),
        ("the same with --html", f"{made:.1f} s", "-"),
        ("cost of the page", f"{100 * overhead:+.1f}%", "-"),
        ("check --manifest (JSON)", f"{checking:.1f} s", "-"),
        ("the same with --html", f"{checked_page:.1f} s", "-"),
        ("cost of its page", f"{100 * check_overhead:+.1f}%", f"≤ {100 * OVERHEAD:.0f}%"),
        ("page size", f"{size_mb:.2f} MB", f"≤ {PAGE_MB:g} MB"),
    ]
    if isinstance(opened, str):
        rows.append(("open in Chromium", opened, f"≤ {OPEN_S:g} s"))
    else:
        rows.append(("open in Chromium", f"{statistics.median(opened):.2f} s", f"≤ {OPEN_S:g} s"))
    for name, value, target in rows:
        print(f"  {name:22} {value:>14}  {target}")
    met = check_overhead <= OVERHEAD and size_mb <= PAGE_MB
    if not isinstance(opened, str):
        met = met and statistics.median(opened) <= OPEN_S
    print("targets met" if met else "a target MISSED")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
