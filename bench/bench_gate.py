#!/usr/bin/env python3
"""The verdict benchmark: `sdpa check` passes every faithful kernel and fails
every real bug, by default, and names the bug.

A benchmark of verdicts, not of time. Every export of bench/gate_kernels.py (PyTorch's CPU
SDPA fused and math, Hugging Face eager attention in tiny random Llama, Mistral, Gemma 2,
BERT and ModernBERT models, JAX's XLA attention; float16, bfloat16 and float32; and
FlashAttention-3's FP8 forward emulated in bench/gate_fp8.py, e4m3 with descales, whose
bugs are the descales misapplied) is checked as a user would check it, with no tolerance
flag:

    sdpa check q.npy k.npy v.npy --expect-output out.npy [--expect-weights w.npy]
        [--expect-lse lse.npy] [--mask mask.npy] [--segment-ids ids.npy] FLAGS --format json

and so is every bug injected into it: one head's output shifted by c × its RMS error
against float64 (c = 1, 2, 4, 8), one query row rolled by a column, the scale 1/d_k, the
mask inverted, the window off by one, the causal alignment flipped (L < S), the causal
mask transposed (triu), packed documents leaking into one another, the temperature
forgotten, a bfloat16 kernel claimed to be float32, Q, K, V and the output saved
(B, L, H, E), the output alone saved so, and an LSE in base 2. A faithful export should
pass (exit 0), a bug should fail (exit 1), an output saved (B, L, H, E) beside
(B, H, L, E) inputs should be refused (exit 2). Each caught bug is *named* when a hint
says what it is (gate_kernels.HINT_NAMES) or, for a head shift or a rolled row, which no
option explains, when the JSON's diagnosis says structural and places it.

Backward kernels' exports (PyTorch's CPU SDPA backward, fused and math; attention written
in PyTorch ops with gpt-oss's sinks, and with dropout replayed from a keep mask; Hugging
Face eager attention's backward in Llama, Mistral and Gemma 2; jax.vjp of JAX's attention
in bfloat16) are
checked with --dout DOUT --expect-dq DQ --expect-dk DK --expect-dv DV and the forward
flags, faithful and with a backward slip put in (dK without the scale, D = rowsum(dO ∘ O)
forgotten, dV from unnormalised weights, the mask left out of the backward two ways,
grouped-query dK and dV not summed, dropout's mask not replayed, one head's dQ shifted by
c = 1, 2, 4, 8 × its error). A
slip is named by its words (gate_kernels.BACKWARD_NAMES) in a hint or a failed check's
summary, a dK without its scale also by a structural fit of the factor 1/scale, a dQ
shift by a structural diagnosis that places its slice; their tables come after the
forward ones, with the slips caught but not named and those that say another slip's words.

Noise runs must raise nothing: causal random data through the fused kernel (no finding
at all in the JSON), `sdpa inspect` of float16 random data (no overflow, flush,
subnormal, NaN or inf counted), and a captured tiny Llama's manifest (no WARN without a
reason in the table). And no failed comparison diagnosed structural may be offered a
--fudge (its passing_factor must be null).

It prints a confusion table per kernel and dtype, a table per bug (caught, named), the
noise table, every wrong verdict, false alarm and unnamed bug with its hints and
diagnosis, per dtype the smallest head shift caught, and Markdown tables for the
documentation. It exits 0 only when no faithful export fails, no bug passes, no noise
run raises anything, no structural error is offered a --fudge, and no run errs.

    .venv/bin/python bench/bench_gate.py
    .venv/bin/python bench/bench_gate.py --only torch-flash --only '*/bfloat16/*'
    .venv/bin/python bench/bench_gate.py --keep /tmp/gate --json gate.json
    make bench-gate

A family of kernels whose library does not import (torch, transformers, jax) is skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
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
    "hf-gemma2, */float16/*, scale-dk, head-shift-2; the backward runs are "
    "backward/KERNEL/DTYPE/CASE/SLIP (backward, 'backward/*/faithful', dk-no-scale); "
    "repeatable"
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
    expected: int = 0  # the right exit code (gate_kernels.expected_exit)
    place: tuple[tuple[int, int], int | None] | None = None  # where a shift or roll is
    fit: float | None = None  # the factor a structural fit names the slip by (dK's 1/scale)
    exit_code: int | None = None
    said: list[dict[str, Any]] = field(default_factory=list)  # failed checks, else the .close ones
    warned: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)  # "check: hint"; a refusal's stderr line
    diagnoses: list[dict[str, Any]] = field(default_factory=list)  # of failed .close checks
    findings: list[str] = field(default_factory=list)  # "severity kind: message"
    error: str = ""  # stderr, or why there is no JSON

    @property
    def right(self) -> bool:
        return self.exit_code == self.expected

    @property
    def outcome(self) -> str:
        """passed or failed (a faithful export), caught or missed (a bug), or error."""
        if self.bug is None:
            return {0: "passed", 1: "failed"}.get(self.exit_code, "error")  # type: ignore[arg-type]
        if self.right:
            return "caught"
        return "missed" if self.exit_code == 0 else "error"

    @property
    def backward(self) -> bool:
        return self.name.startswith("backward/")

    @property
    def named(self) -> bool:
        """Whether a caught bug is named: by its hint, or by a structural diagnosis that
        places it (a head shift: its slice alone; a rolled row: its slice and row). A
        backward slip: by its words in a hint or a failed check's summary, a dK without
        its scale also by a structural fit of the factor 1/scale (gk.BACKWARD_NAMES)."""
        if self.outcome != "caught" or self.bug is None:
            return False
        if self.bug in gk.BACKWARD_NAMES:
            return self._says(gk.BACKWARD_NAMES[self.bug]) or self._fitted()
        words = gk.HINT_NAMES.get(self.bug)
        if words is not None:
            return any(words in h for h in self.hints)
        return self._placed()

    @property
    def named_without_hint(self) -> bool:
        """Whether a caught backward slip is named with no hint: by a failed check's
        summary (dv.sums for dV from unnormalised weights) or a structural diagnosis."""
        if self.outcome != "caught" or not self.backward or self.bug is None:
            return False
        words = gk.BACKWARD_NAMES.get(self.bug)
        if words is None:
            return self._placed()
        return any(words in str(c["summary"]) for c in self.said) or self._fitted()

    @property
    def misnamed(self) -> list[str]:
        """The other backward slips whose words a caught backward slip's report holds."""
        if self.outcome != "caught" or not self.backward:
            return []
        return [b for b, w in gk.BACKWARD_NAMES.items() if b != self.bug and self._says(w)]

    def _says(self, words: str) -> bool:
        """Whether a hint or a failed check's summary holds `words`."""
        return bool(self.saying(words))

    def saying(self, words: str) -> list[str]:
        """Where `words` are said: "hint on CHECK" or "CHECK's summary"."""
        found = [f"hint on {h.split(':', 1)[0]}" for h in self.hints if words in h]
        return found + [f"{c['name']}'s summary" for c in self.said if words in str(c["summary"])]

    def _fitted(self) -> bool:
        """Whether a structural diagnosis fits the export as `fit` × the reference."""
        if self.fit is None:
            return False
        for d in self.diagnoses:
            diagnosis = d.get("diagnosis") or {}
            factor = (diagnosis.get("fit") or {}).get("factor")
            structural = diagnosis.get("error") == "structural"
            if structural and factor and math.isclose(factor, self.fit, rel_tol=0.01):
                return True
        return False

    def _placed(self) -> bool:
        """Whether a structural diagnosis places the slip where it is (`place`)."""
        if self.place is None:
            return False
        where, row = self.place
        for d in self.diagnoses:
            diagnosis = d.get("diagnosis") or {}
            if diagnosis.get("error") != "structural" or diagnosis.get("slices") != [list(where)]:
                continue
            rows = diagnosis.get("rows") or []
            if row is None or any(a <= row <= b for a, b in rows):
                return True
        return False

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "outcome": self.outcome,
            "named": self.named,
            "named_without_hint": self.named_without_hint,
            "misnamed": self.misnamed,
        }


@dataclass
class Noise:
    """A run on data with nothing wrong, and anything it raised: a false alarm."""

    name: str  # noise/SOURCE/...
    source: str  # check, inspect or manifest
    args: list[str]
    exit_code: int | None = None
    raised: list[str] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)  # what a raised WARN stands for
    error: str = ""

    @property
    def quiet(self) -> bool:
        return self.exit_code == 0 and not self.raised and not self.error


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
        "--backend",
        choices=("numpy", "torch"),
        help="the library every check computes with (sdpa check --backend; default numpy)",
    )
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
    names += [f"{case.key}/{b}" for b in (*(gk.EXPORT_BUGS if case.inject else ()), *case.bugs)]
    if not any(wanted(n) for n in names):
        return None, []
    progress(f"building {case.key}")
    faithful = case.run(None)
    exact = gk.attention64(faithful)
    folder = root / case.key
    paths = gk.save(faithful, folder / "faithful")
    exports = [faithful]
    if case.inject:
        exports += [gk.inject(faithful, b, exact) for b in gk.export_bugs(faithful)]
    exports += [case.run(b) for b in case.bugs if wanted(f"{case.key}/{b}")]
    runs = _runs(exports, folder, paths, wanted)
    return _built(exports, gk.relative_error(faithful, exact)), runs


def _runs(exports: list[gk.Export], folder: Path, paths: dict[str, Path], wanted: Any) -> list[Run]:
    """A run of `sdpa check` for each export --only keeps: the faithful one (first,
    saved at `paths`) and the others, saved under folder by their bug beside it."""
    faithful = exports[0]
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
        fit = 1.0 / export.reference.scale if export.bug == gk.DK_NO_SCALE else None
        runs.append(
            Run(
                export.name,
                export.kernel,
                export.dtype,
                export.case,
                export.bug,
                args,
                expected=gk.expected_exit(export.bug),
                place=place(export),
                fit=fit,
            )
        )
    return runs


def _built(exports: list[gk.Export], error: float) -> Built:
    """What was built: the faithful export (first), its error against float64, the bugs."""
    faithful = exports[0]
    return Built(
        faithful.name,
        {n: list(a.shape) for n, a in faithful.arrays.items()},
        list(faithful.flags),
        error,
        [str(e.bug) for e in exports[1:]],
    )


def build_backward(
    case: gk.BackwardCase, root: Path, wanted: Any
) -> tuple[Built | None, list[Run]]:
    """A backward case's faithful export and its slips, written under root; the runs
    --only keeps."""
    slips = (*gk.BACKWARD_SLIPS, *gk.DQ_SHIFT_SLIPS) if case.slips else ()
    if not any(wanted(f"{case.key}/{b}") for b in ("faithful", *slips)):
        return None, []
    progress(f"building {case.key}")
    faithful = case.run()
    exact = gk.backward64(faithful)
    folder = root / case.key
    paths = gk.save(faithful, folder / "faithful")
    applied = gk.backward_slips(faithful) if case.slips else ()
    slipped = [gk.inject_backward(faithful, b, exact) for b in applied if wanted(f"{case.key}/{b}")]
    exports = [faithful, *slipped]
    return _built(exports, gk.gradient_error(faithful, exact)), _runs(
        exports, folder, paths, wanted
    )


def place(export: gk.Export) -> tuple[tuple[int, int], int | None] | None:
    """Where a head shift (of the output or of dQ) or a rolled row sits: its (batch,
    head), and the rolled row."""
    if export.bug in gk.SHIFT_BUGS or export.bug in gk.DQ_SHIFT_SLIPS:
        return gk.SHIFTED, None
    if export.bug == gk.ROW_ROLL:
        return gk.ROLLED_HEAD, int(export.arrays["out"].shape[-2]) // 2
    return None


NOISE_SCRIPT = Path(__file__).resolve().parents[1] / "samples" / "capture" / "tiny_llama.py"


def build_noise(root: Path, wanted: Any, sdpa: str) -> tuple[list[Noise], list[str]]:
    """The noise runs --only keeps (their data written under root), and a line per source
    skipped."""
    noise: list[Noise] = []
    skipped: list[str] = []
    if gk.missing(("torch",)) is None:
        for case in gk.noise_cases():
            name = f"noise/check/{case.key}"
            if not wanted(name):
                continue
            progress(f"building {name}")
            export = case.run(None)
            paths = gk.save(export, root / "noise" / case.key)
            args = [*gk.check_args(paths, export.flags), "--format", "json"]
            noise.append(Noise(name, "check", args))
    else:
        skipped.append("noise/check: skipped, torch does not import")
    for seed in range(gk.NOISE_SEEDS):
        name = f"noise/inspect/float16-randn-seed{seed}"
        if wanted(name):
            path = root / "noise" / f"randn-{seed}.npy"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, gk.randn(seed))
            noise.append(Noise(name, "inspect", ["inspect", str(path), "--format", "json"]))
    name = "noise/manifest/tiny-llama"
    if wanted(name):
        absent = gk.missing(("torch", "transformers"))
        if absent is not None:
            skipped.append(f"{name}: skipped, {absent} does not import")
        else:
            progress(f"capturing {NOISE_SCRIPT.name}")
            out = root / "noise" / "capture"
            capture = [sdpa, "capture", "--out", str(out), "--replace", "--", str(NOISE_SCRIPT)]
            proc = subprocess.run(capture, capture_output=True, text=True, check=False)
            args = ["check", "--manifest", str(out / "manifest.yaml")]
            found = Noise(name, "manifest", args)
            if proc.returncode != 0:
                found.error = f"sdpa capture: exit {proc.returncode}: {proc.stderr.strip()[-500:]}"
            noise.append(found)
    return noise, skipped


# ---------------------------------------------------------------------------- running


CHECK_FLAGS: list[str] = []
"""Flags every `sdpa check` of the run is given (``--backend``)."""


def sdpa_run(sdpa: str, args: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
    """`sdpa ARGS` without color or annotations; None when it ran past 600 s."""
    args = [*args, *CHECK_FLAGS] if args and args[0] == "check" else list(args)
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120"}
    env.pop("GITHUB_ACTIONS", None)  # no annotations on stderr
    try:
        return subprocess.run(
            [sdpa, *args], capture_output=True, text=True, env=env, check=False, timeout=600
        )
    except subprocess.TimeoutExpired:
        return None


def check(sdpa: str, run: Run) -> Run:
    """Run `sdpa check` and read its exit code and JSON report."""
    proc = sdpa_run(sdpa, run.args)
    if proc is None:
        run.error = "killed after 600 s"
        return run
    run.exit_code = proc.returncode
    if proc.returncode == 2 and run.expected == 2:
        # A refused export: its hint is the one-line error.
        run.hints = [line for line in proc.stderr.strip().splitlines()[-1:]]
        return run
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        run.error = (proc.stderr.strip() or proc.stdout.strip() or "no output")[-2000:]
        return run
    read_report(run, report)
    if proc.returncode not in (0, 1):
        run.error = proc.stderr.strip()[-2000:]
    return run


def read_report(run: Run, report: dict[str, Any]) -> None:
    """The failed checks, hints, diagnoses and findings of `sdpa check`'s JSON."""
    cases = report.get("cases", [])
    checks = [c for case in cases for c in case["checks"]]
    for c in checks:
        hint = c.get("hint")
        if hint:
            run.hints.append(f"{c['name']}: {hint}")
        if c.get("status") == "fail" or c.get("passed") is False:
            run.said.append({"name": c["name"], "summary": c.get("summary"), "hint": hint})
            if c["name"].endswith(".close"):
                run.diagnoses.append(diagnosed(c))
        elif c.get("status") == "warn":
            run.warned.append(c["name"])
    run.findings = [
        f"{f.get('severity')} {f.get('kind')}: {f.get('message')}"
        for case in cases
        for f in case.get("findings") or []
    ]
    # What the close checks said when they passed: the margin of a missed bug.
    if run.exit_code == 0:
        run.said = [
            {"name": c["name"], "summary": c.get("summary"), "hint": c.get("hint")}
            for c in checks
            if c["name"].endswith(".close")
        ]


def diagnosed(c: dict[str, Any]) -> dict[str, Any]:
    """A failed .close check's diagnosis and the --fudge it offers (mismatch.passing_factor)."""
    details = c.get("details") or {}
    mismatch = c.get("mismatch") or details.get("mismatch") or {}
    return {
        "name": c["name"],
        "diagnosis": c.get("diagnosis") or details.get("diagnosis"),
        "passing_factor": mismatch.get("passing_factor"),
        "summary": c.get("summary"),
        "hint": c.get("hint"),
    }


def fudged(run: Run) -> list[dict[str, Any]]:
    """The run's failed comparisons diagnosed structural and still offered a --fudge."""
    found = []
    for d in run.diagnoses:
        if (d["diagnosis"] or {}).get("error") != "structural":
            continue
        said = f"{d['summary'] or ''} {d['hint'] or ''}"
        if d["passing_factor"] is not None or "--fudge" in said:
            found.append(d)
    return found


def listen(sdpa: str, noise: Noise) -> Noise:
    """Run a noise command; whatever it raises is a false alarm."""
    if noise.error:  # its data could not be made
        return noise
    proc = sdpa_run(sdpa, noise.args)
    if proc is None:
        noise.error = "killed after 600 s"
        return noise
    noise.exit_code = proc.returncode
    if proc.returncode != 0:
        noise.error = proc.stderr.strip()[-2000:]
    if noise.source == "manifest":
        noise.raised = unexplained_warnings(proc.stdout)
        if noise.raised:
            again = sdpa_run(sdpa, [*noise.args, "--format", "json"])
            if again is not None and again.stdout:
                noise.detail = finding_kinds(json.loads(again.stdout))
        return noise
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        noise.error = noise.error or "no JSON on stdout"
        return noise
    if noise.source == "check":
        run = Run(noise.name, "", "", "", None, noise.args, exit_code=proc.returncode)
        read_report(run, report)
        noise.raised = [f"{name}: warn" for name in run.warned] + run.findings
        noise.raised += [f"{c['name']}: {c['summary']}" for c in run.said if run.exit_code]
    else:
        noise.raised = inspected(report)
    return noise


def unexplained_warnings(table: str) -> list[str]:
    """The rows of `sdpa check --manifest`'s table that say WARN or FAIL and nothing else."""
    found = []
    for line in table.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) >= 3 and cells[1] in ("WARN", "FAIL") and len(cells) < 4:
            found.append(f"{cells[0]}: {cells[1]} without a reason")
    return found


def finding_kinds(report: dict[str, Any]) -> list[str]:
    """Per case of a JSON report, its findings' counts by kind."""
    return [
        f"{case['name']}: "
        + ", ".join(f"{n} {kind}" for kind, n in (case.get("finding_counts") or {}).items())
        for case in report.get("cases", [])
        if case.get("finding_counts")
    ]


def inspected(report: dict[str, Any]) -> list[str]:
    """What `sdpa inspect --format json` counts against a tensor: non-finite values, and
    what a cast to each format would overflow, flush to zero or leave subnormal (the
    subnormals only where inspect calls them notable: 1% of the nonzero values)."""
    raised = []
    for f in report.get("files", []):
        for t in f.get("tensors", []):
            counts = [f"{t[k]} {k}" for k in ("nan", "posinf", "neginf") if t.get(k)]
            for fmt, room in (t.get("headroom") or {}).items():
                own = " (its own format)" if fmt == t.get("dtype") else ""
                counts += [
                    f"{room[k]} {k} in {fmt}{own}"
                    for k in ("overflow", "flush", "subnormal")
                    if room.get(k) and (k != "subnormal" or room.get("subnormal_notable"))
                ]
            raised += [f"{t['name']}: {c}" for c in counts]
    return raised


# ---------------------------------------------------------------------------- report


def counted(run: Run, min_shift: int) -> bool:
    """Whether a wrong verdict on this run counts against the exit code."""
    if run.bug in gk.SHIFT_BUGS or run.bug in gk.DQ_SHIFT_SLIPS:
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


def per_bug(runs: Sequence[Run]) -> list[list[str]]:
    """Per bug: runs, caught, missed, errors, named (of the caught), and what names it."""
    kinds: dict[str, list[Run]] = {}
    for r in runs:
        if r.bug is not None:
            kinds.setdefault(r.bug, []).append(r)
    rows = []
    for kind, rs in kinds.items():
        outcomes = [r.outcome for r in rs]
        caught = outcomes.count("caught")
        rows.append(
            [
                kind,
                str(len(rs)),
                str(caught),
                str(outcomes.count("missed")),
                str(outcomes.count("error")),
                f"{sum(r.named for r in rs)}/{caught}",
                naming(kind),
            ]
        )
    return rows


BUG_HEADERS = ["bug", "runs", "caught", "missed", "errors", "named", "named by"]


def naming(bug: str) -> str:
    """What names the bug: the words its hint must hold, or the diagnosis's place."""
    words = gk.BACKWARD_NAMES.get(bug)
    if words is not None:
        said = f'"{words}" in a hint or summary'
        return f"{said}, or diagnosis: fit 1/scale" if bug == gk.DK_NO_SCALE else said
    words = gk.HINT_NAMES.get(bug)
    if words is not None:
        return f'hint: "{words}"'
    if bug == gk.ROW_ROLL:
        return "diagnosis: structural, its slice and row"
    return "diagnosis: structural, its slice alone"


def noise_rows(noise: Sequence[Noise]) -> list[list[str]]:
    """Per source: runs, quiet, false alarms, and the first thing raised."""
    sources: dict[str, list[Noise]] = {}
    for n in noise:
        sources.setdefault(n.source, []).append(n)
    rows = []
    for source, ns in sources.items():
        loud = [n for n in ns if not n.quiet]
        first = next((n.raised[0] if n.raised else n.error for n in loud), "")
        rows.append(
            [NOISE_SOURCES[source], str(len(ns)), str(len(ns) - len(loud)), str(len(loud)), first]
        )
    return rows


NOISE_HEADERS = ["noise", "runs", "quiet", "false alarms", "first raised"]
NOISE_SOURCES = {
    "check": "check, causal random data (torch fused): no finding",
    "inspect": "inspect, float16 random data: nothing counted",
    "manifest": "check --manifest, a captured tiny Llama: no WARN without a reason",
}


OUTPUT_SHIFTS = (gk.SHIFTS, gk.shift_bug)
DQ_SHIFTS = (gk.DQ_SHIFTS, gk.dq_shift)


def shift_table(
    runs: Sequence[Run], shifts: tuple[Sequence[int], Any] = OUTPUT_SHIFTS
) -> tuple[str, dict[str, int | None]]:
    """Per dtype: caught / runs at each c, and the smallest c from which every shift is
    caught; `shifts`: the factors c and the bug of each (the output's, or dQ's)."""
    factors, bug_of = shifts
    bugs = {bug_of(c) for c in factors}
    dtypes = sorted({r.dtype for r in runs if r.bug in bugs})
    rows = []
    smallest: dict[str, int | None] = {}
    for dtype in dtypes:
        shifted = [r for r in runs if r.dtype == dtype and r.bug in bugs]
        cells = []
        for c in factors:
            rs = [r for r in shifted if r.bug == bug_of(c)]
            cells.append(f"{sum(r.outcome == 'caught' for r in rs)}/{len(rs)}")
        smallest[dtype] = caught_from(shifted, shifts)
        rows.append([dtype, *cells, times(smallest[dtype])])
    headers = ["dtype", *(f"c = {c}" for c in factors), "caught from"]
    return render_table(headers, rows), smallest


def caught_from(
    shifts: Iterable[Run], which: tuple[Sequence[int], Any] = OUTPUT_SHIFTS
) -> int | None:
    """The smallest c such that every head shift by c or more is caught; None if not
    even the largest."""
    factors, bug_of = which
    found = None
    for c in reversed(factors):
        rs = [r for r in shifts if r.bug == bug_of(c)]
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
        lines.append(f"  {what} {r.name}: exit {r.exit_code}, expected {r.expected}{note}")
        lines += _said(r, commands)
    return lines


def unnamed(runs: Sequence[Run], commands: bool) -> list[str]:
    """Every caught bug no hint or diagnosis names, with what the report said."""
    lines = []
    for r in runs:
        if r.outcome != "caught" or r.named:
            continue
        lines.append(f"  UNNAMED {r.name}: wanted {naming(str(r.bug))}")
        lines += _said(r, commands)
        for d in r.diagnoses:
            lines.append(f"      {d['name']} diagnosis: {shown(d['diagnosis'])}")
    return lines


def shown(diagnosis: dict[str, Any] | None) -> str:
    """A diagnosis as JSON, its slices left out when there are more than 8 (--json has them)."""
    if diagnosis is None or len(diagnosis.get("slices") or ()) <= 8:
        return json.dumps(diagnosis, ensure_ascii=False)
    n = len(diagnosis["slices"])
    return json.dumps({**diagnosis, "slices": f"{n} slices"}, ensure_ascii=False)


def _said(r: Run, commands: bool) -> list[str]:
    lines = []
    for c in r.said:
        lines.append(f"      {c['name']}: {c['summary']}")
        if c.get("hint"):
            lines.append(f"      hint: {c['hint']}")
    if r.expected == 2 and r.hints:
        lines.append(f"      stderr: {r.hints[0]}")
    elif r.error:
        lines.append(f"      {r.error.splitlines()[-1]}")
    if commands:
        lines.append(f"      sdpa {' '.join(r.args)}")
    return lines


def false_alarms(noise: Sequence[Noise], commands: bool) -> list[str]:
    lines = []
    for n in noise:
        if n.quiet:
            continue
        lines.append(f"  FALSE ALARM {n.name}: exit {n.exit_code}")
        lines += [f"      {x}" for x in n.raised[:8]]
        if len(n.raised) > 8:
            lines.append(f"      … and {len(n.raised) - 8} more")
        lines += [f"      findings: {x}" for x in n.detail]
        if n.error:
            lines.append(f"      {n.error.splitlines()[-1]}")
        if commands:
            lines.append(f"      sdpa {' '.join(n.args)}")
    return lines


def markdown(
    runs: Sequence[Run], smallest: dict[str, int | None], noise: Sequence[Noise] = ()
) -> str:
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
    rows += ["", "| bug | caught | named | named by |", "|---|---|---|---|"]
    for bug, n, caught, _missed, _errors, named, by in per_bug(runs):
        rows.append(f"| {bug} | {caught} of {n} | {named.replace('/', ' of ')} | {by} |")
    if noise:
        rows += ["", "| noise | quiet | false alarms |", "|---|---|---|"]
        for source, n, quiet, loud, _first in noise_rows(noise):
            rows.append(f"| {source} | {quiet} of {n} | {loud} |")
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
    if args.backend:
        CHECK_FLAGS[:] = ["--backend", args.backend]
    print(f"sdpa: {args.sdpa}; every check with no tolerance flag {' '.join(CHECK_FLAGS)}")
    cases, skipped = gk.cases()
    backward_cases, backward_skipped = gk.backward_cases()

    built: list[Built] = []
    runs: list[Run] = []
    backward = Backward()
    with tempfile.TemporaryDirectory(prefix="sdpa-gate-") as tmp:
        root = args.keep if args.keep is not None else Path(tmp)
        for case in cases:
            b, rs = build(case, root, wanted)
            if b is not None:
                built.append(b)
            runs += rs
        for bcase in backward_cases:
            b, rs = build_backward(bcase, root, wanted)
            if b is not None:
                backward.built.append(b)
            backward.runs += rs
        noise, quiet_skipped = build_noise(root, wanted, args.sdpa)
        skipped += [*backward_skipped, *quiet_skipped]
        for line in skipped:
            print(line)
        print(flush=True)
        if not runs and not backward.runs and not noise:
            print(f"nothing matches --only {' '.join(args.only or [])}")
            return 0
        progress(
            f"checking {len(runs)} exports, {len(backward.runs)} backward exports and "
            f"{len(noise)} noise runs, {args.workers} at a time"
        )
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            runs = list(pool.map(lambda r: check(args.sdpa, r), runs))
            backward.runs = list(pool.map(lambda r: check(args.sdpa, r), backward.runs))
            noise = list(pool.map(lambda n: listen(args.sdpa, n), noise))

    smallest = report(args, built, runs, noise, backward)
    counts = tally(runs, noise, args.min_shift)
    backward_counts = tally(backward.runs, (), args.min_shift)
    print(
        f"faithful exports passed: {counts['passed']} of {counts['faithful']}; bugs caught: "
        f"{counts['caught']} of {counts['bugs']}, named {counts['named']}; noise runs quiet: "
        f"{counts['quiet']} of {len(noise)}"
    )
    extra = (
        f" ({counts['uncounted']} head shifts below {args.min_shift}× missed, not counted)"
        if counts["uncounted"]
        else ""
    )
    print(
        f"false failures: {counts['false_fail']}; false passes: {counts['false_pass']}{extra}; "
        f"false alarms: {counts['false_alarms']}; structural errors offered a --fudge: "
        f"{counts['fudged']}; errors: {counts['errors']}"
    )
    if backward.runs:
        print(backward_line(backward_counts, args.min_shift))

    if args.json is not None:
        dump = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), **found},
            "sdpa": args.sdpa,
            "min_shift": args.min_shift,
            "skipped": skipped,
            "exports": [asdict(b) for b in built],
            "runs": [r.to_json() for r in runs],
            "noise": [{**asdict(n), "quiet": n.quiet} for n in noise],
            "smallest_shift_caught": smallest,
            "counts": counts,
            "backward_exports": [asdict(b) for b in backward.built],
            "backward_runs": [r.to_json() for r in backward.runs],
            "smallest_dq_shift_caught": backward.smallest,
            "backward_counts": backward_counts,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dump, indent=2, default=_json_default) + "\n")
        progress(f"wrote {args.json}")
    failures = ("false_fail", "false_pass", "false_alarms", "fudged", "errors")
    return 0 if not any(c[k] for c in (counts, backward_counts) for k in failures) else 1


def backward_line(counts: dict[str, int], min_shift: int) -> str:
    """The backward runs' counts, as the forward's last two lines."""
    extra = (
        f" ({counts['uncounted']} dQ head shifts below {min_shift}× missed, not counted)"
        if counts["uncounted"]
        else ""
    )
    return (
        f"backward: faithful exports passed: {counts['passed']} of {counts['faithful']}; "
        f"slips caught: {counts['caught']} of {counts['bugs']}, named {counts['named']}; "
        f"false failures: {counts['false_fail']}; false passes: {counts['false_pass']}{extra}; "
        f"structural errors offered a --fudge: {counts['fudged']}; errors: {counts['errors']}"
    )


def tally(runs: Sequence[Run], noise: Sequence[Noise], min_shift: int) -> dict[str, int]:
    """The counts of the last lines and of the exit code."""
    faithful = [r for r in runs if r.bug is None]
    bugs = [r for r in runs if r.bug is not None]
    return {
        "faithful": len(faithful),
        "passed": sum(r.outcome == "passed" for r in faithful),
        "bugs": len(bugs),
        "caught": sum(r.outcome == "caught" for r in bugs),
        "named": sum(r.named for r in bugs),
        "quiet": sum(n.quiet for n in noise),
        "false_fail": sum(r.outcome == "failed" for r in faithful),
        "false_pass": sum(r.outcome == "missed" and counted(r, min_shift) for r in bugs),
        "uncounted": sum(r.outcome == "missed" and not counted(r, min_shift) for r in bugs),
        "false_alarms": sum(not n.quiet for n in noise),
        "fudged": sum(len(fudged(r)) for r in runs),
        "errors": sum(r.outcome == "error" for r in runs),
    }


def report(
    args: argparse.Namespace,
    built: Sequence[Built],
    runs: Sequence[Run],
    noise: Sequence[Noise],
    backward: Backward | None = None,
) -> dict[str, int | None]:
    """Print the tables and lists; return the smallest head shift caught per dtype (and
    set the backward runs' smallest dQ shift caught)."""
    commands = args.keep is not None
    backward = backward if backward is not None else Backward()
    print("Faithful exports (error: the largest head's RMS error against float64 ÷ its RMS):")
    print(built_table(built))
    print()
    print("Verdicts per kernel and dtype (faithful: passed / failed; bugs: caught / missed):")
    print(confusion(runs))
    print()
    print("Verdicts per bug (named: of those caught, how many a hint or diagnosis names):")
    print(render_table(BUG_HEADERS, per_bug(runs)))
    print()
    table, smallest = shift_table(runs)
    print("One head shifted by c × its RMS error against float64: caught / runs")
    print(table)
    print()
    print("Noise (data with nothing wrong: anything raised is a false alarm):")
    print(render_table(NOISE_HEADERS, noise_rows(noise)) if noise else "  none run")
    print()
    sections = [
        ("Wrong verdicts", wrong_verdicts(runs, args.min_shift, commands)),
        ("False alarms", false_alarms(noise, commands)),
        ("Caught but not named", unnamed(runs, commands)),
        ("Structural errors offered a --fudge", fudge_lines(runs)),
    ]
    for title, lines in sections:
        print(f"{title}: {'none' if not lines else ''}".rstrip())
        if lines:
            print("\n".join(lines))
        print()
    if backward.runs:
        sections += report_backward(backward, args.min_shift, commands)
    if not commands and any(lines for _, lines in sections):
        print("(--keep DIR keeps the exports and prints each command to rerun)")
        print()
    print("Verdicts (Markdown, for the documentation):")
    print()
    print(markdown(runs, smallest, noise))
    print()
    if backward.runs:
        print(markdown_backward(backward.runs, backward.smallest))
        print()
    return smallest


def built_table(built: Sequence[Built]) -> str:
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
    return render_table(["export", "flags", "Q", "K", "error"], rows, left=2)


@dataclass
class Backward:
    """The backward exports and their runs, and the smallest dQ head shift caught."""

    built: list[Built] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    smallest: dict[str, int | None] = field(default_factory=dict)


def report_backward(
    backward: Backward, min_shift: int, commands: bool
) -> list[tuple[str, list[str]]]:
    """Print the backward tables and lists; set `backward.smallest`."""
    runs = backward.runs
    print(
        "Faithful backward exports (error: the largest head's RMS error of dQ, dK, dV "
        "against float64 ÷ its RMS):"
    )
    print(built_table(backward.built))
    print()
    print("Backward verdicts per kernel and dtype (faithful: passed / failed; slips: caught /")
    print("missed):")
    print(confusion(runs))
    print()
    print(
        "Backward verdicts per slip (named: of those caught, how many a hint, a failed check's "
        "summary or a diagnosis names; without a hint: by a summary or diagnosis alone; named "
        "as another: another slip's words said):"
    )
    print(render_table(SLIP_HEADERS, per_slip(runs)))
    print()
    table, backward.smallest = shift_table(runs, DQ_SHIFTS)
    print("One head's dQ shifted by c × its RMS error against float64: caught / runs")
    print(table)
    print()
    sections = [
        ("Backward wrong verdicts", wrong_verdicts(runs, min_shift, commands)),
        ("Backward slips caught but not named (the targets for hints)", unnamed(runs, commands)),
        ("Backward slips named as another", misnamed_lines(runs)),
        ("Backward structural errors offered a --fudge", fudge_lines(runs)),
    ]
    for title, lines in sections:
        print(f"{title}: {'none' if not lines else ''}".rstrip())
        if lines:
            print("\n".join(lines))
        print()
    return sections


def per_slip(runs: Sequence[Run]) -> list[list[str]]:
    """Per backward slip: per_bug's columns, and how many caught runs say another
    slip's words (and which)."""
    rows = []
    for row in per_bug(runs):
        caught = [r for r in runs if r.bug == row[0] and r.outcome == "caught"]
        others = sorted({b for r in caught for b in r.misnamed})
        n = sum(bool(r.misnamed) for r in caught)
        alone = sum(r.named_without_hint for r in caught)
        rows.append([*row[:-1], str(alone), f"{n} ({', '.join(others)})" if n else "0", row[-1]])
    return rows


SLIP_HEADERS = [
    "slip",
    "runs",
    "caught",
    "missed",
    "errors",
    "named",
    "without a hint",
    "named as another",
    "named by",
]


def misnamed_lines(runs: Sequence[Run]) -> list[str]:
    """Per slip, the caught runs that say another slip's words: how many, where, the first."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        for other in r.misnamed:
            groups.setdefault((str(r.bug), other), []).append(r)
    lines = []
    for (slip, other), rs in groups.items():
        caught = sum(r.bug == slip and r.outcome == "caught" for r in runs)
        where = sorted({w for r in rs for w in r.saying(gk.BACKWARD_NAMES[other])})
        own = sum(r.named for r in rs)
        lines.append(
            f"  {slip}: {len(rs)} of {caught} caught say {other}'s words "
            f'("{gk.BACKWARD_NAMES[other]}", in {", ".join(where)}); {own} name their own too'
        )
        lines.append(f"      first: {rs[0].name}")
    return lines


def markdown_backward(runs: Sequence[Run], smallest: dict[str, int | None]) -> str:
    """The backward runs' tables: per kernel and dtype, per slip."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.kernel, r.dtype), []).append(r)
    rows = [
        "| backward kernel | dtype | faithful exports passed | slips caught | named "
        "| dQ head shift caught from |",
        "|---|---|---|---|---|---|",
    ]

    def row(kernel: str, dtype: str, rs: Sequence[Run], shift: str) -> str:
        faithful = [r for r in rs if r.bug is None]
        slips = [r for r in rs if r.bug is not None]
        passed = sum(r.outcome == "passed" for r in faithful)
        caught = sum(r.outcome == "caught" for r in slips)
        named = sum(r.named for r in slips)
        return (
            f"| {kernel} | {dtype} | {passed} of {len(faithful)} | {caught} of {len(slips)} "
            f"| {named} | {shift} |"
        )

    for (kernel, dtype), rs in groups.items():
        shifts = [r for r in rs if r.bug in gk.DQ_SHIFT_SLIPS]
        rows.append(row(kernel, dtype, rs, times(caught_from(shifts, DQ_SHIFTS))))
    total = ", ".join(f"{d}: {times(c)}" for d, c in smallest.items())
    rows.append(row("**all**", "", runs, total or "-"))
    rows += [
        "",
        "| backward slip | caught | named | without a hint | named as another | named by |",
        "|---|---|---|---|---|---|",
    ]
    for slip, n, caught, _missed, _errors, named, alone, other, by in per_slip(runs):
        rows.append(
            f"| {slip} | {caught} of {n} | {named.replace('/', ' of ')} | {alone} | {other} "
            f"| {by} |"
        )
    return "\n".join(rows)


def fudge_lines(runs: Sequence[Run]) -> list[str]:
    lines = []
    for r in runs:
        for d in fudged(r):
            lines.append(
                f"  {r.name} {d['name']}: passing_factor {d['passing_factor']}, "
                f"diagnosis {shown(d['diagnosis'])}"
            )
    return lines


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


if __name__ == "__main__":
    sys.exit(main())
