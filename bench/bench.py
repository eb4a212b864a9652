#!/usr/bin/env python3
"""Benchmark sdpa against its performance targets, each figure next to its target.

A report, not a test: it prints tables, a Markdown table (figure | measured | target |
verdict) for the README's performance section and every miss; it exits 0 unless the
script itself crashes.

    .venv/bin/python bench/bench.py              # the full set: the better part of an hour
    .venv/bin/python bench/bench.py --quick      # small shapes, a few minutes
    .venv/bin/python bench/bench.py --only grad --only startup
    make bench / make bench-quick

The figures (one run, side by side, on the same machine; medians of alternated runs,
every run in a fresh process, peak RSS from wait4 through a small launcher):

1. `sdpa check` as a whole process ÷ torch's SDPA kernel alone at the same precision:
   (1, 8, 8192, 128) float16 export (reference float32) ≤ 1.5×, float32 export
   (reference float64) ≤ 1.25×; (1, 8, 16384, 64) float16 ≤ 1.4×; a causal row, no target.
2. Cost per score flat: `sdpa check` ns/score on (1, 8, L, 64) float16 for L 1024 to
   16384, net of a measured start-up floor; largest ÷ smallest ≤ 1.3.
3. Peak RSS ≤ the input files + 256 MiB: check, compute (table, json, yaml, --save),
   explain --query 0, grad --dout and check --dout (a backward export of dQ, dK, dV) at
   every length of 2 (json/yaml up to L 4096).
4. `sdpa grad` ÷ torch's float64 forward + backward, (1, 8, 4096, 64): ≤ 1.3×.
5. `sdpa --help` ≤ 1.3 × `python -c "import click"`; `sdpa compute` on a sample ≤ 0.3 s.
6. A manifest of 64 cases on a local Dask cluster of 2 workers ≤ 1.2 × `--jobs 2`
   (skipped without dask or without `sdpa check --cluster`).

PyTorch is optional: without it the exports come from a naive numpy version and
torch's figures are not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from bench_data import Datasets
from bench_figures import (
    cluster_section,
    grad_section,
    kernel_section,
    scale_section,
    startup_section,
)
from bench_memory import memory_section
from bench_plan import FULL, QUICK, TINY, Context, Plan, Section, matcher
from bench_procs import Limits, launcher_floor_mib
from bench_report import Figure, markdown, summary

SECTIONS = (
    kernel_section,
    scale_section,
    memory_section,
    grad_section,
    startup_section,
    cluster_section,
)
ONLY_HELP = (
    "run the matching figures only: a glob or a substring of a key such as "
    "kernel/1x8x8192x128/f16, kernel/1x8x8192x128/f16/causal, scale/4096, "
    "rss/compute-json/1024 (rss/KEY/L, KEY one of check, compute, compute-json, "
    "compute-yaml, compute-save, explain, grad, check-dout), grad, startup/help, startup/sample, "
    "cluster; repeatable"
)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def torch_version() -> str | None:
    """torch's version and threads, or None where it cannot be imported."""
    try:
        import torch
    except ImportError:
        return None
    return f"{torch.__version__} ({torch.get_num_threads()} threads)"


def positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
        return value

    return parse


def default_sdpa() -> str:
    beside = Path(sys.executable).parent / "sdpa"
    return str(beside) if beside.exists() else shutil.which("sdpa") or "sdpa"


def default_rss_cap_mib() -> float:
    """8 GiB, or half the memory available now where that is less."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return min(8192.0, int(line.split()[1]) / 1024.0 / 2)
    except (OSError, ValueError, IndexError):
        pass
    return 8192.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench.py",
        description="Benchmark sdpa against its speed and memory targets, beside PyTorch.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    size.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the harness only
    parser.add_argument(
        "--repeat",
        type=positive(int),
        metavar="N",
        help="alternated runs per timed figure, their median (default 5; --quick 3)",
    )
    parser.add_argument("--only", action="append", metavar="PATTERN", help=ONLY_HELP)
    parser.add_argument(
        "--no-torch", action="store_true", help="as if torch were absent: no torch figures"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every run as JSON")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="inputs in DIR, kept and reused")
    parser.add_argument("--sdpa", default=default_sdpa(), help="the sdpa executable")
    parser.add_argument(
        "--jobs", type=positive(int), metavar="N", help="passed on as --jobs N to check and grad"
    )
    parser.add_argument(
        "--timeout",
        type=positive(float),
        default=600.0,
        metavar="S",
        help="kill a measured process after S seconds (default 600)",
    )
    parser.add_argument(
        "--rss-cap",
        type=positive(float),
        default=default_rss_cap_mib(),
        metavar="MIB",
        help="kill an sdpa process whose RSS passes MIB (default 8 GiB or half the "
        "memory available): far over every limit, it keeps a runaway off the machine",
    )
    return parser.parse_args(argv)


def print_section(section: Section) -> None:
    print(section.title)
    print(section.text)
    print(flush=True)


def compile_bytecode() -> str:
    """sdpa_cli's modules compiled to bytecode ahead, as pip installs a package: under
    PYTHONDONTWRITEBYTECODE (or a read-only checkout) an editable install compiles
    every module on every start, 60-80 ms that no installed copy pays."""
    import compileall

    import sdpa_cli

    package = Path(sdpa_cli.__file__).parent
    ok = compileall.compile_dir(str(package), quiet=1)
    return f"bytecode: {package} compiled ahead" + ("" if ok else " (some modules failed)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    plan: Plan = TINY if args.tiny else QUICK if args.quick else FULL
    repeat: int = args.repeat or plan.repeat
    torch = None if args.no_torch else torch_version()
    floor = launcher_floor_mib()
    machine: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch,
        "sdpa": args.sdpa,
        "launcher_rss_floor_mib": floor,
    }
    print(
        f"sdpa benchmark ({plan.name}): {machine['platform']}, {machine['cpus']} CPUs, "
        f"python {machine['python']}, numpy {machine['numpy']}"
    )
    if torch:
        print(f"torch {torch}")
    else:
        why = "--no-torch" if args.no_torch else "torch not importable"
        print(f"{why}: torch's figures are not measured; exports from naive numpy")
    print(compile_bytecode())
    print(f"medians of {repeat} alternated runs, each in a fresh process")
    print(
        f"peak RSS ≥ {floor:.0f} MiB (the launcher's); a process is killed past "
        f"{args.rss_cap:.0f} MiB or {args.timeout:g} s"
    )
    print(flush=True)

    figures: list[Figure] = []
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sdpa-bench-") as tmp:
        root = args.keep if args.keep is not None else Path(tmp) / "data"
        scratch = Path(tmp) / "scratch"
        scratch.mkdir()
        ctx = Context(
            sdpa=args.sdpa,
            datasets=Datasets(root, torch is not None, progress),
            scratch=scratch,
            limits=Limits(timeout_s=args.timeout, rss_cap_mib=args.rss_cap),
            repeat=repeat,
            have_torch=torch is not None,
            wanted=matcher(args.only),
            progress=progress,
            jobs=args.jobs,
        )
        for make in SECTIONS:
            section = make(ctx, plan)
            if section is None:
                continue
            print_section(section)
            figures += section.figures
            problems += section.problems

    if not figures:
        print(f"nothing matches --only {' '.join(args.only or [])}")
        return 0
    print("Figures against their targets (Markdown, for the README):")
    print()
    print(markdown(figures))
    print()
    problems = list(dict.fromkeys(problems))
    if problems:
        print("Problems:")
        for p in problems:
            print(f"  {p}")
        print()
    print(summary(figures))

    if args.json is not None:
        dump = {
            "machine": machine,
            "plan": asdict(plan),
            "repeat": repeat,
            "limits": {"timeout_s": args.timeout, "rss_cap_mib": args.rss_cap},
            "runs": [s.to_json() for s in ctx.series],
            "figures": [f.to_json() for f in figures],
            "problems": problems,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dump, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
