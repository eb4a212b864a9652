"""Peak RSS of every command at every length, against the input files + 256 MiB.

One run per command and length (the `check` cells reuse the runs of the per-score
figure when those ran). Output goes to /dev/null. `compute --format json|yaml` print
every stage whole, gigabytes of text at the largest lengths: they run only up to the
plan's text length. A command killed past the benchmark's RSS cap at one length is
over its limit there, and is not run at the longer lengths.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_data import size_mib
from bench_figures import check_command, series_problems
from bench_plan import Context, Plan, Section
from bench_procs import Series, sdpa_runner
from bench_report import Figure, render_table, verdict

HEADROOM_MIB = 256.0
MIB = 1024.0 * 1024.0


@dataclass(frozen=True)
class Mode:
    label: str
    key: str  # --only rss/KEY/L
    text: bool = False  # prints whole stages as text: only up to the text length


MODES = (
    Mode("check", "check"),
    Mode("compute (table)", "compute"),
    Mode("compute json", "compute-json", text=True),
    Mode("compute yaml", "compute-yaml", text=True),
    Mode("compute --save", "compute-save"),
    Mode("explain --query 0", "explain"),
    Mode("grad --dout", "grad"),
    Mode("check --dout --expect-dq/dk/dv", "check-dout"),
)


@dataclass
class Cell:
    series: Series | None = None  # None: not run
    limit_mib: float = 0.0
    why_not: str = ""  # the cell's text when not run

    @property
    def over(self) -> bool | None:
        """Over the limit; None where not known."""
        if self.series is None:
            return None
        if self.series.over_cap:
            return True
        peak = self.series.peak_mib
        if peak is not None and peak > self.limit_mib:
            return True
        return None if self.series.error or peak is None else False

    def text(self) -> str:
        s = self.series
        if s is None:
            return self.why_not
        if s.over_cap:
            return "cap*"
        if s.error and "time limit" in s.error:
            return "t/o*" if self.over else "t/o"
        if s.error:
            return "err"
        return f"{s.peak_mib or 0:.0f}/{self.limit_mib:.0f}" + ("*" if self.over else "")


def _command(ctx: Context, mode: Mode, inputs: list[Path], extra: dict[str, Path]) -> list[str]:
    files = list(map(str, inputs))
    if mode.key == "check":
        return check_command(ctx, inputs, extra["out"], False, extra["report"])
    if mode.key == "explain":
        return [ctx.sdpa, "explain", *files, "--query", "0", "--no-color"]
    if mode.key == "grad":
        return [ctx.sdpa, "grad", *files, "--dout", str(extra["dout"]), "--no-color"]
    if mode.key == "check-dout":
        cmd = [ctx.sdpa, "check", *files, "--dout", str(extra["dout"]), "--no-color"]
        for name in ("dq", "dk", "dv"):
            cmd += [f"--expect-{name}", str(extra[name])]
        return cmd
    cmd = [ctx.sdpa, "compute", *files, "--no-color"]
    if mode.key == "compute-json":
        cmd += ["--format", "json"]
    elif mode.key == "compute-yaml":
        cmd += ["--format", "yaml"]
    elif mode.key == "compute-save":
        cmd += ["--save", str(extra["save"])]
    return cmd


def _save_too_big(ctx: Context, scores: int) -> str:
    """Why --save is not run: its file (every stage whole, float64 at most) would take
    more than half the free disk; else ""."""
    need = scores * (4 * 8 + 1)
    free = shutil.disk_usage(ctx.scratch).free
    if need <= free / 2:
        return ""
    return f"needs ~{need / 2**30:.0f} GiB of disk, {free / 2**30:.0f} GiB free"


def _run_cell(ctx: Context, mode: Mode, length: int, plan: Plan, cell: Cell) -> None:
    shape = plan.scale_shape(length)
    inputs = ctx.datasets.inputs(shape, "float16")
    extra = {"report": ctx.scratch / "rss-report.json", "save": ctx.scratch / "save.npz"}
    files = list(inputs)
    if mode.key == "check":
        extra["out"] = ctx.datasets.export(shape, "float16", False)
        files.append(extra["out"])
    if mode.key in ("grad", "check-dout"):
        extra["dout"] = ctx.datasets.dout(shape, "float16")
        files.append(extra["dout"])
    if mode.key == "check-dout":  # a backward kernel's export of the same gradients
        grads = ctx.datasets.gradients(shape, "float16")
        for name, path in zip(("dq", "dk", "dv"), grads, strict=True):
            extra[name] = path
            files.append(path)
    cell.limit_mib = size_mib(files) + HEADROOM_MIB
    key = f"rss/{mode.key}/{length}"
    if mode.key == "check":
        scaled = [s for s in ctx.series if s.key == f"scale/{length}" and s.rss_mib]
        if scaled:
            cell.series = scaled[0]
            return
    if mode.key == "compute-save":
        cell.why_not = _save_too_big(ctx, shape[0] * shape[1] * length * length)
        if cell.why_not:
            ctx.series.append(Series(key, skipped=cell.why_not))
            cell.why_not = "disk"
            return
    cmd = _command(ctx, mode, inputs, extra)
    series = ctx.new_series(key, cmd)
    ctx.progress(f"  {key}")
    report = extra["report"] if mode.key == "check" else None
    series.add(sdpa_runner(cmd, ctx.limits, report, (0, 1) if report else (0,))())
    extra["save"].unlink(missing_ok=True)
    cell.series = series


def _figure(mode: Mode, cells: dict[int, Cell], lengths: Sequence[int]) -> Figure:
    name = f"peak RSS `{mode.label}`"
    ran = {n: c for n, c in cells.items() if c.series is not None}
    if ran:
        name += f", L {min(ran)}–{max(ran)}" if len(ran) > 1 else f", L {min(ran)}"
    target = f"≤ inputs + {HEADROOM_MIB:.0f} MiB"
    capped = [n for n, c in ran.items() if c.series is not None and c.series.over_cap]
    if capped:
        return Figure(name, f"over the RSS cap at L={capped[0]}", target, limit=1.0, met=False)
    measured = {
        n: (c.series.peak_mib, c.limit_mib)
        for n, c in ran.items()
        if c.series is not None and c.series.peak_mib is not None and not c.series.error
    }
    errors = [n for n, c in ran.items() if c.series is not None and c.series.error]
    if not measured:
        note = f"failed at L={errors[0]}" if errors else "not run"
        return Figure(name, "-", target, limit=1.0, note=note)
    worst = max(measured, key=lambda n: measured[n][0] / measured[n][1])
    peak, limit = measured[worst]
    over = any(c.over for c in ran.values())
    met = True if not errors and not over else False if over else None
    text = f"worst {peak:.0f} of {limit:.0f} MiB (L={worst})"
    note = f"failed at L={', '.join(map(str, errors))}" if errors else ""
    return Figure(name, text, target, peak / limit, 1.0, met, note)


def memory_section(ctx: Context, plan: Plan) -> Section | None:
    lengths = plan.lengths
    wanted = {(m.key, n) for m in MODES for n in lengths if ctx.wanted(f"rss/{m.key}/{n}")}
    if not wanted:
        return None
    ctx.progress("peak RSS: every command at every length, one run each")
    grid: dict[str, dict[int, Cell]] = {m.key: {n: Cell() for n in lengths} for m in MODES}
    for n in lengths:
        for mode in MODES:
            cell = grid[mode.key][n]
            earlier = [grid[mode.key][m] for m in lengths if m < n]
            if (mode.key, n) not in wanted:
                cell.why_not = ""
            elif mode.text and n > plan.text_max_length:
                cell.why_not = "·"
            elif any(c.series is not None and c.series.over_cap for c in earlier):
                cell.why_not = "cap*"  # over the cap at a shorter length: over here too
            elif any(c.text().startswith("t/o") for c in earlier):
                cell.why_not = "t/o"
            else:
                _run_cell(ctx, mode, n, plan, cell)
    figures: list[Figure] = []
    rows: list[list[str]] = []
    problems: list[str] = []
    for mode in MODES:
        cells = grid[mode.key]
        if not any((mode.key, n) in wanted for n in lengths):
            continue
        f = _figure(mode, cells, lengths)
        figures.append(f)
        rows.append([mode.label, *(cells[n].text() for n in lengths), verdict(f)])
        problems += series_problems([c.series for c in cells.values() if c.series is not None])
    headers = ["command", *(f"L={n}" for n in lengths), "verdict"]
    b, h = plan.scale_lead
    text = "\n".join(
        [
            f"  MiB, peak/limit; inputs ({b}, {h}, L, {plan.scale_embed}) float16 .npy files;",
            "  limit = their size (q, k, v; check: + out; grad: + dO; check --dout: + dO, dQ,",
            f"  dK, dV) + {HEADROOM_MIB:.0f} MiB",
            "  *: over the limit; cap: killed past the benchmark's RSS cap (--rss-cap);",
            f"  ·: not run, json/yaml only at L ≤ {plan.text_max_length} (gigabytes of text);",
            "  t/o: past --timeout; disk: --save would fill the disk; err: see below",
            render_table(headers, rows),
        ]
    )
    return Section("3. Peak RSS", text, figures, problems)
