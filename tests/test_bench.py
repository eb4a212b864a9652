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
