"""Processes for the benchmark: a launcher for clean peak RSS, series of alternated runs.

Every measured process is started by a small launcher, not by the benchmark itself: a
child forked (or vforked) from a process reports that process's peak RSS as its own
ru_maxrss, since exec records the high-water mark of the address space it replaces; the
benchmark holds torch and the exports (hundreds of MiB). The launcher (python -S, a few
MiB: see `launcher_floor_mib`) spawns the command, times it and writes its rusage. On
Linux a watchdog thread in the launcher kills the command (through a pidfd, so never
another process) past a time limit or a resident-memory cap, so that a runaway command
(gigabytes of JSON text) cannot take the machine down with it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1024.0 * 1024.0

LAUNCHER = """\
import os, sys, threading, time
result, timeout, cap_kib, argv = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
start = time.perf_counter()
pid = os.posix_spawnp(argv[0], argv, os.environ)
state = {"why": "", "seen": 0}
def watch(fd):
    import signal
    page = os.sysconf("SC_PAGE_SIZE") // 1024
    while True:
        time.sleep(0.05)
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            rss = 0
        state["seen"] = max(state["seen"], rss)
        if cap_kib and rss > cap_kib:
            state["why"] = "cap"
        elif timeout and time.perf_counter() - start > timeout:
            state["why"] = "timeout"
        else:
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        return
if hasattr(os, "pidfd_open"):
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        pass
    else:
        threading.Thread(target=watch, args=(fd,), daemon=True).start()
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
with open(result, "w") as f:
    f.write(f"{wall!r} {max(usage.ru_maxrss, state['seen'])} "
            f"{os.waitstatus_to_exitcode(status)} {state['why'] or '-'}")
"""


@dataclass
class Proc:
    wall_s: float
    maxrss_mib: float
    returncode: int
    stdout: str
    stderr: str
    killed: str | None = None  # "cap" or "timeout": the watchdog killed it


@dataclass(frozen=True)
class Limits:
    """What the watchdog allows a measured process (0: no limit)."""

    timeout_s: float = 0.0
    rss_cap_mib: float = 0.0


def run_process(cmd: Sequence[str], *, capture: bool = True, limits: Limits = Limits()) -> Proc:
    """Run `cmd` to completion: wall time around the process and its own peak RSS.

    Its stdout goes to a temporary file (read back) with `capture`, else to /dev/null,
    never to a pipe; its stderr to a temporary file.
    """
    with (
        tempfile.TemporaryDirectory(prefix="sdpa-bench-run-") as tmp,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        result = Path(tmp) / "rusage"
        cap_kib = int(limits.rss_cap_mib * 1024)
        launcher = [sys.executable, "-S", "-c", LAUNCHER, str(result), str(limits.timeout_s)]
        launcher += [str(cap_kib), *cmd]
        stdout: Any = out if capture else subprocess.DEVNULL
        subprocess.run(launcher, stdin=subprocess.DEVNULL, stdout=stdout, stderr=err, check=False)
        out.seek(0)
        err.seek(0)
        text_out = out.read().decode(errors="replace")
        text_err = err.read().decode(errors="replace")
        if not result.exists():  # the launcher itself failed, e.g. no such command
            return Proc(0.0, 0.0, 127, text_out, text_err)
        wall, maxrss, returncode, why = result.read_text().split()
    # ru_maxrss: KiB on Linux, bytes on macOS.
    rss = int(maxrss) / (MIB if sys.platform == "darwin" else 1024.0)
    killed = None if why == "-" else why
    return Proc(float(wall), rss, int(returncode), text_out, text_err, killed)


def launcher_floor_mib() -> float:
    """The least peak RSS a measured process can report: the launcher's own, inherited."""
    return run_process(["true"]).maxrss_mib


def tail(text: str, lines: int = 2, width: int = 160) -> str:
    joined = " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])
    return joined if len(joined) <= width else joined[: width - 1] + "…"


# --------------------------------------------------------------------------- series


@dataclass
class Outcome:
    """One run: its time (a process's wall time, or what a worker timed inside)."""

    seconds: float | None
    rss_mib: float | None
    error: str | None = None
    passed: bool | None = None  # an sdpa check report's "passed"
    over_cap: bool = False  # killed by the watchdog for its memory


@dataclass
class Series:
    """The runs of one measurement; figures come from the runs without an error."""

    key: str
    command: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None
    passed: bool | None = None  # every run's report passed
    over_cap: bool = False

    def add(self, outcome: Outcome) -> None:
        if outcome.rss_mib is not None:
            self.rss_mib.append(outcome.rss_mib)
        self.over_cap = self.over_cap or outcome.over_cap
        if outcome.error is not None:
            self.error = outcome.error
            return
        if outcome.seconds is not None:
            self.seconds.append(outcome.seconds)
        if outcome.passed is not None:
            self.passed = outcome.passed if self.passed is None else self.passed and outcome.passed

    @property
    def ok(self) -> bool:
        return self.error is None and self.skipped is None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.seconds) if self.ok and self.seconds else None

    @property
    def peak_mib(self) -> float | None:
        """The greatest peak RSS of its runs, also from a run that failed."""
        return max(self.rss_mib) if self.rss_mib and self.skipped is None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "command": self.command,
            "seconds": self.seconds,
            "median_s": self.median_s,
            "rss_mib": self.rss_mib,
            "peak_mib": self.peak_mib,
            "error": self.error,
            "skipped": self.skipped,
            "passed": self.passed,
            "over_cap": self.over_cap,
        }


Runner = Callable[[], Outcome]


def alternate(
    runs: Sequence[tuple[Series, Runner]],
    repeat: int,
    progress: Callable[[str], None] | None = None,
) -> None:
    """`repeat` rounds over `runs`, in turn (reversed every other round), so that drift
    on a shared machine hits every series alike; a series stops at its first error."""
    for r in range(repeat):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for series, run in order:
            if not series.ok:
                continue
            if progress is not None:
                progress(f"  {series.key} ({r + 1}/{repeat})")
            series.add(run())


def process_failure(proc: Proc, limits: Limits, ok_codes: Sequence[int]) -> str | None:
    if proc.killed == "cap":
        return f"killed past the benchmark's RSS cap of {limits.rss_cap_mib:g} MiB"
    if proc.killed == "timeout":
        return f"killed after the benchmark's time limit of {limits.timeout_s:g} s"
    if proc.returncode not in ok_codes:
        return f"exit {proc.returncode}: {tail(proc.stderr or proc.stdout)}"
    return None


def sdpa_runner(
    cmd: Sequence[str], limits: Limits, report: Path | None = None, ok_codes: Sequence[int] = (0,)
) -> Runner:
    """A run of an sdpa command, stdout to /dev/null; with `report`, the JSON report it
    writes (--report) gives `passed` (sdpa check exits 1 when a check fails)."""

    def run() -> Outcome:
        if report is not None:
            report.unlink(missing_ok=True)
        proc = run_process(cmd, capture=False, limits=limits)
        error = process_failure(proc, limits, ok_codes)
        passed = None
        if error is None and report is not None:
            try:
                passed = bool(json.loads(report.read_text()).get("passed"))
            except (OSError, ValueError, AttributeError):
                error = f"exit {proc.returncode}, no JSON report: {tail(proc.stderr)}"
        return Outcome(proc.wall_s, proc.maxrss_mib, error, passed, proc.killed == "cap")

    return run


def worker_runner(cmd: Sequence[str], limits: Limits) -> Runner:
    """A run of a worker that times its own work and prints {"seconds": ...}."""

    def run() -> Outcome:
        proc = run_process(cmd, capture=True, limits=limits)
        error = process_failure(proc, limits, (0,))
        seconds = None
        if error is None:
            try:
                seconds = float(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])
            except (ValueError, KeyError, IndexError, TypeError):
                error = f"no timing on stdout: {tail(proc.stdout + proc.stderr)}"
        return Outcome(seconds, proc.maxrss_mib, error)

    return run
