#!/usr/bin/env python3
"""The verdict benchmark: `sdpa check` passes every faithful kernel and fails
every real bug, by default.

A benchmark of verdicts, not of time. Every export of bench/gate_kernels.py (PyTorch's CPU
SDPA fused and math, Hugging Face eager attention in tiny random Llama, Mistral and
Gemma 2 models, JAX's XLA attention; float16 and bfloat16) is checked as a user would
check it, with no tolerance flag:

    sdpa check q.npy k.npy v.npy --expect-output out.npy [--expect-lse lse.npy]
        [--mask mask.npy] FLAGS --format json

and so is every bug injected into it: one head's output shifted by c × its RMS error
against float64 (c = 1, 2, 4, 8), one query row rolled by a column, the scale 1/d_k, the
mask inverted, the window off by one, the causal alignment flipped (L < S), a bfloat16
kernel claimed to be float32. A faithful export should pass (exit 0), a bug should fail
(exit 1).

It prints a confusion table per kernel and dtype, every wrong verdict with its checks and
hints, per dtype the smallest head shift caught, and a Markdown table for the README. It
exits 0 only when no faithful export fails and no bug passes (and no run errs).

    .venv/bin/python bench/bench_gate.py
    .venv/bin/python bench/bench_gate.py --only torch-flash --only '*/bfloat16/*'
    .venv/bin/python bench/bench_gate.py --keep /tmp/gate --json gate.json
    make bench-gate

A family of kernels whose library does not import (torch, transformers, jax) is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gate_kernels as gk
import numpy as np
from bench_plan import matcher
from bench_report import render_table

ONLY_HELP = (
    "run the matching checks only: a glob or a substring of a run's name, "
    "KERNEL/DTYPE/CASE/BUG such as torch-flash/bfloat16/causal/faithful, "
    "hf-gemma2, */float16/*, scale-dk, head-shift-2; repeatable"
)


@dataclass
class Run:
    """One `sdpa check` of an export, and what it said."""

    name: str
    kernel: str
    dtype: str
    case: str
    bug: str | None  # None: the faithful export
    args: list[str]
    exit_code: int | None = None
    said: list[dict[str, Any]] = field(default_factory=list)  # failed checks, else the .close ones
    warned: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    error: str = ""  # stderr, or why there is no JSON

    @property
    def expected(self) -> int:
        return 0 if self.bug is None else 1

    @property
    def right(self) -> bool:
        return self.exit_code == self.expected

    @property
    def outcome(self) -> str:
        """passed or failed (a faithful export), caught or missed (a bug), or error."""
        if self.exit_code not in (0, 1):
            return "error"
        if self.bug is None:
            return "passed" if self.exit_code == 0 else "failed"
        return "caught" if self.exit_code == 1 else "missed"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "expected": self.expected, "outcome": self.outcome}


@dataclass
class Built:
    """A faithful export as written, with its float64 error: the sanity line of a case."""

    name: str
    shapes: dict[str, list[int]]
    flags: list[str]
    relative_error: float  # largest head's RMS error against float64 ÷ that head's RMS
    bugs: list[str]


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_sdpa() -> str:
    beside = Path(sys.executable).parent / "sdpa"
    return str(beside) if beside.exists() else shutil.which("sdpa") or "sdpa"


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for module in ("numpy", "torch", "transformers", "jax"):
        try:
            found[module] = __import__(module).__version__
        except ImportError:
            found[module] = None
    return found


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_gate.py",
        description="Does `sdpa check` pass every faithful kernel and fail every bug, by default?",
    )
    parser.add_argument("--only", action="append", metavar="PATTERN", help=ONLY_HELP)
    parser.add_argument("--keep", type=Path, metavar="DIR", help="write the exports in DIR, kept")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every run as JSON")
    parser.add_argument("--sdpa", default=default_sdpa(), help="the sdpa executable")
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=2,
        metavar="N",
        help="sdpa processes at once (default 2)",
    )
    parser.add_argument(
        "--min-shift",
        type=positive_int,
        default=2,
        metavar="C",
        help="head shifts below C × the RMS error are measured (the gate's sensitivity) but "
        "not counted in the exit code (default 2: a shift of one RMS error is within what "
        "a kernel's rounding can hide in a small head)",
    )
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------- building


def build(case: gk.Case, root: Path, wanted: Any) -> tuple[Built | None, list[Run]]:
    """The case's faithful export, its bugs, written under root; the runs --only keeps."""
    names = [f"{case.key}/faithful"]
    names += [f"{case.key}/{b}" for b in (*gk.EXPORT_BUGS, *case.bugs)]
    if not any(wanted(n) for n in names):
        return None, []
    progress(f"building {case.key}")
    faithful = case.run(None)
    exact = gk.attention64(faithful)
    folder = root / case.key
    paths = gk.save(faithful, folder / "faithful")
    exports = [faithful]
    exports += [gk.inject(faithful, b, exact) for b in gk.export_bugs(faithful)]
    exports += [case.run(b) for b in case.bugs if wanted(f"{case.key}/{b}")]
    runs = []
    for export in exports:
        if not wanted(export.name):
            continue
        mine = (
            paths
            if export is faithful
            else gk.save(export, folder / str(export.bug), (faithful, paths))
        )
        args = [*gk.check_args(mine, export.flags), "--format", "json"]
        runs.append(Run(export.name, export.kernel, export.dtype, export.case, export.bug, args))
    built = Built(
        faithful.name,
        {n: list(a.shape) for n, a in faithful.arrays.items()},
        list(faithful.flags),
        gk.relative_error(faithful, exact),
        [str(e.bug) for e in exports[1:]],
    )
    return built, runs


# ---------------------------------------------------------------------------- running


def check(sdpa: str, run: Run) -> Run:
    """Run `sdpa check` and read its exit code and JSON report."""
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("GITHUB_ACTIONS", None)  # no annotations on stderr
    try:
        proc = subprocess.run(
            [sdpa, *run.args], capture_output=True, text=True, env=env, check=False, timeout=600
        )
    except subprocess.TimeoutExpired:
        run.error = "killed after 600 s"
        return run
    run.exit_code = proc.returncode
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        run.error = (proc.stderr.strip() or proc.stdout.strip() or "no output")[-2000:]
        return run
    checks = [c for case in report.get("cases", []) for c in case["checks"]]
    for c in checks:
        hint = c.get("hint")
        if hint:
            run.hints.append(f"{c['name']}: {hint}")
        if c.get("status") == "fail" or c.get("passed") is False:
            run.said.append({"name": c["name"], "summary": c.get("summary"), "hint": hint})
        elif c.get("status") == "warn":
            run.warned.append(c["name"])
    # What the close checks said when they passed: the margin of a missed bug.
    if run.exit_code == 0:
        run.said = [
            {"name": c["name"], "summary": c.get("summary"), "hint": c.get("hint")}
            for c in checks
            if c["name"].endswith(".close")
        ]
    if proc.returncode not in (0, 1):
        run.error = proc.stderr.strip()[-2000:]
    return run


# ---------------------------------------------------------------------------- report


def counted(run: Run, min_shift: int) -> bool:
    """Whether a wrong verdict on this run counts against the exit code."""
    if run.bug in gk.SHIFT_BUGS:
        return shift_of(run) >= min_shift
    return True


def shift_of(run: Run) -> int:
    return int(str(run.bug).rsplit("-", 1)[1])


def confusion(runs: Sequence[Run]) -> str:
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.kernel, r.dtype), []).append(r)
    rows = [_confusion_row(k, d, rs) for (k, d), rs in groups.items()]
    rows.append(_confusion_row("all", "", list(runs)))
    headers = [
        "kernel",
        "dtype",
        "faithful",
        "passed",
        "failed",
        "bugs",
        "caught",
        "missed",
        "errors",
    ]
    return render_table(headers, rows, left=2)


def _confusion_row(kernel: str, dtype: str, runs: Sequence[Run]) -> list[str]:
    outcomes = [r.outcome for r in runs]
    faithful = sum(r.bug is None for r in runs)
    return [
        kernel,
        dtype,
        str(faithful),
        str(outcomes.count("passed")),
        str(outcomes.count("failed")),
        str(len(runs) - faithful),
        str(outcomes.count("caught")),
        str(outcomes.count("missed")),
        str(outcomes.count("error")),
    ]


def per_bug(runs: Sequence[Run]) -> str:
    kinds: dict[str, list[Run]] = {}
    for r in runs:
        kinds.setdefault(r.bug or "faithful", []).append(r)
    rows = []
    for kind, rs in kinds.items():
        right = sum(r.right for r in rs)
        hinted = sum(bool(r.hints) for r in rs if r.right)
        rows.append([kind, str(len(rs)), str(right), str(len(rs) - right), str(hinted)])
    return render_table(["export", "runs", "right", "wrong", "right, with a hint"], rows)


def shift_table(runs: Sequence[Run]) -> tuple[str, dict[str, int | None]]:
    """Per dtype: caught / runs at each c, and the smallest c from which every shift is caught."""
    dtypes = sorted({r.dtype for r in runs if r.bug in gk.SHIFT_BUGS})
    rows = []
    smallest: dict[str, int | None] = {}
    for dtype in dtypes:
        shifts = [r for r in runs if r.dtype == dtype and r.bug in gk.SHIFT_BUGS]
        cells = []
        for c in gk.SHIFTS:
            rs = [r for r in shifts if r.bug == gk.shift_bug(c)]
            cells.append(f"{sum(r.outcome == 'caught' for r in rs)}/{len(rs)}")
        smallest[dtype] = caught_from(shifts)
        rows.append([dtype, *cells, times(smallest[dtype])])
    headers = ["dtype", *(f"c = {c}" for c in gk.SHIFTS), "caught from"]
    return render_table(headers, rows), smallest


def caught_from(shifts: Iterable[Run]) -> int | None:
    """The smallest c such that every head shift by c or more is caught; None if not even 8."""
    found = None
    for c in reversed(gk.SHIFTS):
        rs = [r for r in shifts if r.bug == gk.shift_bug(c)]
        if not rs or any(r.outcome != "caught" for r in rs):
            break
        found = c
    return found


def times(c: int | None) -> str:
    return "-" if c is None else f"{c}×"


def wrong_verdicts(runs: Sequence[Run], min_shift: int, commands: bool) -> list[str]:
    lines = []
    for r in runs:
        if r.right:
            continue
        what = {"failed": "FALSE FAIL", "missed": "FALSE PASS", "error": "ERROR"}[r.outcome]
        note = "" if counted(r, min_shift) else f" (below --min-shift {min_shift}: not counted)"
        lines.append(f"  {what} {r.name}: exit {r.exit_code}{note}")
        for c in r.said:
            lines.append(f"      {c['name']}: {c['summary']}")
            if c.get("hint"):
                lines.append(f"      hint: {c['hint']}")
        if r.error:
            lines.append(f"      {r.error.splitlines()[-1]}")
        if commands:
            lines.append(f"      sdpa {' '.join(r.args)}")
    return lines


def markdown(runs: Sequence[Run], smallest: dict[str, int | None]) -> str:
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.kernel, r.dtype), []).append(r)
    rows = [
        "| kernel | dtype | faithful exports passed | bugs caught | head shift caught from |",
        "|---|---|---|---|---|",
    ]

    def row(kernel: str, dtype: str, rs: Sequence[Run], shift: str) -> str:
        faithful = [r for r in rs if r.bug is None]
        bugs = [r for r in rs if r.bug is not None]
        passed = sum(r.outcome == "passed" for r in faithful)
        caught = sum(r.outcome == "caught" for r in bugs)
        return f"| {kernel} | {dtype} | {passed} of {len(faithful)} | {caught} of {len(bugs)} | {shift} |"

    for (kernel, dtype), rs in groups.items():
        shifts = [r for r in rs if r.bug in gk.SHIFT_BUGS]
        rows.append(row(kernel, dtype, rs, times(caught_from(shifts))))
    total = ", ".join(f"{d}: {times(c)}" for d, c in smallest.items())
    rows.append(row("**all**", "", runs, total or "-"))
    return "\n".join(rows)


# ---------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    wanted = matcher(args.only)
    found = versions()
    print(
        f"sdpa verdict benchmark: {platform.platform()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}"
    )
    print(", ".join(f"{m} {v or 'not importable'}" for m, v in found.items()))
    print(f"sdpa: {args.sdpa}; every check with no tolerance flag")
    cases, skipped = gk.cases()
    for line in skipped:
        print(line)
    print(flush=True)

    built: list[Built] = []
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="sdpa-gate-") as tmp:
        root = args.keep if args.keep is not None else Path(tmp)
        for case in cases:
            b, rs = build(case, root, wanted)
            if b is not None:
                built.append(b)
            runs += rs
        if not runs:
            print(f"nothing matches --only {' '.join(args.only or [])}")
            return 0
        progress(f"checking {len(runs)} exports, {args.workers} at a time")
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            runs = list(pool.map(lambda r: check(args.sdpa, r), runs))

    print("Faithful exports (error: the largest head's RMS error against float64 ÷ its RMS):")
    rows = [
        [
            b.name.removesuffix("/faithful"),
            " ".join(b.flags) or "-",
            "x".join(map(str, b.shapes["q"])),
            "x".join(map(str, b.shapes["k"])),
            f"{b.relative_error:.2e}",
        ]
        for b in built
    ]
    print(render_table(["export", "flags", "Q", "K", "error"], rows, left=2))
    print()
    print("Verdicts per kernel and dtype (faithful: passed / failed; bugs: caught / missed):")
    print(confusion(runs))
    print()
    print("Verdicts per export:")
    print(per_bug(runs))
    print()
    table, smallest = shift_table(runs)
    print("One head shifted by c × its RMS error against float64: caught / runs")
    print(table)
    print()
    wrong = wrong_verdicts(runs, args.min_shift, commands=args.keep is not None)
    if wrong:
        print("Wrong verdicts:")
        print("\n".join(wrong))
        if args.keep is None:
            print("  (--keep DIR keeps the exports and prints each command to rerun)")
    else:
        print("Wrong verdicts: none")
    print()
    print("Verdicts (Markdown, for the README):")
    print()
    print(markdown(runs, smallest))
    print()

    faithful = [r for r in runs if r.bug is None]
    bugs = [r for r in runs if r.bug is not None]
    false_fail = sum(r.outcome == "failed" for r in faithful)
    false_pass = sum(r.outcome == "missed" and counted(r, args.min_shift) for r in bugs)
    uncounted = sum(r.outcome == "missed" and not counted(r, args.min_shift) for r in bugs)
    errors = sum(r.outcome == "error" for r in runs)
    passed = sum(r.outcome == "passed" for r in faithful)
    caught = sum(r.outcome == "caught" for r in bugs)
    print(
        f"faithful exports passed: {passed} of {len(faithful)}; bugs caught: {caught} of {len(bugs)}"
    )
    extra = (
        f" ({uncounted} head shifts below {args.min_shift}× missed, not counted)"
        if uncounted
        else ""
    )
    print(f"false failures: {false_fail}; false passes: {false_pass}{extra}; errors: {errors}")

    if args.json is not None:
        dump = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), **found},
            "sdpa": args.sdpa,
            "min_shift": args.min_shift,
            "skipped": skipped,
            "exports": [asdict(b) for b in built],
            "runs": [r.to_json() for r in runs],
            "smallest_shift_caught": smallest,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dump, indent=2, default=_json_default) + "\n")
        progress(f"wrote {args.json}")
    return 0 if false_fail == false_pass == errors == 0 else 1


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


if __name__ == "__main__":
    sys.exit(main())
