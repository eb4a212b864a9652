"""The benchmark harness (bench/): its pure parts, and its launcher on trivial commands.

No figure is measured here: `make bench` does that.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """A module of bench/, which import one another by their plain names."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def test_the_full_plan_measures_the_figures_of_the_issue() -> None:
    plan = load("bench_plan").FULL
    kernel = {(c.shape, c.dtype, c.causal): c.limit for c in plan.kernel}
    assert kernel[((1, 8, 8192, 128), "float16", False)] == 1.5
    assert kernel[((1, 8, 8192, 128), "float32", False)] == 1.25
    assert kernel[((1, 8, 16384, 64), "float16", False)] == 1.4
    assert plan.lengths == (1024, 2048, 4096, 8192, 16384)
    assert plan.scale_shape(2048) == (1, 8, 2048, 64)
    assert plan.grad_shape == (1, 8, 4096, 64)
    assert (plan.manifest_count, plan.text_max_length) == (64, 4096)


def test_only_takes_globs_and_substrings() -> None:
    wanted = load("bench_plan").matcher(["grad", "kernel/*/f32"])
    assert wanted("grad/sdpa")
    assert wanted("rss/grad/1024")
    assert wanted("kernel/1x8x8192x128/f32")
    assert not wanted("kernel/1x8x8192x128/f16")
    assert load("bench_plan").matcher(None)("anything")


def test_figures_verdicts_and_the_markdown_table() -> None:
    report = load("bench_report")
    met = report.figure("a", 1.2, 1.5, "×", ".2f")
    missed = report.figure("b", 0.4, 0.3, " s", ".3f")
    unmeasured = report.figure("c", None, 1.3, "×", ".2f", "torch not measured")
    info = report.figure("d", 2.0, None, "×", ".2f")
    assert (met.measured, met.target, report.verdict(met)) == ("1.20×", "≤ 1.5×", "met")
    assert (missed.measured, missed.target, report.verdict(missed)) == (
        "0.400 s",
        "≤ 0.3 s",
        "MISSED",
    )
    assert report.verdict(unmeasured) == "n/a"
    assert report.verdict(info) == "info"
    lines = report.markdown([met, missed, unmeasured, info]).splitlines()
    assert lines[0] == "| figure | measured | target | verdict |"
    assert lines[3] == "| b | 0.400 s | ≤ 0.3 s | **missed** |"
    assert lines[4] == "| c | - | ≤ 1.3× | n/a: torch not measured |"
    assert lines[5] == "| d | 2.00× | - | info |"
    assert report.summary([met, missed, unmeasured, info]) == (
        "targets met: 1 of 3 (1 missed, 1 not measured)"
    )


def test_tables_align_the_first_column_left_and_the_rest_right() -> None:
    table = load("bench_report").render_table(["case", "s"], [["long name", "1.5"], ["x", "10.25"]])
    assert table.splitlines() == [
        "  case           s",
        "  ---------  -----",
        "  long name    1.5",
        "  x          10.25",
    ]


def test_a_series_takes_the_median_of_its_good_runs_and_stops_at_an_error() -> None:
    procs = load("bench_procs")
    calls: list[str] = []

    def runner(name: str, outcomes: list[Any]) -> Any:
        def run() -> Any:
            calls.append(name)
            return outcomes.pop(0)

        return run

    a, b = procs.Series("a"), procs.Series("b")
    a_runs = [procs.Outcome(s, 10.0, passed=True) for s in (3.0, 1.0, 2.0)]
    b_runs = [procs.Outcome(1.0, 50.0), procs.Outcome(None, 99.0, error="exit 3")]
    procs.alternate([(a, runner("a", a_runs)), (b, runner("b", b_runs))], 3)
    assert calls == ["a", "b", "b", "a", "a"]  # every other round reversed; b stopped
    assert (a.median_s, a.peak_mib, a.passed) == (2.0, 10.0, True)
    assert b.median_s is None  # an error: no figure from it
    assert b.peak_mib == 99.0  # but its memory counts
    assert b.error == "exit 3"


def test_naive_attention_is_softmax_of_the_scaled_scores_times_v() -> None:
    data = load("bench_data")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(4)
    for causal in (False, True):
        s = np.where(np.triu(np.ones((6, 6), bool), 1), -np.inf, scores) if causal else scores
        w = np.exp(s - s.max(-1, keepdims=True))
        expected = (w / w.sum(-1, keepdims=True)) @ v
        whole = data.naive_attention(q, k, v, causal=causal, dtype="float64")
        rows = data.naive_attention(q, k, v, causal=causal, dtype="float64", row_block=4)
        np.testing.assert_allclose(whole, expected, rtol=1e-12)
        np.testing.assert_allclose(rows, expected, rtol=1e-12)


def test_memory_cells_and_their_figure() -> None:
    memory, procs = load("bench_memory"), load("bench_procs")

    def cell(peak: float, limit: float = 300.0, **kw: Any) -> Any:
        return memory.Cell(procs.Series("k", rss_mib=[peak], **kw), limit)

    cells = {1024: cell(200.0), 2048: cell(350.0), 4096: memory.Cell(why_not="·")}
    assert [c.text() for c in cells.values()] == ["200/300", "350/300*", "·"]
    f = memory._figure(memory.MODES[0], cells, [1024, 2048, 4096])
    assert (f.measured, f.met) == ("worst 350 of 300 MiB (L=2048)", False)
    assert f.name == "peak RSS `check`, L 1024–2048"
    capped = {1024: cell(200.0), 2048: cell(9000.0, error="killed", over_cap=True)}
    assert capped[2048].text() == "cap*"
    f = memory._figure(memory.MODES[0], capped, [1024, 2048])
    assert (f.measured, f.met) == ("over the RSS cap at L=2048", False)
    failed = {1024: cell(200.0), 2048: cell(40.0, error="exit 2: refused")}
    f = memory._figure(memory.MODES[0], failed, [1024, 2048])
    assert (f.met, f.note) == (None, "failed at L=2048")


def test_numbers_in_the_tables() -> None:
    figures = load("bench_figures")
    assert [figures.count(n) for n in (512, 8 * 1024 * 1024, 2**31)] == ["512", "8.4M", "2.1G"]
    assert [figures.nanoseconds(x) for x in (None, 3.14159, 1234.5)] == ["-", "3.14", "1234"]


def test_the_launcher_reports_exit_status_and_output() -> None:
    procs = load("bench_procs")
    proc = procs.run_process([sys.executable, "-c", "print('hi'); raise SystemExit(3)"])
    assert (proc.returncode, proc.stdout.strip(), proc.killed) == (3, "hi", None)
    assert proc.maxrss_mib > 0


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watchdog needs a pidfd")
def test_the_launcher_kills_a_command_past_its_time_limit() -> None:
    procs = load("bench_procs")
    limits = procs.Limits(timeout_s=0.3)
    proc = procs.run_process([sys.executable, "-c", "import time; time.sleep(30)"], limits=limits)
    assert proc.killed == "timeout"
    assert proc.wall_s < 10
    assert procs.process_failure(proc, limits, (0,)).startswith("killed after")


# ---------------------------------------------------------------------------- bench_gate


def gate_run(bug: str | None, exit_code: int, **kw: Any) -> Any:
    """A bench_gate.Run of `bug` that exited `exit_code`, as its report left it."""
    gate, gk = load("bench_gate"), load("gate_kernels")
    run = gate.Run("k/d/c/x", "k", "d", "c", bug, [], expected=gk.expected_exit(bug), **kw)
    run.exit_code = exit_code
    return run


def structural(slices: list[list[int]], rows: list[list[int]]) -> dict[str, Any]:
    return {"error": "structural", "slices": slices, "rows": rows, "where": "..."}


def test_gate_a_refused_export_is_caught_only_by_exit_2() -> None:
    gk = load("gate_kernels")
    refused = gate_run(gk.OUTPUT_BSHD, 2, hints=["sdpa: error: ... pass --layout bshd"])
    assert (refused.outcome, refused.named) == ("caught", True)
    assert gate_run(gk.OUTPUT_BSHD, 1).outcome == "error"
    assert gate_run(gk.OUTPUT_BSHD, 0).outcome == "missed"
    assert gate_run(gk.SCALE_DK, 2).outcome == "error"
    assert gate_run(None, 1).outcome == "failed"
    assert gate_run(None, 3).outcome == "error"


def test_gate_a_bug_is_named_by_its_hint_or_by_where_the_diagnosis_puts_it() -> None:
    gk = load("gate_kernels")
    hinted = gate_run(gk.SCALE_DK, 1, hints=["output.close: ... with --scale dk (scale 1/E)"])
    assert hinted.named
    assert not gate_run(gk.SCALE_DK, 1, hints=["output.close: --scale none"]).named
    assert not gate_run(gk.SCALE_DK, 0, hints=["output.close: --scale dk"]).named  # missed

    def shift(slices: list[list[int]]) -> Any:
        diagnoses = [{"name": "output.close", "diagnosis": structural(slices, [[0, 127]])}]
        return gate_run(gk.shift_bug(4), 1, place=(gk.SHIFTED, None), diagnoses=diagnoses)

    assert shift([list(gk.SHIFTED)]).named
    assert not shift([[0, 0], list(gk.SHIFTED)]).named  # every slice blamed: not placed

    def roll(rows: list[list[int]]) -> Any:
        diagnoses = [{"name": "output.close", "diagnosis": structural([[0, 0]], rows)}]
        return gate_run(gk.ROW_ROLL, 1, place=(gk.ROLLED_HEAD, 64), diagnoses=diagnoses)

    assert roll([[64, 64]]).named
    assert not roll([[10, 12]]).named


def test_gate_a_structural_error_offered_a_fudge_is_counted() -> None:
    gate = load("bench_gate")
    check = {"name": "output.close", "summary": "...", "hint": None}
    rounding = {**check, "diagnosis": {"error": "rounding"}, "passing_factor": 3.0}
    honest = {**check, "diagnosis": structural([[0, 1]], []), "passing_factor": None}
    fudged = {**check, "diagnosis": structural([[0, 1]], []), "passing_factor": 40.0}
    told = {**honest, "hint": "would pass with --fudge 40"}
    run = gate_run("head-shift-8", 1, diagnoses=[rounding, honest, fudged, told])
    assert gate.fudged(run) == [fudged, told]
    # As the JSON has it: the diagnosis beside the mismatch, or both under details.
    nested = {"name": "lse.close", "details": {"diagnosis": {"error": "structural"}}}
    assert gate.diagnosed(nested)["diagnosis"] == {"error": "structural"}
    assert gate.diagnosed(nested)["passing_factor"] is None


def test_gate_noise_reads_warnings_without_a_reason_and_inspect_counts() -> None:
    gate = load("bench_gate")
    table = "\n".join(
        [
            " case        result   checks   first failure",
            " ─────────────────────────────────────────────",
            " layers.0    WARN        8/8",
            " layers.1    WARN        8/8   output.close: 3 of 9 beyond",
            " layers.2    PASS        8/8",
        ]
    )
    assert gate.unexplained_warnings(table) == ["layers.0: WARN without a reason"]
    tensor = {
        "name": "x",
        "dtype": "float16",
        "nan": 0,
        "posinf": 1,
        "neginf": 0,
        "headroom": {
            "float16": {"overflow": 0, "flush": 0, "subnormal": 2, "subnormal_notable": True},
            "bfloat16": {"overflow": 0, "flush": 0, "subnormal": 3, "subnormal_notable": False},
        },
    }
    assert gate.inspected({"files": [{"tensors": [tensor]}]}) == [
        "x: 1 posinf",
        "x: 2 subnormal in float16 (its own format)",  # not bfloat16's 3: no notable share
    ]
    quiet = gate.Noise("noise/inspect/x", "inspect", [], exit_code=0)
    loud = gate.Noise("noise/inspect/y", "inspect", [], exit_code=0, raised=["y: 1 posinf"])
    assert (quiet.quiet, loud.quiet) == (True, False)
    assert gate.noise_rows([quiet, loud]) == [
        [gate.NOISE_SOURCES["inspect"], "2", "1", "1", "y: 1 posinf"]
    ]


def test_gate_the_markdown_tables_count_verdicts_bugs_and_noise() -> None:
    gate, gk = load("bench_gate"), load("gate_kernels")
    runs = [
        gate_run(None, 0),
        gate_run(gk.SCALE_DK, 1, hints=["output.close: --scale dk"]),
        gate_run(gk.SCALE_DK, 0),
    ]
    noise = [gate.Noise("noise/check/a", "check", [], exit_code=0)]
    lines = gate.markdown(runs, {}, noise).splitlines()
    assert lines[2] == "| k | d | 1 of 1 | 1 of 2 | - |"
    assert '| scale-dk | 1 of 2 | 1 of 1 | hint: "--scale dk" |' in lines
    assert lines[-1] == f"| {gate.NOISE_SOURCES['check']} | 1 of 1 | 0 |"


def backward_run(slip: str | None, exit_code: int, **kw: Any) -> Any:
    """A bench_gate.Run of a backward export with `slip`, as its report left it."""
    gate, gk = load("bench_gate"), load("gate_kernels")
    name = f"backward/k/d/c/{slip or 'faithful'}"
    run = gate.Run(name, "k", "d", "c", slip, [], expected=gk.expected_exit(slip), **kw)
    run.exit_code = exit_code
    return run


def test_gate_a_backward_slip_is_named_by_its_words_its_fit_or_its_place() -> None:
    gk = load("gate_kernels")
    hinted = backward_run(gk.D_FORGOTTEN, 1, hints=["dq.close: ... D = rowsum(dO ⊙ O) ..."])
    assert hinted.backward
    assert (hinted.named, hinted.named_without_hint) == (True, False)
    assert not backward_run(gk.D_FORGOTTEN, 1, hints=["dq.close: dQ misses the scale"]).named
    assert not backward_run(gk.D_FORGOTTEN, 0, hints=["dq.close: rowsum(dO"]).named  # missed

    sums = {"name": "dv.sums", "summary": "... was dV computed from unnormalised weights?"}
    summed = backward_run(gk.DV_UNNORMALISED, 1, said=[sums])
    assert (summed.named, summed.named_without_hint) == (True, True)
    assert summed.saying("unnormalised") == ["dv.sums's summary"]

    def fitted(factor: float, error: str = "structural") -> Any:
        diagnosis = {"error": error, "fit": {"factor": factor}}
        diagnoses = [{"name": "dk.close", "diagnosis": diagnosis}]
        return backward_run(gk.DK_NO_SCALE, 1, fit=8.0, diagnoses=diagnoses)

    assert fitted(7.99).named_without_hint
    assert not fitted(2.0).named
    assert not fitted(7.99, "rounding").named

    diagnoses = [{"name": "dq.close", "diagnosis": structural([list(gk.SHIFTED)], [[0, 127]])}]
    shift = backward_run(gk.dq_shift(2), 1, place=(gk.SHIFTED, None), diagnoses=diagnoses)
    assert (shift.named, shift.named_without_hint) == (True, True)


def test_gate_a_backward_slip_that_says_another_slips_words_is_counted() -> None:
    gate, gk = load("bench_gate"), load("gate_kernels")
    sums = {"name": "dv.sums", "summary": "... was dV computed from unnormalised weights?"}
    hint = "dq.close: the mask is applied in the forward pass but not in the backward"
    both = backward_run(gk.MASK_FORGOTTEN, 1, said=[sums], hints=[hint])
    alone = backward_run(gk.MASK_FORGOTTEN, 1, hints=[hint])
    assert both.misnamed == [gk.DV_UNNORMALISED]
    assert alone.misnamed == []
    row = gate.per_slip([both, alone])[0]
    assert row[:9] == [
        gk.MASK_FORGOTTEN,
        "2",
        "2",
        "0",
        "0",
        "2/2",
        "0",
        "1 (dv-unnormalised)",
        row[8],
    ]
    lines = gate.misnamed_lines([both, alone])
    assert lines[0].startswith(f"  {gk.MASK_FORGOTTEN}: 1 of 2 caught say dv-unnormalised's")
    assert "in dv.sums's summary" in lines[0]


def test_gate_the_backward_tables_count_verdicts_slips_and_dq_shifts() -> None:
    gate, gk = load("bench_gate"), load("gate_kernels")
    placed: dict[str, Any] = {"name": "dq.close", "summary": "", "hint": None}
    placed |= {"passing_factor": None, "diagnosis": structural([list(gk.SHIFTED)], [])}
    runs = [
        backward_run(None, 0),
        backward_run(gk.dq_shift(2), 0),
        backward_run(gk.dq_shift(4), 1, diagnoses=[placed], place=(gk.SHIFTED, None)),
        backward_run(gk.dq_shift(8), 1),
    ]
    table, smallest = gate.shift_table(runs, gate.DQ_SHIFTS)
    assert smallest == {"d": 4}
    assert all(f"c = {c}" in table for c in gk.DQ_SHIFTS)  # a column for every shift tried
    assert gate.counted(runs[1], 2)
    assert not gate.counted(runs[1], 4)
    lines = gate.markdown_backward(runs, smallest).splitlines()
    assert lines[2] == "| k | d | 1 of 1 | 2 of 3 | 1 | 4× |"
    assert lines[3] == "| **all** |  | 1 of 1 | 2 of 3 | 1 | d: 4× |"
    assert (
        "| dq-head-shift-4 | 1 of 1 | 1 of 1 | 1 | 0 | diagnosis: structural, its slice alone |"
        in lines
    )
    counts = gate.tally(runs, (), 2)
    assert (counts["false_pass"], counts["caught"], counts["named"]) == (1, 2, 1)


@pytest.mark.e2e
def test_the_pages_benchmark_runs_end_to_end_on_a_toy_capture() -> None:
    """bench/bench_pages.py on 2 layers × 2 heads of 64 tokens: every figure printed
    (no target is judged at this size: a process's fixed cost dominates it)."""
    import subprocess

    toy = ["--layers", "2", "--heads", "2", "--length", "64", "--dim", "8", "--repeat", "1"]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_pages.py"), *toy],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stderr
    for figure in ("report model (JSON)", "check --manifest (JSON)", "cost of its page"):
        assert figure in proc.stdout, proc.stdout
    assert "page size" in proc.stdout
