"""The timed figures: check vs torch's kernel, cost per score, grad, start-up, cluster.

Each section runs its processes alternated (`bench_procs.alternate`), takes medians,
and returns its table and its figures against their targets.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from bench_cluster import local_cluster, unavailable
from bench_data import REFERENCE, SHORT, shape_tag
from bench_plan import Context, Plan, Section
from bench_procs import Limits, Runner, Series, alternate, sdpa_runner, worker_runner
from bench_report import Figure, figure, fmt, ratio, render_table, verdict

HERE = Path(__file__).resolve().parent
WORKERS = str(HERE / "bench_workers.py")
SAMPLE = HERE.parent / "samples" / "scorecard.yaml"
SAMPLE_LIMIT_S = 0.3
STARTUP_FACTOR = 1.3
GRAD_FACTOR = 1.3
FLAT_LIMIT = 1.3
CLUSTER_FACTOR = 1.2
FLOOR_LENGTH = 16  # the start-up floor of the per-score cost: check on (B, H, 16, E)


def check_command(
    ctx: Context, inputs: Sequence[Path], out: Path, causal: bool, report: Path
) -> list[str]:
    """`sdpa check` as a user runs it in CI: findings included, a JSON report."""
    cmd = [ctx.sdpa, "check", *map(str, inputs), "--expect-output", str(out)]
    cmd += ["--causal"] if causal else []
    cmd += ["--no-color", "--format", "json", "--report", str(report)]
    return cmd + (["--jobs", str(ctx.jobs)] if ctx.jobs is not None else [])


def torch_limits(ctx: Context) -> Limits:
    return Limits(timeout_s=ctx.limits.timeout_s)  # torch's own memory is not the point


def passed_cell(s: Series) -> str:
    return "ERROR" if s.error else "-" if s.passed is None else "pass" if s.passed else "FAIL"


def series_problems(series: Sequence[Series]) -> list[str]:
    problems = [f"ERROR {s.key}: {s.error}" for s in series if s.error]
    problems += [f"FAIL {s.key}: the check did not pass" for s in series if s.passed is False]
    return problems


def note_of(*series: Series) -> str:
    """Why a figure from these series is not measured: the first error or skip."""
    for s in series:
        if s.skipped:
            return s.skipped
        if s.error:
            return f"{s.key.rsplit('/', 1)[-1]} failed"
    return ""


def count(n: int) -> str:
    """8388608 → 8.4M."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def nanoseconds(x: float | None) -> str:
    return fmt(x, ".0f" if x is not None and x >= 100 else ".2f")


# --------------------------------------------------------------------------- 1


def kernel_section(ctx: Context, plan: Plan) -> Section | None:
    cases = [c for c in plan.kernel if ctx.wanted(c.key)]
    if not cases:
        return None
    rows: list[list[str]] = []
    figures: list[Figure] = []
    problems: list[str] = []
    for case in cases:
        inputs = ctx.datasets.inputs(case.shape, case.dtype)
        out = ctx.datasets.export(case.shape, case.dtype, case.causal)
        ref = REFERENCE[case.dtype]
        cmd = check_command(ctx, inputs, out, case.causal, ctx.scratch / "report.json")
        sdpa = ctx.new_series(f"{case.key}/sdpa", cmd)
        runs: list[tuple[Series, Runner]] = [
            (sdpa, sdpa_runner(cmd, ctx.limits, ctx.scratch / "report.json", (0, 1)))
        ]
        wcmd = [sys.executable, WORKERS, "kernel", *map(str, inputs), "--reference", ref]
        wcmd += ["--causal"] if case.causal else []
        torch = ctx.new_series(f"{case.key}/torch", wcmd)
        # the same check with --backend torch: its lean pass on torch's CPU threads
        tcmd = [*check_command(ctx, inputs, out, case.causal, ctx.scratch / "t.json")]
        tcmd += ["--backend", "torch"]
        on_torch = ctx.new_series(f"{case.key}/sdpa-backend-torch", tcmd)
        if ctx.have_torch:
            runs.append((torch, worker_runner(wcmd, torch_limits(ctx))))
            runs.append(
                (on_torch, sdpa_runner(tcmd, torch_limits(ctx), ctx.scratch / "t.json", (0, 1)))
            )
        else:
            torch.skipped = on_torch.skipped = "torch not measured"
        ctx.progress(f"{case.key}: sdpa check (numpy; torch backend) vs torch {ref} kernel")
        alternate(runs, ctx.repeat, ctx.progress)
        r = ratio(sdpa.median_s, torch.median_s)
        tag = f"{shape_tag(case.shape)} {SHORT[case.dtype]}" + (" causal" if case.causal else "")
        f = figure(
            f"`check` {tag} ÷ torch {SHORT[ref]} kernel",
            r,
            case.limit,
            "×",
            ".2f",
            note_of(sdpa, torch) if r is None else "",
        )
        if sdpa.passed is False:
            f.measured += " (check FAILED)"
        figures.append(f)
        limit = "-" if case.limit is None else f"{case.limit:g}"
        rows.append(
            [
                tag,
                SHORT[ref],
                fmt(sdpa.median_s, ".3f"),
                fmt(torch.median_s, ".3f"),
                fmt(r, ".2f"),
                limit,
                verdict(f),
                passed_cell(sdpa),
            ]
        )
        problems += series_problems([sdpa, torch])
        rt = ratio(on_torch.median_s, torch.median_s)
        figures.append(
            figure(
                f"`check --backend torch` {tag} ÷ torch {SHORT[ref]} kernel",
                rt,
                None,
                "×",
                ".2f",
                note_of(on_torch, torch) if rt is None else "",
            )
        )
        rows.append(
            [
                f"{tag}, --backend torch",
                SHORT[ref],
                fmt(on_torch.median_s, ".3f"),
                fmt(torch.median_s, ".3f"),
                fmt(rt, ".2f"),
                "-",
                "info",
                passed_cell(on_torch),
            ]
        )
        problems += series_problems([on_torch])
    headers = ["case", "ref", "sdpa s", "torch s", "ratio", "target", "verdict", "check"]
    text = "\n".join(
        [
            "  `sdpa check` as a whole process (load, reference, findings, JSON report)",
            "  ÷ torch's SDPA kernel alone (one call after a warm-up, fresh process)",
            render_table(headers, rows),
        ]
    )
    return Section("1. sdpa check vs torch's kernel", text, figures, problems)


# --------------------------------------------------------------------------- 2


def scale_section(ctx: Context, plan: Plan) -> Section | None:
    lengths = [n for n in plan.lengths if ctx.wanted(f"scale/{n}")]
    if not lengths:
        return None
    dtype = "float16"
    runs: list[tuple[Series, Runner]] = []
    by_length: dict[int, Series] = {}
    for n in [FLOOR_LENGTH, *lengths]:
        shape = plan.scale_shape(n)
        inputs = ctx.datasets.inputs(shape, dtype)
        out = ctx.datasets.export(shape, dtype, False)
        report = ctx.scratch / f"report-{n}.json"
        cmd = check_command(ctx, inputs, out, False, report)
        key = "scale/floor" if n == FLOOR_LENGTH else f"scale/{n}"
        series = ctx.new_series(key, cmd)
        by_length[n] = series
        runs.append((series, sdpa_runner(cmd, ctx.limits, report, (0, 1))))
    ctx.progress("cost per score: sdpa check at each length")
    alternate(runs, ctx.repeat, ctx.progress)
    floor = by_length.pop(FLOOR_LENGTH)
    b, h = plan.scale_lead
    rows: list[list[str]] = []
    net: dict[int, float] = {}
    for n, s in by_length.items():
        scores = b * h * n * n
        wall = s.median_s
        gross = None if wall is None else wall / scores * 1e9
        cost = None if wall is None or floor.median_s is None else (wall - floor.median_s)
        if cost is not None and cost > 0:
            net[n] = cost / scores * 1e9
        rows.append(
            [
                str(n),
                count(scores),
                fmt(wall, ".3f"),
                nanoseconds(gross),
                nanoseconds(net.get(n)),
                fmt(s.peak_mib, ".0f"),
                passed_cell(s),
            ]
        )
    short = [str(n) for n in by_length if n not in net]  # no figure, or wall ≤ floor
    flat = max(net.values()) / min(net.values()) if len(net) >= 2 and not short else None
    why = note_of(floor, *by_length.values())
    if flat is None and not why:
        why = f"wall ≤ floor at L={', '.join(short)}" if short else "needs two lengths"
    span = f" ({min(net.values()):.2f}–{max(net.values()):.2f} ns)" if flat is not None else ""
    label = f"({b}, {h}, L, {plan.scale_embed})"
    f = figure(
        f"cost per score flat, `check` {label} f16, L {lengths[0]}–{lengths[-1]}",
        flat,
        FLAT_LIMIT,
        "",
        ".2f",
        "" if flat is not None else why,
    )
    if flat is not None:
        f.measured += span
    headers = ["L", "scores", "wall s", "ns/score", "net ns/score", "peak MiB", "check"]
    text = "\n".join(
        [
            f"  `sdpa check` on {label} float16 exports, non-causal; scores = B·H·L·L",
            "  ns/score = median wall / scores; net = (median wall − floor) / scores,",
            f"  floor = median wall of the same check on ({b}, {h}, {FLOOR_LENGTH}, "
            f"{plan.scale_embed}): {fmt(floor.median_s, '.3f')} s",
            "  flat = largest net ns/score ÷ smallest; target ≤ 1.3",
            render_table(headers, rows),
            f"  flat: {f.measured}, target {f.target}: {verdict(f)}",
        ]
    )
    problems = series_problems([floor, *by_length.values()])
    return Section("2. Cost per score", text, [f], problems)


# --------------------------------------------------------------------------- 4


def grad_section(ctx: Context, plan: Plan) -> Section | None:
    if not ctx.wanted("grad"):
        return None
    shape, dtype = plan.grad_shape, "float16"
    inputs = ctx.datasets.inputs(shape, dtype)
    dout = ctx.datasets.dout(shape, dtype)
    cmd = [ctx.sdpa, "grad", *map(str, inputs), "--dout", str(dout), "--no-color"]
    cmd += ["--jobs", str(ctx.jobs)] if ctx.jobs is not None else []
    sdpa = ctx.new_series("grad/sdpa", cmd)
    runs: list[tuple[Series, Runner]] = [(sdpa, sdpa_runner(cmd, ctx.limits))]
    wcmd = [sys.executable, WORKERS, "grad", *map(str, inputs), str(dout)]
    torch = ctx.new_series("grad/torch", wcmd)
    if ctx.have_torch:
        runs.append((torch, worker_runner(wcmd, torch_limits(ctx))))
    else:
        torch.skipped = "torch not measured"
    # Beside it, sdpa check judging a backward kernel's export of the same gradients.
    dq, dk, dv = ctx.datasets.gradients(shape, dtype)
    ccmd = [ctx.sdpa, "check", *map(str, inputs), "--dout", str(dout), "--no-color"]
    ccmd += ["--expect-dq", str(dq), "--expect-dk", str(dk), "--expect-dv", str(dv)]
    ccmd += ["--jobs", str(ctx.jobs)] if ctx.jobs is not None else []
    check = ctx.new_series("grad/check", ccmd)
    runs.append((check, sdpa_runner(ccmd, ctx.limits)))
    ctx.progress("grad: sdpa grad vs torch float64 forward + backward, and sdpa check --dout")
    alternate(runs, ctx.repeat, ctx.progress)
    r = ratio(sdpa.median_s, torch.median_s)
    tag = shape_tag(shape)
    f = figure(
        f"`grad` {tag} f16 ÷ torch f64 fwd+bwd",
        r,
        GRAD_FACTOR,
        "×",
        ".2f",
        note_of(sdpa, torch) if r is None else "",
    )
    rows = [
        [
            tag,
            fmt(sdpa.median_s, ".3f"),
            fmt(torch.median_s, ".3f"),
            fmt(r, ".2f"),
            f"{GRAD_FACTOR:g}",
            verdict(f),
            fmt(sdpa.peak_mib, ".0f"),
        ]
    ]
    headers = ["inputs f16", "sdpa s", "torch s", "ratio", "target", "verdict", "sdpa MiB"]
    beside = [[tag, fmt(check.median_s, ".3f"), fmt(check.peak_mib, ".0f")]]
    text = "\n".join(
        [
            "  `sdpa grad Q K V --dout dO` as a whole process (tables to /dev/null)",
            "  ÷ torch's float64 forward + backward (after a warm-up, fresh process)",
            render_table(headers, rows),
            "",
            "  beside it, `sdpa check Q K V --dout dO --expect-dq --expect-dk --expect-dv`",
            "  judging the same gradients exported in float16 (no target yet)",
            render_table(["inputs f16", "check s", "check MiB"], beside),
        ]
    )
    problems = series_problems([sdpa, torch, check])
    return Section("4. sdpa grad vs torch autograd", text, [f], problems)


# --------------------------------------------------------------------------- 5


def startup_section(ctx: Context, plan: Plan) -> Section | None:
    want_help, want_sample = ctx.wanted("startup/help"), ctx.wanted("startup/sample")
    if not (want_help or want_sample):
        return None
    runs: list[tuple[Series, Runner]] = []
    figures: list[Figure] = []
    rows: list[list[str]] = []
    quiet = Limits(timeout_s=ctx.limits.timeout_s)
    help_cmd = [ctx.sdpa, "--help"]
    click_cmd = [sys.executable, "-c", "import click"]
    sample_cmd = [ctx.sdpa, "compute", str(SAMPLE), "--no-color"]
    helps = ctx.new_series("startup/help/sdpa", help_cmd)
    click = ctx.new_series("startup/help/click", click_cmd)
    sample = ctx.new_series("startup/sample", sample_cmd)
    # what any torch route pays first in a fresh process: the floor under
    # `check --backend torch` (docs/performance.md, "Why the CPU figures stay out of reach")
    torch_cmd = [sys.executable, "-c", "import torch"]
    imports = ctx.new_series("startup/help/import-torch", torch_cmd)
    if want_help:
        runs += [(helps, sdpa_runner(help_cmd, quiet)), (click, sdpa_runner(click_cmd, quiet))]
        if ctx.have_torch:
            runs.append((imports, sdpa_runner(torch_cmd, quiet)))
        else:
            imports.skipped = "torch not measured"
    if want_sample:
        runs.append((sample, sdpa_runner(sample_cmd, quiet)))
    ctx.progress("start-up: sdpa --help, import click, a sample")
    alternate(runs, plan.startup_repeat, ctx.progress)
    if want_help:
        r = ratio(helps.median_s, click.median_s)
        f = figure("`sdpa --help` ÷ `python -c 'import click'`", r, STARTUP_FACTOR, "×", ".2f")
        f.note = note_of(helps, click) if r is None else ""
        figures.append(f)
        rows.append(
            [
                "sdpa --help",
                fmt(helps.median_s, ".3f"),
                fmt(click.median_s, ".3f"),
                fmt(r, ".2f") + "×",
                f.target,
                verdict(f),
            ]
        )
        t = imports.median_s
        f = figure(
            "`python -c 'import torch'` (the floor of any torch route)", t, None, " s", ".3f"
        )
        f.note = note_of(imports) if t is None else ""
        figures.append(f)
        rows.append(["import torch", fmt(t, ".3f"), "-", "-", "-", verdict(f)])
    if want_sample:
        s = sample.median_s
        f = figure("`sdpa compute samples/scorecard.yaml`", s, SAMPLE_LIMIT_S, " s", ".3f")
        f.note = note_of(sample) if s is None else ""
        figures.append(f)
        rows.append(["compute scorecard.yaml", fmt(s, ".3f"), "-", "-", f.target, verdict(f)])
    headers = ["command", "wall s", "click s", "ratio", "target", "verdict"]
    text = "\n".join(
        [
            f"  medians of {plan.startup_repeat} alternated runs, output to /dev/null",
            render_table(headers, rows),
        ]
    )
    problems = series_problems([helps, click, sample, imports])
    return Section("5. Start-up", text, figures, problems)


# --------------------------------------------------------------------------- 6


def cluster_section(ctx: Context, plan: Plan) -> Section | None:
    if not ctx.wanted("cluster"):
        return None
    count, shape = plan.manifest_count, plan.manifest_shape
    name = f"manifest of {count} × {shape_tag(shape)} f16: cluster ÷ --jobs 2"
    caption = (
        f"  `sdpa check --manifest` of {count} cases {shape} float16 with exported outputs:\n"
        "  a local Dask cluster (2 worker processes × 1 thread) ÷ `--jobs 2` (2 processes)"
    )
    why = unavailable(ctx.sdpa)
    if why is not None:
        f = Figure(
            name, "-", f"≤ {CLUSTER_FACTOR:g}×", limit=CLUSTER_FACTOR, note=f"skipped: {why}"
        )
        return Section("6. Manifest on a cluster", f"{caption}\n  skipped: {why}", [f])
    manifest = ctx.datasets.manifest(count, shape, "float16")
    base = [ctx.sdpa, "check", "--manifest", str(manifest), "--no-color", "--format", "json"]
    jobs_report, cluster_report = ctx.scratch / "jobs.json", ctx.scratch / "cluster.json"
    jobs_cmd = [*base, "--jobs", "2", "--report", str(jobs_report)]
    jobs = ctx.new_series("cluster/jobs", jobs_cmd)
    cluster = ctx.new_series("cluster/dask", [])
    ctx.progress("cluster: starting a local Dask cluster of 2 workers ...")
    try:
        with local_cluster(2) as address:
            cluster_cmd = [*base, "--cluster", address, "--report", str(cluster_report)]
            cluster.command = cluster_cmd
            runs: list[tuple[Series, Runner]] = [
                (jobs, sdpa_runner(jobs_cmd, ctx.limits, jobs_report, (0, 1))),
                (cluster, sdpa_runner(cluster_cmd, ctx.limits, cluster_report, (0, 1))),
            ]
            alternate(runs, ctx.repeat, ctx.progress)
    except (RuntimeError, OSError) as exc:
        cluster.error = f"the local cluster: {exc}"
    r = ratio(cluster.median_s, jobs.median_s)
    f = figure(name, r, CLUSTER_FACTOR, "×", ".2f", note_of(cluster, jobs) if r is None else "")
    if False in (jobs.passed, cluster.passed):
        f.measured += " (a check FAILED)"
    rows = [
        ["--jobs 2", fmt(jobs.median_s, ".3f"), "", "", "", passed_cell(jobs)],
        [
            "--cluster",
            fmt(cluster.median_s, ".3f"),
            fmt(r, ".2f"),
            f"{CLUSTER_FACTOR:g}",
            verdict(f),
            passed_cell(cluster),
        ],
    ]
    table = render_table(["run", "wall s", "ratio", "target", "verdict", "check"], rows)
    problems = series_problems([jobs, cluster])
    return Section("6. Manifest on a cluster", f"{caption}\n{table}", [f], problems)
