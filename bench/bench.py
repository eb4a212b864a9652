#!/usr/bin/env python3
"""Benchmark `sdpa check` side by side with PyTorch's SDPA kernel and a naive numpy version.

A report, not a test: it prints wall times, peak RSS and their ratios against the targets,
lists every miss, and exits 0 unless the script itself crashes.

    .venv/bin/python bench/bench.py            # the full set: many minutes
    .venv/bin/python bench/bench.py --quick    # small shapes, a smoke run
    make bench / make bench-quick

Targets (one run, side by side, on the same machine):

- `sdpa check` as a whole process, diagnostics included, ≤ 1.5 × PyTorch's SDPA kernel
  time at the same precision: a float16 export checked against a float32 reference vs
  torch in float32; a float32 export against a float64 reference vs torch in float64.
- Peak RSS of `sdpa check` ≤ the input files' size (q, k, v and out .npy) + 256 MiB.
- `sdpa --help` ≤ 1.3 × `python -c "import click"`.

Every measurement runs in a fresh process, so the peak RSS (ru_maxrss from wait4) is that
process's own. PyTorch is optional: without it the exports come from the naive numpy
implementation and torch's column is skipped.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Shape = tuple[int, int, int, int]
Array = npt.NDArray[Any]

TIMING_SHAPES: tuple[Shape, ...] = ((1, 16, 4096, 64), (1, 8, 8192, 128))
MEMORY_SHAPE: Shape = (1, 8, 16384, 64)
QUICK_TIMING_SHAPES: tuple[Shape, ...] = ((1, 4, 1024, 64), (1, 2, 2048, 128))
QUICK_MEMORY_SHAPE: Shape = (1, 2, 4096, 64)

EXPORT_DTYPES = ("float16", "float32")
# The reference precision of each export dtype: sdpa check's and torch's alike.
REFERENCE = {"float16": "float32", "float32": "float64"}
SHORT = {"float16": "f16", "float32": "f32"}
MEMORY_DTYPE = "float16"

TIME_FACTOR = 1.5
RSS_HEADROOM_MIB = 256.0
STARTUP_FACTOR = 1.3
STARTUP_REPEAT = 10
EXPORT_ROW_BLOCK = 2048  # query rows at a time when the naive version computes an export

MIB = 1024.0 * 1024.0
SCRIPT = Path(__file__).resolve()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- attention


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


# --------------------------------------------------------------------------- workers


def worker_main(argv: Sequence[str]) -> int:
    """`bench.py _worker torch|naive DIR ...`: time one implementation in this fresh process.

    Loads q, k, v from DIR, converts them to the reference precision, then times only the
    attention (torch: one warm-up call first); prints {"best_s", "times_s"} as JSON.
    """
    parser = argparse.ArgumentParser(prog="bench.py _worker")
    parser.add_argument("impl", choices=("torch", "naive"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--reference", required=True, choices=("float32", "float64"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    q, k, v = (np.load(args.dir / f"{name}.npy") for name in "qkv")
    times: list[float] = []
    if args.impl == "torch":
        import torch
        import torch.nn.functional as F

        tq, tk, tv = (torch.from_numpy(x.astype(args.reference)) for x in (q, k, v))
        del q, k, v
        F.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)  # warm-up
        for _ in range(args.repeat):
            start = time.perf_counter()
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
            times.append(time.perf_counter() - start)
    else:
        qr, kr, vr = (x.astype(args.reference) for x in (q, k, v))
        del q, k, v
        for _ in range(args.repeat):
            start = time.perf_counter()
            naive_attention(qr, kr, vr, causal=args.causal, dtype=args.reference)
            times.append(time.perf_counter() - start)
    print(json.dumps({"best_s": min(times), "times_s": times}))
    return 0


# --------------------------------------------------------------------------- processes


@dataclass
class Proc:
    wall_s: float
    maxrss_mib: float
    returncode: int
    stdout: str
    stderr: str


# Every measured process is started by this small launcher, not by the benchmark itself: a
# child forked (or vforked) from a process reports that process's peak RSS as its own
# ru_maxrss, since exec records the high-water mark of the address space it replaces; the
# benchmark holds torch and the exports (hundreds of MiB). The launcher (python -S, a few
# MiB: see `launcher_floor_mib`) spawns the command, times it and writes its rusage.
LAUNCHER = """\
import os, sys, time
result, argv = sys.argv[1], sys.argv[2:]
start = time.perf_counter()
pid = os.posix_spawnp(argv[0], argv, os.environ)
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
with open(result, "w") as f:
    f.write(f"{wall!r} {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}")
"""


def run_process(cmd: Sequence[str]) -> Proc:
    """Run `cmd` to completion: wall time around the process and its own peak RSS."""
    with (
        tempfile.TemporaryDirectory(prefix="sdpa-bench-run-") as tmp,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        result = Path(tmp) / "rusage"
        launcher = [sys.executable, "-S", "-c", LAUNCHER, str(result), *cmd]
        subprocess.run(launcher, stdin=subprocess.DEVNULL, stdout=out, stderr=err, check=False)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        if not result.exists():  # the launcher itself failed, e.g. no such command
            return Proc(0.0, 0.0, 127, stdout, stderr)
        wall, maxrss, returncode = result.read_text().split()
    # ru_maxrss: KiB on Linux, bytes on macOS.
    rss = int(maxrss) / (MIB if sys.platform == "darwin" else 1024.0)
    return Proc(float(wall), rss, int(returncode), stdout, stderr)


def launcher_floor_mib() -> float:
    """The least peak RSS a measured process can report: the launcher's own, inherited."""
    return run_process(["true"]).maxrss_mib


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


@dataclass
class Measure:
    seconds: float | None = None  # best of --repeat
    rss_mib: float | None = None  # peak RSS of the process (the greatest over the repeats)
    times_s: list[float] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None


def measure_worker(impl: str, data: Path, *, causal: bool, reference: str, repeat: int) -> Measure:
    cmd = [sys.executable, str(SCRIPT), "_worker", impl, str(data), "--reference", reference]
    cmd += ["--repeat", str(repeat)] + (["--causal"] if causal else [])
    proc = run_process(cmd)
    if proc.returncode != 0:
        return Measure(
            rss_mib=proc.maxrss_mib, error=f"exit {proc.returncode}: {tail(proc.stderr)}"
        )
    result = json.loads(proc.stdout)
    return Measure(seconds=result["best_s"], rss_mib=proc.maxrss_mib, times_s=result["times_s"])


@dataclass
class Check:
    passed: bool | None = None  # every run's top-level "passed"
    reference: str | None = None  # the reference format the report names
    failed_checks: list[str] = field(default_factory=list)


def measure_sdpa(cmd: Sequence[str], repeat: int) -> tuple[Measure, Check]:
    measure, check = Measure(), Check()
    for _ in range(repeat):
        proc = run_process(cmd)
        measure.times_s.append(proc.wall_s)
        measure.rss_mib = max(measure.rss_mib or 0.0, proc.maxrss_mib)
        if proc.returncode not in (0, 1):
            measure.error = f"exit {proc.returncode}: {tail(proc.stderr or proc.stdout)}"
            break
        try:
            report = json.loads(proc.stdout)
        except json.JSONDecodeError:
            measure.error = f"exit {proc.returncode}, no JSON on stdout: {tail(proc.stdout)}"
            break
        passed = bool(report.get("passed")) and proc.returncode == 0
        check.passed = passed if check.passed is None else check.passed and passed
        check.reference = report.get("reference")
        check.failed_checks = [
            f"{c.get('name')}: {c.get('summary')}"
            for c in report.get("checks", [])
            if not c.get("passed", True)
        ]
    if measure.times_s:
        measure.seconds = min(measure.times_s)
    return measure, check


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    kind: str  # "timing" or "memory"
    shape: Shape
    export_dtype: str
    reference: str
    causal: bool
    inputs_mib: float = 0.0
    sdpa: Measure = field(default_factory=Measure)
    check: Check = field(default_factory=Check)
    torch: Measure | None = None
    naive: Measure | None = None


def shape_tag(shape: Shape) -> str:
    return "x".join(map(str, shape))


def case_name(kind: str, shape: Shape, dtype: str, causal: bool) -> str:
    prefix = "mem " if kind == "memory" else ""
    return f"{prefix}{shape_tag(shape)}/{SHORT[dtype]}/{'causal' if causal else 'full'}"


def matcher(patterns: Sequence[str] | None) -> Callable[[str], bool]:
    """--only: glob patterns; one without wildcards matches anywhere in the case name."""
    if not patterns:
        return lambda name: True
    globs = [p if any(c in p for c in "*?[") else f"*{p}*" for p in patterns]
    return lambda name: any(fnmatch.fnmatchcase(name, g) for g in globs)


def generate(
    data: Path, shape: Shape, dtype: str, causals: Sequence[bool], have_torch: bool
) -> None:
    """q, k, v (seeded standard normal, in `dtype`) and one export per causal setting."""
    data.mkdir(parents=True, exist_ok=True)
    reference = REFERENCE[dtype]
    progress(f"generating {shape} {dtype} ...")
    rng = np.random.default_rng([20240601, *shape, EXPORT_DTYPES.index(dtype)])
    for name in "qkv":
        np.save(data / f"{name}.npy", rng.standard_normal(shape, dtype=np.float32).astype(dtype))
    q, k, v = (np.load(data / f"{name}.npy", mmap_mode="r") for name in "qkv")
    for causal in causals:
        how = f"torch {reference}" if have_torch else f"naive numpy {reference}"
        progress(f"exporting {shape} {dtype}{' causal' if causal else ''} with {how} ...")
        out_shape = (*shape[:-1], v.shape[-1])
        out = np.lib.format.open_memmap(
            data / export_file(causal), mode="w+", dtype=dtype, shape=out_shape
        )
        if have_torch:
            torch_export(q, k, v, causal=causal, reference=reference, out=out)
        else:
            naive_attention(
                q, k, v, causal=causal, dtype=reference, out=out, row_block=EXPORT_ROW_BLOCK
            )
        out.flush()
        del out


def export_file(causal: bool) -> str:
    return "out-causal.npy" if causal else "out.npy"


def sdpa_command(sdpa: str, data: Path, causal: bool, jobs: int | None) -> list[str]:
    cmd = [sdpa, "check", *(str(data / f"{n}.npy") for n in "qkv")]
    cmd += ["--expect-output", str(data / export_file(causal))]
    cmd += ["--causal"] if causal else []
    cmd += ["--no-color", "--format", "json"]
    cmd += ["--jobs", str(jobs)] if jobs is not None else []
    return cmd


def run_case(case: Case, data: Path, args: argparse.Namespace, have_torch: bool) -> None:
    files = [data / f"{n}.npy" for n in "qkv"] + [data / export_file(case.causal)]
    case.inputs_mib = sum(f.stat().st_size for f in files) / MIB
    if case.kind == "timing":
        if have_torch:
            progress(f"  {case.name}: torch {case.reference} ...")
            case.torch = measure_worker(
                "torch", data, causal=case.causal, reference=case.reference, repeat=args.repeat
            )
        else:
            case.torch = Measure(skipped="torch not importable")
        progress(f"  {case.name}: naive numpy {case.reference} ...")
        case.naive = measure_worker(
            "naive", data, causal=case.causal, reference=case.reference, repeat=args.repeat
        )
    progress(f"  {case.name}: sdpa check ...")
    case.sdpa, case.check = measure_sdpa(
        sdpa_command(args.sdpa, data, case.causal, args.jobs), args.repeat
    )


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    what: str
    value: float | None
    limit: float | None
    unit: str
    met: bool | None  # None: not measured
    note: str = ""


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def time_met(case: Case) -> bool | None:
    """sdpa/torch ≤ TIME_FACTOR; None where not measured (torch absent, an error)."""
    r = ratio(valid(case.sdpa, "seconds"), valid(case.torch, "seconds"))
    return None if r is None else r <= TIME_FACTOR


def rss_met(case: Case) -> bool | None:
    """sdpa's peak RSS ≤ its input files + RSS_HEADROOM_MIB; None where sdpa errored."""
    rss = valid(case.sdpa, "rss_mib")
    return None if rss is None else rss <= case.inputs_mib + RSS_HEADROOM_MIB


def targets_of(cases: Sequence[Case]) -> list[Target]:
    targets: list[Target] = []
    for case in cases:
        if case.kind == "timing":
            torch = case.torch or Measure()
            r = ratio(valid(case.sdpa, "seconds"), valid(torch, "seconds"))
            note = case.sdpa.error or torch.skipped or torch.error or ""
            targets.append(
                Target(f"{case.name} time", r, TIME_FACTOR, "x torch", time_met(case), note)
            )
        limit = case.inputs_mib + RSS_HEADROOM_MIB
        targets.append(
            Target(
                f"{case.name} rss",
                valid(case.sdpa, "rss_mib"),
                limit,
                "MiB",
                rss_met(case),
                case.sdpa.error or "",
            )
        )
    return targets


# --------------------------------------------------------------------------- output


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else "ok" if met else "OVER"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def measure_cell(m: Measure | None, spec: str, attr: str) -> str:
    if m is None:
        return "-"
    if m.skipped:
        return "skipped"
    if m.error:
        return "ERROR"
    value: float | None = getattr(m, attr)
    return fmt(value, spec)


def valid(m: Measure | None, attr: str) -> float | None:
    """A figure to compute ratios with: none from a process that failed or was skipped."""
    if m is None or m.error or m.skipped:
        return None
    value: float | None = getattr(m, attr)
    return value


def timing_table(cases: Sequence[Case]) -> str:
    rows = []
    for c in cases:
        if c.kind != "timing":
            continue
        torch_s = valid(c.torch, "seconds")
        r = ratio(valid(c.sdpa, "seconds"), torch_s)
        check = "ERROR" if c.sdpa.error else "pass" if c.check.passed else "FAIL"
        rows.append(
            [
                c.name,
                c.reference,
                measure_cell(c.sdpa, ".3f", "seconds"),
                measure_cell(c.torch, ".3f", "seconds"),
                measure_cell(c.naive, ".3f", "seconds"),
                fmt(r, ".2f"),
                fmt(ratio(valid(c.naive, "seconds"), torch_s), ".2f"),
                f"{TIME_FACTOR:.2f}",
                "ERROR" if c.sdpa.error else verdict(time_met(c)),
                check,
            ]
        )
    headers = ["case", "ref", "sdpa s", "torch s", "naive s", "sdpa/torch", "naive/torch"]
    return render_table([*headers, "target", "result", "check"], rows)


def memory_table(cases: Sequence[Case]) -> str:
    rows = []
    for c in cases:
        limit = c.inputs_mib + RSS_HEADROOM_MIB
        rss = valid(c.sdpa, "rss_mib")
        rows.append(
            [
                c.name,
                measure_cell(c.sdpa, ".0f", "rss_mib"),
                measure_cell(c.torch, ".0f", "rss_mib"),
                measure_cell(c.naive, ".0f", "rss_mib"),
                f"{c.inputs_mib:.0f}",
                f"{limit:.0f}",
                fmt(ratio(rss, limit), ".2f"),
                "ERROR" if c.sdpa.error else verdict(rss_met(c)),
                measure_cell(c.sdpa, ".3f", "seconds"),
            ]
        )
    headers = ["case", "sdpa MiB", "torch MiB", "naive MiB", "inputs MiB", "limit MiB"]
    return render_table([*headers, "sdpa/limit", "result", "sdpa s"], rows)


@dataclass
class Startup:
    sdpa_help_s: float | None = None
    import_click_s: float | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return ratio(self.sdpa_help_s, self.import_click_s)


def measure_startup(sdpa: str) -> Startup:
    progress(f"start-up: `sdpa --help` vs `python -c 'import click'`, best of {STARTUP_REPEAT} ...")
    help_times: list[float] = []
    click_times: list[float] = []
    for _ in range(STARTUP_REPEAT):  # interleaved, so drift hits both alike
        proc = run_process([sdpa, "--help"])
        if proc.returncode != 0:
            return Startup(error=f"sdpa --help: exit {proc.returncode}: {tail(proc.stderr)}")
        help_times.append(proc.wall_s)
        proc = run_process([sys.executable, "-c", "import click"])
        if proc.returncode != 0:
            return Startup(error=f"import click: exit {proc.returncode}: {tail(proc.stderr)}")
        click_times.append(proc.wall_s)
    return Startup(sdpa_help_s=min(help_times), import_click_s=min(click_times))


def startup_table(s: Startup) -> str:
    met = None if s.ratio is None else s.ratio <= STARTUP_FACTOR
    rows = [
        [
            "sdpa --help",
            fmt(s.sdpa_help_s, ".3f"),
            fmt(s.import_click_s, ".3f"),
            fmt(s.ratio, ".2f"),
            f"{STARTUP_FACTOR:.2f}",
            verdict(met) if not s.error else "ERROR",
        ]
    ]
    return render_table(["case", "sdpa s", "import click s", "ratio", "target", "result"], rows)


def startup_target(s: Startup) -> Target:
    met = None if s.ratio is None else s.ratio <= STARTUP_FACTOR
    return Target(
        "sdpa --help start-up", s.ratio, STARTUP_FACTOR, "x import click", met, s.error or ""
    )


def problems_of(
    cases: Sequence[Case], targets: Sequence[Target], startup: Startup | None
) -> list[str]:
    """Every miss, one line each; an error shared by several cases is listed once."""
    errors: dict[str, list[str]] = {}
    problems: list[str] = []
    for case in cases:
        if case.sdpa.error:
            errors.setdefault(f"sdpa check {case.sdpa.error}", []).append(case.name)
        elif case.check.passed is False:
            detail = "; ".join(case.check.failed_checks) or "see its report"
            problems.append(f"FAIL {case.name}: sdpa check did not pass: {detail}")
        if case.check.reference not in (None, case.reference):
            problems.append(
                f"NOTE {case.name}: sdpa check used a {case.check.reference} reference, "
                f"not {case.reference} as torch and the benchmark assume"
            )
        for label, m in (("torch", case.torch), ("naive", case.naive)):
            if m is not None and m.error:
                errors.setdefault(f"{label} {m.error}", []).append(case.name)
    problems[:0] = [f"ERROR {', '.join(names)}: {msg}" for msg, names in errors.items()]
    for t in targets:
        if t.met is False:
            problems.append(
                f"OVER {t.what}: {fmt(t.value, '.2f')} > {fmt(t.limit, '.2f')} {t.unit}"
            )
    if startup is not None and startup.error:
        problems.append(f"ERROR start-up: {startup.error}")
    return problems


# --------------------------------------------------------------------------- main


def torch_available() -> str | None:
    """torch's version, or None where it cannot be imported."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, not {value}")
    return value


def default_sdpa() -> str:
    beside = Path(sys.executable).parent / "sdpa"
    return str(beside) if beside.exists() else shutil.which("sdpa") or "sdpa"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench.py",
        description="Benchmark `sdpa check` against PyTorch's SDPA and a naive numpy version.",
    )
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=3,
        metavar="N",
        help="best wall time of N (default 3)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        metavar="N",
        help="passed on as `sdpa check --jobs N` (only when given)",
    )
    parser.add_argument("--keep", type=Path, metavar="DIR", help="generate into DIR and keep it")
    parser.add_argument(
        "--only",
        action="append",
        metavar="PATTERN",
        help="run the matching cases only (glob or substring of e.g. "
        "'1x8x8192x128/f32/causal', 'mem 1x8x16384x64/f16/full', 'startup'); repeatable",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure as JSON")
    parser.add_argument("--sdpa", default=default_sdpa(), help="the sdpa executable")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:
        return worker_main(argv[1:])
    args = parse_args(argv)
    wanted = matcher(args.only)
    timing_shapes = QUICK_TIMING_SHAPES if args.quick else TIMING_SHAPES
    memory_shape = QUICK_MEMORY_SHAPE if args.quick else MEMORY_SHAPE

    torch_version = torch_available()
    have_torch = torch_version is not None
    machine: dict[str, Any] = {
        "rss_floor_mib": launcher_floor_mib(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "sdpa": args.sdpa,
    }
    print(
        f"sdpa benchmark{' (--quick)' if args.quick else ''}: {machine['platform']}, "
        f"{machine['cpus']} CPUs, python {machine['python']}, numpy {machine['numpy']}"
    )
    machine["torch"] = torch_version
    if have_torch:
        import torch

        machine["torch_threads"] = torch.get_num_threads()
        print(f"torch {torch_version}, {torch.get_num_threads()} threads")
    else:
        print(
            "torch not importable: its column is skipped; exports come from the naive numpy version"
        )
    print(
        f"peak RSS of a measured process is at least {machine['rss_floor_mib']:.0f} MiB (the launcher's)"
    )
    print(flush=True)

    groups: list[tuple[str, Shape, str]] = [
        ("timing", shape, dtype) for shape in timing_shapes for dtype in EXPORT_DTYPES
    ]
    groups.append(("memory", memory_shape, MEMORY_DTYPE))

    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="sdpa-bench-") as tmp:
        root = args.keep if args.keep is not None else Path(tmp)
        for kind, shape, dtype in groups:
            group = [
                Case(case_name(kind, shape, dtype, c), kind, shape, dtype, REFERENCE[dtype], c)
                for c in (False, True)
            ]
            group = [c for c in group if wanted(c.name)]
            if not group:
                continue
            data = root / f"{kind}-{shape_tag(shape)}-{dtype}"
            generate(data, shape, dtype, [c.causal for c in group], have_torch)
            for case in group:
                run_case(case, data, args, have_torch)
                cases.append(case)
            if args.keep is None:
                shutil.rmtree(data)
        startup = measure_startup(args.sdpa) if wanted("startup") else None

    targets = targets_of(cases)
    if startup is not None:
        targets.append(startup_target(startup))

    if any(c.kind == "timing" for c in cases):
        print(
            f"Time: `sdpa check` as a whole process vs the SDPA kernel alone, best of {args.repeat}"
        )
        print(timing_table(cases))
        print()
    if cases:
        print(f"Peak RSS: `sdpa check` ≤ its input files + {RSS_HEADROOM_MIB:.0f} MiB")
        print(memory_table(cases))
        print()
    if startup is not None:
        print(f"Start-up: best of {STARTUP_REPEAT}")
        print(startup_table(startup))
        print()

    problems = problems_of(cases, targets, startup)
    if problems:
        print("Mismatches:")
        for p in problems:
            print(f"  {p}")
        print()

    met = sum(t.met is True for t in targets)
    over = sum(t.met is False for t in targets)
    unmeasured = sum(t.met is None for t in targets)
    failed = sum(c.check.passed is False or c.sdpa.error is not None for c in cases)
    summary = f"targets met: {met} of {len(targets)}"
    summary += f" ({over} over" + (f", {unmeasured} not measured" if unmeasured else "") + ")"
    if failed:
        summary += f"; sdpa check FAILED or errored in {failed} of {len(cases)} cases"
    print(summary)

    if args.json is not None:
        figures = {
            "machine": machine,
            "quick": args.quick,
            "repeat": args.repeat,
            "targets_spec": {
                "time_factor": TIME_FACTOR,
                "rss_headroom_mib": RSS_HEADROOM_MIB,
                "startup_factor": STARTUP_FACTOR,
            },
            "cases": [asdict(c) for c in cases],
            "startup": None if startup is None else {**asdict(startup), "ratio": startup.ratio},
            "targets": [asdict(t) for t in targets],
            "problems": problems,
            "summary": {
                "met": met,
                "over": over,
                "not_measured": unmeasured,
                "total": len(targets),
            },
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
